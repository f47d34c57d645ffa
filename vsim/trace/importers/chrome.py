"""The profiler's Chrome trace (Kineto) reduced to what a trace needs: top-level CPU ops with
their kernels, allocator events and markers (`parse_chrome`); used by `import_kineto` and by
the recorder."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import TraceError
from ...safeload import parse_json
from ..io import read_maybe_gzip

_TRANSPARENT_OPS = ("PythonDispatchMode",)  # a dispatch mode's frame, not an op of its own
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "runtime")
KERNEL_NAME_CHARS = 160  # kernel names are C++ signatures; the head identifies the kernel


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


def as_int(value: Any, default: int | None = None) -> int | None:
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
            tid = as_int(ev.get("tid"), 0) or 0
            if cat in ("cpu_op", "operator") and isinstance(name, str) \
                    and not name.startswith("vsim::"):
                if name not in _TRANSPARENT_OPS:
                    cpu.setdefault(tid, []).append((start, end, name, args))
            elif cat in ("user_annotation", "cpu_op") and isinstance(name, str):
                # user ranges; vsim's own ranges may be recorded as cpu_op by the fast API
                annotations.append(Annotation(name, tid, start, end))
            elif cat in _RUNTIME_CATS:
                corr = as_int(args.get("correlation"))
                if corr is not None:
                    runtime[corr] = (tid, start)
            elif cat in _DEVICE_CATS:
                device.append((ev, i))
        elif ph == "i" and name == "[memory]":
            addr, delta = as_int(args.get("Addr")), as_int(args.get("Bytes"))
            if addr is None or delta is None:
                raise TraceError(f"traceEvents[{i}].args: [memory] event without Addr/Bytes",
                                 where)
            memory.append(MemRec(_ns(ev.get("ts", 0)), as_int(ev.get("tid"), 0) or 0, addr, delta,
                                 as_int(args.get("Total Allocated")),
                                 as_int(args.get("Total Reserved")),
                                 as_int(args.get("Device Type"), 0) or 0,
                                 as_int(args.get("Device Id"), -1) or 0))

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
    ops = [CpuOp(i, name, tid, start, end, as_int(args.get("Sequence number")))
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
        corr = as_int(args.get("correlation"))
        launch = runtime.get(corr) if corr is not None else None
        op = locate(*launch) if (launch is not None and ops) else None
        stream = as_int(args.get("stream"), as_int(ev.get("tid"), 0)) or 0
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
