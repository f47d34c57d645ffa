"""Fit the executor's own host cost per action (HostModel's executor section) to the measured runs.

vsim's executor (vsim/runtime/executor.py) times the host work of carrying out a plan's
actions in each iteration (`executed.executor_host_us` in validation/measured/*.json, with the
iteration's counts of offloads, prefetches, releases, drops, recomputed and recorded aten
calls). That time is Python and PyTorch host code: events, stream switches, storage resizes,
copy launches, the replay of recomputed aten calls and their recording in forward.

The runtime times the replay (`executor_recompute_us`) and the recording (`executor_record_us`)
apart, so each has its own per-call cost: the median over the fitted runs of the run's time per
call (`recompute_call_us`, `record_call_us`; a joint least-squares fit cannot separate them,
recorded and replayed calls rising together). The rest of the executor's time,

    executor_host_us - recompute - record = copy_us * (offloads + prefetches)
                                            + free_us * (releases + drops),

is fitted (non-negative least squares).

Two costs of the runtime fall outside those timers, and are estimated apart (`unseen`):
- the saved-tensor hook, a Python call per tensor autograd saves (`executor_pack_us`, timed
  since 2026-11-26 10:48 UTC): `pack_us` per forward op, the median over runs of the hook's
  time per forward op of the run's trace (2.2 saved tensors per forward op, 1.7-2.3);
- under the native tracker, its call back into Python with each recorded call's arguments and
  outputs (converted before the Python callback's timer starts): `record_callback_us` per
  recorded call, from the host's issue time of the iteration (`host_issue_us`): a run that
  recomputes, less the same model's run without a policy measured in the same call
  (`same_call`), less the executor's timed time and the hook's, per recorded call; the median
  over such pairs whose plan neither offloads nor made the allocator retry (their issue time
  waits for the GPU).

Offloads and prefetches come in equal numbers in almost every run, so they share one cost. The
engine charges the replay and the recording per aten
call, a trace op counting as `calls_per_op` calls (validation/host/calls_per_op.py). Runs whose
caching allocator retried (allocator_churn.num_alloc_retries > 0) are left out: a retry
synchronizes the device inside an action, so their executor time includes waiting for the GPU.
So are runs that recompute but whose recording was not timed (before 2026-11-26 07:00 UTC).
Fitted on the FIT models, checked on the others. Writes nothing: prints the values for
hardware/host/NAME.yaml's `executor` section and the check table.

    python validation/host/fit_executor.py \
        --hold-out efficientnet_b0,regnet_y_1_6gf,swin_t,wide_resnet50_2 [--since 2026-11-27]

`--core`: the runs whose plan the executor's core carried out in C++ (vsim/runtime/native/core.cpp,
`executed.executor_core` "native", from 2026-11-27T18:50), for the profile's `executor.core`
section. There the count call backs are C++ end to end and timed whole (`executor_callback_us`):
their part outside the executor's timed work (registering the outputs the plan acts on) joins
the time fitted per action, the frame call backs are charged at their median per call
(`frame_callback_us`), and nothing of the runtime's runs untimed per recorded call any more
(no call back into Python per recorded call once the replay is compiled). What is left per
recorded call of a recomputing run's host issue time over its plain twin's (`record_callback_us`)
is measured again on the runs validation/host/core-twins/runs.txt lists (each plan and the
model without a policy in one call): the issue time difference less everything the runtime
timed and the counter's estimate (native_us_per_call per call through its key), per recorded
call, the median over the
pairs of models not held out whose plan does not offload, whose allocator did not retry and
whose difference is not negative (a GPU-bound issue waits).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROOT = Path(__file__).resolve().parents[2]
TERMS = ("copy_us", "free_us", "recompute_call_us", "record_call_us")  # in this order


def runs(hardware: str, since: str = "", core: bool = False) -> list[dict]:
    out = []
    for f in sorted(glob.glob(str(ROOT / "validation/measured/*.json"))):
        d = json.loads(Path(f).read_text())
        ex = d.get("executed")
        if not ex or d.get("iteration_time_us") is None or d.get("hardware") != hardware:
            continue
        if d["provenance"].get("date", "") < since:
            continue
        x = [ex["offloads"] + ex["prefetches"], ex["releases"] + ex["drops"]]
        if sum(x) + ex["recomputed_calls"] == 0 or \
                (ex["recomputed_calls"] and "executor_record_us" not in ex):
            continue
        if core != (ex.get("executor_core") == "native"):
            continue
        outside = ex.get("executor_callback_us", 0.0) - ex.get("executor_callback_timed_us", 0.0) \
            if core else 0.0
        churn = d.get("allocator_churn") or {}
        replay, record = ex.get("executor_recompute_us", 0.0), ex.get("executor_record_us", 0.0)
        out.append({"id": d["id"], "model": d["model"], "x": x,
                    "y": ex["executor_host_us"] - replay - record + outside,
                    "frames": (ex.get("executor_frame_us", 0.0), ex.get("frame_calls", 0)),
                    "host": ex["executor_host_us"],
                    "replay": (replay, ex["recomputed_calls"]),
                    "record": (record, ex.get("recorded_calls", 0)),
                    "retried": bool(churn.get("num_alloc_retries"))})
    return out


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (few terms: every subset of them)."""
    best, best_err = np.zeros(x.shape[1]), float("inf")
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            full = np.zeros(x.shape[1])
            full[list(cols)] = c
            err = float(((x @ full - y) ** 2).sum())
            if err < best_err:
                best, best_err = full, err
    return best


def per_call(rows: list[dict], key: str) -> float:
    got = [us / n for r in rows for us, n in (r[key],) if n]
    return float(np.median(got)) if got else 0.0


def same_call(a: dict, b: dict, minutes: float = 20.0) -> bool:
    """Whether two runs were measured in one device call (their dates within `minutes`): the
    host's speed moves between calls by up to 1.5x (host/noise/rerun-2026-11-26.json), which a
    difference of issue times must not include."""
    from datetime import datetime

    def when(d: dict) -> datetime:
        return datetime.fromisoformat(d["provenance"]["date"].replace("Z", "+00:00"))
    return abs((when(a) - when(b)).total_seconds()) <= minutes * 60


# runs of the runtime before the native tracker called back only where calibration acted
# (2026-11-26, before the sixth session's merge): many recorded calls per run, which is what
# separates a recorded call's call back from the tracker's own cost per op
EARLIER = ROOT / "validation/host/runtime-before-noted"


NATIVE_COST = ROOT / "validation/host/native-cost/runs"  # tracked and plain runs, H100


def unseen(hardware: str, held: set[str], since: str = "") -> dict[str, float]:
    """pack_us (per forward op), native_us_per_call and record_callback_us: see the module.
    The profiles charge the call back alone (its median per recorded call) and no per-call
    cost: the joint fit was evaluated and not adopted (validation/host/README.md)."""
    from datetime import datetime

    from vsim.host import load_host_model
    from vsim.trace import load_trace

    model = load_host_model(hardware)
    assert model is not None
    traces: dict[str, tuple[float, int]] = {}  # trace -> (counted calls, forward ops)

    def counts(trace: str) -> tuple[float, int]:
        if trace not in traces:
            t = load_trace(ROOT / trace).ops
            traces[trace] = (sum(model.counted(o) for o in t), sum(o.phase == "fwd" for o in t))
        return traces[trace]

    def when(d: dict) -> float:
        return datetime.fromisoformat(d["provenance"]["date"].replace("Z", "+00:00")).timestamp()

    files = [*sorted(glob.glob(str(ROOT / "validation/measured/*.json"))),
             *sorted(glob.glob(str(EARLIER / "*.json"))),
             *sorted(glob.glob(str(NATIVE_COST / "*.json")))]
    measured = [json.loads(Path(f).read_text()) for f in files]
    measured = [d for d in measured if d.get("hardware") == hardware
                and d["provenance"].get("date", "") >= since]
    pack = []
    for d in measured:
        ex = d.get("executed") or {}
        if ex.get("packs") and d["model"] not in held:
            pack.append(ex["executor_pack_us"] / counts(d["trace"])[1])
    plain: dict[tuple[str, int], list[dict]] = {}
    for d in measured:
        if d.get("host_issue_us") and not d.get("executed") and d.get("fits"):
            plain.setdefault((d["model"], d["batch_size"]), []).append(d)
    pairs, check = [], []
    for d in measured:
        ex = d.get("executed") or {}
        churn = d.get("allocator_churn") or {}
        if not d.get("host_issue_us") or ex.get("offloads") or ex.get("tracker") != "native" \
                or churn.get("num_alloc_retries") or not ex.get("packs"):
            continue
        nones = [n for n in plain.get((d["model"], d["batch_size"]), []) if same_call(d, n)]
        if not nones:
            continue
        none = min(nones, key=lambda n: abs(when(n) - when(d)))  # the run beside it
        left = (d["host_issue_us"] - none["host_issue_us"] - ex["executor_host_us"]
                - ex.get("executor_pack_us", 0.0))
        if left < 0:  # the timers held waits for the GPU (a pack or replay that synced)
            continue
        row = (d["id"], counts(d["trace"])[0], ex.get("recorded_calls", 0), left)
        (check if d["model"] in held else pairs).append(row)
    out = {"pack_us": float(np.median(pack)) if pack else 0.0,
           "native_us_per_call": 0.0, "record_callback_us": 0.0}
    if pairs:
        c = nnls(np.array([[n, r] for _, n, r, _ in pairs], float),
                 np.array([y for *_, y in pairs], float))
        out["native_us_per_call"], out["record_callback_us"] = float(c[0]), float(c[1])
    alone = [y / r for _, _, r, y in pairs if r]
    print(f"  pack_us: {out['pack_us']:.1f}  # {len(pack)} runs")
    print(f"  # the call back alone, what the profiles charge (native_us_per_call 0): "
          f"{float(np.median(alone)) if alone else 0.0:.1f} us, median over {len(alone)} runs "
          "with recorded calls of what is left per recorded call")
    print(f"  native_us_per_call: {out['native_us_per_call']:.2f}")
    print(f"  record_callback_us: {out['record_callback_us']:.1f}  # both by least squares "
          f"over {len(pairs)} runs against their plain twins (counted calls, recorded calls)")
    def modelled(n: float, r: int) -> float:
        return out["native_us_per_call"] * n + out["record_callback_us"] * r

    for name, rows in (("fit", pairs), ("held out", check)):
        if rows:
            e = [abs(modelled(n, r) - y) for _, n, r, y in rows]
            print(f"  # {name}: {len(rows)} runs, mean abs error {np.mean(e) / 1e3:.1f} ms "
                  f"(left {np.mean([y for *_, y in rows]) / 1e3:.1f} ms on average), ms left "
                  "(modelled): " + ", ".join(f"{i} {y / 1e3:.1f} ({modelled(n, r) / 1e3:.1f})"
                                             for i, n, r, y in rows))
    return out


CORE_TWINS = ROOT / "validation/host/core-twins"


def core_left(hardware: str, held: set[str]) -> float:
    """record_callback_us under the core, from CORE_TWINS (see the module)."""
    from vsim.host import load_host_model

    model = load_host_model(hardware)
    assert model is not None
    paths = (CORE_TWINS / "runs.txt").read_text().split()
    runs = {Path(f).stem.rsplit("-", 1)[0]: json.loads((ROOT / f).read_text()) for f in paths}
    runs = {k: d for k, d in runs.items() if d.get("hardware") == hardware}
    plain = {(d["model"], d["batch_size"]): d for d in runs.values() if not d.get("executed")}
    got = []
    for rid, d in sorted(runs.items()):
        ex = d.get("executed")
        none = plain.get((d["model"], d["batch_size"]))
        if not ex or none is None or not ex.get("recorded_calls"):
            continue
        timed = (ex["executor_host_us"] + ex.get("executor_pack_us", 0.0)
                 + ex.get("executor_frame_us", 0.0) + ex["executor_callback_us"]
                 - ex["executor_callback_timed_us"])
        left = d["host_issue_us"] - none["host_issue_us"] - timed \
            - model.native_us_per_call * (ex.get("calls_through_tracker") or 0)
        per = left / ex["recorded_calls"]
        churn = (d.get("allocator_churn") or {}).get("num_alloc_retries")
        use = d["model"] not in held and not ex["offloads"] and not churn and left >= 0
        print(f"  # {rid}: {left / 1e3:.1f} ms left, {ex['recorded_calls']} recorded calls, "
              f"{per:.1f} us each{'' if use else ' (not used)'}")
        if use:
            got.append(per)
    value = float(np.median(got)) if got else 0.0
    print(f"  record_callback_us: {value:.1f}  # median over {len(got)} pairs")
    return value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--hold-out", default="efficientnet_b0,regnet_y_1_6gf,swin_t,wide_resnet50_2")
    ap.add_argument("--since", default="", help="only runs measured at or after this UTC date "
                    "(a runtime change: 2026-11-27 for the native actions and hook)")
    ap.add_argument("--core", action="store_true", help="the runs the executor's core carried "
                    "out (executed.executor_core native): the profile's executor.core section")
    args = ap.parse_args()
    held = set(args.hold_out.split(","))
    data = runs(args.hardware, args.since, args.core)
    fit = [r for r in data if r["model"] not in held and not r["retried"]]
    c = nnls(np.array([r["x"] for r in fit], float), np.array([r["y"] for r in fit], float))
    values = dict(zip(TERMS, [*c, per_call(fit, "replay"), per_call(fit, "record")],
                      strict=True))
    if args.core:
        values["frame_callback_us"] = per_call(fit, "frames")
        print("left per recorded call (validation/host/core-twins/):")
        values["record_callback_us"] = core_left(args.hardware, held)
    print("executor:" if not args.core else "executor.core:")
    for name, v in values.items():
        print(f"  {name}: {v:.1f}")
    print(f"fit on {len(fit)} runs of {len({r['model'] for r in fit})} models; held out: "
          f"{sorted(held)}")

    def predict(r: dict) -> float:
        return (values["copy_us"] * r["x"][0] + values["free_us"] * r["x"][1]
                + values["recompute_call_us"] * r["replay"][1]
                + values["record_call_us"] * r["record"][1])

    def err(rows: list[dict]) -> str:
        rows = [r for r in rows if r["host"] > 0]
        if not rows:
            return "-"
        e = [abs(predict(r) - r["host"]) / r["host"] for r in rows]
        return (f"{len(rows)} runs, MAPE {100 * sum(e) / len(e):.0f}%, "
                f"median {100 * float(np.median(e)):.0f}%")
    print("| runs | executor host time error |")
    print("|---|---|")
    print(f"| fit | {err(fit)} |")
    print(f"| held out | {err([r for r in data if r['model'] in held and not r['retried']])} |")
    print(f"| allocator retried (not fitted) | {err([r for r in data if r['retried']])} |")
    if args.core:
        return
    print("outside the executor's timers:")
    unseen(args.hardware, held, args.since)


if __name__ == "__main__":
    main()
