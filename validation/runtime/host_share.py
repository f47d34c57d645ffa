"""The executor's host share of the iteration per measured run (issue 13 item 2): all of it
(`executed.executor_host_us`) and its own part, the host work that is vsim's runtime's rather
than PyTorch calls a plan needs whatever runs it (allocations, copy launches, pinned-pool
waits, the replayed calls themselves: `executor_replay_call_us`, timed from 2026-11-26 08:30
UTC; the native actions' event and stream calls, `executor_event_us`, from 2026-11-27; the frees
of released and dropped tensors, `executor_free_us`, from 2026-11-27), with what lies outside
the executor's host time added back (the frame call backs, `executor_frame_us`, and where a run
timed them, the crossings of the call backs at counts): vsim.validate's `runtime_own_us`.
That leaves out the native tracker itself (its counter on every
counted call and the saved-tensor hooks, outside the executor's timers); the last column adds
them as vsim.validate's `tracker_estimate_us` does for `vsim validate`'s "+trk" column: the
counter at the run's hardware profile's `native_us_per_call` per call through its key (a gated
backward's count; before it, every counted call of the run's trace), the hooks at its
`save_us` per save the run made through them (`executed.packs`: every save before
2026-11-27T08:30, only around the calls with a save the plan acts on since). Measured on the
H100 (validation/host/waits/), an estimate, not a timing of that run; the H200's profile
charges neither, so its runs get none.
Reads validation/measured/; writes nothing.

    python validation/runtime/host_share.py [--since 2026-11-26T08:40] [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path
from typing import Any

from vsim.trace import load_trace
from vsim.validate import runtime_own_us, tracker_estimate_us

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--since", default="", help="only runs measured at or after this UTC date")
    ap.add_argument("--hardware", default=None)
    args = ap.parse_args()
    rows = []
    traces: dict[str, Any] = {}  # a run that counted every call is charged its trace's count

    class Trace:  # loaded only where the estimate needs the trace's ops
        def __init__(self, path: str) -> None:
            self.path = path

        @property
        def ops(self) -> Any:
            if self.path not in traces:
                traces[self.path] = load_trace(ROOT / self.path)
            return traces[self.path].ops

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
        estimate = tracker_estimate_us(d, Trace(d["trace"]), d["hardware"])
        with_tracker = own + (estimate or 0.0)
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
