"""`none`: everything stays resident (vDNN's baseline, base(p) or base(m))."""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import Hardware
from ..plan import Plan
from ..spec import choice
from ..trace.schema import Trace
from ..workspace_free import memory_optimal_retimes
from .base import Policy, register


@register
@dataclass(frozen=True)
class NoOffload(Policy):
    name = "none"
    description = "no offload: every tensor stays on the GPU (vDNN base(p)/base(m))"
    algo: str = choice("performance", "memory")
    examples = ("none:algo=memory",)

    def plan(self, trace: Trace, hw: Hardware, capacity_bytes: int) -> Plan:
        if self.algo == "performance":
            return Plan()
        retimes, notes = memory_optimal_retimes(trace, hw)
        return Plan(actions=tuple(retimes), notes=tuple(notes))
