"""Which cases' plans a host-model change would move: each case planned as `vsim validate` plans
it, then planned again with the change applied to every host model the planning loads; the
cases whose plan digests differ must be remeasured before the change is adopted. Prints them
and a `--only` list for the suite runner. Writes nothing.

    PYTHONPATH=tools python tools/moved_plans.py --armed-pack-us 44.1 [--hardware h100-sxm]

`--armed-pack-us`: the saved-tensor hooks' charge per hooked forward op for the runs with the
hooks armed (validation/host/waits/ section 7: 6.88 saves of 6.4 us).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import vsim.engine as engine
from vsim.allocator import make_allocator
from vsim.engine import TIMING_DRAWS, simulate
from vsim.hardware import Hardware, load_hardware
from vsim.host import HostModel
from vsim.plan import plan_digest
from vsim.policies import make_policy
from vsim.retarget import for_hardware
from vsim.trace import load_trace
from vsim.trace.schema import Trace
from vsim.validate import Case, load_cases, planned_tracker


def plan_with(case: Case, change: Callable[[HostModel], HostModel] | None) -> str:
    """The digest of the plan `vsim validate` makes for `case`, with `change` applied to the
    host models its planning loads (None: as they are)."""
    hw = load_hardware(case.hardware)
    trace, _ = for_hardware(load_trace(case.trace), hw)
    doc = json.loads(Path(case.measured).read_text()) if case.measured != "trace" else {}
    base = engine._host_model  # noqa: SLF001

    def changed(trace: Trace, hw: Hardware, host_time: Any,
                tracker: Any = None) -> HostModel | None:
        host = base(trace, hw, host_time, tracker)
        return None if host is None or change is None else change(host)

    if change is not None:
        engine._host_model = changed  # noqa: SLF001
    try:
        plan = simulate(trace, hw, make_policy(case.policy), make_allocator(case.allocator),
                        case.memory_bytes, plan_tracker=planned_tracker(doc),
                        draws=TIMING_DRAWS).plan
    finally:
        engine._host_model = base  # noqa: SLF001
    return plan_digest(plan)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--armed-pack-us", type=float, required=True)
    ap.add_argument("--hardware", default=None)
    args = ap.parse_args()

    def change(host: HostModel) -> HostModel:
        if host.hooks != "armed":
            return host
        return dataclasses.replace(host, pack_us=args.armed_pack_us)

    moved = []
    cases = [c for c in load_cases(sorted(glob.glob("validation/cases/*.yaml")))
             if c.policy.split(":")[0] != "none"
             and (args.hardware is None or c.hardware == args.hardware)]
    for case in cases:
        if case.measured == "trace" or \
                planned_tracker(json.loads(Path(case.measured).read_text())) != "native":
            continue  # planned for the hooks always on: the change does not reach its plan
        if plan_with(case, None) != plan_with(case, change):
            moved.append(case.id)
            print(f"moves: {case.id}", flush=True)
    print(f"{len(moved)} plans move")
    if moved:
        print("--only " + ",".join(moved))


if __name__ == "__main__":
    main()
