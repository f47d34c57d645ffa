"""Replay a recorded iteration's allocator events through an allocator model.

The recorder keeps PyTorch's allocator history of one iteration (alloc, free_requested,
free_completed with address and requested size, in the order the program made them). Replaying
that exact sequence checks an allocator model on its own, apart from the engine's op-level
allocation order: the tensors resident before the iteration (weights, optimizer state, input)
are allocated first, then each `alloc` is served and each `free_completed` returned, matched by
address. The iteration is played `iterations` times so that reserved memory reaches the steady
state a long training run has.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TraceError
from ..trace.schema import Trace
from .base import AllocatorSpec


@dataclass(frozen=True)
class ReplayResult:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    events: int


def replay_allocator(trace: Trace, spec: AllocatorSpec, capacity_bytes: int,
                     iterations: int = 2) -> ReplayResult:
    """Peaks of allocated and reserved bytes when `spec` serves the trace's own allocation
    sequence. TraceError when the trace has no allocator history."""
    allocs = [e for e in trace.mem_events if e.action in ("alloc", "free_completed")]
    if not allocs:
        raise TraceError("trace has no allocator history (mem_events) to replay",
                         str(trace.meta.get("model", "trace")))
    allocator = spec.build(capacity_bytes)
    peak_alloc = peak_resv = 0
    phase = {op.id: op.phase for op in trace.ops}
    # The first training step creates the optimizer state (SGD's momentum buffers) when the
    # optimizer first runs; everything else resident exists before the first iteration.
    late = [t for t in trace.tensors if t.producer is None and t.kind == "optimizer_state"]
    for t in trace.tensors:
        if t.producer is None and t.kind != "optimizer_state" and \
                allocator.malloc(t.size_bytes) is None:
            return ReplayResult(0, allocator.reserved_bytes, False, 0)
    live: dict[int, object] = {}
    count = 0
    for _ in range(iterations):
        for e in allocs:
            if late and e.op is not None and phase.get(e.op) == "opt":
                for t in late:
                    if allocator.malloc(t.size_bytes) is None:
                        return ReplayResult(peak_alloc, peak_resv, False, count)
                late = []
            count += 1
            if e.action == "alloc":
                block = allocator.malloc(e.size_bytes, e.stream)
                if block is None:
                    return ReplayResult(peak_alloc, peak_resv, False, count)
                live[e.addr] = block
            elif e.addr in live:  # frees of blocks from before the iteration are not replayed
                allocator.free(live.pop(e.addr))
            peak_alloc = max(peak_alloc, allocator.allocated_bytes)
            peak_resv = max(peak_resv, allocator.reserved_bytes)
        for block in live.values():  # what outlives the iteration is freed before the next
            allocator.free(block)
        live.clear()
    return ReplayResult(peak_alloc, peak_resv, True, count)
