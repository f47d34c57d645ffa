"""Where the caching model places each request of a real warm-up, by where new segments lie.

Best fit breaks ties between free blocks of equal size by address, so where the driver puts
each new segment decides which of two equal blocks a request gets. This replays each history
of warmup_probe.py (the whole process up to its case's first capped iteration: the model's
build, the warm-up steps, the reference) through vsim's caching model three ways: the
recorded segment addresses, new segments below the last (the model's rule since 2026-11-28:
the driver hands out addresses top-down), and new segments above the last (the rule before).
A request is misplaced when its block is not at the recorded one's offset in the recorded
one's segment; once one is, later ones may follow it, so the count measures how soon and how
far a rule goes wrong. Writes nothing.

    python validation/allocator/segment_order.py validation/allocator/h200/warmup/*.warmup.json.gz \
        validation/allocator/h100/*.history.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any

from vsim.allocator.caching import CachingAllocator

MIB = 2**20


def warm_up(doc: dict[str, Any]) -> list[list[Any]]:
    """The history up to the case's first iteration (an in-process op map stopped it: the part
    before the map then, which holds the build and the warm-up steps). record_history.py's
    histories (validation/allocator/h100/*.history.json.gz: a model built, then plain steps
    without a cap) whole."""
    if "marks" not in doc:
        return [[e["action"], e["addr"], e["size"], e["stream"], 0] for e in doc["entries"]]
    entries = doc.get("before_map") or doc["entries"]
    start = next((t for label, t in doc["marks"] if label == "case start"), None)
    return [e for e in entries if start is None or e[4] < start]


def misplaced(entries: list[list[Any]], memory: CachingAllocator) -> tuple[int, int, int]:
    """(requests misplaced, requests, the model's reserved bytes at the end)."""
    live: dict[int, Any] = {}
    model_to_real: dict[int, int] = {}
    segments: dict[int, int] = {}
    opened = None
    bad = n = 0
    for i, (action, addr, size, stream, _t) in enumerate(entries):
        if action == "segment_alloc":
            segments[addr], opened = size, addr
        elif action == "segment_free":
            segments.pop(addr, None)
            if entries[i - 1][0] != "segment_free":  # a run of them: one empty_cache
                memory.empty_cache()
        elif action == "alloc":
            block = live[addr] = memory.malloc(size, stream)
            seg = block.segment  # type: ignore[attr-defined]
            if opened is not None:
                model_to_real.setdefault(seg.addr, opened)
            opened = None
            real = next((a for a, s in segments.items() if a <= addr < a + s), None)
            n += 1
            if model_to_real.get(seg.addr) != real or \
                    block.addr - seg.addr != addr - (real or 0):  # type: ignore[attr-defined]
                bad += 1
        elif action == "free_completed" and addr in live:
            memory.free(live.pop(addr))
    return bad, n, memory.reserved_bytes


def main() -> int:
    print(f"{'history':36s} {'rule':10s} {'misplaced':>15s}  reserved (model, real)")
    for path in sys.argv[1:]:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        entries = warm_up(doc)
        real_reserved = 0
        for action, _a, size, _s, _t in entries:
            real_reserved += size if action == "segment_alloc" else \
                -size if action == "segment_free" else 0
        addresses = [a for action, a, *_ in entries if action == "segment_alloc"]
        name = path.rsplit("/", 1)[-1].split(".")[0]
        for rule, memory in (("recorded", CachingAllocator(1 << 50, addresses)),
                             ("top-down", CachingAllocator(1 << 50, top_down=True)),
                             ("bottom-up", CachingAllocator(1 << 50))):
            bad, n, reserved = misplaced(entries, memory)
            print(f"{name:36s} {rule:10s} {bad:6d} of {n:6d}  {reserved / MIB:8.0f} "
                  f"{real_reserved / MIB:8.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
