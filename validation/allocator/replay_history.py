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
from collections.abc import Iterator
from typing import Any

from vsim.allocator.caching import CachingAllocator
from vsim.allocator.expandable import ExpandableAllocator
from vsim.allocator.history import lay_out

Table = dict[int, dict[str, int]]


def add(table: Table, it: int, key: str, n: int = 1) -> None:
    row = table.setdefault(it, {})
    row[key] = row.get(key, 0) + n


class Requests:
    """A history's request stream played into an allocator model: the blocks alive at its
    start allocated first, then each logged free given back as it comes, but for the
    completions a release's synchronize logs just before its `release_action` entries
    (segment_free, or segment_unmap with expandable segments), which PyTorch searched its
    pools without: those are held back and given back by the model's own release
    (`before_release`), or after the next request where the model released nothing."""

    def __init__(self, history: dict[str, Any], allocator: Any, release_action: str) -> None:
        self.history, self.a, self.release_action = history, allocator, release_action
        self.blocks: dict[int, object] = {}
        if "segments_at_start" in history:
            # the segments alive when the history began, free parts included: a segment
            # opened before the history and never freed serves requests from those parts
            # (VGG-16(256) recompute at 20 GiB: a 392 MiB request in iteration 0)
            self.blocks = lay_out(allocator, history["segments_at_start"],
                                  history["alive_at_start"])
        else:  # (histories before 2026-11-28: the live blocks alone, each its own segment)
            for addr, size, stream in history["alive_at_start"]:
                self.blocks[addr] = allocator.malloc(size, stream)
        allocator.driver_calls.clear()
        self.held: list[int] = []
        allocator.before_release = self.give_back

    def give_back(self) -> None:
        while self.held:
            block = self.blocks.pop(self.held.pop(), None)
            if block is not None:
                self.a.free(block)

    def __iter__(self) -> Iterator[tuple[int, str, int, int, int]]:
        """(iteration, action, addr, size, stream) of every entry but the frees, which it
        applies; iteration -1 is before the first."""
        starts, entries = self.history["iteration_starts_us"], self.history["entries"]
        it = -1
        for k, (action, addr, size, stream, t) in enumerate(entries):
            while it + 1 < len(starts) and t >= starts[it + 1]:
                it += 1
            if action != "free_completed":
                yield it, action, addr, size, stream
                continue
            j = k
            while j < len(entries) and entries[j][0] == "free_completed":
                j += 1
            if j < len(entries) and entries[j][0] == self.release_action:
                self.held.append(addr)  # the synchronize of the release that follows
                continue
            block = self.blocks.pop(addr, None)
            if block is not None:
                self.a.free(block)

    def request(self, size: int, stream: int) -> Any:
        """The model's answer to a request (None: it failed), the held completions given back
        after it where the model released nothing (they came after it)."""
        block = self.a.malloc(size, stream)
        self.give_back()
        return block


def replay(history: dict[str, Any]) -> tuple[Table, Table]:
    """Per iteration (-1: before the first), PyTorch's (malloc, free) counts and the model's
    (hits, malloc, free, failed)."""
    a = CachingAllocator(history["memory_bytes"])
    stream_of = Requests(history, a, "segment_free")
    real: Table = {}
    model: Table = {}
    for it, action, addr, size, stream in stream_of:
        if action == "alloc":
            hits, segs, calls = a.capacity_hits, a.segment_allocs, len(a.driver_calls)
            block = stream_of.request(size, stream)
            if block is None:
                add(model, it, "failed")
                continue
            stream_of.blocks[addr] = block
            add(model, it, "hits", a.capacity_hits - hits)
            add(model, it, "malloc", a.segment_allocs - segs)
            add(model, it, "free", sum(1 for c in a.driver_calls[calls:] if c[0] == "free"))
        elif action == "oom":  # PyTorch gave up on this request (cuDNN may try another)
            add(real, it, "oom")
            block = stream_of.request(size, stream)
            if block is not None:  # the model would have served it
                add(model, it, "served_oom")
                a.free(block)
        elif action in ("segment_alloc", "segment_free"):
            add(real, it, "malloc" if action == "segment_alloc" else "free")
    return real, model


def replay_expandable(history: dict[str, Any]) -> tuple[Table, Table]:
    """Per iteration (-1: before the first), PyTorch's page maps and unmaps (`map`, `unmap`
    and their bytes, `map_bytes`, `unmap_bytes`) and OOMs, and the model's (`sync`: its
    releases, as PyTorch's retries; `map`, `unmap`, their bytes; `failed`: requests PyTorch
    served and the model could not; `served_oom`), replaying the same requests in order."""
    a = ExpandableAllocator(history["memory_bytes"])
    stream_of = Requests(history, a, "segment_unmap")
    real: Table = {}
    model: Table = {}
    for it, action, addr, size, stream in stream_of:
        if action in ("alloc", "oom"):
            calls = len(a.driver_calls)
            block = stream_of.request(size, stream)
            for what, n in a.driver_calls[calls:]:
                add(model, it, what)
                add(model, it, what + "_bytes", n)
            if action == "oom":  # PyTorch gave up on this request (cuDNN may try another)
                add(real, it, "oom")
                if block is not None:
                    add(model, it, "served_oom")
                    a.free(block)
            elif block is None:
                add(model, it, "failed")
            else:
                stream_of.blocks[addr] = block
        elif action in ("segment_map", "segment_unmap"):
            key = "map" if action == "segment_map" else "unmap"
            add(real, it, key)
            add(real, it, key + "_bytes", size)
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
