"""The profiling loop of the capacity-aware policies, and their base class.

`FittedPolicy` owns what they share: plan() plans for a budget (`plan_for`, given an `Attempt`:
the trace's layer view, the budget, the convolutions' algorithms for it), checks the plan by one
simulated iteration through the `run_plan` it is given (`check`, the profiling run of Capuchin or
vDNN_dyn) and, when that runs out of memory, plans again with a convolution run without its
workspace or for a lower budget (`fit_by_profiling`). A subclass holds only its own rules.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a capacity-aware policy plans, as the engine
    pauses it per run: the planning's memos (segment shapes, candidate tables, the runs' reports)
    are long-lived containers that its passes traverse again and again, and the runs leave no
    cycles (engine.run_plan). What it would have freed is freed after. The plan is the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def planning_view(trace: Trace) -> Iterator[TraceView]:
    """A TraceView for one planning, with the collector paused (collector_paused). At the end
    its memos are dropped: they hold Segmenters and tables that point back at the view, cycles
    that only the collector frees, and its first pass after the planning then traversed all of
    them (0.25 s of recompute optimal's 4 s on resnet152 at 0.3 of its peak). Cleared, they go
    by reference counting. The plan is the same."""
    view = TraceView(trace)
    with collector_paused():
        try:
            yield view
        finally:
            view.memo.clear()


def check(run_plan: RunPlan, trace: Trace, hw: Hardware, plan: Plan, capacity_bytes: int
          ) -> dict[str, Any]:
    """One simulated iteration of `plan` as the run it is planned for will simulate it (a
    profiling run): `run_plan` with allocator None, which engine.planning_runner runs on the
    run's own allocator, first iteration and workspace fallback (PyTorch's caching allocator
    outside a simulation). Judged so, a plan found to fit fits the run (issue 14)."""
    report: dict[str, Any] = run_plan(trace, hw, plan, None, capacity_bytes).report
    return report


SCREEN_ITERATIONS = 3
"""Iterations (the first one included) of a screening run: on the validation cases' profiling
runs, 501 of the 551 that ran out of memory did so by the third iteration, and a run that fits
takes up to 13."""


def _verdict(result: Any) -> dict[str, Any]:
    """A run's report as its judge reads it: `fits`, `oom` and `iteration_time_us` (a
    SimResult's `verdict`, without the rest of its report; a runner that gives none, its
    report)."""
    verdict = getattr(result, "verdict", None)
    out: dict[str, Any] = result.report if verdict is None else verdict
    return out


class _PlanKey:
    """A plan without its notes as a dict key, its hash computed once (a plan of hundreds of
    actions hashes each of them, and the judge looked each plan up four times)."""

    __slots__ = ("plan", "hash")

    def __init__(self, plan: Plan) -> None:
        self.plan = dataclasses.replace(plan, notes=())
        self.hash = hash(self.plan)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or isinstance(other, _PlanKey) and self.hash == other.hash \
            and self.plan == other.plan


class Judge:
    """`check`, memoised by plan: a planner that weighs several candidate plans (recompute
    optimal, the escalation below) runs each distinct plan once. `screen` runs a plan for its
    first SCREEN_ITERATIONS only (where the run_plan can: engine.planning_runner), which is all
    a run that runs out of memory early needs. What it returns of a run is the report's
    `fits`, `oom` and `iteration_time_us` (`_verdict`): all its callers read; so it runs them
    without the memory log the rest is built from, where the run_plan can (`unlogged`:
    engine.planning_runner's)."""

    def __init__(self, run_plan: RunPlan, trace: Trace, hw: Hardware, capacity_bytes: int
                 ) -> None:
        self.run_plan, self.trace, self.hw, self.capacity = run_plan, trace, hw, capacity_bytes
        self._seen: dict[_PlanKey, dict[str, Any]] = {}
        # screened runs that fit so far, with the way to go on (SimResult.resume)
        self._screened: dict[_PlanKey, tuple[dict[str, Any], Callable[[], Any] | None]] = {}
        self.runs = 0

    def __call__(self, plan: Plan) -> dict[str, Any]:
        key = _PlanKey(plan)
        got = self._seen.get(key)
        if got is None:
            resume = self._screened.pop(key, (None, None))[1]
            if resume is not None:  # its screening run, gone on
                got = _verdict(resume())
            else:
                self.runs += 1  # (check's run, its verdict alone)
                unlogged = getattr(self.run_plan, "unlogged", None)
                got = _verdict(unlogged(self.trace, self.hw, plan, self.capacity, None)
                               if unlogged is not None else
                               self.run_plan(self.trace, self.hw, plan, None, self.capacity))
            self._seen[key] = got
        return got

    def screen(self, plan: Plan) -> dict[str, Any]:
        """The report of a run of `plan`'s first SCREEN_ITERATIONS: out of memory there is the
        whole run's verdict, and so is fitting where the run settled within them; a run that
        fits them and goes on says only that. The whole run's report where there is one."""
        key = _PlanKey(plan)
        got = self._seen.get(key)
        if got is not None:
            return got
        screened = self._screened.get(key)
        if screened is None:
            screen = getattr(self.run_plan, "unlogged", None) \
                or getattr(self.run_plan, "screen", None)
            if screen is None:
                return self(plan)
            self.runs += 1
            result = screen(self.trace, self.hw, plan, self.capacity, SCREEN_ITERATIONS)
            report = _verdict(result)
            if result.resume is None:
                self._seen[key] = report  # the whole run's verdict: settled, or out of memory
                return report
            screened = self._screened[key] = (report, result.resume)
        return screened[0]

    def floor(self, plan: Plan) -> float:
        """A lower bound on the time `self(plan)` reports (plan.iteration_floor; 0 if none)."""
        return iteration_floor(self.run_plan, self.trace, self.hw, plan)

    def time_if_fits(self, plan: Plan) -> float | None:
        r = self(plan)
        return float(r["iteration_time_us"]) if r["fits"] else None


def fit_with_notes(run_plan: RunPlan | Judge, trace: Trace, hw: Hardware, capacity_bytes: int,
                   build: PlanBuilder, tries: int = 8, escalate: bool = True,
                   evicts_by_budget: bool = True) -> Plan:
    """fit_by_profiling's plan with the profiling notes after the plan's own."""
    plan, notes = fit_by_profiling(run_plan, trace, hw, capacity_bytes, build, tries, escalate,
                                   evicts_by_budget)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes))


ESCALATION_STEPS = 7
"""Bisection steps over the budget when the profiling loop finds no plan that fits."""
ESCALATION_LADDER = 7
"""Budgets tried (evenly between 0 and the last budget tried) when the plan for budget 0 does
not fit either."""
SCREENED_LADDER = 2 * ESCALATION_LADDER + 1
"""The same on screening runs, which cost less: twice as dense, every budget of the other
among them (plans fit only in narrow windows of the budget, gpt2 fp32 hybrid at 0.6 of its
peak between 2.05 and 2.53 GiB of 8.3)."""


def fit_by_profiling(run_plan: RunPlan | Judge, trace: Trace, hw: Hardware, capacity_bytes: int,
                     build: PlanBuilder, tries: int = 8, escalate: bool = True,
                     evicts_by_budget: bool = True) -> tuple[Plan, list[str]]:
    """Plan for a budget, run it once, and when the run does not fit, plan again: if what could
    not be allocated is a convolution's workspace, or the run stopped at a convolution that
    would allocate one, with that convolution also run without workspace (`build`'s second
    argument: the ops to downgrade, which a policy honours under algo=auto, as cuDNN frameworks
    fall back when a workspace allocation fails); otherwise for a budget lowered by what the
    failed request lacked (at least 1% of the capacity).

    When `tries` such runs find nothing that fits, escalate (`escalate` False: the first plan,
    with a note): a search over the budget (`_escalate`: the policy's plan for budget 0, the
    most eviction its own rules allow; if that does not fit, a ladder of SCREENED_LADDER
    budgets up to the last one tried; then a bisection from the highest that fits) on
    screening runs (Judge.screen). Of the plans that pass, the fastest is run whole; if it runs
    out of memory later on, a bisection over those below it, then the rest, fastest first; the
    fastest that fits whole is returned. If all of them run out of memory later on, the first
    budget down a ladder below the lowest of them that fits whole; then the search of the
    escalation on whole runs (ESCALATION_LADDER budgets); if nothing fits there either, the
    policy cannot fit by its own rules and the first plan is returned with a note saying so.
    `evicts_by_budget` False: a builder whose budget changes only which convolutions run
    without workspace (a fixed recomputation schedule), so that the plan for budget 0 holds
    the least memory of all: when it does not pass its screening, no budget is tried above it.
    Every run is judged as the run the plan is for will be (`check`). Deterministic. Returns
    the plan and notes."""
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
    top = whole_top = max(1, min(budget, capacity_bytes))
    # Escalation, screened first: the budgets a search over the budget passes through mostly run
    # out of memory in their first iterations, or fit, and a whole run of one that fits costs
    # four times its screening (SCREEN_ITERATIONS). Of the plans that pass their screening,
    # the fastest goes on to a whole run (the highest budget is not always the fastest:
    # vDNN++'s prefetches); the whole run of a screening goes on from where it stopped.
    most: list[dict[str, Any]] = []  # the report of the plan with the most eviction
    found = _escalate(judge.screen, build, forced, top,
                      SCREENED_LADDER if evicts_by_budget else 0, most)
    if found is None:  # no plan passes even its screening: none fits (out of memory is final)
        if not evicts_by_budget:
            between = ("any plan for a higher budget, which holds the same tensors and more "
                       "workspace")
        elif top > SCREENED_LADDER:
            between = f"those for {SCREENED_LADDER} budgets between it and {format_size(top)}"
        else:
            between = f"any between it and {format_size(top)} (none left to try)"
        return first, [f"cannot fit {format_size(capacity_bytes)} by its own rules: "
                       f"neither its plan with the most eviction (planned for 0 B; "
                       f"{_why_not(most[0])}) nor {between} fit ({judge.runs} profiling "
                       f"run(s)); this is the plan for the full capacity"]
    cands = sorted(found, key=lambda c: c[0])
    best_fit, failed_at = _fastest_whole(judge, cands)
    if best_fit is not None:
        budget, best = best_fit
        return best, [f"planned for {budget} B (more eviction) after {runs} profiling run(s) "
                      f"did not fit: the fastest that fit whole of the {len(cands)} plan(s) a "
                      f"screened search over the budget found ({judge.runs} run(s) in all)"]
    top = min(top, failed_at)
    # Every one ran out of memory later on: plans fail late over a band of budgets. Down a
    # ladder below the lowest of them, the first that fits whole (no bisection back toward
    # the band).
    for step in range(SCREENED_LADDER, -1, -1):
        budget = top * step // (SCREENED_LADDER + 1)
        p = build(budget, forced)
        if judge.screen(p)["fits"] and judge(p)["fits"]:
            return p, [f"planned for {budget} B (more eviction) after {runs} profiling run(s) "
                       f"did not fit: the first that fit whole down a ladder below "
                       f"{format_size(top)}, where {len(cands)} plan(s) of a screened search "
                       f"over the budget ran out of memory in later iterations "
                       f"({judge.runs} run(s) in all)"]
    # Every plan that passed its screening ran out of memory later on (rare): the search on
    # whole runs, over the whole range (those already run are not run again).
    found = _escalate(judge, build, forced, whole_top)
    if found is None:
        return first, [f"cannot fit {format_size(capacity_bytes)} by its own rules: "
                       f"no plan of a search over the budget fits ({judge.runs} profiling "
                       f"run(s)); this is the plan for the full capacity"]
    lo, best = _fastest(judge, found)
    return best, [f"planned for {lo} B (more eviction) after {runs} profiling run(s) did not "
                  f"fit: the fastest of the {len(found)} plan(s) a search over the budget on "
                  f"whole runs found to fit ({judge.runs} run(s) in all)"]


def _fastest_whole(judge: Judge, cands: list[tuple[int, Plan]]
                   ) -> tuple[tuple[int, Plan] | None, int]:
    """Of candidates (budget, plan) that passed their screening, in budget order, the fastest
    that fits whole, and the lowest budget of those run whole that did not. The fastest first;
    when it runs out of memory in a later iteration (fragmentation that builds up near the
    budget where plans stop fitting), a bisection over the candidates below it for the highest
    that fits whole (about log2 of them run whole); if none does (fitting is not monotone in
    the budget), the others, the fastest first, until one fits."""
    def screened_us(c: tuple[int, Plan]) -> tuple[float, int]:
        return float(judge.screen(c[1])["iteration_time_us"]), -c[0]

    failed_at = cands[-1][0]
    hi = min(range(len(cands)), key=lambda i: screened_us(cands[i]))
    lo, fitting = -1, []
    tried = [cands[hi][1]]
    if judge(cands[hi][1])["fits"]:
        fitting.append(cands[hi])
    else:
        failed_at = min(failed_at, cands[hi][0])
        while hi - lo > 1:
            mid = (lo + hi) // 2
            tried.append(cands[mid][1])
            if judge(cands[mid][1])["fits"]:
                lo = mid
                fitting.append(cands[mid])
            else:
                hi = mid
                failed_at = min(failed_at, cands[mid][0])
    if not fitting:
        for c in sorted((c for c in cands if c[1] not in tried), key=screened_us):
            if judge(c[1])["fits"]:
                fitting.append(c)
                break
            failed_at = min(failed_at, c[0])
    if not fitting:
        return None, failed_at
    return _fastest(judge, fitting), failed_at


def _fastest(judge: Judge, fitting: list[tuple[int, Plan]]) -> tuple[int, Plan]:
    """Of (budget, plan)s that fit whole, the fastest whole run; ties to the higher budget."""
    return min(fitting, key=lambda c: (judge(c[1])["iteration_time_us"], -c[0]))


def _why_not(report: dict[str, Any]) -> str:
    """Why a run did not fit, in a few words: the memory that ran out and the request."""
    o = report.get("oom") or {}
    where = "before the first op" if o.get("op") is None else f"at op {o['op']}"
    return (f"out of {o.get('memory', 'device')} memory {where}: "
            f"{format_size(int(o.get('need_bytes', 0)))} needed, "
            f"{format_size(int(o.get('free_bytes', 0)))} free")


def _escalate(judge: Callable[[Plan], dict[str, Any]], build: PlanBuilder,
              forced: frozenset[int], top: int, ladder: int = ESCALATION_LADDER,
              most_report: list[dict[str, Any]] | None = None
              ) -> list[tuple[int, Plan]] | None:
    """The plans (with their budgets) that `judge` finds to fit on the way: the policy's plan
    for budget 0 (the most eviction its own rules allow; its report appended to
    `most_report`); if that does not fit, a ladder of `ladder` budgets evenly between 0 and
    `top`, highest first; from the first that fits, a bisection over the budget up to `top`
    (a lower budget evicts more). None: no plan on the ladder fits."""
    found: list[tuple[int, Plan]] = []
    most = build(0, forced)
    lo, hi = 0, top
    report = judge(most)
    if most_report is not None:
        most_report.append(report)
    if report["fits"]:
        found.append((0, most))
    else:
        # The plan for budget 0 is not always the likeliest to fit: a planner may fall back
        # below some budget (recompute optimal's DP to sqrt), and the caching allocator's
        # fragmentation or prefetches issued early can sink the plan with the most eviction
        # while a milder one fits (gpt2-medium, 2048 tokens at 24 GiB: the DP's plans for
        # 0.6..0.85 of the capacity fit, for 0 and 0.9 not). A ladder of budgets, highest
        # first, finds a budget that fits; the bisection then climbs from it.
        for step in range(ladder, 0, -1):
            mid = top * step // (ladder + 1)
            p = build(mid, forced)
            if judge(p)["fits"]:
                lo = mid
                found.append((mid, p))
                break
            hi = mid
        else:
            return None
    # Down to 1/2**ESCALATION_STEPS of the range: from a rung of the ladder, 4 steps.
    resolution = max(1, top >> ESCALATION_STEPS)
    for _ in range(ESCALATION_STEPS):
        mid = (lo + hi) // 2
        if mid <= lo or hi - lo <= resolution:
            break
        p = build(mid, forced)
        if judge(p)["fits"]:
            lo = mid
            found.append((mid, p))
        else:
            hi = mid
    return found


@dataclass(frozen=True)
class Attempt:
    """One plan at one budget: what every capacity-aware policy starts from. `forced`: the
    convolutions a profiling run could not give their workspace (run without it under
    algo=auto or microbatch)."""

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
        algo = str(getattr(self, "algo"))  # noqa: B009  (a field of every subclass)
        with planning_view(trace) as view:
            return fit_with_notes(run_plan, trace, hw, capacity_bytes, lambda budget, forced:
                                  anchor_prefetches(view, self.plan_for(
                                      Attempt(trace, hw, view, budget, forced, algo))))

    def plan_for(self, attempt: Attempt) -> Plan:
        raise NotImplementedError
