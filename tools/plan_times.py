"""Planning time and outcome of every built-in policy on traces, uncapped and at a capacity that
binds (a fraction of the uncapped peak reserved), with the caching allocator. `plan`: a digest
of the plan as run (a change that only plans faster leaves it as it was).

    python tools/plan_times.py TRACE... [--hw h100-sxm] [--fraction 0.6] [--policy SPEC]...
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import signal
import sys
import time

from vsim.allocator import make_allocator
from vsim.engine import planning_runner, run_plan
from vsim.hardware import load_hardware
from vsim.policies import make_policy, registry
from vsim.policies.base import example_specs
from vsim.trace import load_trace

DEFAULT = [s for n, c in registry().items() if n != "plan" for s in example_specs(c)[:1]] + [
    "recompute:strategy=sqrt", "vdnn:mode=all"]


class Timeout(Exception):
    pass


def _timeout(*_: object) -> None:
    raise Timeout("did not return in time")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--hw", default="h100-sxm")
    ap.add_argument("--fraction", type=float, action="append")
    ap.add_argument("--policy", action="append")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per plan")
    args = ap.parse_args()
    hw = load_hardware(args.hw)
    alloc = make_allocator("caching")
    runner = planning_runner(alloc)  # as `vsim run` plans: profiling runs on the run's allocator
    for path in args.traces:
        trace = load_trace(path)
        none = run_plan(trace, hw, make_policy("none").plan(trace, hw, hw.capacity_bytes),
                        alloc, hw.capacity_bytes).report
        peak = int(none["peak_reserved_bytes"])
        for frac in args.fraction or [1.0, 0.6]:
            cap = hw.capacity_bytes if frac >= 1.0 else int(peak * frac)
            for spec in args.policy or DEFAULT:
                pol = make_policy(spec)
                t0 = time.process_time()
                signal.signal(signal.SIGALRM, _timeout)
                signal.alarm(args.timeout)
                try:
                    plan = pol.plan_with(trace, hw, cap, runner)
                    plan_s = time.process_time() - t0
                    rep = run_plan(trace, hw, plan, alloc, cap).report
                    out = {"fits": rep["fits"], "iter_ms": round(rep["iteration_time_us"] / 1e3, 3),
                           "plan": hashlib.sha256(repr(dataclasses.replace(plan, notes=())).encode()
                                                  ).hexdigest()[:12]}
                except Exception as e:  # noqa: BLE001
                    plan_s = time.process_time() - t0
                    out = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                signal.alarm(0)
                print(json.dumps({"trace": path.split("/")[-1].split(".")[0], "ops": len(trace.ops),
                                  "fraction": frac, "cap_gib": round(cap / 2**30, 2),
                                  "policy": spec, "plan_s": round(plan_s, 2), **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
