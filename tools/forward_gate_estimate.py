"""What gating forward by module hooks could save (issue 13 item 2), estimated from the traces
before building it: the native tracker counts every forward aten call; a module call in which
the plan acts at no op could run with the tracker's key excluded, its count resynchronised by a
forward pre-hook and a forward hook. Per case: forward counted calls (the H100 profile's
`counted_calls`), those inside the outermost module calls with no op the runtime calls back at
(an action before or after it, a recorded or noted op, a hooked save, the producer of a tensor
the plan acts on), and the saving at `--call-us` per counted call less `--hooks-us` per gated
module call (a pre-hook 1.0 us on the H100, validation/host/waits/ section 8; the forward
hook and two calls into the counter about as much again). Module calls are the trace's layer
names: contiguous ops sharing a dotted prefix (vsim.engine.hostclock.forward_gated, the host
model's charge for runs under VSIM_NATIVE_FWD_GATE=modules). An estimate, not a measurement.

    python tools/forward_gate_estimate.py CASE_ID... [--call-us 2.6] [--hooks-us 2.3]
"""

from __future__ import annotations

import argparse
import glob

from vsim.engine.hostclock import forward_gated
from vsim.host import load_host_model
from vsim.plan import PlanIndex
from vsim.validate import case_inputs, load_cases, simulate_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ids", nargs="+")
    ap.add_argument("--call-us", type=float, default=2.6)
    ap.add_argument("--hooks-us", type=float, default=2.3)
    args = ap.parse_args()
    cases = [c for c in load_cases(sorted(glob.glob("validation/cases/*.yaml")))
             if c.id in args.ids]
    for case in cases:
        trace, hw, measured = case_inputs(case)
        host = load_host_model(case.hardware)
        assert host is not None
        index = PlanIndex(simulate_case(case, trace, hw, measured).plan)
        gated, firsts = forward_gated(trace, index)
        calls = len(firsts)
        fwd = sum(host.counted(op) for op in trace.ops if op.phase == "fwd")
        inside = sum(host.counted(op) for op in trace.ops if op.id in gated)
        saved = inside * args.call_us - calls * args.hooks_us
        it = measured.get("iteration_time_us") or float("nan")
        print(f"{case.id}: {fwd:.0f} forward counted calls, {inside:.0f} in {calls} module calls "
              f"with no action: {saved / 1e3:.2f} ms a step, {100 * saved / it:.2f}% of "
              f"{it / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
