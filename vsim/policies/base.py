"""The policy interface: a policy is a frozen dataclass that turns a trace into a Plan.

`plan(trace, hw, capacity_bytes)` is pure: it reads the trace and returns actions (vsim.plan) for
the engine (and the real executor) to carry out. Policies never touch SimPy. A policy that checks
its plan by a profiling run (one simulated iteration) overrides `plan_with(trace, hw,
capacity_bytes, run_plan)` and runs it through the `run_plan` it is given: the engine's
simulate() passes vsim.engine.run_plan; a plain `plan()` call (vsim measure, tests) takes the
engine's too (default_run_plan). Policies that need no run override `plan`. Capacity-aware
policies derive from policies.fitted.FittedPolicy, which owns their common prologue.

The plan vocabulary lives in vsim.plan and spec parsing in vsim.spec (below the engine and the
allocator registry); they are re-exported here for code written against this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..hardware import Hardware
from ..plan import (  # noqa: F401  (re-exported)
    Action,
    Drop,
    Offload,
    Plan,
    PlanIndex,
    Prefetch,
    Recompute,
    Release,
    Retime,
    RunPlan,
    Sync,
)
from ..spec import choice, describe, parse_spec  # noqa: F401  (re-exported)
from ..trace.schema import Trace


@dataclass(frozen=True)
class Policy:
    """Base of every policy. Subclasses are frozen dataclasses whose fields are the parameters.
    `examples`: specs besides the defaults that the tests and `vsim search` run (the policy's
    key variants); `capacity_aware`: the plan is made to fit the capacity it is given."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    examples: ClassVar[tuple[str, ...]] = ()
    capacity_aware: ClassVar[bool] = False

    def plan(self, trace: Trace, hw: Hardware, capacity_bytes: int) -> Plan:
        """The plan; profiling runs (policies that override plan_with) go through the engine's
        run_plan."""
        return self.plan_with(trace, hw, capacity_bytes, default_run_plan())

    def plan_with(self, trace: Trace, hw: Hardware, capacity_bytes: int,
                  run_plan: RunPlan) -> Plan:
        """The plan, with `run_plan` for profiling runs. A subclass overrides this or plan()."""
        if type(self).plan is Policy.plan:
            raise NotImplementedError(f"{type(self).__name__} defines neither plan nor plan_with")
        return self.plan(trace, hw, capacity_bytes)

    def spec(self) -> str:
        """The spec string that rebuilds this policy: 'vdnn:mode=conv,algo=memory'."""
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}:{params}" if params else self.name


def default_run_plan() -> RunPlan:
    """vsim.engine.run_plan (as engine.planning_runner for PyTorch's caching allocator), for
    plan() called outside a simulation. The engine is below the policies (it runs plans and
    knows no policy), so this import goes down the layers; inside a simulation the engine
    passes its runner to plan_with itself."""
    from ..engine import planning_runner

    return planning_runner(None)


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its `name`."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise TypeError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Policy]]:
    return dict(_REGISTRY)


def example_specs(cls: type[Policy]) -> list[str]:
    """The policy at its defaults, then its `examples`, as normalised specs (each once)."""
    specs: list[str] = []
    for s in (cls.name, *cls.examples):
        spec = parse_spec(s, _REGISTRY, "policy").spec()
        if spec not in specs:
            specs.append(spec)
    return specs
