"""Replay a real run's allocator history (retry_probe.py's ID.requests.json.gz) through vsim's
caching allocator model, and compare, per iteration, PyTorch's cudaMalloc/cudaFree calls with
the model's, and the model's capacity hits with PyTorch's retries (retry_probe's summary).
A history recorded with expandable segments (its entries map and unmap pages) goes through
the expandable model instead, and the bytes mapped and unmapped per iteration are compared
(`replay_expandable`; h100/expandable/, validation/allocator/README.md).

The history is the program's own request sequence (alloc, free_completed), so the comparison
judges the allocator's rules alone. One ordering detail matters: the blocks whose stream events
a failed request synchronizes (release_cached_blocks) are logged free_completed just before
that request's segment_free burst, i.e. before its alloc entry, although PyTorch searched its
pools without them. They are held back here and given back by the model's own release
(`before_release`), as PyTorch does; replayed in log order instead, the model finds them free
and misses most retries.

    python validation/allocator/replay_history.py DIR/ID.requests.json.gz...
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any

from vsim.allocator.caching import CachingAllocator
from vsim.allocator.expandable import ExpandableAllocator


def replay(history: dict[str, Any]) -> tuple[dict[int, dict[str, int]], dict[int, dict[str, int]]]:
    """Per iteration (-1: before the first), PyTorch's (malloc, free) counts and the model's
    (hits, malloc, free, failed)."""
    a = CachingAllocator(history["memory_bytes"])
    blocks: dict[int, object] = {}
    for addr, size, stream in history["alive_at_start"]:
        blocks[addr] = a.malloc(size, stream)
    starts, entries = history["iteration_starts_us"], history["entries"]
    held: list[int] = []  # completions logged by a release's synchronize, not yet given back

    def give_back() -> None:
        while held:
            block = blocks.pop(held.pop(), None)
            if block is not None:
                a.free(block)

    a.before_release = give_back
    real: dict[int, dict[str, int]] = {}
    model: dict[int, dict[str, int]] = {}
    it = -1

    def add(table: dict[int, dict[str, int]], key: str, n: int = 1) -> None:
        row = table.setdefault(it, {})
        row[key] = row.get(key, 0) + n

    for k, (action, addr, size, stream, t) in enumerate(entries):
        while it + 1 < len(starts) and t >= starts[it + 1]:
            it += 1
        if action == "free_completed":
            j = k
            while j < len(entries) and entries[j][0] == "free_completed":
                j += 1
            if j < len(entries) and entries[j][0] == "segment_free":
                held.append(addr)  # the synchronize of the release that follows
                continue
            block = blocks.pop(addr, None)
            if block is not None:
                a.free(block)
        elif action == "alloc":
            hits, segs, calls = a.capacity_hits, a.segment_allocs, len(a.driver_calls)
            block = a.malloc(size, stream)
            give_back()  # served without a release: those completions came after it
            if block is None:
                add(model, "failed")
                continue
            blocks[addr] = block
            add(model, "hits", a.capacity_hits - hits)
            add(model, "malloc", a.segment_allocs - segs)
            add(model, "free", sum(1 for c in a.driver_calls[calls:] if c[0] == "free"))
        elif action == "oom":  # PyTorch gave up on this request (cuDNN may try another)
            add(real, "oom")
            block = a.malloc(size, stream)
            give_back()
            if block is not None:  # the model would have served it
                add(model, "served_oom")
                a.free(block)
        elif action in ("segment_alloc", "segment_free"):
            add(real, "malloc" if action == "segment_alloc" else "free")
    return real, model


def replay_expandable(history: dict[str, Any]) -> tuple[dict[int, dict[str, int]],
                                                        dict[int, dict[str, int]]]:
    """Per iteration (-1: before the first), PyTorch's page maps and unmaps (`map`, `unmap`
    and their bytes, `map_bytes`, `unmap_bytes`) and OOMs, and the model's (`sync`: its
    releases, as PyTorch's retries; `map`, `unmap`, their bytes; `failed`: requests PyTorch
    served and the model could not; `served_oom`), replaying the same requests in order. The
    completions a release's synchronize logs just before its unmaps are held back and given
    back by the model's own release, as in `replay`."""
    a = ExpandableAllocator(history["memory_bytes"])
    blocks: dict[int, object] = {}
    for addr, size, stream in history["alive_at_start"]:
        blocks[addr] = a.malloc(size, stream)
    a.driver_calls.clear()
    starts, entries = history["iteration_starts_us"], history["entries"]
    held: list[int] = []

    def give_back() -> None:
        while held:
            block = blocks.pop(held.pop(), None)
            if block is not None:
                a.free(block)

    a.before_release = give_back
    real: dict[int, dict[str, int]] = {}
    model: dict[int, dict[str, int]] = {}
    it = -1

    def add(table: dict[int, dict[str, int]], key: str, n: int = 1) -> None:
        row = table.setdefault(it, {})
        row[key] = row.get(key, 0) + n

    for k, (action, addr, size, stream, t) in enumerate(entries):
        while it + 1 < len(starts) and t >= starts[it + 1]:
            it += 1
        if action == "free_completed":
            j = k
            while j < len(entries) and entries[j][0] == "free_completed":
                j += 1
            if j < len(entries) and entries[j][0] == "segment_unmap":
                held.append(addr)  # the synchronize of the release that follows
                continue
            block = blocks.pop(addr, None)
            if block is not None:
                a.free(block)
        elif action in ("alloc", "oom"):
            calls = len(a.driver_calls)
            block = a.malloc(size, stream)
            give_back()  # served without a release: those completions came after it
            for what, n in a.driver_calls[calls:]:
                add(model, what)
                add(model, what + "_bytes", n)
            if action == "oom":  # PyTorch gave up on this request (cuDNN may try another)
                add(real, "oom")
                if block is not None:
                    add(model, "served_oom")
                    a.free(block)
            elif block is None:
                add(model, "failed")
            else:
                blocks[addr] = block
        elif action in ("segment_map", "segment_unmap"):
            key = "map" if action == "segment_map" else "unmap"
            add(real, key)
            add(real, key + "_bytes", size)
    return real, model


def main() -> int:
    for path in sys.argv[1:]:
        with gzip.open(path, "rt") as f:
            history = json.load(f)
        if any(e[0] in ("segment_map", "segment_unmap") for e in history["entries"]):
            real, model = replay_expandable(history)
            print(f"{history['id']}: per iteration, PyTorch's page maps and unmaps (GiB), "
                  "OOMs | the model's releases, maps and unmaps (GiB), requests it failed, "
                  "PyTorch's OOMs it would have served")
            for i in sorted(set(real) | set(model)):
                r, m = real.get(i, {}), model.get(i, {})
                print(f"  {i:3d}  {r.get('map', 0):3d} {r.get('map_bytes', 0) / 2**30:5.1f} / "
                      f"{r.get('unmap', 0):3d} {r.get('unmap_bytes', 0) / 2**30:5.1f}, "
                      f"{r.get('oom', 0):3d}  |  {m.get('sync', 0):3d}, {m.get('map', 0):3d} "
                      f"{m.get('map_bytes', 0) / 2**30:5.1f} / {m.get('unmap', 0):3d} "
                      f"{m.get('unmap_bytes', 0) / 2**30:5.1f}, {m.get('failed', 0)}, "
                      f"{m.get('served_oom', 0)}")
            continue
        real, model = replay(history)
        print(f"{history['id']}: per iteration, PyTorch's cudaMalloc/cudaFree, OOMs | the "
              "model's capacity hits, cudaMalloc/cudaFree, requests it failed, PyTorch's OOMs "
              "it would have served")
        for i in sorted(set(real) | set(model)):
            r, m = real.get(i, {}), model.get(i, {})
            print(f"  {i:3d}  {r.get('malloc', 0):4d} / {r.get('free', 0):4d}, "
                  f"{r.get('oom', 0):2d}  |  {m.get('hits', 0)}, {m.get('malloc', 0):4d} / "
                  f"{m.get('free', 0):4d}, {m.get('failed', 0)}, {m.get('served_oom', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
