"""Where the executor's own host time goes: cProfile over a few iterations of one plan under the
native tracker (issue 13, item 2), printed by own time per function.

    python validation/runtime/profile_actions.py TRACE POLICY [--iters 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from vsim.runtime.executor import Executor
from vsim.runtime.measure import Session
from vsim.trace import load_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("policy")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    s = Session(None, None, trace, device=args.device, check=False)
    _pol, plan = s._plan(args.policy, None)
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs, s._pool(plan))
    for _ in range(2):  # calibration, then one native iteration
        ex.run(s.step)
    s._sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        ex.run(s.step)
    s._sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(f"tracker {ex.tracker_used}; per iteration: executor host {ex.stats.host_us:.0f} us, "
          f"offloads {ex.stats.offloads}, prefetches {ex.stats.prefetches}")
    print(out.getvalue())


if __name__ == "__main__":
    main()
