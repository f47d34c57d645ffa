"""The executor's host share of the iteration per measured run (issue 13 item 2): all of it
(`executed.executor_host_us`) and its own part, the host work that is vsim's runtime's rather
than PyTorch calls a plan needs whatever runs it (allocations, copy launches, pinned-pool
waits, the replayed calls themselves: `executor_replay_call_us`, timed from 2026-11-26 08:30
UTC; the native actions' event and stream calls, `executor_event_us`, from 2026-11-27): see
`own_us`.
Reads validation/measured/; writes nothing.

    python validation/runtime/host_share.py [--since 2026-11-26T08:40] [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def own_us(ex: dict) -> float:
    """The runtime's own host time per iteration. Runs with `executor_own_includes_replay`
    (from 2026-11-27 03:30 UTC) report it as `executor_own_us`: the median over the measured
    iterations of each one's own time. Runs since the medians (2026-11-27) report
    `executor_own_us` without the recording and the replay's bookkeeping: those are added
    back (steady from one iteration to the next, unlike the allocator's waits under a cap).
    Earlier runs: their parts' times subtracted (one iteration's)."""
    if ex.get("executor_own_includes_replay"):
        return ex["executor_own_us"]
    if "executor_own_us" in ex and "executor_iterations_timed" in ex:
        return (ex["executor_own_us"] + ex["executor_recompute_us"]
                - ex["executor_replay_call_us"] + ex["executor_record_us"])
    waits = (ex["executor_alloc_us"] + ex["executor_copy_us"] + ex["executor_pool_wait_us"]
             + ex["executor_replay_call_us"] + ex.get("executor_event_us", 0.0))
    return ex["executor_host_us"] - waits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--since", default="", help="only runs measured at or after this UTC date")
    ap.add_argument("--hardware", default=None)
    args = ap.parse_args()
    rows = []
    for f in sorted(glob.glob(str(ROOT / "validation/measured/*.json"))):
        d = json.loads(Path(f).read_text())
        ex, it = d.get("executed"), d.get("iteration_time_us")
        if not ex or not it or "executor_replay_call_us" not in ex:
            continue
        if not (ex["offloads"] or ex["releases"] or ex["drops"] or ex["recomputed_calls"]):
            continue  # nothing to carry out
        if d["provenance"].get("date", "") < args.since:
            continue
        if args.hardware and d.get("hardware") != args.hardware:
            continue
        rows.append((d["id"], ex["executor_host_us"] / it, own_us(ex) / it, ex.get("tracker")))
    if not rows:
        raise SystemExit("no measured run with executor_replay_call_us")
    print("| run | executor host share | own share | tracker |")
    print("|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r[2]):
        print(f"| {r[0]} | {100 * r[1]:.1f}% | {100 * r[2]:.1f}% | {r[3]} |")
    for name, i in (("executor host share", 1), ("own share", 2)):
        v = [r[i] for r in rows]
        print(f"{name}: median {100 * statistics.median(v):.1f}%, largest {100 * max(v):.1f}%, "
              f"over 10%: {sum(x > 0.10 for x in v)} of {len(v)}")


if __name__ == "__main__":
    main()
