"""Bring captures made with PyTorch's own tools into vsim traces, without torch.

- `import_kineto(path)`: a torch.profiler Chrome-trace export (JSON, optionally gzip). Ops are the
  top-level CPU ops (one aten op in forward, one autograd node in backward, each optimizer op),
  timed by their GPU kernels when the capture has them, by their CPU span otherwise; tensors come
  from the "[memory]" events when the capture was made with profile_memory=True.
- `import_torch_snapshot(path)`: a pickle from torch.cuda.memory._dump_snapshot. It holds
  allocator events only, so each allocation becomes an op of its own, timed by the allocator's
  CPU clock. The pickle is read with an unpickler that refuses every class outside a few builtins.

The recorder (vsim.record) joins its passes through the same pieces, so they live here, free of
torch: `parse_chrome` (the profiler's event tree reduced to top-level ops with their kernels,
allocator events and markers), `build_trace` (ops with allocation events -> tensors, frees,
dependencies, kinds), `op_layer_type` and `stream_map`.
"""

from __future__ import annotations

import bisect
import importlib
import io
import math
import pickle
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TraceError
from ..safeload import parse_json
from .io import read_maybe_gzip
from .schema import MEM_ACTIONS, Kernel, Measured, MemEvent, Op, Tensor, Trace

BWD_PREFIX = "autograd::engine::evaluate_function: "
OPTIMIZER_PREFIX = "Optimizer."  # torch.optim's profiler ranges: Optimizer.step#SGD.step, ...
_TRANSPARENT_OPS = ("PythonDispatchMode",)  # a dispatch mode's frame, not an op of its own
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "runtime")
KERNEL_NAME_CHARS = 160  # kernel names are C++ signatures; the head identifies the kernel


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


# ---------------------------------------------------------------- Chrome trace (Kineto) parsing

@dataclass
class KernelRec:
    name: str
    stream: int
    start_ns: int
    end_ns: int
    op: int | None = None  # index of the top-level op that launched it, when known


@dataclass
class MemRec:
    """One "[memory]" event: an allocation (delta > 0) or a free (delta < 0) of one block."""

    ts_ns: int
    tid: int
    addr: int
    delta: int
    total_allocated: int | None
    total_reserved: int | None
    device_type: int
    device_id: int


@dataclass
class Annotation:
    name: str
    tid: int
    start_ns: int
    end_ns: int


@dataclass
class CpuOp:
    """A top-level CPU op with what happened inside it."""

    index: int
    name: str
    tid: int
    start_ns: int
    end_ns: int
    seq: int | None
    kernels: list[KernelRec] = field(default_factory=list)
    mem: list[MemRec] = field(default_factory=list)
    markers: list[tuple[int, str]] = field(default_factory=list)  # (time ns, name)


@dataclass
class Capture:
    """A profiler capture reduced to top-level ops in start order."""

    ops: list[CpuOp]
    annotations: list[Annotation]
    device_name: str | None = None
    unattributed_kernels: int = 0
    kernels: list[KernelRec] = field(default_factory=list)  # every device activity, by start

    def annotations_named(self, prefix: str) -> list[Annotation]:
        return sorted((a for a in self.annotations if a.name.startswith(prefix)),
                      key=lambda a: a.start_ns)

    def ops_between(self, start_ns: int, end_ns: int) -> list[CpuOp]:
        return [op for op in self.ops if start_ns <= op.start_ns <= end_ns]


def _ns(value: Any) -> int:
    return int(round(float(value) * 1000))


def _int(value: Any, default: int | None = None) -> int | None:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


def load_chrome(path: str | Path) -> Any:
    """Read a Chrome-trace JSON file, gzip or plain; TraceError naming the file if unreadable."""
    where = str(path)
    try:  # bounded (safeload); NaN/Infinity named by their JSON path
        return parse_json(read_maybe_gzip(path), where, TraceError, finite=True)
    except TraceError as exc:
        raise TraceError(f"not a Chrome-trace JSON file ({exc.message})", where) from None


def parse_chrome(doc: Any, where: str = "<chrome trace>") -> Capture:
    """Reduce a torch.profiler Chrome-trace document to top-level ops with their kernels (joined
    through the CUDA runtime call's correlation id), allocator events and vsim markers (user
    annotations named 'vsim::...#N'), each attributed to the top-level op that encloses it on its
    thread, or else to the op that started last before it. TraceError on a document that is not
    a Chrome trace."""
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
    else:
        events = doc
    if not isinstance(events, list):
        raise TraceError("traceEvents: expected a list of Chrome trace events", where)
    cpu: dict[int, list[tuple[int, int, str, dict[str, Any]]]] = {}
    annotations: list[Annotation] = []
    runtime: dict[int, tuple[int, int]] = {}
    device: list[tuple[dict[str, Any], int]] = []
    memory: list[MemRec] = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise TraceError(f"traceEvents[{i}]: expected an object", where)
        ph, cat, name = ev.get("ph"), ev.get("cat"), ev.get("name")
        raw_args = ev.get("args")
        args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
        if ph == "X":
            try:
                start, end = _ns(ev["ts"]), _ns(ev["ts"]) + _ns(ev.get("dur", 0))
            except (KeyError, TypeError, ValueError):
                raise TraceError(f"traceEvents[{i}]: 'X' event without a numeric ts/dur",
                                 where) from None
            tid = _int(ev.get("tid"), 0) or 0
            if cat in ("cpu_op", "operator") and isinstance(name, str) \
                    and not name.startswith("vsim::"):
                if name not in _TRANSPARENT_OPS:
                    cpu.setdefault(tid, []).append((start, end, name, args))
            elif cat in ("user_annotation", "cpu_op") and isinstance(name, str):
                # user ranges; vsim's own ranges may be recorded as cpu_op by the fast API
                annotations.append(Annotation(name, tid, start, end))
            elif cat in _RUNTIME_CATS:
                corr = _int(args.get("correlation"))
                if corr is not None:
                    runtime[corr] = (tid, start)
            elif cat in _DEVICE_CATS:
                device.append((ev, i))
        elif ph == "i" and name == "[memory]":
            addr, delta = _int(args.get("Addr")), _int(args.get("Bytes"))
            if addr is None or delta is None:
                raise TraceError(f"traceEvents[{i}].args: [memory] event without Addr/Bytes",
                                 where)
            memory.append(MemRec(_ns(ev.get("ts", 0)), _int(ev.get("tid"), 0) or 0, addr, delta,
                                 _int(args.get("Total Allocated")),
                                 _int(args.get("Total Reserved")),
                                 _int(args.get("Device Type"), 0) or 0,
                                 _int(args.get("Device Id"), -1) or 0))

    # top-level ops: not enclosed by another cpu op of the same thread
    tops: list[tuple[int, int, int, str, dict[str, Any]]] = []
    for tid, evs in cpu.items():
        evs.sort(key=lambda e: (e[0], -e[1]))
        open_ends: list[int] = []
        for start, end, name, args in evs:
            while open_ends and start >= open_ends[-1]:
                open_ends.pop()
            if not open_ends:
                tops.append((start, end, tid, name, args))
            open_ends.append(end)
    tops.sort(key=lambda t: (t[0], t[2]))
    ops = [CpuOp(i, name, tid, start, end, _int(args.get("Sequence number")))
           for i, (start, end, tid, name, args) in enumerate(tops)]
    locate = _Locator(ops)

    for mem in sorted(memory, key=lambda m: m.ts_ns):
        op = locate(mem.tid, mem.ts_ns)
        if op is not None:
            op.mem.append(mem)
    for ann in sorted(annotations, key=lambda a: a.start_ns):
        if ann.name.startswith("vsim::") and "#" in ann.name:
            op = locate(ann.tid, ann.start_ns)
            if op is not None:
                op.markers.append((ann.start_ns, ann.name))
    unattributed = 0
    kernels: list[KernelRec] = []
    for ev, _ in device:
        raw_args = ev.get("args")
        args = raw_args if isinstance(raw_args, dict) else {}
        corr = _int(args.get("correlation"))
        launch = runtime.get(corr) if corr is not None else None
        op = locate(*launch) if (launch is not None and ops) else None
        stream = _int(args.get("stream"), _int(ev.get("tid"), 0)) or 0
        start = _ns(ev["ts"])
        rec = KernelRec(str(ev.get("name", "?"))[:KERNEL_NAME_CHARS], stream, start,
                        start + _ns(ev.get("dur", 0)), None if op is None else op.index)
        kernels.append(rec)
        if op is None:
            unattributed += 1
        else:
            op.kernels.append(rec)
    kernels.sort(key=lambda k: k.start_ns)
    for op in ops:
        op.kernels.sort(key=lambda k: k.start_ns)
    device_name = None
    if isinstance(doc, dict) and isinstance(doc.get("deviceProperties"), list):
        props = doc["deviceProperties"]
        if props and isinstance(props[0], dict) and isinstance(props[0].get("name"), str):
            device_name = props[0]["name"]
    return Capture(ops, annotations, device_name, unattributed, kernels)


class _Locator:
    """The top-level op enclosing (thread, time), else the one that started last before it."""

    def __init__(self, ops: list[CpuOp]) -> None:
        self.ops = ops
        self.starts = [op.start_ns for op in ops]
        self.by_tid: dict[int, list[CpuOp]] = {}
        for op in ops:
            self.by_tid.setdefault(op.tid, []).append(op)
        self.tid_starts = {tid: [op.start_ns for op in lst] for tid, lst in self.by_tid.items()}

    def __call__(self, tid: int, ts: int) -> CpuOp | None:
        lst = self.by_tid.get(tid)
        if lst:
            i = bisect.bisect_right(self.tid_starts[tid], ts) - 1
            if i >= 0 and lst[i].end_ns >= ts:
                return lst[i]
        i = bisect.bisect_right(self.starts, ts) - 1
        if i >= 0:
            return self.ops[i]
        return self.ops[0] if self.ops else None


def innermost(intervals: list[Annotation], points: list[int]) -> list[Annotation | None]:
    """For each time in `points`, the innermost of properly nested `intervals` containing it."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    ivs = sorted(intervals, key=lambda a: (a.start_ns, -a.end_ns))
    result: list[Annotation | None] = [None] * len(points)
    stack: list[Annotation] = []
    j = 0
    for i in order:
        t = points[i]
        while j < len(ivs) and ivs[j].start_ns <= t:
            while stack and stack[-1].end_ns < ivs[j].start_ns:
                stack.pop()
            stack.append(ivs[j])
            j += 1
        while stack and stack[-1].end_ns < t:
            stack.pop()
        result[i] = stack[-1] if stack else None
    return result


def containing(intervals: list[Annotation], t: int) -> Annotation | None:
    """The latest-starting interval that contains t (intervals sorted by start)."""
    starts = [a.start_ns for a in intervals]
    i = bisect.bisect_right(starts, t) - 1
    while i >= 0:
        if intervals[i].end_ns >= t:
            return intervals[i]
        i -= 1
    return None


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
                      attrs=tuple(sorted(d.attrs.items()))))
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


# ---------------------------------------------------------------- Kineto import

def _phases(ops: list[CpuOp], capture: Capture, backward: list[Annotation]) -> list[str]:
    """fwd before the first backward op, bwd from the first to the last backward op (autograd
    nodes, or ops inside a vsim::backward range), opt inside torch.optim's ranges, else other."""
    optim = capture.annotations_named(OPTIMIZER_PREFIX)
    is_bwd = [op.name.startswith(BWD_PREFIX) or containing(backward, op.start_ns) is not None
              for op in ops]
    first = next((i for i, b in enumerate(is_bwd) if b), None)
    last = max((i for i, b in enumerate(is_bwd) if b), default=None)
    phases = []
    for i, op in enumerate(ops):
        if containing(optim, op.start_ns) is not None:
            phases.append("opt")
        elif first is not None and last is not None and first <= i <= last:
            phases.append("bwd")
        elif first is None or i < first:
            phases.append("fwd")
        else:
            phases.append("other")
    return phases


def backward_layers(ops: list[CpuOp], phases: list[str], layers: list[str],
                    types: list[str]) -> None:
    """Give each backward node the layer and type of the forward op that created it: the forward
    top-level op with the largest autograd sequence number not above the node's (every node an op
    creates gets a number from the op's range). In place."""
    fwd = [(op.seq, i) for i, op in enumerate(ops) if phases[i] == "fwd" and op.seq is not None]
    fwd.sort()
    seqs = [s for s, _ in fwd]
    for i, op in enumerate(ops):
        if phases[i] != "bwd" or not op.name.startswith(BWD_PREFIX) or op.seq is None:
            continue
        j = bisect.bisect_right(seqs, op.seq) - 1
        if j >= 0:
            f = fwd[j][1]
            layers[i] = layers[f]
            if types[f] != "other":
                types[i] = types[f]


def import_kineto(path: str | Path, step: int | None = None) -> Trace:
    """A vsim trace of one iteration of a torch.profiler Chrome-trace export.

    With ProfilerStep#N ranges in the capture, the iteration is step N (default: the last one);
    otherwise the whole capture. Op times are GPU kernel spans relative to the iteration's start
    when the capture has kernels, CPU spans otherwise. Tensors come from '[memory]' events
    (profile_memory=True): blocks freed but not allocated in the iteration, and the remainder of
    'Total Allocated' at its start, are resident tensors of unknown kind (temporary). Layers are
    unknown (empty); layer types come from op names. TraceError naming the file and place on
    anything else than a torch.profiler Chrome trace."""
    where = str(path)
    capture = parse_chrome(load_chrome(path), where)
    if not capture.ops:
        raise TraceError("no CPU ops (cat 'cpu_op') in traceEvents: not a torch.profiler "
                         "Chrome trace", where)
    steps = [a for a in capture.annotations_named("ProfilerStep#")]
    if steps:
        numbers = {_int(a.name.split("#", 1)[1]): a for a in steps}
        if step is None:
            window = steps[-1]
        elif step in numbers:
            window = numbers[step]
        else:
            raise TraceError(f"no ProfilerStep#{step}; the capture has "
                             f"{', '.join(a.name for a in steps)}", where)
        ops = capture.ops_between(window.start_ns, window.end_ns)
        origin = window.start_ns
        label = window.name
    else:
        ops = list(capture.ops)
        origin = ops[0].start_ns
        label = "whole capture"
    phases = _phases(ops, capture, [])
    layers = [""] * len(ops)
    types = [op_layer_type(op.name) if phases[i] != "opt" else "optimizer"
             for i, op in enumerate(ops)]
    backward_layers(ops, phases, layers, types)
    has_kernels = any(op.kernels for op in ops)
    smap = stream_map(k.stream for op in ops for k in op.kernels)
    mem_device = 1 if any(m.device_type == 1 for op in ops for m in op.mem) else 0
    tracker = AllocTracker()
    drafts: list[OpDraft] = []
    first_total: int | None = None
    for i, op in enumerate(ops):
        d = OpDraft(name=op.name, phase=phases[i], layer=layers[i], layer_type=types[i])
        if has_kernels:
            if op.kernels:
                d.kernels = [Kernel(k.name, k.stream, (k.start_ns - origin) / 1000,
                                    (k.end_ns - k.start_ns) / 1000) for k in op.kernels]
                d.start_us = max(0.0, (op.kernels[0].start_ns - origin) / 1000)
                d.dur_us = (max(k.end_ns for k in op.kernels) - op.kernels[0].start_ns) / 1000
                d.stream = smap[op.kernels[0].stream]
        else:
            d.start_us, d.dur_us = (op.start_ns - origin) / 1000, (op.end_ns - op.start_ns) / 1000
            d.keep = True
        for m in op.mem:
            if m.device_type != mem_device:
                continue
            if first_total is None and m.total_allocated is not None:
                first_total = m.total_allocated - m.delta
            if m.delta > 0:
                d.events.append((tracker.alloc(m.addr, m.delta), +1))
            elif m.delta < 0:
                aid = tracker.free(m.addr, -m.delta, resident_if_unknown=True)
                if aid is not None:
                    d.events.append((aid, -1))
        drafts.append(d)
    known_resident = sum(a.size for a in tracker.allocs.values() if a.resident)
    if first_total is not None and first_total > known_resident:
        aid = len(tracker.allocs)
        tracker.allocs[aid] = AllocDraft(aid, first_total - known_resident, resident=True,
                                         name="resident before the capture (unidentified)")
    for a in tracker.allocs.values():
        if a.resident and not a.name:
            a.name = "resident before the capture"
    clip_overlaps(drafts)
    built = build_trace(drafts, tracker.allocs)
    meta = {"source": "measured", "importer": "kineto", "imported_from": Path(path).name,
            "iteration": label, "model": None, "batch_size": None,
            "device": capture.device_name or ("cpu" if not has_kernels else None),
            "stream_names": {str(v): ("compute" if v == 0 else f"stream {k}")
                             for k, v in smap.items()},
            "memory": "profile_memory events" if tracker.allocs else "none in the capture"}
    return built.trace(meta)


def clip_overlaps(drafts: list[OpDraft]) -> None:
    """Ops on one stream must not overlap: an op whose kernels start before the previous op on
    its stream ended (kernels launched out of CPU order) is clipped to start at that end."""
    ends: dict[int, float] = {}
    for d in drafts:
        if d.start_us is None:
            continue
        prev = ends.get(d.stream)
        if prev is not None and d.start_us < prev:
            end = d.start_us + d.dur_us
            d.start_us = prev
            d.dur_us = max(0.0, end - prev)
        ends[d.stream] = d.start_us + d.dur_us


# ---------------------------------------------------------------- torch memory snapshot import

def block_size(requested: int) -> int:
    """Bytes the caching allocator counts for a request (memory_allocated semantics): rounded up
    to a multiple of 512, as CUDACachingAllocator's round_size does by default."""
    return 512 * max(1, -(-requested // 512)) if requested > 0 else 0


def snapshot_blocks(segments: Any, device: int | None,
                    where: str = "<snapshot>") -> list[tuple[int, int, str]]:
    """(address, size, state) of every block of a torch.cuda.memory snapshot's segments on
    `device` (None: all). A block without an address sits right after the previous one in its
    segment, as torch's own viewer assumes. TraceError naming segments[s].blocks[b] otherwise."""
    if not isinstance(segments, list):
        raise TraceError("segments: expected a list", where)
    out = []
    for s, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list):
            raise TraceError(f"segments[{s}]: expected a dict with a list 'blocks'", where)
        if device is not None and seg.get("device", device) != device:
            continue
        addr = seg.get("address")
        for b, block in enumerate(seg.get("blocks", [])):
            if not isinstance(block, dict):
                raise TraceError(f"segments[{s}].blocks[{b}]: expected a dict", where)
            baddr, bsize = block.get("address", addr), block.get("size")
            if isinstance(baddr, bool) or not isinstance(baddr, int) \
                    or isinstance(bsize, bool) or not isinstance(bsize, int) or bsize < 0:
                raise TraceError(f"segments[{s}].blocks[{b}]: expected integer address "
                                 "(of the block or its segment) and size", where)
            out.append((baddr, bsize, str(block.get("state", ""))))
            addr = baddr + bsize
    return out


class _SafeUnpickler(pickle.Unpickler):
    """Loads plain data only: a snapshot is dicts, lists, tuples, numbers and strings."""

    _ALLOWED = {("builtins", n) for n in ("set", "frozenset", "list", "dict", "tuple", "int",
                                          "float", "str", "bytes", "bool", "complex")}
    _ALLOWED.add(("collections", "OrderedDict"))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a memory snapshot holds "
                                     "plain data only")


def _load_snapshot(path: str | Path) -> Any:
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read: {exc.strerror or exc}", where) from None
    try:
        return _SafeUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as exc:
        raise TraceError(f"not a torch.cuda.memory._dump_snapshot pickle ({exc})", where) from None


def import_torch_snapshot(path: str | Path, device: int | None = None) -> Trace:
    """A vsim trace of the allocator history in a torch.cuda.memory._dump_snapshot pickle
    (recorded with torch.cuda.memory._record_memory_history).

    The history records requested sizes; tensors get the allocator's block size (rounded up to
    512 bytes, memory_allocated's count) while mem_events keep the recorded sizes.
    The history has no ops, so each allocation is an op ('alloc', layer = the innermost stack
    frame when the capture kept stacks) producing its block; frees go to the op before them. Op
    times are the allocator's CPU clock (time_us) relative to the first event, each op lasting
    until the next, zero without time_us. Blocks freed but not allocated in the history, and
    blocks still allocated in 'segments' but not allocated in the history, are resident tensors.
    Every allocator event is kept in mem_events. TraceError naming the file and the place
    (device_traces[d][i].field) on any other structure."""
    where = str(path)
    snap = _load_snapshot(path)
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list) \
            or not isinstance(snap.get("device_traces"), list):
        raise TraceError("top level: expected a dict with lists 'segments' and 'device_traces' "
                         "(torch.cuda.memory._snapshot format)", where)
    traces = snap["device_traces"]
    for d, tr in enumerate(traces):
        if not isinstance(tr, list):
            raise TraceError(f"device_traces[{d}]: expected a list of trace entries", where)
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d])) if traces else 0
    if device >= len(traces) or not traces[device]:
        raise TraceError(f"device_traces[{device}]: no allocator history (was "
                         "_record_memory_history enabled?)", where)
    entries = traces[device]
    known_actions = set(MEM_ACTIONS) | {"segment_map", "segment_unmap", "snapshot"}
    for i, e in enumerate(entries):
        p = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict):
            raise TraceError(f"{p}: expected a dict", where)
        action = e.get("action")
        if action not in known_actions:
            raise TraceError(f"{p}.action: unknown action {action!r}", where)
        for key in ("size",) + (("addr",) if action != "oom" else ()):
            v = e.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TraceError(f"{p}.{key}: expected a non-negative integer, got {v!r}", where)
        t = e.get("time_us", 0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TraceError(f"{p}.time_us: expected a finite number, got {t!r}", where)
    live_at_end = {addr: size for addr, size, state in snapshot_blocks(snap["segments"],
                                                                          device, where)
                   if state == "active_allocated"}

    tracker = AllocTracker()
    drafts: list[OpDraft] = []
    entry_op: list[int | None] = []
    entry_alloc: list[int | None] = []
    allocated_here: set[int] = set()
    t0 = float(entries[0].get("time_us", 0) or 0)
    streams = stream_map(int(e.get("stream", 0) or 0) for e in entries)
    for e in entries:
        action, addr, size = e["action"], e.get("addr", 0), e["size"]
        aid: int | None = None
        if action == "alloc":
            aid = tracker.alloc(addr, block_size(size))
            allocated_here.add(aid)
            frames = e.get("frames") or []
            layer = ""
            if frames and isinstance(frames[0], dict):
                layer = f"{frames[0].get('name', '')} ({frames[0].get('filename', '')}:" \
                        f"{frames[0].get('line', '')})"
            drafts.append(OpDraft(name="alloc", layer=layer, phase="other",
                                  start_us=float(e.get("time_us", t0) or t0) - t0,
                                  events=[(aid, +1)], keep=True))
        elif action == "free_requested":
            aid = tracker.free(addr, size, resident_if_unknown=True)
            if not drafts:
                drafts.append(OpDraft(name="free", phase="other", start_us=0.0, keep=True))
            if aid is not None:
                drafts[-1].events.append((aid, -1))
        elif action == "free_completed":
            aid = tracker.last_freed.get(addr)
        entry_op.append(len(drafts) - 1 if drafts else None)
        entry_alloc.append(aid)
    for cur, nxt in zip(drafts, drafts[1:], strict=False):
        if cur.start_us is not None and nxt.start_us is not None:
            cur.dur_us = max(0.0, nxt.start_us - cur.start_us)
    for addr, size in live_at_end.items():
        aid = tracker.live.get(addr)
        if aid is None:
            tracker.add_resident(addr, size, name="resident before the history")
    for a in tracker.allocs.values():
        if a.resident and not a.name:
            a.name = "resident before the history"
    built = build_trace(drafts, tracker.allocs)
    events = []
    for i, e in enumerate(entries):
        if e["action"] not in MEM_ACTIONS:
            continue
        op = entry_op[i]
        op_id = built.op_id.get(op) if op is not None else None
        aid = entry_alloc[i]
        events.append(MemEvent(action=e["action"],
                               time_us=max(0.0, float(e.get("time_us", t0) or t0) - t0),
                               addr=int(e.get("addr", 0) or 0), size_bytes=e["size"],
                               stream=streams.get(int(e.get("stream", 0) or 0), 0),
                               tensor=built.tensor_of_alloc.get(aid) if aid is not None else None,
                               op=op_id))
    meta = {"source": "measured", "importer": "torch-snapshot",
            "imported_from": Path(path).name, "device_index": device, "model": None,
            "batch_size": None, "device": None,
            "note": "ops are allocator events of the memory history; times are the allocator's "
                    "CPU clock, not GPU kernel time"}
    return built.trace(meta, mem_events=tuple(events))


__all__ = [
    "AllocDraft", "AllocTracker", "Annotation", "Built", "Capture", "CpuOp", "KernelRec",
    "MemRec", "OpDraft", "build_trace", "clip_overlaps", "containing", "import_kineto",
    "import_torch_snapshot",
    "innermost", "load_chrome", "op_layer_type", "parse_chrome", "short_op_name",
    "block_size", "snapshot_blocks", "stream_map",
]

