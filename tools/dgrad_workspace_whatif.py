"""What-if: a backward convolution allocates two workspaces in turn (cuDNN's data-gradient
kernel's, then the weight-gradient kernel's), where the trace keeps one, merged at its peak
(vsim/trace/importers/build.py: every allocation an op makes and frees itself is one
workspace). PyTorch's allocator histories show the first (validation/allocator/h100/: on
vgg16-b128, 11 of 12 backward convolutions allocate about their forward convolution's
workspace, free it, then allocate the recorded one), and the blocks it leaves are the segments
the model misses: vgg16-b128 with no policy reserves 19.55 GiB for real and 15.99 GiB in the
model, three segments (108, 402 and 3138 MiB) short.

Each validation case on the caching allocator is planned as `vsim validate` plans it, then that
plan is run again with every backward convolution first allocating and freeing its forward
convolution's workspace (Engine.transient_before); plans held, so no remeasure is needed to read
the effect. Prints fits right, time and reserved errors both ways.

    python tools/dgrad_workspace_whatif.py [CASE.yaml...]
"""

from __future__ import annotations

import glob
import statistics
import sys

from vsim.allocator import make_allocator
from vsim.engine import run_plan, simulate
from vsim.engine.simulator import Engine
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.retarget import for_hardware
from vsim.trace import load_trace
from vsim.trace.schema import Op, Trace
from vsim.validate import load_cases, measured_result, measured_tracker


def dgrad_workspaces(trace: Trace) -> dict[int, int]:
    """Per backward convolution with a workspace, its forward convolution's workspace bytes
    (same layer)."""
    tensors = trace.tensor_by_id()

    def workspace(op: Op) -> int:
        return max((tensors[t].size_bytes for t in op.writes
                    if tensors[t].kind == "workspace"), default=0)

    forward = {o.layer: workspace(o) for o in trace.ops
               if o.layer_type == "conv" and o.phase == "fwd" and o.layer}
    return {o.id: forward[o.layer] for o in trace.ops
            if o.layer_type == "conv" and o.phase == "bwd" and forward.get(o.layer)
            and workspace(o) > 0}


def rel(p: float, m: float) -> float:
    return (p - m) / m


def main() -> None:
    paths = sys.argv[1:] or sorted(glob.glob("validation/cases/*.yaml"))
    rows = []
    for case in load_cases(paths):
        if case.allocator != "caching" or case.measured == "trace":
            continue
        hw = load_hardware(case.hardware)
        trace, _ = for_hardware(load_trace(case.trace), hw)
        m = measured_result(case, trace.measured)
        alloc = make_allocator(case.allocator)
        sim = simulate(trace, hw, make_policy(case.policy), alloc, case.memory_bytes,
                       tracker=measured_tracker(m), plan_tracker="native")
        extra = dgrad_workspaces(trace)
        none = Engine.transient_before
        Engine.transient_before = extra
        try:
            again = run_plan(trace, hw, sim.plan, make_allocator(case.allocator),
                             case.memory_bytes, tracker=measured_tracker(m)).report
        finally:
            Engine.transient_before = none
        rows.append((case.id, bool(m["fits"]), sim.report, again, m, len(extra)))
    for label, k in (("as now", 2), ("with the data-gradient workspace", 3)):
        right = sum(r[1] == bool(r[k]["fits"]) for r in rows)
        opt = sum(r[k]["fits"] and not r[1] for r in rows)
        pes = sum(r[1] and not r[k]["fits"] for r in rows)
        t = [abs(rel(float(r[k]["timed_iteration_time_us"]), float(r[4]["iteration_time_us"])))
             for r in rows if r[1] and r[k]["fits"] and r[4].get("iteration_time_us")]
        rs = [rel(float(r[k]["peak_reserved_bytes"]), float(r[4]["peak_reserved_bytes"]))
              for r in rows if r[1] and r[k]["fits"] and r[4].get("peak_reserved_bytes")]
        print(f"{label}: fits right {right}/{len(rows)} ({opt} predicted to fit that ran out of "
              f"memory, {pes} the other way); time MAPE {100 * statistics.mean(t):.2f}% over "
              f"{len(t)}; reserved signed mean {100 * statistics.mean(rs):+.2f}%, MAPE "
              f"{100 * statistics.mean(map(abs, rs)):.2f}% over {len(rs)}")
    print("verdicts that change:")
    for cid, fits, a, b, _, n in rows:
        if bool(a["fits"]) != bool(b["fits"]):
            print(f"  {cid}: measured {'fits' if fits else 'out of memory'}; predicted "
                  f"{'fits' if a['fits'] else 'out of memory'} -> "
                  f"{'fits' if b['fits'] else 'out of memory'} ({n} convolutions)")


if __name__ == "__main__":
    main()
