"""Planning time (issue 14 item 1), by behaviour rather than seconds: the lower bound planners
prune candidates with never exceeds a judged run's time, and pruning with it leaves the plan as
it was while running fewer profiling runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vsim.allocator import make_allocator
from vsim.engine import planning_runner, run_plan
from vsim.hardware import load_hardware
from vsim.plan import Plan, iteration_floor
from vsim.policies import make_policy
from vsim.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
HW = load_hardware("h100-sxm")
CACHING = make_allocator("caching")


class Counting:
    """A planning runner that counts profiling runs and checks the floor against each; with
    `floor` False it offers none (as a runner that knows no bound)."""

    def __init__(self, floor: bool) -> None:
        self.inner = planning_runner(CACHING)
        self.runs: list[tuple[float, bool, float]] = []
        if floor:
            self.iteration_floor = self.inner.iteration_floor  # type: ignore[attr-defined]

    def __call__(self, trace: Any, hw: Any, plan: Plan, allocator: Any,
                 capacity: int | None = None) -> Any:
        result = self.inner(trace, hw, plan, allocator, capacity)
        if allocator is None:
            low = iteration_floor(self.inner, trace, hw, plan)
            self.runs.append((low, bool(result.report["fits"]),
                              float(result.report["iteration_time_us"])))
        return result


@pytest.fixture(scope="module")
def resnet50() -> tuple[Any, int]:
    trace = load_trace(TRACES / "resnet50-b64-h100.vsim.json.gz")
    peak = run_plan(trace, HW, Plan(), CACHING, HW.capacity_bytes).report["peak_reserved_bytes"]
    return trace, int(peak)


@pytest.mark.parametrize("spec", ["recompute", "superneurons", "vdnn:mode=dyn", "hybrid"])
def test_the_floor_never_exceeds_a_fitting_runs_time(resnet50: tuple[Any, int],
                                                     spec: str) -> None:
    trace, peak = resnet50
    runner = Counting(floor=True)
    make_policy(spec).plan_with(trace, HW, int(peak * 0.6), runner)
    assert runner.runs and any(low > 0 for low, _, _ in runner.runs)  # a host model applies
    for low, fits, us in runner.runs:
        assert not fits or low <= us * (1 + 1e-12)


def test_recompute_optimal_prunes_by_the_floor_without_changing_its_plan(
        resnet50: tuple[Any, int]) -> None:
    trace, peak = resnet50
    plans, runs = [], []
    for floor in (False, True):
        runner = Counting(floor)
        plans.append(make_policy("recompute").plan_with(trace, HW, int(peak * 0.6), runner))
        runs.append(len(runner.runs))
    assert plans[0].actions == plans[1].actions
    assert runs[1] < runs[0]
