"""Where a capacity-aware policy's planning time goes: its own planning (plan_for and the
profiling loop's bookkeeping, with every profiling run's verdict replayed from a first pass) and
the simulation of its profiling runs (CPU ms per simulated iteration of its final plan). For
changes that make one of the two faster; the plan digest is plan_times.py's.

    python tools/plan_split.py TRACE... [--fraction 0.6] [--policy SPEC]... [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from typing import Any

from vsim.allocator import make_allocator
from vsim.engine import planning_runner, run_plan, simulator
from vsim.hardware import load_hardware
from vsim.policies import fitted, make_policy

DEFAULT = ["superneurons", "accudnn", "hybrid"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--hw", default="h100-sxm")
    ap.add_argument("--fraction", type=float, default=0.6)
    ap.add_argument("--policy", action="append")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many (both measures)")
    args = ap.parse_args()
    from vsim.trace import load_trace

    hw = load_hardware(args.hw)
    alloc = make_allocator("caching")
    runner = planning_runner(alloc)
    iterations = [0]
    engine_run = simulator.Engine.run

    def counted(self: simulator.Engine) -> Any:
        iterations[0] += 1
        return engine_run(self)

    simulator.Engine.run = counted  # type: ignore[method-assign]
    check = fitted.check
    for path in args.traces:
        trace = load_trace(path)
        none = run_plan(trace, hw, make_policy("none").plan(trace, hw, hw.capacity_bytes),
                        alloc, hw.capacity_bytes).report
        cap = int(int(none["peak_reserved_bytes"]) * args.fraction)
        for spec in args.policy or DEFAULT:
            verdicts: dict[Any, dict[str, Any]] = {}

            def replay(run: Any, trace: Any, hw: Any, plan: Any, capacity: int,
                       verdicts: dict[Any, dict[str, Any]] = verdicts) -> dict[str, Any]:
                key = dataclasses.replace(plan, notes=())
                if key not in verdicts:
                    verdicts[key] = check(run, trace, hw, plan, capacity)
                return verdicts[key]

            fitted.check = replay  # type: ignore[assignment]
            try:
                t0 = time.process_time()
                plan = make_policy(spec).plan_with(trace, hw, cap, runner)
                first = time.process_time() - t0
                own = min(_timed(make_policy(spec).plan_with, trace, hw, cap, runner)
                          for _ in range(args.repeat))
            finally:
                fitted.check = check
            runs = []
            for _ in range(args.repeat):
                iterations[0] = 0
                runs.append(_timed(runner, trace, hw, plan, None, cap))
            digest = hashlib.sha256(repr(dataclasses.replace(plan, notes=())).encode()
                                    ).hexdigest()[:12]
            print(json.dumps({
                "trace": path.split("/")[-1].split(".")[0], "fraction": args.fraction,
                "policy": spec, "plan_s": round(first, 2), "own_planning_s": round(own, 3),
                "profiling_runs": len(verdicts), "iterations": iterations[0],
                "ms_per_iteration": round(min(runs) / iterations[0] * 1e3, 2),
                "plan": digest}), flush=True)
    return 0


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.process_time()
    fn(*args)
    return time.process_time() - t0


if __name__ == "__main__":
    sys.exit(main())
