"""Which cases' plans a host-model change would move: each case planned as `vsim validate` plans
it, then planned again with the change applied to every host model the planning loads; the
cases whose plan digests differ must be remeasured before the change is adopted. Prints them
and a `--only` list for the suite runner. Writes nothing.

    PYTHONPATH=tools python tools/moved_plans.py --save-us US [--hardware h100-sxm]
    PYTHONPATH=tools python tools/moved_plans.py --gate [--hardware h100-sxm]

`--save-us`: the saved-tensor hooks' charge per save for the runs with the hooks armed (the
profile charges it times each hooked op's saves, `saves_per_op`). Before the per-save charge,
`--armed-pack-us 44.1` set a charge per hooked op and moved 10 plans (validation/host/waits/
section 7). `--gate`: the plans made for the native tracker with backward gated
("native-gated", VSIM_NATIVE_GATE=nodes) instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
from pathlib import Path

from host_whatif import planned

from vsim.host import HostModel
from vsim.plan import plan_digest
from vsim.validate import case_inputs, load_cases, planned_tracker, simulate_case


def main() -> None:
    ap = argparse.ArgumentParser()
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--save-us", type=float)
    what.add_argument("--gate", action="store_true")
    ap.add_argument("--hardware", default=None)
    args = ap.parse_args()

    def change(host: HostModel) -> HostModel:
        if host.hooks != "armed":
            return host
        return dataclasses.replace(host, save_us=args.save_us)

    moved = []
    cases = [c for c in load_cases(sorted(glob.glob("validation/cases/*.yaml")))
             if c.policy.split(":")[0] != "none"
             and (args.hardware is None or c.hardware == args.hardware)]
    for case in cases:
        if case.measured == "trace" or \
                planned_tracker(json.loads(Path(case.measured).read_text())) != "native":
            continue  # planned for the hooks always on: the change does not reach its plan
        if args.gate:
            trace, hw, m = case_inputs(case)
            gated = {**m, "provenance": {**m.get("provenance", {}),
                                         "plan_tracker": "native-gated"}}
            a, b = (simulate_case(case, trace, hw, x).plan for x in (m, gated))
        else:
            a, b = planned(case)[1], planned(case, change)[1]
        if plan_digest(a) != plan_digest(b):
            moved.append(case.id)
            print(f"moves: {case.id}", flush=True)
    print(f"{len(moved)} plans move")
    if moved:
        print("--only " + ",".join(moved))


if __name__ == "__main__":
    main()
