"""What the engine derives from a trace alone, computed once per trace and shared by every run
on it: a caching allocator's first and steady iterations, and a policy's profiling runs, each
build an Engine on the same trace (a 1M-op trace: about a second per Engine before).

Read only: an Engine copies what it changes (its `first_use`)."""

from __future__ import annotations

import gc
import weakref
from bisect import bisect_right
from itertools import pairwise
from typing import Any

from ..allocator.first_use import first_use_residents
from ..trace.schema import Op, Tensor, Trace

# One stream's ops in order, each with (op, launch gap us, reads it does not write, deps on
# other streams): see TracePrep.streams.
Step = tuple[Op, float, tuple[int, ...], tuple[int, ...]]


class TracePrep:
    """Per-trace lookups of the engine. `streams`: per stream, its ops in order, each with what
    the short path needs: the GPU idle time before it in the recording on its stream (the
    launch gap), what it reads that it does not write itself (a trace may list an op's own
    output or workspace among its reads), and its deps on other streams (a dep on its own
    stream has ended before it: a stream runs its ops in order). `waited`: the ops another
    stream waits for (the engine makes a SimPy event for each)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = weakref.ref(trace)
        self.tensors: dict[int, Tensor] = trace.tensor_by_id()
        self.size: dict[int, int] = {t.id: t.size_bytes for t in trace.tensors}
        self.ops: dict[int, Op] = {op.id: op for op in trace.ops}
        self.resident: tuple[int, ...] = tuple(t.id for t in trace.tensors if t.producer is None)
        streams: dict[int, list[Step]] = {}
        last_end: dict[int, float] = {}
        stream_of: dict[int, int] = {}
        waited: dict[int, None] = {}  # (ordered, as the engine made its events before)
        for op in trace.ops:
            stream = op.stream
            stream_of[op.id] = stream
            prev = last_end.get(stream, 0.0)
            gap = op.start_us - prev if op.start_us > prev else 0.0
            end = op.start_us + op.dur_us
            last_end[stream] = end if end > prev else prev
            reads, writes = op.reads, op.writes
            if writes and reads:
                for t in reads:
                    if t in writes:
                        reads = tuple(t for t in reads if t not in writes)
                        break
            deps: tuple[int, ...] = ()
            if op.deps:
                deps = tuple(d for d in op.deps if stream_of[d] != stream)
                for d in deps:
                    waited[d] = None
            steps = streams.get(stream)
            if steps is None:
                steps = streams[stream] = []
            steps.append((op, gap, reads, deps))
        self.streams = streams
        self.waited: tuple[int, ...] = tuple(waited)
        # per op, what it reads that it does not write, each once, in tensor order (the order
        # the engine checks them in, Engine._reads_ready)
        self.reads_sorted: dict[int, tuple[int, ...]] = {
            op.id: tuple(sorted(set(op.reads).difference(op.writes))) for op in trace.ops}
        self.position: dict[int, int] = {op.id: i for i, op in enumerate(trace.ops)}
        self._ids = [op.id for op in trace.ops]
        self._ids_rising = all(a < b for a, b in pairwise(self._ids))
        self._first_use: dict[int, list[int]] | None = None
        self._inplace: dict[int, tuple[int, ...]] | None = None
        self._later_outputs: dict[int, list[int]] | None = None
        self._dgrad: dict[int, int] | None = None
        self._same_shape: dict[int, tuple[int, ...]] | None = None
        # vsim.engine.warm's layouts, per (hardware, allocator spec, transients)
        self.warm: dict[tuple[object, ...], tuple[Any, dict[int, object]]] = {}
        # the host clock's per-op times, per host model's tables (hostclock._model_clock)
        self.host_tables: dict[tuple[int, int, int, float], tuple[Any, ...]] = {}

    def same_shape(self) -> dict[int, tuple[int, ...]]:
        """Per convolution, the other convolutions of its trace of the same shape and pass:
        the same aten call on tensors of the same sizes and kinds (reads; results but the
        workspace). PyTorch caches one cuDNN engine per shape and pass, so the engine that a
        squeeze or a workspace fallback leaves for one is what the others run too (the
        VGG-16(256) profile of validation/runtime/microbatch-21-h100.log: conv 0.24 and 0.26
        squeezed, 0.28 ran the same workspace-free engines)."""
        if self._same_shape is None:
            tensors = self.tensors
            groups: dict[tuple[Any, ...], list[int]] = {}
            for o in self.ops.values():
                if o.layer_type != "conv":
                    continue
                key = (o.name, o.phase,
                       tuple(sorted((tensors[t].kind, tensors[t].size_bytes) for t in o.reads)),
                       tuple(sorted((tensors[t].kind, tensors[t].size_bytes) for t in o.writes
                                    if tensors[t].kind != "workspace")))
                groups.setdefault(key, []).append(o.id)
            self._same_shape = {o: tuple(x for x in ids if x != o)
                                for ids in groups.values() if len(ids) > 1 for o in ids}
        return self._same_shape

    def dgrad_workspaces(self) -> dict[int, int]:
        """Per backward convolution with a workspace, its forward convolution's workspace bytes
        (the same layer): cuDNN runs the data-gradient kernel, then the weight-gradient one,
        each with its own workspace, and the first is about the forward's (the same tensors,
        transposed the same way), while the trace merged the two into one at its peak
        (vsim/trace/importers/build.py). PyTorch's histories show the first one in 11 of
        vgg16-b128's 12 backward convolutions (docs/design.md, allocator models)."""
        if self._dgrad is None:
            tensors = self.tensors

            def workspace(op: Op) -> int:
                return max((tensors[t].size_bytes for t in op.writes
                            if tensors[t].kind == "workspace"), default=0)

            ops = self.ops.values()
            forward = {o.layer: workspace(o) for o in ops
                       if o.layer_type == "conv" and o.phase == "fwd" and o.layer}
            self._dgrad = {o.id: forward[o.layer] for o in ops
                           if o.layer_type == "conv" and o.phase == "bwd"
                           and forward.get(o.layer) and workspace(o) > 0}
        return self._dgrad

    def stop_after(self, until: int) -> int:
        """The position in the trace of its first op whose id is above `until` (its length if
        none): where a walk in trace order that stops there stops."""
        if self._ids_rising:  # (ids in trace order, as every importer numbers them)
            return bisect_right(self._ids, until)
        trace = self._trace()
        assert trace is not None
        return next((i for i, op in enumerate(trace.ops) if op.id > until), len(trace.ops))

    def inplace_updates(self) -> dict[int, tuple[int, ...]]:
        """Per position in the trace of an in-place op (`aten::*_`) that reads something, in
        trace order, the tensors it updates: its `mutates` attribute where recorded, else its
        first read (hostclock.noted_ops)."""
        if self._inplace is None:
            trace = self._trace()
            assert trace is not None
            self._inplace = {i: tuple(dict(op.attrs).get("mutates") or op.reads[:1])
                             for i, op in enumerate(trace.ops) if op.name.startswith("aten::")
                             and op.name.endswith("_") and op.reads}
        return self._inplace

    def later_outputs(self) -> dict[int, list[int]]:
        """Per tensor, the forward ops that write it as an output other than their first
        (hostclock.hooked_ops)."""
        if self._later_outputs is None:
            trace = self._trace()
            assert trace is not None
            got: dict[int, list[int]] = {}
            for op in trace.ops:
                if op.phase == "fwd":
                    for t in op.writes[1:]:
                        ops = got.setdefault(t, [])
                        if not ops or ops[-1] != op.id:
                            ops.append(op.id)
            self._later_outputs = got
        return self._later_outputs

    def first_use(self) -> dict[int, list[int]]:
        """vsim.allocator.first_use.first_use_residents of the trace (built on first call)."""
        if self._first_use is None:
            trace = self._trace()
            assert trace is not None
            self._first_use = first_use_residents(trace)
        return self._first_use


_PREPS: dict[int, TracePrep] = {}


def trace_prep(trace: Trace) -> TracePrep:
    """The trace's TracePrep, built on first use and dropped when the trace is (a trace is
    immutable, so what was derived from it stays true)."""
    key = id(trace)
    prep = _PREPS.get(key)
    if prep is None or prep._trace() is not trace:  # noqa: SLF001
        # The cyclic collector paused, as load_trace does: building millions of records makes
        # it walk the whole heap, the trace's too, again and again (a 1M-op trace: 4 s), and
        # they hold no cycles for it to find.
        enabled = gc.isenabled()
        gc.disable()
        try:
            prep = _PREPS[key] = TracePrep(trace)
        finally:
            if enabled:
                gc.enable()
        weakref.finalize(trace, _PREPS.pop, key, None)
    return prep
