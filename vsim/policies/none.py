"""`none`: everything stays resident (vDNN's baseline, base(p) or base(m))."""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import Hardware
from ..trace.schema import Trace
from .algorithms import memory_optimal_retimes
from .base import Plan, Policy, choice, register


@register
@dataclass(frozen=True)
class NoOffload(Policy):
    name = "none"
    description = "no offload: every tensor stays on the GPU (vDNN base(p)/base(m))"
    algo: str = choice("performance", "memory")

    def plan(self, trace: Trace, hw: Hardware, capacity_bytes: int) -> Plan:
        if self.algo == "performance":
            return Plan()
        retimes, notes = memory_optimal_retimes(trace)
        return Plan(actions=tuple(retimes), notes=tuple(notes))
