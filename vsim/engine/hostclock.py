"""The host (CPU) clock: when PyTorch's host thread has issued each op (vsim.host's model).

A GPU waits for a slow host. For a recorded op the host's issue time is known only as a bound:
the model's cumulative host cost, but never later than the op's recorded start (it did start
then), so `issue[i] = min(issue[i-1] + host_us(op i), recorded start)`; replaying the recording
unchanged, the bound never binds. What a plan adds on the host delays every later issue by the
same amount (`extra_us`): recomputed ops (re-run by the runtime at their forward host cost),
the caching allocator's driver calls (cudaMalloc of a new segment, cudaFree of released ones),
and a device-wide synchronize (an allocation retry), after which the host has no lead left.
Hidden while the host is ahead of the GPU, they show where it is not: host-bound models, and
after every sync. A synthesized trace has no recorded start to bound it: its issue times are the
model's alone.

Tracked (`tracked=True`): the run is vsim's executor carrying out a plan, whose dispatch mode
costs `model.tracker_us_per_op` of host time per op (validation/host/README.md); that cost
accumulates on top of the bounded issue times, hidden while the host's lead lasts.
"""

from __future__ import annotations

from ..host import HostModel
from ..trace.schema import Op, Trace


class HostClock:
    def __init__(self, trace: Trace, model: HostModel, tracked: bool = False) -> None:
        self.model = model
        self.alloc = model.allocator
        bounded = trace.meta.get("source") == "measured"
        self.issue: dict[int, float] = {}
        clock = 0.0
        per_op = model.tracker_us_per_op if tracked else 0.0
        for i, op in enumerate(trace.ops):
            clock += model.op_us(op)
            if bounded and op.start_us < clock:
                clock = op.start_us
            self.issue[op.id] = clock + per_op * (i + 1)
        self.extra_us = 0.0  # host time the plan added so far

    def ready_us(self, op: int) -> float:
        """When the host issues recorded op `op`."""
        return self.issue[op] + self.extra_us

    def recompute(self, op: Op) -> None:
        """The host re-runs a forward op before the one that needs its output."""
        self.extra_us += self.model.op_us(op)

    def spend(self, us: float) -> None:
        self.extra_us += us

    def synced(self, op: int, now_us: float) -> None:
        """The host waited for the device at `now_us` while issuing `op`: no lead is left."""
        lag = now_us - self.issue[op]
        if lag > self.extra_us:
            self.extra_us = lag
