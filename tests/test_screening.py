"""Screening runs (issue 14, planning time): a profiling run cut short after its first iterations,
which goes on from there when its plan is then run whole, and the escalation that screens the
budgets it searches before it runs the fastest candidates whole."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vsim.allocator import make_allocator
from vsim.engine import planning_runner, run_plan
from vsim.hardware import load_hardware
from vsim.plan import Plan, Retime
from vsim.policies import make_policy
from vsim.policies.fitted import SCREEN_ITERATIONS, Judge, fit_by_profiling
from vsim.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
HW = load_hardware("h100-sxm")
CACHING = make_allocator("caching")


@pytest.mark.parametrize("name,spec,fraction", [
    ("squeezenet1_1-b128-h100", "accudnn", 0.5),  # 13 iterations: the layout never repeats
    ("resnet50-b64-h100", "vdnnpp", 0.5),  # settles in its 12th
    ("squeezenet1_1-b128-h100", "superneurons", 0.6),  # runs out of memory in its 6th
])
def test_a_screening_run_gone_on_reports_what_a_whole_run_reports(name: str, spec: str,
                                                                    fraction: float) -> None:
    trace = load_trace(TRACES / f"{name}.vsim.json.gz")
    none = run_plan(trace, HW, make_policy("none").plan(trace, HW, HW.capacity_bytes),
                    CACHING, HW.capacity_bytes).report
    cap = int(int(none["peak_reserved_bytes"]) * fraction)
    runner = planning_runner(CACHING)
    plan = make_policy(spec).plan_with(trace, HW, cap, runner)
    whole = runner(trace, HW, plan, None, cap)
    assert whole.output.iterations > SCREEN_ITERATIONS  # a run the screening cuts short
    for n in (2, SCREEN_ITERATIONS, 5):
        screened = runner.screen(trace, HW, plan, cap, n)
        assert screened.output.iterations == min(n, whole.output.iterations)
        assert screened.resume is not None or screened.output.iterations == \
            whole.output.iterations
        gone_on = screened.resume() if screened.resume is not None else screened
        assert json.dumps(gone_on.report, sort_keys=True) == json.dumps(whole.report,
                                                                         sort_keys=True)
        assert gone_on.resume is None


def test_a_run_simulates_at_least_two_iterations() -> None:
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")
    with pytest.raises(ValueError, match="at least 2"):
        run_plan(trace, HW, Plan(), CACHING, None, iterations=1)


# ---------------------------------------------------------------- the escalation, on a model

@dataclass
class _Result:
    report: dict[str, Any]
    iterations: int
    resume: Any = None

    @property
    def output(self) -> Any:
        return self


@dataclass
class Landscape:
    """A planning runner over plans that name their budget (a Retime of op `budget`): plans
    for budgets up to `fits_to` fit; up to `late_to`, they run out of memory in iteration
    `late_at` (after a screening); above it, in the first. Higher budgets are faster."""

    fits_to: int
    late_to: int
    late_at: int = 6
    whole: list[int] = field(default_factory=list)  # budgets run whole (or gone on)
    screened: list[int] = field(default_factory=list)

    def _report(self, budget: int, fits: bool) -> dict[str, Any]:
        oom = None if fits else {"op": None, "tensor": -1, "need_bytes": 2, "free_bytes": 1}
        return {"fits": fits, "oom": oom, "iteration_time_us": 1000.0 - budget}

    def _whole(self, budget: int) -> _Result:
        self.whole.append(budget)
        if budget <= self.fits_to:
            return _Result(self._report(budget, True), 13)
        return _Result(self._report(budget, False), self.late_at if budget <= self.late_to
                       else 1)

    def __call__(self, trace: Any, hw: Any, plan: Plan, allocator: Any, cap: int) -> _Result:
        return self._whole(plan.actions[0].op)

    def screen(self, trace: Any, hw: Any, plan: Plan, cap: int, n: int) -> _Result:
        budget = plan.actions[0].op
        self.screened.append(budget)
        if budget > self.late_to:
            return _Result(self._report(budget, False), 1)
        return _Result(self._report(budget, True), n, lambda: self._whole(budget))


def _build(budget: int, forced: frozenset[int]) -> Plan:
    return Plan(actions=(Retime(budget, 1.0, 0),))


def test_the_escalation_screens_then_runs_the_fastest_whole_until_one_fits() -> None:
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")
    land = Landscape(fits_to=500, late_to=700)
    plan, notes = fit_by_profiling(land, trace, HW, 1000, _build, tries=2)
    budget = plan.actions[0].op
    assert "the fastest that fit whole of the 6 plan(s) a screened search" in notes[0]
    # The two profiling runs, then screenings: every budget screened up to 700 passed
    assert land.whole[:2] == [1000, 990]
    passed = sorted(b for b in set(land.screened) if b <= 700)
    # Of those, the fastest (the highest budget, here in the band that fails late) ran whole
    # first, then a bisection over the ones below it: the highest that fits whole is returned
    assert budget == max(b for b in passed if b <= 500)
    gone_on = land.whole[2:]
    assert gone_on[0] == max(passed) and budget in gone_on
    assert len(gone_on) <= 2 + len(passed).bit_length()  # not all of them
    assert len(gone_on) < len(passed)


def test_the_escalation_says_so_when_nothing_passes_even_its_screening() -> None:
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")
    land = Landscape(fits_to=-1, late_to=-1)
    plan, notes = fit_by_profiling(land, trace, HW, 1000, _build, tries=2)
    assert plan.actions[0].op == 1000 and "cannot fit" in notes[0]


def test_a_schedule_whose_budget_moves_only_workspaces_stops_at_budget_0() -> None:
    """sqrt's and every-k's plans (recompute optimal's candidates) evict the same at every
    budget: when the plan for budget 0 fails its screening, no budget above it is tried."""
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")
    land = Landscape(fits_to=-1, late_to=-1)  # budget 0 fails its screening
    plan, notes = fit_by_profiling(land, trace, HW, 1000, _build, tries=2,
                                   evicts_by_budget=False)
    assert plan.actions[0].op == 1000 and "cannot fit" in notes[0]
    assert "holds the same tensors and more workspace" in notes[0]
    assert land.screened == [0]
    land = Landscape(fits_to=-1, late_to=-1)
    fit_by_profiling(land, trace, HW, 1000, _build, tries=2)  # a policy that evicts by budget
    assert len(set(land.screened)) > 1


def test_the_escalation_searches_whole_runs_when_every_screened_plan_fails_later() -> None:
    # Everything up to 700 passes its screening and then runs out of memory: the screened
    # rounds find nothing, and the search on whole runs says that the policy cannot fit.
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")
    land = Landscape(fits_to=-1, late_to=700)
    plan, notes = fit_by_profiling(land, trace, HW, 1000, _build, tries=2)
    assert plan.actions[0].op == 1000 and "cannot fit" in notes[0]


def test_judge_goes_on_from_the_screening_and_memoises() -> None:
    land = Landscape(fits_to=500, late_to=700)
    judge = Judge(land, None, HW, 1000)  # type: ignore[arg-type]
    fits = _build(400, frozenset())
    assert judge.screen(fits)["fits"] and land.whole == []
    assert judge(fits)["fits"] and land.whole == [400]  # gone on, once
    assert judge(fits)["fits"] and judge.screen(fits)["fits"] and land.whole == [400]
    late = _build(600, frozenset())
    assert judge.screen(late)["fits"] and not judge(late)["fits"]
    assert not judge.screen(late)["fits"]  # the whole run's verdict from then on
    early = _build(800, frozenset())
    assert not judge.screen(early)["fits"] and not judge(early)["fits"]
    assert land.screened == [400, 600, 800] and land.whole == [400, 600]


def test_the_escalation_tries_the_other_candidates_where_fitting_is_not_monotone() -> None:
    # Everything up to 700 passes its screening; only budgets from 480 to 500 fit whole. The
    # fastest candidate (696) fails, the bisection below it (612, then 0) finds nothing, so
    # the others run whole, fastest first (688, 673), until 490 fits.
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")

    class Window(Landscape):
        def _whole(self, budget: int) -> _Result:
            self.whole.append(budget)
            fits = 480 <= budget <= 500
            return _Result(self._report(budget, fits), 13 if fits else self.late_at)

    land = Window(fits_to=-1, late_to=700)
    plan, notes = fit_by_profiling(land, trace, HW, 1000, _build, tries=2)
    assert sorted(b for b in set(land.screened) if b <= 700) == [0, 490, 612, 673, 688, 696]
    assert land.whole[2:] == [696, 612, 0, 688, 673, 490]
    assert plan.actions[0].op == 490 and "the fastest that fit whole" in notes[0]
