"""Fit the executor's own host cost per action (HostModel's executor section) to the measured runs.

vsim's executor (vsim/runtime/executor.py) times the host work of carrying out a plan's
actions in each iteration (`executed.executor_host_us` in validation/measured/*.json, with the
iteration's counts of offloads, prefetches, releases, drops and recomputed aten calls). That time
is Python and PyTorch host code: events, stream switches, storage resizes, copy launches, and the
replay of recomputed aten calls. A linear model per action,

    executor_host_us = copy_us * (offloads + prefetches) + free_us * (releases + drops)
                       + recompute_call_us * recomputed_calls,

is fitted (non-negative least squares) on the runs of the FIT models and checked on the others.
Offloads and prefetches come in equal numbers in almost every run, so they share one cost.
Runs whose caching allocator retried (allocator_churn.num_alloc_retries > 0) are left out: a
retry synchronizes the device inside an action, so their executor time includes waiting for the
GPU, not only host work. So are runs that recompute but whose recording was not yet timed
(no `executed.executor_record_us`: the runtime before 2026-11-26 07:00 UTC left the recording
of recomputed calls out of `executor_host_us`); the recording is charged with the replay, per
recomputed call. Writes nothing: prints the values for hardware/host/NAME.yaml's
`executor` section and the check table.

    python validation/host/fit_executor.py \
        --hold-out efficientnet_b0,regnet_y_1_6gf,swin_t,wide_resnet50_2
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TERMS = ("copy_us", "free_us", "recompute_call_us")


def runs(hardware: str) -> list[dict]:
    out = []
    for f in sorted(glob.glob(str(ROOT / "validation/measured/*.json"))):
        d = json.loads(Path(f).read_text())
        ex = d.get("executed")
        if not ex or d.get("iteration_time_us") is None or d.get("hardware") != hardware:
            continue
        x = [ex["offloads"] + ex["prefetches"], ex["releases"] + ex["drops"],
             ex["recomputed_calls"]]
        if sum(x) == 0 or (ex["recomputed_calls"] and "executor_record_us" not in ex):
            continue
        churn = d.get("allocator_churn") or {}
        out.append({"id": d["id"], "model": d["model"], "x": x, "y": ex["executor_host_us"],
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--hold-out", default="efficientnet_b0,regnet_y_1_6gf,swin_t,wide_resnet50_2")
    args = ap.parse_args()
    held = set(args.hold_out.split(","))
    data = runs(args.hardware)
    fit = [r for r in data if r["model"] not in held and not r["retried"]]
    c = nnls(np.array([r["x"] for r in fit], float), np.array([r["y"] for r in fit], float))
    print("executor:")
    for name, v in zip(TERMS, c, strict=True):
        print(f"  {name}: {v:.1f}")
    print(f"fit on {len(fit)} runs of {len({r['model'] for r in fit})} models; held out: "
          f"{sorted(held)}")

    def err(rows: list[dict]) -> str:
        if not rows:
            return "-"
        e = [abs(float(np.dot(c, r["x"])) - r["y"]) / r["y"] for r in rows]
        return (f"{len(rows)} runs, MAPE {100 * sum(e) / len(e):.0f}%, "
                f"median {100 * float(np.median(e)):.0f}%")
    print("| runs | executor host time error |")
    print("|---|---|")
    print(f"| fit | {err(fit)} |")
    print(f"| held out | {err([r for r in data if r['model'] in held and not r['retried']])} |")
    print(f"| allocator retried (not fitted) | {err([r for r in data if r['retried']])} |")


if __name__ == "__main__":
    main()
