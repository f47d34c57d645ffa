"""`caching` (events=host, the default since 2026-11-26) against `caching:events=gpu` (the
GPU-clock model before it) on the validation corpus, with the plans as measured: each case is
planned as `vsim validate` plans it (its own allocator), and that plan's final run is simulated
on both. Prints fits right and the iteration-time MAPE of each, over the cases both predict to
fit, and the verdicts that flip (from events=host to events=gpu).
(Planning with events=gpu moves plans away from the measured ones: `vsim validate` with the
cases' allocator changed shows that.)

    python tools/host_events_check.py [validation/cases/*.yaml]
"""

from __future__ import annotations

import glob
import sys

from vsim.allocator import make_allocator
from vsim.engine import run_plan, simulate
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.retarget import for_hardware
from vsim.trace import load_trace
from vsim.validate import load_cases, measured_result, measured_tracker, relative_error


def main() -> None:
    paths = sys.argv[1:] or sorted(glob.glob("validation/cases/*.yaml"))
    rows = []
    for case in load_cases(paths):
        if case.allocator != "caching":
            continue
        trace = load_trace(case.trace)
        measured = measured_result(case, trace.measured)
        hw = load_hardware(case.hardware)
        trace, _ = for_hardware(trace, hw)
        tracker = measured_tracker(measured)
        plan = simulate(trace, hw, make_policy(case.policy), make_allocator("caching"),
                        case.memory_bytes, tracker=tracker).plan
        got = {}
        for spec in ("caching", "caching:events=gpu"):
            rep = run_plan(trace, hw, plan, make_allocator(spec), case.memory_bytes,
                           tracker=tracker).report
            err = relative_error(float(rep["iteration_time_us"]),
                                 float(measured["iteration_time_us"])) \
                if rep["fits"] and measured["fits"] else None
            got[spec] = (rep["fits"], err)
        rows.append((case.id, bool(measured["fits"]), got))
    for spec in ("caching", "caching:events=gpu"):
        right = sum(g[spec][0] == fits for _, fits, g in rows)
        print(f"{spec}: fits right {right}/{len(rows)}")
    both = [g for _, _, g in rows if all(e is not None for _, e in g.values())]
    for spec in ("caching", "caching:events=gpu"):
        errs = [abs(g[spec][1] or 0.0) for g in both]  # (none is None in `both`)
        print(f"{spec}: time MAPE {100 * sum(errs) / len(errs):.2f}% over the {len(both)} cases "
              "both predict to fit")
    for cid, fits, g in rows:
        if g["caching"][0] != g["caching:events=gpu"][0]:
            verdict = "right" if g["caching:events=gpu"][0] == fits else "wrong"
            print(f"  flips: {cid}: fits {g['caching'][0]} -> {g['caching:events=gpu'][0]} "
                  f"(measured {fits}): {verdict}")


if __name__ == "__main__":
    main()
