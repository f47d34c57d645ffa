"""Replay a recorded run's whole caching-allocator history through the allocator model.

A history file (validation/allocator/record_history.py writes them) holds every allocator event
of a PyTorch process from before the model is built through a few training iterations, and the
memory PyTorch reported after each iteration. Replaying all of it, not one steady-state
iteration, checks the caching model on exactly the request stream PyTorch served: reserved
memory is set in the first iteration, whose allocation order differs from the later ones (the
cuBLAS workspace and SGD's momentum buffers are created at first use, in the middle of it).

The replay serves each `alloc` with the model and returns each `free_completed` by address; it
takes no decision from the recorded segments except, optionally, their addresses: best fit
breaks ties between equal free blocks by address, and where cudaMalloc places a segment is the
driver's choice, not the allocator's. The recorded runs never came near their GPU's capacity,
so the model runs without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TraceError
from ..safeload import parse_json
from ..trace.io import read_maybe_gzip
from .caching import CachingAllocator

HISTORY_SUFFIX = ".history.json.gz"
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom"}
TOLERANCE = 0.03  # issue 4's target for the caching model's reserved memory
UNLIMITED = 1 << 50


@dataclass(frozen=True)
class Iteration:
    first_entry: int
    allocated: int
    reserved: int


@dataclass(frozen=True)
class History:
    path: str
    meta: dict[str, Any]
    entries: tuple[tuple[str, int, int, int], ...]  # (action, addr, size, stream)
    iterations: tuple[Iteration, ...]

    @property
    def name(self) -> str:
        return f"{self.meta.get('model', '?')}-b{self.meta.get('batch_size', '?')}"


def lay_out(allocator: Any, segments: list[tuple[int, int, int, str]],
            live: list[tuple[int, int, int]]) -> dict[int, object]:
    """A recorded layout on `allocator`: `segments` (addr, bytes, stream, "large" or "small")
    and the `live` blocks in them (addr, bytes, stream); the live blocks' model blocks, by
    recorded address. Each large segment is opened whole and filled in address order, its
    gaps by fillers held until every segment is laid out (so that best fit has only this
    segment's rest to take from), then freed: its live blocks sit at their offsets and its
    free parts are free. A small segment's blocks are allocated as they come. Laid out without
    the allocator's capacity (a process lays out its segments before it caps itself)."""
    blocks: dict[int, object] = {}
    fillers = []
    cap, allocator.capacity_bytes = allocator.capacity_bytes, UNLIMITED
    for addr, total, stream, kind in sorted(segments):
        inside = sorted((b, size) for b, size, _ in live if addr <= b < addr + total)
        if kind != "large":
            for b, size in inside:
                blocks[b] = allocator.malloc(size, stream)
            continue
        allocator.free(allocator.malloc(total, stream))
        at = addr
        for b, size in inside:
            if b > at:
                fillers.append(allocator.malloc(b - at, stream))
            blocks[b] = allocator.malloc(size, stream)
            at = b + size
        if addr + total > at:
            fillers.append(allocator.malloc(addr + total - at, stream))
    for block in fillers:
        allocator.free(block)
    allocator.capacity_bytes = cap
    return blocks


def history_files(paths: list[str]) -> list[Path]:
    """The allocator histories among `paths` (files, or every *.history.json.gz in folders)."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(path.rglob("*" + HISTORY_SUFFIX)))
        elif path.is_file() and path.name.endswith(HISTORY_SUFFIX):
            files.append(path)
    return files


def load_history(path: str | Path) -> History:
    """Read and check a history file; TraceError naming the file and the place."""
    where = str(path)
    doc = parse_json(read_maybe_gzip(path, "allocator history"), where, TraceError)  # bounded
    if not isinstance(doc, dict):
        raise TraceError("expected an object with meta, entries and iterations", where)
    for key in ("meta", "entries", "iterations"):
        if key not in doc:
            raise TraceError(f"missing key {key!r}", where)
    entries = []
    for i, e in enumerate(doc["entries"]):
        place = f"{where}: entries[{i}]"
        if not isinstance(e, dict) or e.get("action") not in ACTIONS:
            raise TraceError(f"unknown action {e.get('action') if isinstance(e, dict) else e!r}"
                             f" (known: {', '.join(sorted(ACTIONS))})", place)
        size, addr = e.get("size", 0), e.get("addr", 0)
        if not isinstance(size, int) or size < 0 or not isinstance(addr, int):
            raise TraceError("size and addr must be whole numbers, size at least 0", place)
        entries.append((e["action"], addr, size, int(e.get("stream", 0))))
    iterations = []
    for i, it in enumerate(doc["iterations"]):
        place = f"{where}: iterations[{i}]"
        try:
            iterations.append(Iteration(int(it["first_entry"]), int(it["allocated"]),
                                        int(it["reserved"])))
        except (KeyError, TypeError, ValueError):
            raise TraceError("needs first_entry, allocated and reserved as numbers",
                             place) from None
        if not 0 <= iterations[-1].first_entry <= len(entries):
            raise TraceError(f"first_entry {iterations[-1].first_entry} is outside the "
                             f"{len(entries)} entries", place)
    if not iterations:
        raise TraceError("no iterations", where)
    return History(where, dict(doc["meta"]), tuple(entries), tuple(iterations))


@dataclass(frozen=True)
class Replayed:
    """Model and recorded memory after each iteration, and the segments each allocated."""

    reserved: tuple[tuple[int, int], ...]   # (recorded, model) per iteration
    allocated: tuple[tuple[int, int], ...]
    recorded_segments: tuple[int, ...]
    model_segments: tuple[int, ...]

    @property
    def reserved_error(self) -> float:
        recorded, model = self.reserved[-1]
        return model / recorded - 1 if recorded else 0.0

    def first_divergence(self) -> int | None:
        """Index of the first segment whose size differs (None: the same sequence)."""
        for k, (a, b) in enumerate(zip(self.recorded_segments, self.model_segments,
                                       strict=False)):
            if a != b:
                return k
        if len(self.recorded_segments) != len(self.model_segments):
            return min(len(self.recorded_segments), len(self.model_segments))
        return None


def replay_history(history: History, recorded_addresses: bool = True,
                   top_down: bool = False) -> Replayed:
    """Serve the history's requests with the caching model (see the module docstring);
    `top_down`: without the recorded addresses, new segments where the driver puts them
    (CachingAllocator's `top_down`: top-down 32 MiB ranges)."""
    segments = [(addr, size) for action, addr, size, _ in history.entries
                if action == "segment_alloc"]
    model = CachingAllocator(UNLIMITED, [a for a, _ in segments] if recorded_addresses else (),
                             top_down=top_down)
    ends = [it.first_entry for it in history.iterations[1:]] + [len(history.entries)]
    live: dict[int, object] = {}
    model_segments: list[int] = []
    reserved, allocated = [], []
    start = 0  # the model's build before the first iteration is replayed with it
    for it, end in zip(history.iterations, ends, strict=True):
        for action, addr, size, stream in history.entries[start:end]:
            if action == "alloc":
                before = model.reserved_bytes
                block = model.malloc(size, stream)
                if block is None:  # cannot happen without a capacity; kept explicit
                    raise TraceError(f"the model could not serve {size} B", history.path)
                if model.reserved_bytes > before:
                    model_segments.append(model.reserved_bytes - before)
                live[addr] = block
            elif action == "free_completed" and addr in live:
                model.free(live.pop(addr))
        start = end
        reserved.append((it.reserved, model.reserved_bytes))
        allocated.append((it.allocated, model.allocated_bytes))
    return Replayed(tuple(reserved), tuple(allocated), tuple(size for _, size in segments),
                    tuple(model_segments))
