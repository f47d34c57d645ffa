"""The data-gradient workspace, off and on with plans held: a backward convolution allocates two
workspaces in turn (cuDNN's data-gradient kernel's, then the weight-gradient kernel's), where
the trace keeps one, merged at its peak (vsim/trace/importers/build.py); run_plan's
`dgrad_workspace` (on by default with PyTorch's allocators) allocates and frees the first,
about its forward convolution's workspace (TracePrep.dgrad_workspaces), before each backward
convolution. PyTorch's allocator histories show it (validation/allocator/h100/), and the blocks
it leaves are segments the model missed: vgg16-b128 with no policy reserves 19.55 GiB for real,
15.99 GiB in the model without it, three segments (108, 402 and 3138 MiB) short.

Each validation case on the caching allocator is planned as `vsim validate` plans it, then that
plan is run with the mechanism off and on (plans held: the effect of the mechanism alone).
Prints fits right, time and reserved errors both ways.

    python tools/dgrad_workspace_whatif.py [CASE.yaml...]
"""

from __future__ import annotations

import glob
import statistics
import sys
from typing import Any

from vsim.allocator import make_allocator
from vsim.engine import run_plan, simulate
from vsim.engine.prep import trace_prep
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.retarget import for_hardware
from vsim.trace import load_trace
from vsim.validate import load_cases, measured_result, measured_tracker


def rel(p: float, m: float) -> float:
    return (p - m) / m


def main() -> None:
    paths = sys.argv[1:] or sorted(glob.glob("validation/cases/*.yaml"))
    rows: list[dict[str, Any]] = []
    for case in load_cases(paths):
        if case.allocator != "caching" or case.measured == "trace":
            continue
        hw = load_hardware(case.hardware)
        trace, _ = for_hardware(load_trace(case.trace), hw)
        m = measured_result(case, trace.measured)
        alloc = make_allocator(case.allocator)
        sim = simulate(trace, hw, make_policy(case.policy), alloc, case.memory_bytes,
                       tracker=measured_tracker(m), plan_tracker="native")
        off, on = (run_plan(trace, hw, sim.plan, make_allocator(case.allocator),
                            case.memory_bytes, tracker=measured_tracker(m),
                            dgrad_workspace=flag).report for flag in (False, True))
        n = len(trace_prep(trace).dgrad_workspaces())
        rows.append({"id": case.id, "fits": bool(m["fits"]), "off": off, "on": on, "m": m,
                     "n": n})
    for label, k in (("without the data-gradient workspace", "off"), ("with it", "on")):
        right = sum(r["fits"] == bool(r[k]["fits"]) for r in rows)
        opt = sum(r[k]["fits"] and not r["fits"] for r in rows)
        pes = sum(r["fits"] and not r[k]["fits"] for r in rows)
        t = [abs(rel(float(r[k]["timed_iteration_time_us"]), float(r["m"]["iteration_time_us"])))
             for r in rows if r["fits"] and r[k]["fits"] and r["m"].get("iteration_time_us")]
        rs = [rel(float(r[k]["peak_reserved_bytes"]), float(r["m"]["peak_reserved_bytes"]))
              for r in rows if r["fits"] and r[k]["fits"] and r["m"].get("peak_reserved_bytes")]
        print(f"{label}: fits right {right}/{len(rows)} ({opt} predicted to fit that ran out of "
              f"memory, {pes} the other way); time MAPE {100 * statistics.mean(t):.2f}% over "
              f"{len(t)}; reserved signed mean {100 * statistics.mean(rs):+.2f}%, MAPE "
              f"{100 * statistics.mean(map(abs, rs)):.2f}% over {len(rs)}")
    print("verdicts that change:")
    for r in rows:
        a, b = bool(r["off"]["fits"]), bool(r["on"]["fits"])
        if a != b:
            print(f"  {r['id']}: measured {'fits' if r['fits'] else 'out of memory'}; predicted "
                  f"{'fits' if a else 'out of memory'} -> {'fits' if b else 'out of memory'} "
                  f"({r['n']} convolutions)")

if __name__ == "__main__":
    main()
