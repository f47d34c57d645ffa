"""The caching allocator's retries (PyTorch's num_alloc_retries: a cudaMalloc refused at the
capacity, the cache freed after a device-wide sync, the request tried again), predicted per
iteration against measured, for every validation case whose measured run counted them
(`allocator_churn`, over its timed iterations). Predicted: the median of the allocator
model's capacity hits over the iterations a measurement times (4 to 13), the plan planned as
`vsim validate` plans it. Prints one row per case with retries on either side, and the
totals. Writes nothing.

    python tools/retries_check.py [--allocator SPEC] [validation/cases/*.yaml]

`--allocator caching:events=gpu`: the GPU-clock event model (the default before 2026-11-26,
events=host now) instead of the cases' own allocator (planned and run with it).
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import vsim.engine as engine
from vsim.allocator import make_allocator
from vsim.engine import simulate
from vsim.engine import simulator as sim
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.retarget import for_hardware
from vsim.trace import load_trace
from vsim.validate import load_cases, measured_tracker


def main() -> None:
    args = sys.argv[1:]
    spec = None
    if args[:1] == ["--allocator"]:
        spec, args = args[1], args[2:]
    paths = args or sorted(glob.glob("validation/cases/*.yaml"))
    hits: list[int] = []
    original_run = sim.Engine.run
    original_new_run = engine._Run.__init__  # noqa: SLF001

    def run(self: sim.Engine) -> object:  # the capacity hits of each simulated iteration
        before = self.allocator.capacity_hits
        out = original_run(self)
        hits.append(self.allocator.capacity_hits - before)
        return out

    def new_run(*args: Any, **kwargs: Any) -> None:  # one run: its iterations' hits only
        hits.clear()
        original_new_run(*args, **kwargs)

    sim.Engine.run = run  # type: ignore[method-assign, assignment]
    engine._Run.__init__ = new_run  # type: ignore[method-assign]  # noqa: SLF001
    rows = []
    for case in load_cases(paths):
        if case.allocator != "caching" or case.measured == "trace":
            continue
        m = json.loads(Path(case.measured).read_text())
        churn = m.get("allocator_churn") or {}
        timed = (m.get("iterations") or {}).get("measured") or 0
        if not m.get("fits") or "num_alloc_retries" not in churn or not timed:
            continue
        trace = load_trace(case.trace)
        hw = load_hardware(case.hardware)
        trace, _ = for_hardware(trace, hw)
        alloc = make_allocator(spec or case.allocator)
        result = simulate(trace, hw, make_policy(case.policy), alloc, case.memory_bytes,
                          tracker=measured_tracker(m), plan_tracker="native")
        if not result.report["fits"]:
            hits.clear()
            continue
        # the final run's hits in the iterations a measurement times (4 to 13: its first
        # iteration is hits[0]); a run that settled early repeats its last iteration
        steady = (hits + hits[-1:] * engine.RUN_ITERATIONS)[engine.TIMED_FROM - 1:
                                                             engine.RUN_ITERATIONS]
        predicted = statistics.median(steady) if steady else 0
        hits.clear()
        measured = churn["num_alloc_retries"] / timed
        if predicted or measured:
            rows.append((case.id, predicted, measured))
    print("| case | predicted retries per iteration | measured |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:g} | {r[2]:.1f} |")
    both = sum(1 for r in rows if r[1] and r[2])
    print(f"{len(rows)} cases with retries on either side: both {both}, only predicted "
          f"{sum(1 for r in rows if r[1] and not r[2])}, only measured "
          f"{sum(1 for r in rows if r[2] and not r[1])}")


if __name__ == "__main__":
    main()
