"""The executor's host share of the iteration per measured run (issue 13 item 2): all of it
(`executed.executor_host_us`) and its own part, the host work that is vsim's runtime's rather
than PyTorch calls a plan needs whatever runs it (allocations, copy launches, pinned-pool
waits, the replayed calls themselves: `executor_replay_call_us`, timed from 2026-11-26 08:30
UTC; the native actions' event and stream calls, `executor_event_us`, from 2026-11-27):
vsim.validate's `runtime_own_us`. That leaves out the native tracker itself (its counter on every
counted call and the saved-tensor hooks, outside the executor's timers); the last column adds
them: the counter as the run's hardware profile charges it (`native_us_per_call` per counted
call of the run's trace, or per call through its key where the run counted them: a gated
backward's), the hooks at the H100 profile's `save_us` per save the run made
through them (`executed.packs`: every save before 2026-11-27T08:30, only around the calls with
a save the plan acts on since). Measured on the H100 (validation/host/waits/), an estimate,
not a timing of that run.
Reads validation/measured/; writes nothing.

    python validation/runtime/host_share.py [--since 2026-11-26T08:40] [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

from vsim.host import load_host_model
from vsim.trace import load_trace
from vsim.validate import runtime_own_us

ROOT = Path(__file__).resolve().parents[2]


def save_us() -> float:
    """The saved-tensor hooks per save: the H100 profile's `save_us` (median of five models,
    validation/host/waits/ README, section 2: 4.6-8.6 us), for every run: not measured on the
    H200."""
    host = load_host_model("h100-sxm")
    assert host is not None and host.save_us > 0
    return host.save_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--since", default="", help="only runs measured at or after this UTC date")
    ap.add_argument("--hardware", default=None)
    args = ap.parse_args()
    rows = []
    per_save = save_us()
    tracker_us: dict[tuple[str, str], float] = {}  # (hardware, trace) -> the profile's charge

    def counter(hardware: str, trace: str) -> float:
        if (hardware, trace) not in tracker_us:
            host = load_host_model(hardware)
            ops = load_trace(ROOT / trace).ops
            tracker_us[hardware, trace] = 0.0 if host is None else sum(
                host.native_us_per_call * host.counted(o) for o in ops)
        return tracker_us[hardware, trace]

    def per_call(hardware: str) -> float:
        host = load_host_model(hardware)
        return 0.0 if host is None else host.native_us_per_call

    for f in sorted(glob.glob(str(ROOT / "validation/measured/*.json"))):
        d = json.loads(Path(f).read_text())
        ex, it = d.get("executed"), d.get("iteration_time_us")
        own = runtime_own_us(ex)  # None: no executor timing, or nothing to carry out
        if own is None or not it:
            continue
        if d["provenance"].get("date", "") < args.since:
            continue
        if args.hardware and d.get("hardware") != args.hardware:
            continue
        assert ex is not None
        native = ex.get("tracker") == "native"
        # the counter: per call through the tracker's key where the run counted them (a gated
        # backward, from 2026-11-28), else per counted call of the trace
        through = ex.get("calls_through_tracker")
        calls_us = (counter(d["hardware"], d["trace"]) if through is None else
                    per_call(d["hardware"]) * through)
        with_tracker = own + (calls_us + per_save * (ex.get("packs") or 0) if native else 0.0)
        tracker = f"native ({ex.get('native_hooks', 'always')})" if native else ex.get("tracker")
        rows.append((d["id"], ex["executor_host_us"] / it, own / it, tracker, with_tracker / it))
    if not rows:
        raise SystemExit("no measured run with executor_replay_call_us")
    print("| run | executor host share | own share | tracker | own share with the tracker (est.) |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r[2]):
        print(f"| {r[0]} | {100 * r[1]:.1f}% | {100 * r[2]:.1f}% | {r[3]} | {100 * r[4]:.1f}% |")
    for kind in sorted({r[3] for r in rows}):
        some = [r for r in rows if r[3] == kind]
        for name, i in (("executor host share", 1), ("own share", 2),
                        ("own share with the tracker (estimated)", 4)):
            v = [r[i] for r in some]
            print(f"{kind}: {name}: median {100 * statistics.median(v):.1f}%, largest "
                  f"{100 * max(v):.1f}%, over 10%: {sum(x > 0.10 for x in v)} of {len(v)}")


if __name__ == "__main__":
    main()
