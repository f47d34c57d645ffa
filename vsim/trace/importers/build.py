"""What every source shares: the op vocabulary (`short_op_name`, `op_layer_type`, `stream_map`),
the trace builder (ops with allocation events -> tensors, frees, dependencies, kinds) and the
allocation tracker that pairs allocator events into blocks."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...errors import TraceError
from ..schema import Kernel, Measured, MemEvent, Op, Tensor, Trace

BWD_PREFIX = "autograd::engine::evaluate_function: "
OPTIMIZER_PREFIX = "Optimizer."  # torch.optim's profiler ranges: Optimizer.step#SGD.step, ...


# ---------------------------------------------------------------- op vocabulary

_OP_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"attention|sdpa|flash", "attention"),
    (r"_foreach|fused_sgd|fused_adam|sgd|adam", "optimizer"),
    (r"conv", "conv"),
    (r"batch_?norm", "bn"),
    (r"layer_?norm|rms_?norm", "layernorm"),
    (r"group_?norm", "bn"),
    (r"local_?response|lrn", "lrn"),
    (r"pool", "pool"),
    (r"log_?softmax", "softmax"),
    (r"softmax", "softmax"),
    (r"nll_?loss|cross_?entropy|mse_?loss|_loss$|^loss", "loss"),
    (r"dropout|bernoulli", "dropout"),
    (r"embedding", "embedding"),
    (r"gelu", "gelu"),
    (r"relu|threshold|clamp_min|hardtanh", "relu"),
    (r"^(cat|concat|stack|_cat)$", "concat"),
    (r"^(add|add_|sum)$", "add"),
    (r"^(linear|addmm|mm|bmm|matmul|baddbmm)$", "fc"),
)


def short_op_name(name: str) -> str:
    """'autograd::engine::evaluate_function: ConvolutionBackward0' -> 'ConvolutionBackward0'."""
    return name[len(BWD_PREFIX):] if name.startswith(BWD_PREFIX) else name


def op_layer_type(name: str) -> str:
    """The layer type an op name implies (conv, fc, relu, ...; 'other' when none does). Backward
    nodes are read without their 'Backward0' suffix: ConvolutionBackward0 -> conv."""
    core = short_op_name(name).split("::")[-1]
    core = re.sub(r"Backward\d*$", "", core)
    core = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", core).lower()  # CamelCase -> snake_case
    core = re.sub(r"_backward(_data|_input|_weight)?$", "", core)
    for pattern, kind in _OP_PATTERNS:
        if re.search(pattern, core):
            return kind
    return "other"


def stream_map(streams: Iterable[int]) -> dict[int, int]:
    """Raw stream ids -> trace streams: the busiest becomes 0 (compute), the others 3, 4, ...
    (1 and 2 are the simulator's H2D and D2H copy streams)."""
    counts = Counter(streams)
    ordered = sorted(counts, key=lambda s: (-counts[s], s))
    return {s: (0 if i == 0 else i + 2) for i, s in enumerate(ordered)}


# ---------------------------------------------------------------- the trace builder

@dataclass
class AllocDraft:
    """One device allocation seen by a capture. `resident`: live when the iteration starts.
    `kind`: forced (weight, input, gradient, ...); None lets the builder infer it."""

    id: int
    size: int
    resident: bool = False
    kind: str | None = None
    name: str = ""
    saved: bool = False


@dataclass
class OpDraft:
    """One op before ids are assigned. `events` are (alloc id, +1 allocated / -1 freed) in the
    order the allocator saw them; `start_us` None places the op at the previous op's end with
    zero duration (an op with no kernels)."""

    name: str
    phase: str = "other"
    layer: str = ""
    layer_type: str = "other"
    stream: int = 0
    start_us: float | None = None
    dur_us: float = 0.0
    kernels: list[Kernel] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)
    reads: set[int] = field(default_factory=set)
    mutates: set[int] = field(default_factory=set)  # allocs of `reads` it updates in place
    flops: float = 0.0
    dram_bytes: float = 0.0
    attrs: dict[str, Any] = field(default_factory=dict)
    keep: bool = False


@dataclass
class Built:
    """The builder's result, with the maps a caller needs to attach allocator events."""

    ops: list[Op]
    tensors: list[Tensor]
    op_id: dict[int, int]          # draft index -> op id (kept ops only)
    tensor_of_alloc: dict[int, int]  # alloc id -> tensor id (internal ones -> their workspace)
    diagnostics: dict[str, int]

    def trace(self, meta: dict[str, Any], measured: Measured | None = None,
              mem_events: tuple[MemEvent, ...] = ()) -> Trace:
        return Trace(meta=meta, tensors=tuple(self.tensors), ops=tuple(self.ops),
                     measured=measured, mem_events=mem_events)


def build_trace(drafts: list[OpDraft], allocs: dict[int, AllocDraft],
                drop_idle: bool = True) -> Built:
    """Turn op drafts and allocations into trace ops and tensors.

    An allocation is produced by the op whose events allocate it and freed by the op whose events
    free it (never freed: lives to the end). Allocations made and freed inside one op are merged
    into one workspace tensor (conv ops) or temporary tensor (others) sized so that the replay's
    peak inside the op, with every allocation of an op at its start and every free at its end,
    equals the real peak excursion inside it: max(0, E - P) with E the largest running sum of the
    op's allocation events and P the bytes of its outputs that outlive it. Inferred kinds: forward
    outputs saved for backward, read later or freed in backward are activations, backward outputs
    gradients, the rest temporaries. Ops with no kernels, no allocator events and no `keep` are
    dropped when `drop_idle`. Raises TraceError on inconsistent events (an allocation made twice).
    """
    producer: dict[int, int] = {}
    freer: dict[int, int] = {}
    for i, d in enumerate(drafts):
        for aid, sign in d.events:
            a = allocs[aid]
            if sign > 0:
                if a.resident or aid in producer:
                    raise TraceError(f"allocation {aid} ({a.name or a.size}) is allocated twice "
                                     f"(op {i} {d.name})")
                producer[aid] = i
            else:
                if aid in freer:
                    raise TraceError(f"allocation {aid} is freed twice (op {i} {d.name})")
                freer[aid] = i
    diagnostics = {"reads_after_free_dropped": 0, "workspace_bytes_merged": 0}
    internal = {aid for aid, p in producer.items() if freer.get(aid) == p}
    readers: dict[int, set[int]] = {}
    for i, d in enumerate(drafts):
        for aid in d.reads:
            readers.setdefault(aid, set()).add(i)

    kept = [i for i, d in enumerate(drafts)
            if not drop_idle or d.keep or d.kernels or d.events]
    op_id = {i: n for n, i in enumerate(kept)}

    # workspace per op
    workspace: dict[int, int] = {}
    for i in kept:
        d = drafts[i]
        running = peak = 0
        persistent = 0
        for aid, sign in d.events:
            running += sign * allocs[aid].size
            peak = max(peak, running)
            if sign > 0 and aid not in internal:
                persistent += allocs[aid].size
        if any(aid in internal for aid, _ in d.events):
            diagnostics["workspace_bytes_merged"] += sum(
                allocs[aid].size for aid, s in d.events if s > 0 and aid in internal)
            workspace[i] = max(0, peak - persistent)

    # tensors: residents first, then in production order
    tensors: list[Tensor] = []
    tensor_of_alloc: dict[int, int] = {}
    pending: list[dict[str, Any]] = []

    def kind_of(aid: int) -> str:
        a = allocs[aid]
        if a.kind:
            return a.kind
        if a.resident:
            return "temporary"
        phase = drafts[producer[aid]].phase
        if phase == "fwd":
            later = any(r != producer[aid] for r in readers.get(aid, ()))
            into_bwd = aid in freer and drafts[freer[aid]].phase == "bwd"
            return "activation" if (a.saved or later or into_bwd) else "temporary"
        if phase == "bwd":
            return "gradient"
        return "temporary"

    for aid in sorted(a for a in allocs if allocs[a].resident):
        tensor_of_alloc[aid] = len(pending)
        pending.append({"alloc": aid, "producer": None})
    for i in kept:
        for aid, sign in drafts[i].events:
            if sign > 0 and aid not in internal:
                tensor_of_alloc[aid] = len(pending)
                pending.append({"alloc": aid, "producer": i})
        if workspace.get(i):
            ws_index = len(pending)
            pending.append({"workspace": i})
            for aid, sign in drafts[i].events:
                if sign > 0 and aid in internal:
                    tensor_of_alloc[aid] = ws_index

    consumers: dict[int, set[int]] = {}
    op_reads: dict[int, list[int]] = {}
    for i in kept:
        tids = set()
        for aid in drafts[i].reads:
            if aid not in tensor_of_alloc or aid in internal:
                continue
            if producer.get(aid) == i:
                continue
            if aid in freer and freer[aid] < i:
                diagnostics["reads_after_free_dropped"] += 1
                continue
            if aid in producer and producer[aid] > i:
                continue
            tids.add(tensor_of_alloc[aid])
        op_reads[i] = sorted(tids)
        for t in tids:
            consumers.setdefault(t, set()).add(op_id[i])

    for n, p in enumerate(pending):
        if "workspace" in p:
            i = p["workspace"]
            d = drafts[i]
            kind = "workspace" if d.layer_type == "conv" else "temporary"
            tensors.append(Tensor(id=n, size_bytes=workspace[i], kind=kind,
                                  name=f"{kind} of {short_op_name(d.name)}"
                                       + (f" ({d.layer})" if d.layer else ""),
                                  producer=op_id[i]))
        else:
            aid = p["alloc"]
            a = allocs[aid]
            prod = p["producer"]
            name = a.name
            if not name and prod is not None:
                d = drafts[prod]
                name = f"{short_op_name(d.name)}" + (f" ({d.layer})" if d.layer else "")
            tensors.append(Tensor(id=n, size_bytes=a.size, kind=kind_of(aid), name=name,
                                  producer=None if prod is None else op_id[prod],
                                  consumers=tuple(sorted(consumers.get(n, ())))))

    ops: list[Op] = []
    tensor_producer = {t.id: t.producer for t in tensors}
    clock = 0.0
    stream_of = {op_id[i]: drafts[i].stream for i in kept}
    for i in kept:
        d = drafts[i]
        n = op_id[i]
        attrs = dict(d.attrs)
        mutated = sorted({tensor_of_alloc[aid] for aid in d.mutates if aid in tensor_of_alloc}
                         & set(op_reads[i]))
        if mutated:  # which reads it updated in place (Op.mutates)
            attrs["mutates"] = tuple(mutated)
        writes = [tensor_of_alloc[aid] for aid, s in d.events if s > 0 and aid not in internal]
        frees = [tensor_of_alloc[aid] for aid, s in d.events
                 if s < 0 and aid not in internal and aid in tensor_of_alloc]
        if workspace.get(i):
            ws = next(k for k, p in enumerate(pending) if p.get("workspace") == i)
            writes.append(ws)
            frees.append(ws)
        dep_set: set[int] = set()
        for t in op_reads[i]:
            prod = tensor_producer[t]
            if prod is not None and prod != n:
                dep_set.add(prod)
        for t in frees:  # a free on another stream waits for the producer and every reader
            for o in [tensor_producer[t], *consumers.get(t, ())]:
                if o is not None and o < n and stream_of[o] != d.stream:
                    dep_set.add(o)
        deps = sorted(dep_set)
        if d.start_us is None:
            start, dur = clock, 0.0
        else:
            start, dur = d.start_us, d.dur_us
        clock = max(clock, start + dur)
        ops.append(Op(id=n, name=short_op_name(d.name), layer=d.layer, layer_type=d.layer_type,
                      phase=d.phase, start_us=round(start, 3), dur_us=round(dur, 3),
                      stream=d.stream, reads=tuple(op_reads[i]), writes=tuple(writes),
                      frees=tuple(frees), deps=tuple(deps), kernels=tuple(d.kernels),
                      flops=d.flops, dram_bytes=d.dram_bytes,
                      attrs=tuple(sorted(attrs.items()))))
    return Built(ops, tensors, op_id, tensor_of_alloc, diagnostics)


# ---------------------------------------------------------------- allocation tracking

class AllocTracker:
    """Follows '[memory]' events (or allocator trace entries) by address: which allocation is live
    at an address, which were live before the capture began (frees of unknown addresses)."""

    def __init__(self, allocs: dict[int, AllocDraft] | None = None) -> None:
        self.allocs: dict[int, AllocDraft] = allocs if allocs is not None else {}
        self.live: dict[int, int] = {}       # addr -> alloc id
        self.last_freed: dict[int, int] = {}  # addr -> alloc id freed most recently there
        self.unknown_frees = 0

    def add_resident(self, addr: int, size: int, kind: str | None = None,
                     name: str = "") -> int:
        aid = len(self.allocs)
        self.allocs[aid] = AllocDraft(aid, size, resident=True, kind=kind, name=name)
        self.live[addr] = aid
        return aid

    def alloc(self, addr: int, size: int) -> int:
        aid = len(self.allocs)
        self.allocs[aid] = AllocDraft(aid, size)
        self.live[addr] = aid
        return aid

    def free(self, addr: int, size: int, resident_if_unknown: bool) -> int | None:
        aid = self.live.pop(addr, None)
        if aid is None:
            if not resident_if_unknown:
                self.unknown_frees += 1
                return None
            aid = len(self.allocs)
            self.allocs[aid] = AllocDraft(aid, size, resident=True)
        self.last_freed[addr] = aid
        return aid

    def lookup(self, addr: int) -> int | None:
        aid = self.live.get(addr)
        return aid if aid is not None else self.last_freed.get(addr)
