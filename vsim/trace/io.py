"""Read and write vsim-trace files: Chrome trace JSON (gzip or plain) with one sidecar key.

Layout (DESIGN.md, contract): {"vsim": {format, version, meta, measured, tensors},
"traceEvents": [...]}. Ops are "X" events with cat "op", copies "X" with cat "copy", allocator
events "i" with cat "mem", counters "C" (for viewing only, ignored on load). Trace order is
ascending op id; `deps` may only name earlier ops, which rules out cycles. Every field is checked
on load and an error names the file and the JSON path of the first bad value.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TraceError
from ..fileio import write_atomic
from ..safeload import parse_json, read_bytes
from . import migrate
from .order import StreamOrder as _StreamOrder
from .order import first_repeat as _first_repeat
from .schema import (
    COPY_DIRECTIONS,
    FORMAT,
    MEM_ACTIONS,
    PHASES,
    SCHEMA_VERSION,
    SOURCES,
    TENSOR_KINDS,
    Copy,
    Kernel,
    Measured,
    MemEvent,
    Op,
    Tensor,
    Trace,
)

GPU_PID = 1
_ALLOCATOR_TID = 1000  # allocator events of stream 0 would sit under the compute slices

# Bounds that keep every sum and product the engine and metrics form finite and exact. Times are
# microseconds from the iteration's start: 1e15 us is 31 years, so a larger value is a unit or
# epoch mistake (Kineto's absolute timestamps are about 1.7e15 us). Sizes up to 2^53 bytes
# (8 PiB) stay exact as JSON numbers in every reader (Perfetto's is JavaScript).
MAX_TIME_US = 1e15
MAX_BYTES = 2**53
# Attributes that vsim itself interprets, and the kind of value each must hold.
_TIME_ATTRS = ("stall_us", "dur_us_memory_algo")
_ID_ATTRS = ("recompute_of", "trace_op")


# ---------------------------------------------------------------- writing

def trace_to_json(trace: Trace) -> dict[str, Any]:
    """The JSON document of a trace (what `save_trace` writes)."""
    events: list[dict[str, Any]] = []
    streams: set[int] = set()
    for op in trace.ops:
        streams.add(op.stream)
        args: dict[str, Any] = {
            "op": op.id, "layer": op.layer, "layer_type": op.layer_type, "phase": op.phase,
            "reads": list(op.reads), "writes": list(op.writes), "frees": list(op.frees),
            "deps": list(op.deps),
            "kernels": [[k.name, k.stream, k.start_us, k.dur_us] for k in op.kernels],
        }
        if op.flops:
            args["flops"] = op.flops
        if op.dram_bytes:
            args["dram_bytes"] = op.dram_bytes
        if op.attrs:
            args["attrs"] = dict(op.attrs)
        events.append({"name": op.name, "cat": "op", "ph": "X", "ts": op.start_us,
                       "dur": op.dur_us, "pid": GPU_PID, "tid": op.stream, "args": args})
    for copy in trace.copies:
        streams.add(copy.stream)
        events.append({"name": f"{copy.direction} t{copy.tensor}", "cat": "copy", "ph": "X",
                       "ts": copy.start_us, "dur": copy.dur_us, "pid": GPU_PID,
                       "tid": copy.stream, "args": {"tensor": copy.tensor,
                                                    "direction": copy.direction,
                                                    "bytes": copy.size_bytes}})
    for ev in trace.mem_events:
        events.append({"name": ev.action, "cat": "mem", "ph": "i", "s": "t", "ts": ev.time_us,
                       "pid": GPU_PID, "tid": _ALLOCATOR_TID,
                       "args": {"addr": ev.addr, "bytes": ev.size_bytes, "stream": ev.stream,
                                "tensor": ev.tensor, "op": ev.op}})
    events.extend(trace.counters)
    names = {GPU_PID: "GPU"}
    events.append({"name": "process_name", "ph": "M", "pid": GPU_PID, "tid": 0,
                   "args": {"name": f"{names[GPU_PID]} ({trace.meta.get('source', '?')})"}})
    for stream in sorted(streams):
        events.append({"name": "thread_name", "ph": "M", "pid": GPU_PID, "tid": stream,
                       "args": {"name": _stream_label(stream, trace)}})
    if trace.mem_events:
        events.append({"name": "thread_name", "ph": "M", "pid": GPU_PID, "tid": _ALLOCATOR_TID,
                       "args": {"name": "allocator"}})
    sidecar: dict[str, Any] = {
        "format": FORMAT, "version": SCHEMA_VERSION, "meta": trace.meta,
        "measured": None if trace.measured is None else {
            "iteration_time_us": trace.measured.iteration_time_us,
            "peak_allocated_bytes": trace.measured.peak_allocated_bytes,
            "peak_reserved_bytes": trace.measured.peak_reserved_bytes},
        "tensors": [{"id": t.id, "bytes": t.size_bytes, "kind": t.kind, "name": t.name,
                     "producer": t.producer, "consumers": list(t.consumers)}
                    for t in trace.tensors],
    }
    return {"vsim": sidecar, "traceEvents": events, "displayTimeUnit": "ms"}


def _stream_label(stream: int, trace: Trace) -> str:
    labels = trace.meta.get("stream_names", {})
    return str(labels.get(str(stream), f"stream {stream}"))


def save_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write atomically (temporary file, then rename): a failed write leaves nothing behind.
    Gzip when the name ends in .gz."""
    path = Path(path)
    text = json.dumps(trace_to_json(trace), separators=(",", ":"), allow_nan=False)
    parent = path.parent if str(path.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text, gzip_level=9 if path.suffix == ".gz" else None)


# ---------------------------------------------------------------- reading

def read_maybe_gzip(path: str | os.PathLike[str], what: str = "") -> bytes | bytearray:
    """The file's bytes, gunzipped when they start with gzip's magic number; TraceError naming
    the file when it cannot be read ("cannot read {what}: ..."), its gzip data is corrupt, or
    it is larger than safeload's input limit once decompressed (a gzip bomb)."""
    return read_bytes(path, TraceError, what)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace; raises TraceError naming the file and JSON path on bad input."""
    where = str(path)
    # The cyclic garbage collector finds nothing to free in a document being built, but its
    # passes over millions of new containers cost more than the parse (1M ops: 60% of it).
    enabled = gc.isenabled()
    gc.disable()
    try:
        raw: bytes | bytearray | str = read_maybe_gzip(path, "trace")
        try:  # the parser decodes bytes to a str of its own: decode once, keep only the str
            raw = raw.decode("utf-8")  # type: ignore[union-attr]
        except UnicodeDecodeError:
            pass  # parse_json says what is wrong with it
        # Well-formed op events and tensors become Op and Tensor objects as the parser builds
        # them, so the parsed dicts of a large trace never all exist at once (a 1M-op trace:
        # 3.5 GB of dicts); anything unusual stays a dict for the field-by-field reader.
        doc = parse_json(raw, where, TraceError, object_hook=_early_records({}))
        version = doc.get("vsim", {}).get("version") if isinstance(doc, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) \
                and version < SCHEMA_VERSION:  # migrations work on plain documents
            doc = parse_json(raw, where, TraceError)
        del raw
        return trace_from_json(doc, where)
    finally:
        if enabled:
            gc.enable()


_TENSOR_KEYS = frozenset({"id", "bytes", "kind", "name", "producer", "consumers"})


def _early_records(ints: dict[int, int]) -> Callable[[dict[str, Any]], Any]:
    """The parser's object hook (load_trace): an "X"/"op" event as its Op and a tensor entry
    (exactly a tensor's keys) as its Tensor when the fast readers accept them, else the dict.
    Their ids are shared through `ints` (an id -> the one int object kept for it): the parser
    makes an int object of every number, and a trace names each tensor about five times
    (1M ops: 170 MB of duplicate ints)."""

    def hook(obj: dict[str, Any]) -> Any:
        if obj.get("cat") == "op" and obj.get("ph") == "X":
            return _fast_op(obj, ints) or obj
        if "kind" in obj and "bytes" in obj and obj.keys() <= _TENSOR_KEYS:
            return _fast_tensor(obj, ints) or obj
        return obj

    return hook


def trace_from_json(doc: Any, where: str = "<trace>") -> Trace:
    """Validate a parsed JSON document and build the Trace."""
    reader = _Reader(where)
    doc = reader.obj(doc, "")
    if "vsim" not in doc:
        raise reader.fail("", "missing required field 'vsim' (not a vsim trace; a PyTorch "
                          "profiler trace converts with `vsim import kineto`)")
    sidecar = reader.obj(doc["vsim"], "vsim")
    fmt = sidecar.get("format")
    if fmt != FORMAT:
        raise TraceError(f"vsim.format is {fmt!r}, expected {FORMAT!r}", where)
    version = sidecar.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TraceError(f"vsim.version must be an integer, got {version!r}", where)
    if version > SCHEMA_VERSION:
        raise TraceError(f"trace version {version} is newer than this vsim reads "
                         f"(up to {SCHEMA_VERSION}); upgrade vsim", where)
    if version < 1:
        raise TraceError(f"vsim.version {version} does not exist", where)
    doc = migrate.upgrade(doc, version, where)
    return reader.trace(doc)


class _Reader:
    """Field-by-field validation with JSON paths in every message."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, message: str) -> TraceError:
        return TraceError(f"{path or 'top level'}: {message}", self.where)

    def obj(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {type(value).__name__}")
        return value

    def lst(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {type(value).__name__}")
        return value

    def integer(self, value: Any, path: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {value}")
        return value

    def size(self, value: Any, path: str) -> int:
        """Bytes: an integer from 0 to MAX_BYTES."""
        size = self.integer(value, path)
        if size > MAX_BYTES:
            raise self.fail(path, f"{size} bytes is more than 2^53 (8 PiB)")
        return size

    def number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise self.fail(path, f"must be finite and not negative, got {value!r}")
        return float(value)

    def time(self, value: Any, path: str) -> float:
        """Microseconds from the iteration's start: a number from 0 to MAX_TIME_US."""
        time_us = self.number(value, path)
        if time_us > MAX_TIME_US:
            raise self.fail(path, f"{value!r} us is more than 1e15 us (31 years); times are "
                            "microseconds from the iteration's start")
        return time_us

    def strict(self, value: Any, path: str) -> None:
        """Free-form data vsim keeps and writes back (meta, attrs, counters): no NaN or
        Infinity, which strict JSON (and so Perfetto) cannot hold."""
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(path, f"{value!r} is not a finite number (not valid JSON)")
        if isinstance(value, dict):
            for k, v in value.items():
                self.strict(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self.strict(v, f"{path}[{i}]")

    def string(self, value: Any, path: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.fail(path, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def ids(self, value: Any, path: str) -> tuple[int, ...]:
        return tuple(self.integer(v, f"{path}[{i}]") for i, v in enumerate(self.lst(value, path)))

    def key(self, obj: dict[str, Any], name: str, path: str) -> Any:
        if name not in obj:
            raise self.fail(path, f"missing required field {name!r}")
        return obj[name]

    # -- the document

    def trace(self, doc: dict[str, Any]) -> Trace:
        sidecar = doc["vsim"]
        meta = self.obj(self.key(sidecar, "meta", "vsim"), "vsim.meta")
        self.string(self.key(meta, "source", "vsim.meta"), "vsim.meta.source", SOURCES)
        self.strict(meta, "vsim.meta")
        if "iteration_tail_us" in meta:
            self.time(meta["iteration_tail_us"], "vsim.meta.iteration_tail_us")
        for k, v in self.obj(meta.get("stream_names", {}), "vsim.meta.stream_names").items():
            self.string(v, f"vsim.meta.stream_names.{k}")
        measured = self.measured(sidecar.get("measured"))
        tensors = tuple(self.tensor(t, f"vsim.tensors[{i}]") for i, t in
                        enumerate(self.lst(self.key(sidecar, "tensors", "vsim"), "vsim.tensors")))
        events = self.lst(self.key(doc, "traceEvents", ""), "traceEvents")
        ops: list[Op] = []
        where: list[int] = []  # the index of each op's event (for messages)
        copies: list[Copy] = []
        mem: list[MemEvent] = []
        counters: list[dict[str, Any]] = []
        for i, ev in enumerate(events):
            if type(ev) is Op:  # read as the document was parsed (load_trace)
                ops.append(ev)
                where.append(i)
                continue
            path = f"traceEvents[{i}]"
            ev = self.obj(ev, path)
            ph, cat = ev.get("ph"), ev.get("cat")
            if ph == "X" and cat == "op":
                ops.append(self.op(ev, path))
                where.append(i)
            elif ph == "X" and cat == "copy":
                copies.append(self.copy(ev, path))
            elif ph == "i" and cat == "mem":
                mem.append(self.mem(ev, path))
            elif ph == "C":
                self.strict(ev, path)
                counters.append(ev)
            elif not isinstance(ph, str):
                raise self.fail(f"{path}.ph", f"expected a phase string, got {ph!r}")
        self.check_graph(tensors, ops, where)
        return Trace(meta=meta, tensors=tensors, ops=tuple(ops),
                     measured=measured, copies=tuple(copies), mem_events=tuple(mem),
                     counters=tuple(counters))

    def measured(self, value: Any) -> Measured | None:
        if value is None:
            return None
        path = "vsim.measured"
        m = self.obj(value, path)
        return Measured(
            iteration_time_us=self.time(self.key(m, "iteration_time_us", path),
                                        f"{path}.iteration_time_us"),
            peak_allocated_bytes=self.size(self.key(m, "peak_allocated_bytes", path),
                                           f"{path}.peak_allocated_bytes"),
            peak_reserved_bytes=self.size(self.key(m, "peak_reserved_bytes", path),
                                          f"{path}.peak_reserved_bytes"))

    def tensor(self, value: Any, path: str) -> Tensor:
        if type(value) is Tensor:  # read as the document was parsed (load_trace)
            return value
        fast = _fast_tensor(value)
        if fast is not None:
            return fast
        t = self.obj(value, path)
        producer = t.get("producer")
        return Tensor(
            id=self.integer(self.key(t, "id", path), f"{path}.id"),
            size_bytes=self.size(self.key(t, "bytes", path), f"{path}.bytes"),
            kind=self.string(self.key(t, "kind", path), f"{path}.kind", TENSOR_KINDS),
            name=self.string(t.get("name", ""), f"{path}.name"),
            producer=None if producer is None else self.integer(producer, f"{path}.producer"),
            consumers=self.ids(t.get("consumers", []), f"{path}.consumers"))

    def op(self, ev: dict[str, Any], path: str) -> Op:
        """The op of an "X"/"op" event: `_fast_op` for a well-formed one, else the field-by-field
        checks below, which name the first bad value."""
        fast = _fast_op(ev)
        if fast is not None:
            return fast
        args = self.obj(self.key(ev, "args", path), f"{path}.args")
        ap = f"{path}.args"
        kernels = []
        for k, kern in enumerate(self.lst(args.get("kernels", []), f"{ap}.kernels")):
            kp = f"{ap}.kernels[{k}]"
            kern = self.lst(kern, kp)
            if len(kern) != 4:
                raise self.fail(kp, "expected [name, stream, ts, dur]")
            kernels.append(Kernel(self.string(kern[0], f"{kp}[0]"),
                                  self.integer(kern[1], f"{kp}[1]"),
                                  self.time(kern[2], f"{kp}[2]"),
                                  self.time(kern[3], f"{kp}[3]")))
        attrs = self.obj(args.get("attrs", {}), f"{ap}.attrs")
        self.strict(attrs, f"{ap}.attrs")
        for name in _TIME_ATTRS:
            if name in attrs:
                self.time(attrs[name], f"{ap}.attrs.{name}")
        for name in _ID_ATTRS:
            if name in attrs:
                self.integer(attrs[name], f"{ap}.attrs.{name}")
        return Op(
            id=self.integer(self.key(args, "op", ap), f"{ap}.op"),
            name=self.string(self.key(ev, "name", path), f"{path}.name"),
            layer=self.string(self.key(args, "layer", ap), f"{ap}.layer"),
            layer_type=self.string(self.key(args, "layer_type", ap), f"{ap}.layer_type"),
            phase=self.string(self.key(args, "phase", ap), f"{ap}.phase", PHASES),
            start_us=self.time(self.key(ev, "ts", path), f"{path}.ts"),
            dur_us=self.time(self.key(ev, "dur", path), f"{path}.dur"),
            stream=self.integer(self.key(ev, "tid", path), f"{path}.tid"),
            reads=self.ids(args.get("reads", []), f"{ap}.reads"),
            writes=self.ids(args.get("writes", []), f"{ap}.writes"),
            frees=self.ids(args.get("frees", []), f"{ap}.frees"),
            deps=self.ids(args.get("deps", []), f"{ap}.deps"),
            kernels=tuple(kernels),
            flops=self.number(args.get("flops", 0.0), f"{ap}.flops"),
            dram_bytes=self.number(args.get("dram_bytes", 0.0), f"{ap}.dram_bytes"),
            # JSON arrays come back as tuples, as the recorder made them (Op.mutates)
            attrs=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                               for k, v in attrs.items())))

    def copy(self, ev: dict[str, Any], path: str) -> Copy:
        args = self.obj(self.key(ev, "args", path), f"{path}.args")
        ap = f"{path}.args"
        return Copy(
            tensor=self.integer(self.key(args, "tensor", ap), f"{ap}.tensor"),
            direction=self.string(self.key(args, "direction", ap), f"{ap}.direction",
                                  COPY_DIRECTIONS),
            size_bytes=self.size(self.key(args, "bytes", ap), f"{ap}.bytes"),
            start_us=self.time(self.key(ev, "ts", path), f"{path}.ts"),
            dur_us=self.time(self.key(ev, "dur", path), f"{path}.dur"),
            stream=self.integer(self.key(ev, "tid", path), f"{path}.tid"))

    def mem(self, ev: dict[str, Any], path: str) -> MemEvent:
        args = self.obj(self.key(ev, "args", path), f"{path}.args")
        ap = f"{path}.args"
        tensor, op = args.get("tensor"), args.get("op")
        return MemEvent(
            action=self.string(self.key(ev, "name", path), f"{path}.name", MEM_ACTIONS),
            time_us=self.time(self.key(ev, "ts", path), f"{path}.ts"),
            addr=self.integer(self.key(args, "addr", ap), f"{ap}.addr"),
            size_bytes=self.size(self.key(args, "bytes", ap), f"{ap}.bytes"),
            stream=self.integer(args.get("stream", 0), f"{ap}.stream"),
            tensor=None if tensor is None else self.integer(tensor, f"{ap}.tensor"),
            op=None if op is None else self.integer(op, f"{ap}.op"))

    def check_graph(self, tensors: tuple[Tensor, ...], ops: list[Op], where: list[int]
                    ) -> None:
        """Ids unique and known, deps only backwards, producers consistent, no use after free,
        and no use across streams without a dependency (see `_StreamOrder`). `where`: the
        index of each op's event in traceEvents. Written for speed (once per op of every
        trace): an op's lists go through loops that only test, with no index or path; the first
        op they find anything wrong with goes through `_op_problem`, which checks its lists
        again in the order of the messages and raises the first (and the same for tensors)."""
        by_id: dict[int, Tensor] = {}
        for i, t in enumerate(tensors):
            if t.id in by_id:
                raise self.fail(f"vsim.tensors[{i}].id", f"duplicate tensor id {t.id}")
            by_id[t.id] = t
        op_ids: set[int] = set()
        last = -1
        freed: dict[int, int] = {}
        written: set[int] = set()
        order = _StreamOrder(len({op.stream for op in ops}) > 1)
        ordered = order.enabled
        located, readers_of, before = order.where, order.readers, order.before
        tensor_of = by_id.get
        for n, op in enumerate(ops):
            oid = op.id
            if oid in op_ids:
                raise self.fail(f"traceEvents[{where[n]}].args.op", f"duplicate op id {oid}")
            if oid <= last:
                raise self.fail(f"traceEvents[{where[n]}].args.op", f"op ids must increase in "
                                f"trace order ({oid} after {last})")
            last = oid
            if op.deps:
                for j, dep in enumerate(op.deps):
                    if dep not in op_ids:
                        raise self.fail(f"traceEvents[{where[n]}].args.deps[{j}]",
                                        f"op {dep} is not an earlier op (dependencies must "
                                        "point backwards; a cycle or unknown op)")
            stream = op.stream
            if ordered:
                order.enter(op)
            # The tests of `_op_problem`, in any order and without messages. The readers noted
            # on the way are the ones it would note (it redoes the reads before the frees).
            ok = True
            for tid in op.reads:
                rec = tensor_of(tid)
                if rec is None or tid in freed:
                    ok = False
                    break
                producer = rec.producer
                if producer is not None and producer != oid and (
                        producer not in op_ids or ordered and located[producer][0] != stream
                        and not before(producer, op)):
                    ok = False
                    break
                if ordered:
                    seen = readers_of.get(tid)
                    if seen is None:
                        readers_of[tid] = {stream: oid}
                    else:
                        seen[stream] = oid
            writes, frees = op.writes, op.frees
            if ok and writes:
                for tid in writes:
                    rec = tensor_of(tid)
                    if rec is None or rec.producer != oid:
                        ok = False
                        break
                if len(writes) > 1 and _first_repeat(writes) >= 0:
                    ok = False
            if ok and frees:
                if len(frees) > 1 and _first_repeat(frees) >= 0:
                    ok = False
                for tid in frees:
                    if not ok:
                        break
                    rec = tensor_of(tid)
                    if rec is None or tid in freed:
                        ok = False
                        break
                    producer = rec.producer
                    if producer is not None and producer != oid and (
                            producer not in op_ids or ordered and located[producer][0] != stream
                            and not before(producer, op)):
                        ok = False
                        break
                    if ordered:
                        seen = readers_of.get(tid)
                        if seen:
                            for reader_stream, reader in seen.items():
                                if reader_stream != stream and not before(reader, op):
                                    ok = False
                                    break
            if not ok:
                raise self._op_problem(op, where[n], by_id, op_ids, freed, order)
            written.update(writes)
            for tid in frees:
                freed[tid] = oid
            op_ids.add(oid)
        for i, t in enumerate(tensors):
            producer = t.producer
            if producer is not None and (producer not in op_ids or t.id not in written) \
                    or t.consumers and not op_ids.issuperset(t.consumers):
                raise self._tensor_problem(t, i, op_ids, written)

    def _op_problem(self, op: Op, index: int, by_id: dict[int, Tensor], op_ids: set[int],
                    freed: dict[int, int], order: _StreamOrder) -> TraceError:
        """The first thing wrong with an op's reads, writes and frees (check_graph found one),
        as its error: `index` is its event's in traceEvents."""
        oid = op.id
        ordered = order.enabled
        for j, tid in enumerate(op.reads):
            rec = by_id.get(tid)
            if rec is None:
                problem: str | None = f"tensor {tid} does not exist"
            elif tid in freed:
                problem = f"tensor {tid} was freed by op {freed[tid]}"
            else:
                producer = rec.producer
                if producer is not None and producer != oid and producer not in op_ids:
                    problem = f"tensor {tid} is produced later, by op {producer}"
                else:
                    problem = order.use(op, tid, producer, False) if ordered else None
            if problem:
                return self.fail(f"traceEvents[{index}].args.reads[{j}]", problem)
        writes = op.writes
        repeat = _first_repeat(writes)
        for j, tid in enumerate(writes):
            if tid not in by_id:
                problem = f"tensor {tid} does not exist"
            elif j == repeat:
                problem = f"tensor {tid} is listed twice"
            else:
                continue
            return self.fail(f"traceEvents[{index}].args.writes[{j}]", problem)
        frees = op.frees
        repeat = _first_repeat(frees)
        for j, tid in enumerate(frees):
            rec = by_id.get(tid)
            if rec is None:
                problem = f"tensor {tid} does not exist"
            elif j == repeat:
                problem = f"tensor {tid} is listed twice"
            elif tid in freed:
                problem = f"tensor {tid} was freed by op {freed[tid]}"
            else:
                producer = rec.producer
                if producer is not None and producer != oid and producer not in op_ids:
                    problem = f"tensor {tid} is produced later, by op {producer}"
                else:
                    problem = order.use(op, tid, producer, True) if ordered else None
            if problem:
                return self.fail(f"traceEvents[{index}].args.frees[{j}]", problem)
        for j, tid in enumerate(writes):
            if by_id[tid].producer != oid:
                return self.fail(f"traceEvents[{index}].args.writes[{j}]",
                                 f"tensor {tid} lists producer {by_id[tid].producer}, "
                                 f"not op {oid}")
        raise AssertionError(f"check_graph: nothing wrong with op {oid}")  # (unreachable)

    def _tensor_problem(self, t: Tensor, i: int, op_ids: set[int], written: set[int]
                        ) -> TraceError:
        """What is wrong with tensor `t` (vsim.tensors[i]) once every op is read."""
        if t.producer is not None and t.producer not in op_ids:
            return self.fail(f"vsim.tensors[{i}].producer", f"op {t.producer} does not exist")
        if t.producer is not None and t.id not in written:
            return self.fail(f"vsim.tensors[{i}].producer", f"op {t.producer} does not list "
                             f"tensor {t.id} in its writes")
        for j, c in enumerate(t.consumers):
            if c not in op_ids:
                return self.fail(f"vsim.tensors[{i}].consumers[{j}]", f"op {c} does not exist")
        raise AssertionError(f"check_graph: nothing wrong with tensor {t.id}")  # (unreachable)


_PHASE = {p: p for p in PHASES}  # one shared string per phase, not one per op


def _builder(cls: type) -> Callable[..., Any]:
    """A positional constructor (every field, in order) of a frozen slots dataclass, faster
    than its own __init__, which sets each field through object.__setattr__ (it is frozen):
    the object is made as an instance of a plain class with the same slots (the same layout),
    whose fields the interpreter stores directly, and then given its class (a 1M-op trace's
    load builds 2.6M records: an Op 2.9 us through __init__, 0.9 through each slot's __set__,
    0.3 this way). The same object as cls(*fields): these classes have no __post_init__
    (tests/test_trace_io.py holds the two equal)."""
    names = [f.name for f in dataclasses.fields(cls)]
    if tuple(names) != tuple(cls.__dict__["__slots__"]):
        raise TypeError(f"{cls.__name__}: its slots are not its fields in order")
    blank = type(f"_{cls.__name__}Blank", (), {"__slots__": tuple(names)})
    scope: dict[str, Any] = {"new": object.__new__, "blank": blank, "cls": cls}
    body = "".join(f"    obj.{n} = {n}\n" for n in names)
    exec(f"def build({', '.join(names)}):\n    obj = new(blank)\n{body}"
         "    obj.__class__ = cls\n    return obj\n", scope)
    build: Callable[..., Any] = scope["build"]
    return build


_new_op, _new_kernel, _new_tensor = _builder(Op), _builder(Kernel), _builder(Tensor)


def _ids(value: Any, ints: dict[int, int] | None = None) -> tuple[int, ...] | None:
    if type(value) is not list:
        return None
    n = len(value)
    if n == 0:
        return ()
    if n == 1:  # (most lists of most ops: one or two ids, written out, a third of the time)
        v = value[0]
        if type(v) is not int or v < 0:
            return None
        return (v,) if ints is None else (ints.setdefault(v, v),)
    if n == 2:
        a, b = value
        if type(a) is not int or a < 0 or type(b) is not int or b < 0:
            return None
        return (a, b) if ints is None else (ints.setdefault(a, a), ints.setdefault(b, b))
    for v in value:
        if type(v) is not int or v < 0:
            return None
    if ints is None:
        return tuple(value)
    return tuple(map(ints.setdefault, value, value))  # (one int object per id: see load_trace)


def _t(value: Any) -> bool:
    """A time `_Reader.time` accepts (NaN fails the comparison)."""
    return (type(value) is float or type(value) is int) and 0 <= value <= MAX_TIME_US


_EMPTY: list[Any] = []  # (read only) the default of a missing list


def _fast_op(ev: dict[str, Any], ints: dict[int, int] | None = None) -> Op | None:
    """The Op of a well-formed event without formatting a JSON path for every field (a 1M-op
    trace spent most of its load there), or None for anything unusual: `_Reader.op` then
    checks field by field and names the first bad value. Accepts exactly what that accepts.
    The checks are written out (no helper calls): this runs once per op of every trace."""
    args = ev.get("args")
    if type(args) is not dict or "attrs" in args:
        return None
    get = args.get
    try:  # (subscripts: cheaper than get; a missing key or an unhashable phase goes slow)
        oid, name, layer, layer_type = args["op"], ev["name"], args["layer"], args["layer_type"]
        phase = _PHASE.get(args["phase"])
        ts, dur, stream = ev["ts"], ev["dur"], ev["tid"]
    except (KeyError, TypeError):
        return None
    flops, dram = get("flops", 0.0), get("dram_bytes", 0.0)
    if not (type(oid) is int and oid >= 0 and type(name) is str and type(layer) is str
            and type(layer_type) is str and phase is not None
            and (type(ts) is float or type(ts) is int) and 0 <= ts <= MAX_TIME_US
            and (type(dur) is float or type(dur) is int) and 0 <= dur <= MAX_TIME_US
            and type(stream) is int and stream >= 0
            and (type(flops) is float or type(flops) is int) and 0 <= flops < math.inf
            and (type(dram) is float or type(dram) is int) and 0 <= dram < math.inf):
        return None
    reads, writes = _ids(get("reads", _EMPTY), ints), _ids(get("writes", _EMPTY), ints)
    frees, deps = _ids(get("frees", _EMPTY), ints), _ids(get("deps", _EMPTY), ints)
    if reads is None or writes is None or frees is None or deps is None:
        return None
    raw_kernels = get("kernels", _EMPTY)
    if type(raw_kernels) is not list:
        return None
    kernels: tuple[Kernel, ...] = ()
    if raw_kernels:
        made = []
        for k in raw_kernels:
            if not (type(k) is list and len(k) == 4):
                return None
            kname, kstream, kts, kdur = k
            if not (type(kname) is str and type(kstream) is int and kstream >= 0
                    and (type(kts) is float or type(kts) is int) and 0 <= kts <= MAX_TIME_US
                    and (type(kdur) is float or type(kdur) is int)
                    and 0 <= kdur <= MAX_TIME_US):
                return None
            made.append(_new_kernel(kname, kstream, float(kts), float(kdur)))
        kernels = tuple(made)
    if ints is not None:  # and a layer's name once for its forward and backward ops
        oid, layer = ints.setdefault(oid, oid), sys.intern(layer)
    op: Op = _new_op(oid, name, layer, sys.intern(layer_type), phase, float(ts), float(dur),
                     stream, reads, writes, frees, deps, kernels, float(flops), float(dram), ())
    return op


_KIND = {k: k for k in TENSOR_KINDS}


def _fast_tensor(t: Any, ints: dict[int, int] | None = None) -> Tensor | None:
    """The Tensor of a well-formed entry without a JSON path per field, else None (then
    `_Reader.tensor` names the first bad value); accepts exactly what that accepts."""
    if type(t) is not dict:
        return None
    get = t.get
    tid, size, name = get("id"), get("bytes"), get("name", "")
    kind, producer = get("kind"), get("producer")
    if type(kind) is not str:
        return None  # (an unhashable one would raise in the lookup below)
    kind = _KIND.get(kind)
    consumers = _ids(get("consumers", _EMPTY), ints)
    if not (type(tid) is int and tid >= 0 and type(size) is int and 0 <= size <= MAX_BYTES
            and kind is not None and type(name) is str and consumers is not None
            and (producer is None or (type(producer) is int and producer >= 0))):
        return None
    if ints is not None:
        tid = ints.setdefault(tid, tid)
        producer = None if producer is None else ints.setdefault(producer, producer)
    tensor: Tensor = _new_tensor(tid, size, kind, name, producer, consumers)
    return tensor


def _finite(value: Any) -> bool:
    """A number `_Reader.number` accepts: finite and not negative."""
    return (type(value) is float or type(value) is int) and 0 <= value < math.inf
