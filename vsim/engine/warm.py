"""Where a process that warmed up before its cap holds its resident tensors (issue 15, edge fits).

`vsim measure` (vsim.runtime.session.Session) runs the model's plain step with the whole GPU
before any case: its first iteration creates SGD's momentum and cuBLAS's workspaces at first use,
in whatever blocks the iteration has free then. Each case then frees the gradients, empties the
cache (`torch.cuda.empty_cache()`), sets the cap and runs its plan. Its first capped iteration
thus starts with every resident tensor already there (the runs' `allocated_at_start_bytes` hold
the trace's residents to within 3.3 MiB), in the segments that plain iteration left them in,
holes included; `run_plan`'s first iteration instead creates momentum and the workspaces at
first use under the cap, as a fresh training process does, which runs its first forward and
backward without the optimizer state (vgg11_bn: 507 MiB less at op 82 than the real run's
first iteration, which ran out of memory there).

`warm_layout` builds that start: the trace's recorded allocator history (one plain step's
requests in program order) served with room to spare, residents up front but those created at
first use (vsim.allocator.replay's first pass), every block but the residents' given back, the
cache emptied. The recorded order, not the engine's op-level one, because the residents' holes
are the segments that step opened, and the engine's order opens others (docs/design.md,
allocator models); a trace without a history (synthesized) gets the engine's own plain
iteration. Computed once per trace, hardware and allocator, copied for each run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..allocator.caching import CachingAllocator
from ..allocator.first_use import first_use_residents
from ..plan import Plan
from .prep import trace_prep
from .simulator import Engine

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..allocator.base import Allocator, AllocatorSpec
    from ..hardware import Hardware
    from ..trace.schema import Trace

ROOM = 1 << 50  # the warm-up's capacity: the whole GPU, which the plain step never fills


def _replayed(trace: Trace, memory: CachingAllocator) -> dict[int, object] | None:
    """The plain step as the trace recorded its allocator's requests, in program order
    (vsim.allocator.replay's first pass: residents up front but those created at first use,
    which come at their op; up front in the order the process made them, `built`), on
    `memory`; every block but the residents' then given back.
    The residents' blocks; None where the trace has no allocator history."""
    events = [e for e in trace.mem_events if e.action in ("alloc", "free_completed")]
    if not events:
        return None
    first_use = first_use_residents(trace)
    deferred = {t for ts in first_use.values() for t in ts}
    resident: dict[int, object] = {}
    size = {t.id: t.size_bytes for t in trace.tensors}
    pos = {op.id: i for i, op in enumerate(trace.ops)}

    def built(t: Any) -> tuple[int, int, int]:
        """The order the process made them in: the model's weights as it registered them (for
        which the first op reading each stands), then the inputs, then the rest."""
        rank = {"weight": 0, "input": 1}.get(t.kind, 2)
        readers = [pos[c] for c in t.consumers if c in pos] if rank == 0 else []
        return (rank, min(readers) if readers else len(pos), t.id)

    for t in sorted((t for t in trace.tensors if t.producer is None and t.id not in deferred),
                    key=built):
        resident[t.id] = memory.malloc(t.size_bytes)
    late = sorted((pos[op], ts) for op, ts in first_use.items())
    live: dict[int, object] = {}
    for e in events:
        while late and e.op is not None and late[0][0] <= pos.get(e.op, -1):
            for tid in late.pop(0)[1]:
                resident[tid] = memory.malloc(size[tid])
        if e.action == "alloc":
            live[e.addr] = memory.malloc(e.size_bytes, e.stream)
        elif e.addr in live:
            memory.free(live.pop(e.addr))
    for _, ts in late:  # (placed at ops that logged no event, after the last)
        for tid in ts:
            resident[tid] = memory.malloc(size[tid])
    for block in live.values():
        memory.free(block)
    return resident


def supports_warm_start(memory: Allocator) -> bool:
    """Whether `warm_layout` models this allocator (PyTorch's caching allocator; expandable
    segments' empty_cache, which unmaps pages, is not modelled)."""
    return type(memory) is CachingAllocator


def warm_layout(trace: Trace, hw: Hardware, spec: AllocatorSpec, capacity_bytes: int,
                transients: Mapping[int, int] | None) -> tuple[CachingAllocator,
                                                                 dict[int, object]]:
    """A caching allocator of `capacity_bytes` holding the trace's resident tensors where a
    plain iteration with room placed them, its cache emptied; and the resident tensors' blocks
    (tensor -> block), for the first capped iteration to adopt."""
    prep = trace_prep(trace)
    key = (hw.name, spec, transients is not None)
    warm = prep.warm.get(key)
    if warm is None:
        memory = spec.build(ROOM)
        if not isinstance(memory, CachingAllocator):
            raise TypeError(f"no warm start for the {type(memory).__name__} model")
        resident = _replayed(trace, memory)
        if resident is None:
            engine = Engine(trace, hw, Plan(), memory, first_use=prep.first_use(),
                            transients=transients, logged=False)
            out = engine.run()
            if out.oom is not None:  # (a step that does not fit the whole GPU)
                raise ValueError("the plain step ran out of memory with room to spare")
            resident = engine.resident_left()
            memory.before_release = None
        memory.empty_cache()
        warm = prep.warm[key] = (memory, resident)
    memory, resident = warm
    new, blocks = memory.copy(capacity_bytes)
    return new, {t: blocks[id(b)] for t, b in resident.items()}
