"""The gated host model's calls through the native tracker's key against the runs': for every
case whose measured run reports `executed.calls_through_tracker` (a gated backward, from
2026-11-27), the calls the host model charges for its plan as `vsim validate` plans it
(`hostclock.gated_calls` over the profile's `counted_calls`) and the calls the run put through
the key. A check of the mechanism the host model charges, not of a fitted number. Writes
nothing.

    python tools/gated_calls_check.py [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import glob
import statistics

from vsim.engine.hostclock import gated_calls
from vsim.host import load_host_model
from vsim.plan import PlanIndex
from vsim.validate import case_inputs, load_cases, simulate_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="h100-sxm")
    args = ap.parse_args()
    host = load_host_model(args.hardware)
    if host is None:
        raise SystemExit(f"{args.hardware}: no host model")
    ratios = []
    print("| case | calls through the key, measured | charged | all counted |")
    print("|---|---|---|---|")
    for case in load_cases(sorted(glob.glob("validation/cases/*.yaml"))):
        if case.hardware != args.hardware or case.measured == "trace":
            continue
        trace, hw, measured = case_inputs(case)
        through = (measured.get("executed") or {}).get("calls_through_tracker")
        if through is None or not measured.get("fits"):
            continue
        gated = gated_calls(trace, PlanIndex(simulate_case(case, trace, hw, measured).plan))
        charged = sum(min(host.counted(o), gated.get(o.id, host.counted(o))) for o in trace.ops)
        every = sum(host.counted(o) for o in trace.ops)
        ratios.append(charged / through)
        print(f"| {case.id} | {through} | {charged:.0f} | {every:.0f} |")
    if ratios:
        print(f"charged over measured: median {statistics.median(ratios):.2f}, "
              f"{min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} runs")


if __name__ == "__main__":
    main()
