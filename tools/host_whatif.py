"""What the what-if tools on the host model share: a validation case planned as `vsim validate`
plans it, then that plan run again with the host model changed (plans held, so no remeasure is
needed to read the effect; adopting the change would move plans). Used by
tools/host_calls_whatif.py, host_probe_whatif.py, tracker_whatif.py, moved_plans.py and
hooked_saves_check.py; not a command of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import vsim.engine as engine
from vsim.allocator import make_allocator
from vsim.engine import run_plan
from vsim.hardware import Hardware
from vsim.host import HostModel
from vsim.plan import Plan
from vsim.trace.schema import Trace
from vsim.validate import Case, case_inputs, run_tracker, simulate_case

HELD_OUT = ("efficientnet_b0", "regnet_y_1_6gf", "swin_t", "wide_resnet50_2")


@contextmanager
def host_changed(change: Callable[[HostModel], HostModel] | None) -> Iterator[None]:
    """Within: `change` applied to every host model a run loads (None: as they are)."""
    base = engine._host_model  # noqa: SLF001

    def changed(trace: Trace, hw: Hardware, host_time: Any,
                tracker: Any = None) -> HostModel | None:
        host = base(trace, hw, host_time, tracker)
        return host if host is None or change is None else change(host)

    engine._host_model = changed  # noqa: SLF001
    try:
        yield
    finally:
        engine._host_model = base  # noqa: SLF001


def planned(case: Case, change: Callable[[HostModel], HostModel] | None = None
            ) -> tuple[Trace, Plan]:
    """(the case's trace on its hardware, the plan `vsim validate` makes for it), with `change`
    applied to every host model its planning loads (None: as they are)."""
    trace, hw, m = case_inputs(case)
    with host_changed(change):
        return trace, simulate_case(case, trace, hw, m).plan


def rerun_with_host(case: Case, *changes: Callable[[HostModel], HostModel],
                    fitted_only: bool = True
                    ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]] | None:
    """(measured, report as validate plans and runs it, per change the report of that plan
    run again with the change applied to every host model the run loads); None when
    `fitted_only` and the measured run did not fit or has no time."""
    trace, hw, m = case_inputs(case)
    if fitted_only and (not m["fits"] or not m.get("iteration_time_us")):
        return None
    sim = simulate_case(case, trace, hw, m)
    again = []
    for change in changes:
        with host_changed(change):
            again.append(run_plan(trace, hw, sim.plan, make_allocator(case.allocator),
                                  case.memory_bytes, tracker=run_tracker(m)).report)
    return m, sim.report, again
