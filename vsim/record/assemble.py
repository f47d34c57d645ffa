"""Join the recorder's passes into one trace (pure Python: no torch here, so it is testable alone).

The recorder runs the same training step several times (eager mode issues the same sequence of
top-level aten ops each iteration):
- the STRUCTURE pass, under the profiler (CPU activity, profile_memory) with saved-tensor hooks,
  a dispatch mode and module hooks that leave markers in the capture: which tensors each op reads,
  which forward op saved which activation and which backward op unpacked it, module names, grads;
- the TIMING pass, under the profiler alone (CPU and CUDA activity), a few iterations of which the
  median one is kept: kernels with their GPU start and duration;
- the MEASUREMENT, without profiler or hooks: median iteration time and peak memory.
The two captures are joined by aligning their sequences of top-level op names.

Hooks and the profiler slow the CPU side, which shows up only as GPU idle time between kernels.
`fit_idle` reconciles the timing pass with the measured iteration time by shrinking (or growing)
those idle gaps, never kernel durations; the trace's meta.timing records how much.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from ..errors import TraceError
from ..trace.importers import (
    BWD_PREFIX,
    AllocDraft,
    AllocTracker,
    Annotation,
    Capture,
    CpuOp,
    MemRec,
    OpDraft,
    backward_layers,
    build_trace,
    clip_overlaps,
    innermost,
    op_layer_type,
    phases_of,
    short_op_name,
    stream_map,
)
from ..trace.schema import Kernel, Measured, MemEvent, Trace
from .markers import BACKWARD, DISPATCH, GRAD, ITERATION, MODULE, SAVE, UNPACK  # noqa: F401 - re-exported for the recorder, synth and opmap
from .timing import fit_idle, timing_kernels, timing_ops


@dataclass
class Storage:
    """A tensor storage the recorder knows by name: its address, bytes and kind."""

    addr: int
    size: int
    kind: str
    name: str


@dataclass
class StructureLog:
    """What the hooks of the structure pass saw, indexed by the number in each marker."""

    device_type: int                      # profiler code: 0 CPU, 1 CUDA
    # per aten call: storages read, flops, bytes of tensor arguments and results
    dispatch: list[tuple[list[int], float, float]] = field(default_factory=list)
    mutated: dict[int, list[int]] = field(default_factory=dict)  # call -> storages it updates
    saved: list[int] = field(default_factory=list)          # storage address saved for backward
    grads: list[tuple[str, str, int]] = field(default_factory=list)  # param, module, grad address
    modules: dict[str, tuple[str, bool]] = field(default_factory=dict)  # qualname -> (type, leaf)
    known_start: list[Storage] = field(default_factory=list)   # weights, inputs, state, grads
    known_end: list[Storage] = field(default_factory=list)     # optimizer state after the step
    resident_blocks: list[tuple[int, int]] | None = None    # CUDA: (addr, size) live at start
    allocated_at_start: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # CUDA allocator trace entries


# ---------------------------------------------------------------- idle-gap fitting

def join_kernels(sops: list[_StructOp], kernels: list[Kernel]) -> tuple[list[int], dict[str, int]]:
    """For each timing kernel, the index in `sops` of the op that launched it: the kernel
    sequences of the two passes aligned by name; a kernel the structure pass did not see goes
    to the op of the kernel before it."""
    seq = sorted((k.start_ns, k.name, i) for i, s in enumerate(sops) for k in s.op.kernels)
    names = [x[1] for x in seq]
    owners_s = [x[2] for x in seq]
    tnames = [k.name for k in kernels]
    owner: list[int | None] = [None] * len(kernels)
    if names == tnames:
        owner = list(owners_s)
    else:
        matcher = difflib.SequenceMatcher(None, names, tnames, autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            for k in range(size):
                owner[b + k] = owners_s[a + k]
    matched = sum(o is not None for o in owner)
    first = next((o for o in owner if o is not None), 0)
    out = []
    prev = first
    for o in owner:
        prev = o if o is not None else prev
        out.append(prev)
    return out, {"kernels_structure": len(names), "kernels_timing": len(kernels),
                 "kernels_matched": matched}


# ---------------------------------------------------------------- structure pass

@dataclass
class _StructOp:
    op: CpuOp
    draft: OpDraft
    mem: list[tuple[MemRec, int]]   # (record, alloc id) for allocator-event joining


def _storage_index(storages: list[Storage]) -> dict[int, Storage]:
    index: dict[int, Storage] = {}
    for s in storages:
        index.setdefault(s.addr, s)
    return index


def structure_ops(capture: Capture, log: StructureLog,
                  optimizer_layer: str = "optimizer") -> tuple[list[_StructOp],
                                                               dict[int, AllocDraft],
                                                               dict[str, Any]]:
    """Ops of the structure pass with their allocation events, reads, layers and phases."""
    iterations = capture.annotations_named(ITERATION)
    if len(iterations) != 1:
        raise TraceError(f"the structure pass should hold one iteration, it holds "
                         f"{len(iterations)}")
    window = iterations[0]
    ops = capture.ops_between(window.start_ns, window.end_ns)
    if not ops:
        raise TraceError("the structure pass recorded no ops: did the step run between "
                         "Recorder.step() calls?")
    backward = capture.annotations_named(BACKWARD)
    phases = phases_of(ops, capture, backward)

    # layers: innermost module range on the op's thread (forward), autograd sequence (backward)
    layers = [""] * len(ops)
    types = [op_layer_type(op.name) for op in ops]
    by_tid: dict[int, list[Annotation]] = {}
    for a in capture.annotations:
        if a.name.startswith(MODULE):
            by_tid.setdefault(a.tid, []).append(a)
    for tid, anns in by_tid.items():
        idx = [i for i, op in enumerate(ops) if op.tid == tid]
        found = innermost(anns, [ops[i].start_ns for i in idx])
        for i, ann in zip(idx, found, strict=False):
            if ann is None or phases[i] != "fwd":
                continue
            qual = ann.name[len(MODULE):]
            layers[i] = qual
            mtype, leaf = log.modules.get(qual, ("other", False))
            if leaf and mtype != "other":
                types[i] = mtype
            elif types[i] == "other":
                types[i] = mtype if leaf else "other"
    for i in range(len(ops)):
        if phases[i] == "opt":
            layers[i], types[i] = optimizer_layer, "optimizer"
    backward_layers(ops, phases, layers, types)

    # memory and markers, in time order
    known = _storage_index(log.known_start)
    tracker = AllocTracker()
    if log.resident_blocks is not None:
        for addr, size in log.resident_blocks:
            s = known.get(addr)
            tracker.add_resident(addr, size, s.kind if s else "temporary",
                                 s.name if s else "resident (unidentified)")
    else:
        for s in known.values():
            tracker.add_resident(s.addr, s.size, s.kind, s.name)
    allocs = tracker.allocs
    saved_alloc: dict[int, int] = {}
    result: list[_StructOp] = []
    diag: dict[str, Any] = {"unknown_frees": 0, "unresolved_reads": 0,
                            "total_allocated_mismatch": 0}
    live_bytes = sum(a.size for a in allocs.values())
    if log.allocated_at_start is not None:
        diag["resident_bytes"] = live_bytes
        diag["allocated_at_start"] = log.allocated_at_start
    for i, op in enumerate(ops):
        d = OpDraft(name=op.name, phase=phases[i], layer=layers[i], layer_type=types[i])
        mem_pairs: list[tuple[MemRec, int]] = []
        items: list[tuple[int, int, Any]] = []
        for m in op.mem:
            if m.device_type == log.device_type:
                items.append((m.ts_ns, 0 if m.delta > 0 else 2, m))
        for ts, name in op.markers:
            items.append((ts, 1, name))
        items.sort(key=lambda x: (x[0], x[1]))
        for _, rank, item in items:
            if rank != 1:
                m = item
                if m.delta > 0:
                    aid = tracker.alloc(m.addr, m.delta)
                    d.events.append((aid, +1))
                    mem_pairs.append((m, aid))
                    live_bytes += m.delta
                elif m.delta < 0:
                    # CPU: a free of an unknown block was allocated before the iteration
                    got = tracker.free(m.addr, -m.delta,
                                       resident_if_unknown=log.resident_blocks is None)
                    if got is None:
                        diag["unknown_frees"] += 1
                        continue
                    d.events.append((got, -1))
                    mem_pairs.append((m, got))
                    live_bytes -= allocs[got].size
                if m.total_allocated is not None and log.resident_blocks is not None \
                        and m.total_allocated != live_bytes:
                    diag["total_allocated_mismatch"] += 1
                continue
            name = item
            num = name.rpartition("#")[2]
            try:
                k = int(num)
            except ValueError:
                continue
            if name.startswith(DISPATCH) and k < len(log.dispatch):
                reads, flops, nbytes = log.dispatch[k]
                d.flops += flops
                d.dram_bytes += nbytes
                for addr in reads:
                    hit = tracker.lookup(addr)
                    if hit is None:
                        diag["unresolved_reads"] += 1
                    else:
                        d.reads.add(hit)
                for addr in log.mutated.get(k, ()):
                    hit = tracker.lookup(addr)
                    if hit is not None:
                        d.mutates.add(hit)
            elif name.startswith(SAVE) and k < len(log.saved):
                hit = tracker.lookup(log.saved[k])
                if hit is not None:
                    allocs[hit].saved = True
                    saved_alloc[k] = hit
            elif name.startswith(UNPACK):
                hit = saved_alloc.get(k)
                if hit is not None:
                    d.reads.add(hit)
            elif name.startswith(GRAD) and k < len(log.grads):
                param, module, addr = log.grads[k]
                hit = tracker.lookup(addr)
                if hit is not None and not allocs[hit].resident:
                    allocs[hit].kind = "gradient"
                    allocs[hit].name = f"grad {param}"
                if short_op_name(op.name).endswith("AccumulateGrad"):
                    d.layer = module
                    mtype, _ = log.modules.get(module, ("other", False))
                    d.layer_type = mtype
                    d.attrs["param"] = param
        result.append(_StructOp(op, d, mem_pairs))
    for s in log.known_end:
        end_hit = tracker.live.get(s.addr)
        if end_hit is not None and not allocs[end_hit].resident:
            allocs[end_hit].kind = s.kind
            allocs[end_hit].name = s.name
    # peak of the events with every resident block (also those found by their free) from the start
    running = sum(a.size for a in allocs.values() if a.resident)
    peak = running
    for r in result:
        for aid, sign in r.draft.events:
            running += sign * allocs[aid].size
            peak = max(peak, running)
    diag["peak_from_events"] = peak
    return result, allocs, diag


# ---------------------------------------------------------------- joining

def align(a: list[str], b: list[str]) -> list[tuple[int | None, int | None]]:
    """Pairs (index in a, index in b) in order: matched names, then the unmatched of each."""
    pairs: list[tuple[int | None, int | None]] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(range(i1, i2), range(j1, j2), strict=False))
        else:
            pairs.extend((i, None) for i in range(i1, i2))
            pairs.extend((None, j) for j in range(j1, j2))
    return pairs


def assemble(structure: Capture, log: StructureLog, timing: Capture, *, gpu: bool,
             measured: Measured | None, meta: dict[str, Any],
             fit_gaps: bool = True) -> Trace:
    """The trace of one iteration: structure-pass ops with the timing pass's kernels (GPU:
    kernel sequences aligned by name) or CPU spans (CPU: op sequences aligned by name)."""
    sops, allocs, sdiag = structure_ops(structure, log)
    target = measured.iteration_time_us if (measured is not None and fit_gaps) else None
    if gpu:
        return _assemble_gpu(sops, allocs, sdiag, log, timing, measured, meta, target)
    tops, tinfo = timing_ops(timing, gpu, target)
    pairs = align([short_op_name(s.op.name) for s in sops], [short_op_name(t.name) for t in tops])
    drafts: list[OpDraft] = []
    mem_of_draft: list[list[tuple[MemRec, int]]] = []
    join = {"matched": 0, "structure_only": 0, "timing_only": 0,
            "timing_only_with_kernels": 0}
    for si, ti in pairs:
        if si is not None:
            d = sops[si].draft
            mem_of_draft.append(sops[si].mem)
        else:
            t = tops[ti]  # type: ignore[index]
            d = OpDraft(name=t.name, phase=t.phase, layer_type=op_layer_type(t.name)
                        if t.phase != "opt" else "optimizer",
                        layer="optimizer" if t.phase == "opt" else "")
            mem_of_draft.append([])
        if ti is not None:
            t = tops[ti]
            if t.timed:
                d.start_us, d.dur_us, d.stream, d.kernels = t.start_us, t.dur_us, t.stream, \
                    t.kernels
                d.keep = not gpu  # CPU: every op is CPU work
        if si is not None and ti is not None:
            join["matched"] += 1
        elif si is not None:
            join["structure_only"] += 1
        else:
            join["timing_only"] += 1
            join["timing_only_with_kernels"] += bool(tops[ti].kernels)  # type: ignore[index]
        drafts.append(d)
    clip_overlaps(drafts)
    built = build_trace(drafts, allocs)
    mem_events = _mem_events(log, drafts, mem_of_draft, built) if log.history else ()
    meta = dict(meta)
    meta["timing"] = tinfo
    meta["join"] = join
    meta["structure_check"] = {k: v for k, v in {**sdiag, **built.diagnostics}.items()}
    return built.trace(meta, measured, mem_events)


def _assemble_gpu(sops: list[_StructOp], allocs: dict[int, AllocDraft], sdiag: dict[str, Any],
                  log: StructureLog, timing: Capture, measured: Measured | None,
                  meta: dict[str, Any], target: float | None) -> Trace:
    kernels, tinfo = timing_kernels(timing, target)
    owners, join = join_kernels(sops, kernels)
    smap = stream_map(k.stream for k in kernels)
    per_op: dict[int, list[Kernel]] = {}
    for k, o in zip(kernels, owners, strict=True):
        per_op.setdefault(o, []).append(k)
    drafts = []
    for i, s in enumerate(sops):
        d = s.draft
        ks = per_op.get(i, [])
        if ks:
            d.kernels = ks
            d.start_us = ks[0].start_us
            d.dur_us = max(k.start_us + k.dur_us for k in ks) - ks[0].start_us
            d.stream = smap[ks[0].stream]
        drafts.append(d)
    clip_overlaps(drafts)
    built = build_trace(drafts, allocs)
    mem_events = _mem_events(log, drafts, [s.mem for s in sops], built) if log.history else ()
    meta = dict(meta)
    meta["timing"] = {**tinfo, "stream_map": {str(k): v for k, v in smap.items()}}
    meta["join"] = {**join, "ops_structure": len(sops),
                    "ops_with_kernels": sum(1 for d in drafts if d.kernels)}
    meta["structure_check"] = {**sdiag, **built.diagnostics}
    meta["stream_names"] = {str(v): ("compute" if v == 0 else f"stream {raw}")
                            for raw, v in smap.items()}
    return built.trace(meta, measured, mem_events)


def _mem_events(log: StructureLog, drafts: list[OpDraft],
                mem_of_draft: list[list[tuple[MemRec, int]]], built: Any) -> tuple[MemEvent, ...]:
    """Allocator history entries joined, in order, to the profiler's allocator events of the
    structure pass (same allocations, same order): each gets the op and tensor of its match.
    Times are the op's: start for allocations, end for frees (the history's clock is the CPU's)."""
    ops_by_id = {op.id: op for op in built.ops}
    records: list[tuple[int, int, int, int, int]] = []  # sign, addr, size, draft, alloc
    for di, pairs in enumerate(mem_of_draft):
        for m, aid in pairs:
            records.append((1 if m.delta > 0 else -1, m.addr, abs(m.delta), di, aid))
    smap = stream_map(int(e.get("stream", 0) or 0) for e in log.history)
    events: list[MemEvent] = []
    j = 0
    last_op: int | None = None
    freed_at: dict[int, tuple[int | None, int | None]] = {}
    pending_segments: list[dict[str, Any]] = []

    def when(op_id: int | None, at_end: bool) -> float:
        if op_id is None or op_id not in ops_by_id:
            return 0.0
        op = ops_by_id[op_id]
        return op.start_us + (op.dur_us if at_end else 0.0)

    def emit(e: dict[str, Any], op_id: int | None, tensor: int | None, at_end: bool) -> None:
        events.append(MemEvent(action=e["action"], time_us=round(when(op_id, at_end), 3),
                               addr=int(e.get("addr", 0) or 0), size_bytes=int(e.get("size", 0)),
                               stream=smap.get(int(e.get("stream", 0) or 0), 0), tensor=tensor,
                               op=op_id))

    for e in log.history:
        action = e.get("action")
        if action in ("alloc", "free_requested"):
            sign = 1 if action == "alloc" else -1
            match = None
            for k in range(j, min(j + 16, len(records))):
                r = records[k]
                # by address: the history records requested sizes, the profiler block sizes
                if r[0] == sign and r[1] == e.get("addr"):
                    match = k
                    break
            op_id = tensor = None
            if match is not None:
                _, _, _, di, aid = records[match]
                j = match + 1
                op_id = built.op_id.get(di)
                tensor = built.tensor_of_alloc.get(aid)
            if action == "alloc":
                for seg in pending_segments:
                    emit(seg, op_id, None, False)
                pending_segments = []
                emit(e, op_id, tensor, False)
            else:
                freed_at[int(e.get("addr", 0) or 0)] = (op_id, tensor)
                emit(e, op_id, tensor, True)
            last_op = op_id if op_id is not None else last_op
        elif action == "free_completed":
            op_id, tensor = freed_at.pop(int(e.get("addr", 0) or 0), (last_op, None))
            emit(e, op_id, tensor, True)
        elif action == "segment_alloc":
            pending_segments.append(e)
        elif action in ("segment_free", "oom"):
            emit(e, last_op, None, True)
    for seg in pending_segments:
        emit(seg, last_op, None, True)
    return tuple(events)


__all__ = ["Storage", "StructureLog", "align", "assemble", "fit_idle", "structure_ops",
           "timing_ops", "BWD_PREFIX"]
