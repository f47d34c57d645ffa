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

from ..allocator import make_allocator
from ..hardware import Hardware
from ..plan import Plan, PlanBuilder, Release, Retime, RunPlan
from ..trace.schema import Trace
from .base import Policy
from .layers import TraceView
from .planning import Evictions, Usage, algorithm_retimes, anchor_prefetches, apply_releases


def check(run_plan: RunPlan, trace: Trace, hw: Hardware, plan: Plan, capacity_bytes: int
          ) -> dict[str, Any]:
    """One simulated iteration of `plan` with the exact allocator (a profiling run): the
    report of `run_plan` (vsim.engine.run_plan)."""
    report: dict[str, Any] = run_plan(trace, hw, plan, make_allocator("exact"),
                                      capacity_bytes).report
    return report


def fit_with_notes(run_plan: RunPlan, trace: Trace, hw: Hardware, capacity_bytes: int,
                   build: PlanBuilder) -> Plan:
    """fit_by_profiling's plan with the profiling notes after the plan's own."""
    plan, notes = fit_by_profiling(run_plan, trace, hw, capacity_bytes, build)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes))


def fit_by_profiling(run_plan: RunPlan, trace: Trace, hw: Hardware, capacity_bytes: int,
                     build: PlanBuilder, tries: int = 8) -> tuple[Plan, list[str]]:
    """Plan for a budget, run it once, and when the run does not fit, plan again: if what could
    not be allocated is a convolution's workspace, or the run stopped at a convolution that
    would allocate one, with that convolution also run without workspace (`build`'s second
    argument: the ops to downgrade, which a policy honours under algo=auto, as cuDNN frameworks
    fall back when a workspace allocation fails); otherwise for a budget lowered by what the
    failed request lacked (at least 1% of the capacity).
    Deterministic. Returns the first plan that fits, or the first one tried, with notes."""
    budget = capacity_bytes
    forced: frozenset[int] = frozenset()
    first = plan = build(budget, forced)
    tensors = trace.tensor_by_id()
    ops = {o.id: o for o in trace.ops}
    i = 0
    for i in range(tries):
        report = check(run_plan, trace, hw, plan, capacity_bytes)
        if report["fits"]:
            if budget < capacity_bytes:
                return plan, [f"planned for {budget} B after {i} profiling run(s) did not fit"]
            return plan, []
        oom = report["oom"]
        assert isinstance(oom, dict)
        failed = tensors.get(int(oom["tensor"]))
        at = oom["op"]
        at_ws = at is not None and any(tensors[t].kind == "workspace" for t in ops[int(at)].writes)
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
    return first, [f"no plan found that fits {capacity_bytes} B in {i + 1} profiling run(s); "
                   f"this is the plan for the full capacity"]


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
        return algorithm_retimes(self.trace, self.hw, self.view, self.algo, self.budget,
                                 self.forced)

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
