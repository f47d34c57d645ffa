"""`import_kineto`: a torch.profiler Chrome-trace export as a vsim trace."""

from __future__ import annotations

import bisect
from pathlib import Path

from ...errors import TraceError
from ..schema import Kernel, Trace
from .build import (
    BWD_PREFIX,
    OPTIMIZER_PREFIX,
    AllocDraft,
    AllocTracker,
    OpDraft,
    build_trace,
    op_layer_type,
    stream_map,
)
from .chrome import Annotation, Capture, CpuOp, as_int, containing, load_chrome, parse_chrome

# ---------------------------------------------------------------- Kineto import

def phases_of(ops: list[CpuOp], capture: Capture, backward: list[Annotation]) -> list[str]:
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
        numbers = {as_int(a.name.split("#", 1)[1]): a for a in steps}
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
    phases = phases_of(ops, capture, [])
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
