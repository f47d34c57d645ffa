"""`expandable`: PyTorch's caching allocator with expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; c10/cuda/CUDACachingAllocator.cpp,
ExpandableSegment).

Modelled rules:
- sizes round up to multiples of 512 B; requests of at most 1 MiB come from the small pool,
  larger ones from the large pool, per stream, as with the plain caching allocator;
- each pool of each stream is one segment of virtual addresses, backed by physical pages of
  2 MiB (small pool) or 20 MiB (large pool) mapped as blocks need them. Blocks are split and
  merged as in the caching allocator (best fit; a split when at least 512 B, large pool above
  1 MiB, would remain), so fragmentation is in addresses: a request no free block holds takes
  the segment's end, whose pages must be mapped;
- a freed block keeps its pages mapped (cached); when the pages a request needs would pass the
  capacity, every page lying wholly inside a free block of any pool is unmapped first
  (release_cached_blocks: a device-wide synchronize, then the unmaps), and the request fails
  when its pages still do not fit.

The driver calls (page maps and unmaps, the synchronize) are what expandable segments cost the
host: measured per MiB on the H100 (validation/churn/README.md; hardware/host/NAME.yaml's
`allocator.expandable_map` and `expandable_unmap`) and charged by the engine. Before this model,
`exact` stood in for expandable segments and charged none of them: the vgg16(256) 12 GiB cases
measured with expandable segments were predicted 16-31% too fast (validation/README.md).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import cast

from ..spec import choice
from .base import Allocator, AllocatorSpec, register_allocator
from .blocks import Block, BlockPool
from .caching import MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, round_size, segment_size

LARGE_PAGE = 20 << 20  # kLargeBuffer: the large pool's segment maps pages of this size
SMALL_PAGE = SMALL_BUFFER
SPAN = 1 << 40  # a segment's virtual addresses (more than any capacity)


class _Segment:
    """One pool's expandable segment: its blocks (one BlockPool over `SPAN` addresses, whose
    last free block is the unused end) and its mapped pages (sorted page numbers)."""

    __slots__ = ("blocks", "mapped", "page", "split_from")

    def __init__(self, base: int, small: bool, stream: int) -> None:
        self.page = SMALL_PAGE if small else LARGE_PAGE
        self.split_from = MIN_BLOCK if small else SMALL_SIZE + 1
        self.blocks = BlockPool()
        self.blocks.add_segment(base, SPAN, "small" if small else "large", stream)
        self.mapped: list[int] = []

    def unmapped_pages(self, block: Block) -> list[int]:
        first, last = block.addr // self.page, (block.addr + block.size - 1) // self.page
        mapped = self.mapped
        i = bisect.bisect_left(mapped, first)
        have = set(mapped[i:bisect.bisect_right(mapped, last, i)])
        return [p for p in range(first, last + 1) if p not in have]

    def unmapped_count(self, addr: int, size: int) -> int:
        """How many pages of the `size` bytes at `addr` are unmapped (without listing them: the
        segment's unused end spans its whole address range)."""
        first, last = addr // self.page, (addr + size - 1) // self.page
        mapped = self.mapped
        i = bisect.bisect_left(mapped, first)
        return last - first + 1 - (bisect.bisect_right(mapped, last, i) - i)

    def has_unmapped(self, block: Block) -> bool:
        """Whether a page of `block` is unmapped."""
        return self.unmapped_count(block.addr, block.size) > 0

    def map(self, pages: list[int]) -> None:
        for p in pages:
            bisect.insort(self.mapped, p)

    def mapped_runs(self, block: Block) -> list[tuple[int, int]]:
        """The (start, end) address runs of free `block` whose pages are all mapped: PyTorch's
        mapped free blocks (a free block and an unmapped one never merge there)."""
        page, mapped = self.page, self.mapped
        first, last = block.addr // page, (block.addr + block.size - 1) // page
        i = bisect.bisect_left(mapped, first)
        j = bisect.bisect_right(mapped, last, i)
        if j - i == last - first + 1:  # wholly mapped (most free blocks)
            return [(block.addr, block.addr + block.size)]
        runs: list[tuple[int, int]] = []
        k = i
        while k < j:
            # the run from k: the last m with mapped[m] - m == mapped[k] - k (that difference
            # never decreases along a sorted list of distinct pages), by bisection
            run_first, lo, hi = mapped[k], k, j - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if mapped[mid] - mid == run_first - k:
                    lo = mid
                else:
                    hi = mid - 1
            runs.append((max(block.addr, run_first * page),
                         min(block.addr + block.size, (mapped[lo] + 1) * page)))
            k = lo + 1
        return runs

    def mapped_fit(self, size: int) -> tuple[Block, int, int] | None:
        """get_free_block: the smallest mapped free run of at least `size` bytes (lowest
        address on ties), as (its free block, its start, its size); None when none fits."""
        best: tuple[int, int, Block] | None = None
        for block in self.blocks.free.blocks.values():
            if block.size < size:
                continue
            for start, end in self.mapped_runs(block):
                if end - start >= size and (best is None or (end - start, start) <
                                            (best[0], best[1])):
                    best = (end - start, start, block)
        return None if best is None else (best[2], best[1], best[0])

    def first_hole(self, size: int) -> Block:
        """try_allocate_expandable_block: the lowest-addressed free block with an unmapped
        page and room for `size` bytes (PyTorch walks its unmapped blocks by address, each
        with the free mapped block before it and the free ones after). The segment's unused
        end is one."""
        block: Block | None = self.blocks.segments[0].head
        while block is not None:
            if block.free and block.size >= size and self.has_unmapped(block):
                return block
            block = block.next
        raise AssertionError("an expandable segment's unused end holds any request")

    def unmap_free(self) -> int:
        """Unmaps the pages lying wholly inside free blocks; returns how many."""
        page, mapped = self.page, self.mapped
        keep: list[int] = []
        gone = 0
        block: Block | None = self.blocks.segments[0].head
        i = 0
        while block is not None and i < len(mapped):
            if block.free:
                lo = -(-block.addr // page)
                hi = (block.addr + block.size) // page  # pages [lo, hi) lie inside
                j = bisect.bisect_left(mapped, lo, i)
                keep += mapped[i:j]
                k = bisect.bisect_left(mapped, hi, j)
                gone += k - j
                i = k
            block = block.next
        keep += mapped[i:]
        self.mapped = keep
        return gone


class ExpandableAllocator(Allocator):
    retries_after_pending_frees = True
    capacity_only_at_limit = True
    block_fields = True

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.segments: dict[tuple[bool, int], _Segment] = {}

    def _segment(self, size: int, stream: int) -> _Segment:
        small = size <= SMALL_SIZE
        seg = self.segments.get((small, stream))
        if seg is None:
            seg = self.segments[(small, stream)] = _Segment(len(self.segments) * SPAN, small,
                                                            stream)
        return seg

    def _over_cap(self, size: int) -> bool:
        """alloc_block's check: the mapped memory and the request's whole allocation size
        (segment_size) past the capacity (PyTorch's total_allocated_memory + alloc_size >
        allowed_memory_maximum), however much of it a free mapped neighbour would give."""
        return self.reserved_bytes + segment_size(size) > self.capacity_bytes

    @staticmethod
    def _hole(seg: _Segment, size: int) -> tuple[Block, int, int]:
        """try_allocate_expandable_block's choice for the request: the hole, the bytes its block
        takes (a rest too small to split taken too) and the bytes it would map."""
        hole = seg.first_hole(size)
        take = size if hole.size - size >= seg.split_from else hole.size
        return hole, take, seg.unmapped_count(hole.addr, take) * seg.page

    def _maps_past_cap(self, maps: int) -> bool:
        """map_block's check: mapping `maps` bytes takes the mapped memory past the capacity.
        More than the allocation size where the block straddles a page boundary (an 18 MiB
        block over two 20 MiB pages); PyTorch never maps past its cap."""
        return self.reserved_bytes + maps > self.capacity_bytes

    def would_hit(self, size_bytes: int, stream: int = 0) -> bool:
        """Whether `malloc` would find no mapped free block and no room under the capacity
        for the request's allocation size: PyTorch's allocator would then synchronize the
        device and unmap its free pages (release_cached_blocks) before it maps again."""
        size = round_size(size_bytes)
        seg = self._segment(size, stream)
        return seg.mapped_fit(size) is None and (
            self._over_cap(size) or self._maps_past_cap(self._hole(seg, size)[2]))

    def malloc(self, size_bytes: int, stream: int = 0, searched: bool = False,
               unless_hit: bool = False) -> object | None:
        """`searched` and `unless_hit` as CachingAllocator.malloc's: the retry after a
        device-wide synchronize maps (alloc_block) without searching the free blocks again;
        where `would_hit`, None with nothing changed."""
        size = round_size(size_bytes)
        seg = self._segment(size, stream)
        found = None if searched else seg.mapped_fit(size)  # get_free_block: no map call
        if found is None and unless_hit and (
                self._over_cap(size) or self._maps_past_cap(self._hole(seg, size)[2])):
            return None
        if found is not None:
            # a run whose rest would be too small to split is taken whole, as PyTorch
            # takes its block (should_split)
            block_, start, run = found
            block = seg.blocks.take_at(block_, start,
                                       size if run - size >= seg.split_from else run)
            self.allocated_bytes += block.size
            return block
        # alloc_block over the cap: release (release_cached_blocks), then alloc_block again
        for retry in (False, True):
            hole, take, maps = self._hole(seg, size)
            if not self._over_cap(size) and not self._maps_past_cap(maps):
                break
            if retry:
                return None
            self.capacity_hits += 1
            # the synchronize gives back the blocks whose stream events had not been seen
            if self.before_release is not None:
                self.before_release()
            self.driver_calls.append(("sync", 0))
            for other in self.segments.values():
                gone = other.unmap_free() * other.page
                if gone:
                    self.driver_calls.append(("unmap", gone))
                    self.reserved_bytes -= gone
        block = seg.blocks.take_at(hole, hole.addr, take)
        pages = seg.unmapped_pages(block)
        if pages:
            seg.map(pages)
            self.driver_calls.append(("map", len(pages) * seg.page))
            self.segment_allocs += 1
            self.reserved_bytes += len(pages) * seg.page
        self.allocated_bytes += block.size
        return block

    def free(self, block: object) -> None:
        b = cast(Block, block)
        self.allocated_bytes -= b.size
        owner = b.segment.owner
        assert owner is not None
        owner.give_back(b)

    def block_size(self, block: object) -> int:
        return cast(Block, block).size

    def block_addr(self, block: object) -> int:
        return cast(Block, block).addr

    def largest_free_bytes(self) -> int:
        # what a request could map after unmapping every free page (fragmentation in addresses
        # costs no physical memory)
        return max(0, self.capacity_bytes - self.allocated_bytes) // MIN_BLOCK * MIN_BLOCK

    def layout(self) -> object:
        out = []
        for key, seg in sorted(self.segments.items()):
            block: Block | None = seg.blocks.segments[0].head
            blocks = []
            while block is not None:
                blocks.append((block.addr, block.size, block.free))
                block = block.next
            out.append((key, tuple(blocks), tuple(seg.mapped)))
        return tuple(out)


@register_allocator
@dataclass(frozen=True)
class Expandable(AllocatorSpec):
    name = "expandable"
    description = ("PyTorch's caching allocator with expandable segments: pages mapped as "
                   "blocks need them, unmapped from free blocks when the capacity binds; "
                   "blocks freed while a copy used them come back as with `caching` "
                   "(events=host or gpu)")
    pytorch_runtime = True
    # as Caching's `events`: PyTorch's event processing is the same with expandable segments
    events: str = choice("host", "gpu")

    def build(self, capacity_bytes: int) -> Allocator:
        alloc = ExpandableAllocator(capacity_bytes)
        alloc.host_events = self.events == "host"
        return alloc
