"""A case predicted from the allocator layout its real run started from, against the engine's
own warm start: whether the warm start's layout is what a miss comes from.

`vsim validate` starts a caching-allocator case warm (vsim/engine/warm.py: the recorder's plain
step replayed, the cache emptied). A run's allocator history (validation/allocator/
retry_probe.py, with `segments_at_start` since 2026-11-28) holds the real layout when the
capped iterations began: the segments the session's warm-up left and the blocks alive in them.
This lays that layout out (each large segment whole, its live blocks at their offsets), gives
each resident tensor of the trace the real block of its size, and predicts the case from it
as `vsim validate` does. Prints both predictions and the measured time. Writes nothing.

    python tools/warm_from_history.py CASE.yaml HISTORY.requests.json.gz

VGG-16(256) recompute at 20 GiB (validation/allocator/README.md): 276.2 ms from the engine's
warm start, 347.9 ms from the real layout (conv 0.7's backward falls back, as it did), 325.4
measured; peak reserved 19.93 and 17.24 GiB, 17.25 measured.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from typing import Any

import vsim.engine as engine
from vsim.allocator.caching import MIN_BLOCK, CachingAllocator
from vsim.allocator.history import lay_out
from vsim.engine.warm import ROOM
from vsim.validate import case_inputs, load_cases, simulate_case

MIB = 2**20


def layout_at_start(history: dict[str, Any]) -> tuple[list[tuple[int, int, int, str]],
                                                     list[tuple[int, int, int]]]:
    """(segments as (addr, bytes, stream, kind), live blocks as (addr, bytes, stream)) when the
    history's first iteration began: the segments it recorded at its start, changed by its
    entries until then (vsim.allocator.history.lay_out's arguments)."""
    segments = {addr: (size, stream, kind)
                for addr, size, stream, kind in history["segments_at_start"]}
    live = {addr: (size, stream) for addr, size, stream in history["alive_at_start"]}
    first = history["iteration_starts_us"][0]
    for action, addr, size, stream, t in history["entries"]:
        if t >= first:
            break
        if action == "segment_alloc":
            segments[addr] = (size, stream, "large" if size > 2 * MIB else "small")
        elif action == "segment_free":
            segments.pop(addr, None)
        elif action == "alloc":
            live[addr] = (size, stream)
        elif action == "free_completed":
            live.pop(addr, None)
    return ([(a, size, stream, kind) for a, (size, stream, kind) in segments.items()],
            [(a, size, stream) for a, (size, stream) in live.items()])


def real_warm_layout(history: dict[str, Any]) -> Any:
    """A stand-in for vsim.engine.warm_layout that lays out the history's starting layout."""
    segments, live = layout_at_start(history)
    said: list[bool] = []

    def warm_layout(trace: Any, _hw: Any, _spec: Any, capacity_bytes: int,
                    _transients: Any) -> tuple[CachingAllocator, dict[int, object]]:
        memory = CachingAllocator(ROOM)
        blocks = lay_out(memory, segments, live).values()
        by_size: dict[int, list[Any]] = defaultdict(list)
        for block in blocks:
            by_size[block.size].append(block)  # type: ignore[attr-defined]
        resident: dict[int, object] = {}
        unmatched = 0
        for t in trace.tensors:
            if t.producer is None:
                size = max(MIN_BLOCK, -(-t.size_bytes // MIN_BLOCK) * MIN_BLOCK)
                if by_size[size]:
                    resident[t.id] = by_size[size].pop()
                else:
                    unmatched += 1
                    resident[t.id] = memory.malloc(t.size_bytes)
        if not said:  # (once: every timing draw lays it out again)
            said.append(True)
            print(f"real layout: {memory.reserved_bytes / MIB:.0f} MiB reserved, {unmatched} "
                  "resident tensor(s) without a block of their size", file=sys.stderr)
        new, copied = memory.copy(capacity_bytes)
        return new, {t: copied[id(b)] for t, b in resident.items()}

    return warm_layout


def main() -> int:
    case_path, history_path = sys.argv[1:3]
    case = load_cases([case_path])[0]
    with gzip.open(history_path, "rt") as f:
        history = json.load(f)
    trace, hw, measured = case_inputs(case)
    rows = [("engine's warm start", simulate_case(case, trace, hw, measured).report)]
    own = engine.warm_layout
    engine.warm_layout = real_warm_layout(history)  # type: ignore[assignment]
    try:
        rows.append(("the run's own layout", simulate_case(case, trace, hw, measured).report))
    finally:
        engine.warm_layout = own
    for label, r in rows:
        print(f"{label:22s} {r['timed_iteration_time_us'] / 1e3:9.2f} ms, peak reserved "
              f"{r['peak_reserved_bytes'] / 2**30:.2f} GiB, fits {r['fits']}")
    print(f"{'measured':22s} {measured['iteration_time_us'] / 1e3:9.2f} ms, peak reserved "
          f"{measured['peak_reserved_bytes'] / 2**30:.2f} GiB, fits {measured['fits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
