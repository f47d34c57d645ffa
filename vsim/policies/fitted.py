"""The profiling loop of the capacity-aware policies, and their base class.

`FittedPolicy` owns what they share: plan() plans for a budget (`plan_for`, given an `Attempt`:
the trace's layer view, the budget, the convolutions' algorithms for it), checks the plan by one
simulated iteration through the `run_plan` it is given (`check`, the profiling run of Capuchin or
vDNN_dyn) and, when that runs out of memory, plans again with a convolution run without its
workspace or for a lower budget (`fit_by_profiling`). A subclass holds only its own rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..hardware import Hardware
from ..plan import Plan, PlanBuilder, Release, Retime, RunPlan, iteration_floor
from ..trace.schema import Trace
from ..units import format_size
from .base import Policy
from .layers import TraceView
from .planning import Evictions, Usage, algorithm_retimes, anchor_prefetches, apply_releases


def check(run_plan: RunPlan, trace: Trace, hw: Hardware, plan: Plan, capacity_bytes: int
          ) -> dict[str, Any]:
    """One simulated iteration of `plan` as the run it is planned for will simulate it (a
    profiling run): `run_plan` with allocator None, which engine.planning_runner runs on the
    run's own allocator, first iteration and workspace fallback (PyTorch's caching allocator
    outside a simulation). Judged so, a plan found to fit fits the run (issue 14)."""
    report: dict[str, Any] = run_plan(trace, hw, plan, None, capacity_bytes).report
    return report


class Judge:
    """`check`, memoised by plan: a planner that weighs several candidate plans (recompute
    optimal, the escalation below) runs each distinct plan once."""

    def __init__(self, run_plan: RunPlan, trace: Trace, hw: Hardware, capacity_bytes: int
                 ) -> None:
        self.run_plan, self.trace, self.hw, self.capacity = run_plan, trace, hw, capacity_bytes
        self._seen: dict[Plan, dict[str, Any]] = {}
        self.runs = 0

    def __call__(self, plan: Plan) -> dict[str, Any]:
        key = dataclasses.replace(plan, notes=())
        if key not in self._seen:
            self.runs += 1
            self._seen[key] = check(self.run_plan, self.trace, self.hw, plan, self.capacity)
        return self._seen[key]

    def floor(self, plan: Plan) -> float:
        """A lower bound on the time `self(plan)` reports (plan.iteration_floor; 0 if none)."""
        return iteration_floor(self.run_plan, self.trace, self.hw, plan)

    def time_if_fits(self, plan: Plan) -> float | None:
        r = self(plan)
        return float(r["iteration_time_us"]) if r["fits"] else None


def fit_with_notes(run_plan: RunPlan | Judge, trace: Trace, hw: Hardware, capacity_bytes: int,
                   build: PlanBuilder, tries: int = 8, escalate: bool = True) -> Plan:
    """fit_by_profiling's plan with the profiling notes after the plan's own."""
    plan, notes = fit_by_profiling(run_plan, trace, hw, capacity_bytes, build, tries, escalate)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes))


ESCALATION_STEPS = 7
"""Bisection steps over the budget when the profiling loop finds no plan that fits."""
ESCALATION_LADDER = 7
"""Budgets tried (evenly between 0 and the last budget tried) when the plan for budget 0 does
not fit either."""


def fit_by_profiling(run_plan: RunPlan | Judge, trace: Trace, hw: Hardware, capacity_bytes: int,
                     build: PlanBuilder, tries: int = 8, escalate: bool = True
                     ) -> tuple[Plan, list[str]]:
    """Plan for a budget, run it once, and when the run does not fit, plan again: if what could
    not be allocated is a convolution's workspace, or the run stopped at a convolution that
    would allocate one, with that convolution also run without workspace (`build`'s second
    argument: the ops to downgrade, which a policy honours under algo=auto, as cuDNN frameworks
    fall back when a workspace allocation fails); otherwise for a budget lowered by what the
    failed request lacked (at least 1% of the capacity).

    When `tries` such runs find nothing that fits, escalate: the policy's plan for budget 0 (as
    much eviction as its own rules allow); if even that does not fit, the policy cannot fit by
    its own rules and the first plan is returned with a note saying so (`escalate` False: no
    escalation, the first plan with a note); otherwise a bisection
    over the budget between 0 and the last budget tried (a lower budget evicts more) returns
    the plan for the highest budget found to fit. When the plan for budget 0 does not fit,
    ESCALATION_LADDER budgets evenly between 0 and the last budget tried are tried, highest
    first, before giving up; the bisection then starts from the first that fits. Every run is
    judged as the run the plan is for will be (`check`). Deterministic. Returns the plan and
    notes."""
    judge = run_plan if isinstance(run_plan, Judge) else \
        Judge(run_plan, trace, hw, capacity_bytes)
    budget = capacity_bytes
    forced: frozenset[int] = frozenset()
    first = plan = build(budget, forced)
    tensors = trace.tensor_by_id()
    ops = {o.id: o for o in trace.ops}
    i = 0
    for i in range(tries):
        report = judge(plan)
        if report["fits"]:
            if budget < capacity_bytes:
                return plan, [f"planned for {budget} B after {i} profiling run(s) did not fit"]
            return plan, []
        oom = report["oom"]
        assert isinstance(oom, dict)
        failed = tensors.get(int(oom["tensor"]))
        at = oom["op"]
        at_ws = at is not None and int(at) in ops \
            and any(tensors[t].kind == "workspace" for t in ops[int(at)].writes)
        if failed is not None and failed.kind == "workspace" and failed.producer is not None \
                and failed.producer not in forced:
            forced = forced | {failed.producer}
        elif at_ws and int(at) not in forced:
            forced = forced | {int(at)}  # the op it ran out at would need its workspace too
        else:
            short = int(oom["need_bytes"]) - int(oom["free_bytes"])
            budget -= max(short, capacity_bytes // 100)
            if budget <= 0:
                break
        plan = build(budget, forced)
    runs = judge.runs
    if not escalate:
        return first, [f"no plan found that fits {capacity_bytes} B in {runs} profiling run(s)"]
    # Escalation: the most eviction the policy's rules allow, then bisection over the budget.
    top = max(1, min(budget, capacity_bytes))
    most = build(0, forced)
    lo, hi, best = 0, top, most
    if not judge(most)["fits"]:
        # The plan for budget 0 is not always the likeliest to fit: a planner may fall back
        # below some budget (recompute optimal's DP to sqrt), and the caching allocator's
        # fragmentation or prefetches issued early can sink the plan with the most eviction
        # while a milder one fits (gpt2-medium, 2048 tokens at 24 GiB: the DP's plans for
        # 0.6..0.85 of the capacity fit, for 0 and 0.9 not). A ladder of budgets, highest
        # first, finds a budget that fits; the bisection then climbs from it.
        for step in range(ESCALATION_LADDER, 0, -1):
            mid = top * step // (ESCALATION_LADDER + 1)
            p = build(mid, forced)
            if judge(p)["fits"]:
                lo, best = mid, p
                break
            hi = mid
        else:
            return first, [f"cannot fit {format_size(capacity_bytes)} by its own rules: "
                           f"neither its plan with the most eviction (planned for 0 B) nor those "
                           f"for {ESCALATION_LADDER} budgets between it and {format_size(top)} fit "
                           f"({judge.runs} profiling run(s)); this is the plan for the full "
                           f"capacity"]
    # Down to 1/2**ESCALATION_STEPS of the range: from a rung of the ladder, 4 steps.
    resolution = max(1, top >> ESCALATION_STEPS)
    for _ in range(ESCALATION_STEPS):
        mid = (lo + hi) // 2
        if mid <= lo or hi - lo <= resolution:
            break
        p = build(mid, forced)
        if judge(p)["fits"]:
            lo, best = mid, p
        else:
            hi = mid
    return best, [f"planned for {lo} B (more eviction) after {runs} profiling run(s) did not "
                  f"fit, by bisection over the budget ({judge.runs} run(s) in all)"]


@dataclass(frozen=True)
class Attempt:
    """One plan at one budget: what every capacity-aware policy starts from. `forced`: the
    convolutions a profiling run could not give their workspace (run without it under
    algo=auto)."""

    trace: Trace
    hw: Hardware
    view: TraceView
    budget: int
    forced: frozenset[int]
    algo: str

    @cached_property
    def _algorithms(self) -> tuple[list[Retime], list[str]]:
        key = ("algorithms", self.hw.name, self.algo, self.budget, self.forced)
        if key not in self.view.memo:
            self.view.memo[key] = algorithm_retimes(self.trace, self.hw, self.view, self.algo,
                                                    self.budget, self.forced)
        out: tuple[list[Retime], list[str]] = self.view.memo[key]
        return out

    @property
    def retimes(self) -> list[Retime]:
        """The convolutions run with their workspace-free algorithm (planning.algorithm_retimes)."""
        return self._algorithms[0]

    @property
    def retime_notes(self) -> list[str]:
        return self._algorithms[1]

    def usage(self, releases: list[Release] | None = None) -> Usage:
        """The static profile with the retimes' workspaces (and `releases`) taken out."""
        usage = Usage(self.view, self.retimes)
        if releases:
            apply_releases(usage, self.view, releases)
        return usage

    def evictions(self, usage: Usage | None = None, blocking: bool = False) -> Evictions:
        """Swaps and drops to choose against the budget, over `usage` (default: usage())."""
        return Evictions(self.view, self.hw, self.usage() if usage is None else usage,
                         self.budget, blocking=blocking)

    def forcing(self, ops: set[int] | frozenset[int]) -> Attempt:
        """The same attempt with `ops` also run without their workspace."""
        return dataclasses.replace(self, forced=self.forced | frozenset(ops))


@dataclass(frozen=True)
class FittedPolicy(Policy):
    """Base of the capacity-aware policies (see the module docstring). Subclasses write
    `plan_for(attempt)` and have an `algo` field (auto, performance or memory: each declares it
    itself, so that its spec keeps its fields in order)."""

    capacity_aware = True

    def plan_with(self, trace: Trace, hw: Hardware, capacity_bytes: int,
                  run_plan: RunPlan) -> Plan:
        view = TraceView(trace)
        algo = str(getattr(self, "algo"))  # noqa: B009  (a field of every subclass)
        return fit_with_notes(run_plan, trace, hw, capacity_bytes, lambda budget, forced:
                              anchor_prefetches(view, self.plan_for(
                                  Attempt(trace, hw, view, budget, forced, algo))))

    def plan_for(self, attempt: Attempt) -> Plan:
        raise NotImplementedError
