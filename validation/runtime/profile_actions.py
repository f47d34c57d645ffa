"""Where the executor's own host time goes: cProfile over a few iterations of one plan under the
native tracker (issue 13, item 2), printed by own time per function.

    python validation/runtime/profile_actions.py TRACE POLICY [--memory GIB] [--iters 5]
        [--device cuda]

`--memory`: plan for that capacity (the iterations run uncapped: the actions, not the cap).
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
    ap.add_argument("--memory", type=float, default=None, help="GiB to plan for")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    s = Session(None, None, trace, device=args.device, check=False)
    _pol, plan = s._plan(args.policy, None if args.memory is None else int(args.memory * 2**30))
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
    st = ex.stats
    print(f"tracker {ex.tracker_used}; last iteration: executor host {st.host_us:.0f} us, "
          f"record {st.record_us:.0f} us ({st.recorded_calls} calls), recompute "
          f"{st.recompute_us:.0f} us, pack {st.pack_us:.0f} us ({st.packs}), offloads "
          f"{st.offloads}, prefetches {st.prefetches}")
    print(out.getvalue())


if __name__ == "__main__":
    main()
