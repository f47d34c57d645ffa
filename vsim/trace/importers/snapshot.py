"""`import_torch_snapshot`: a torch.cuda.memory._dump_snapshot pickle as a vsim trace (allocator
events only), read with an unpickler that refuses every class outside a few builtins."""

from __future__ import annotations

import importlib
import io
import math
import pickle
from pathlib import Path
from typing import Any

from ...errors import TraceError
from ..schema import MEM_ACTIONS, MemEvent, Trace
from .build import AllocTracker, OpDraft, build_trace, stream_map

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
