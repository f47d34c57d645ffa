"""`caching`: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

Modelled rules (PyTorch 2.x defaults, no PYTORCH_CUDA_ALLOC_CONF):
- sizes round up to multiples of 512 B (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) come from the small pool, whose segments are 2 MiB
  (kSmallBuffer); larger ones from the large pool, whose segments are 20 MiB (kLargeBuffer) for
  requests under 10 MiB (kMinLargeAlloc) and the request rounded up to 2 MiB (kRoundLarge)
  otherwise;
- a request takes the best-fitting free block of its pool and stream (blocks freed on one stream
  serve only that stream: stream-ordered frees);
- a block is split when the remainder is at least 512 B (small pool) or above 1 MiB (large
  pool); otherwise the whole block is handed out and counted as allocated, as PyTorch does;
- a freed block merges with free neighbours in its segment; segments stay reserved;
- when a new segment would pass the capacity, every fully free segment is released
  (release_cached_blocks) and the cudaMalloc retried once; if it still does not fit: out of
  memory, even though free bytes may exist inside segments (fragmentation). PyTorch's first
  step, release_available_cached_blocks, releases nothing without max_split_size (its default,
  unset: the function returns false at once), so the full release is the first one here too.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterable
from dataclasses import dataclass

from ..spec import choice
from .base import Allocator, AllocatorSpec, register_allocator
from .blocks import ADDR_BITS, ADDR_MASK, Block, BlockPool, Segment

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
# Where new segments lie (`top_down`). Best fit breaks ties between equal free blocks by the
# lower address, so where the driver puts each segment decides which of two equal blocks a
# request gets. In the recorded histories the driver reserves virtual addresses top-down in
# 32 MiB-aligned ranges (VA_CHUNK), puts a segment at the bottom of its range, and puts later
# segments in the lowest free space of the ranges it holds (a range's rest, a freed segment's)
# before it reserves another. Increasing addresses put VGG-16(256)'s fc1 momentum into the
# wrong 392 MiB block and opened a 3138 MiB segment PyTorch never did
# (validation/allocator/segment_order.py, docs/design.md).
BOTTOM_ADDR = 1 << 32
TOP_ADDR = 1 << 46
VA_CHUNK = 32 << 20


def round_size(size_bytes: int) -> int:
    if size_bytes < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size_bytes + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size_bytes: int) -> int:
    if size_bytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if size_bytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size_bytes + ROUND_LARGE - 1) // ROUND_LARGE)


class CachingAllocator(Allocator):
    """`segment_addresses`: where each new segment lies, in order (a recorded run's cudaMalloc
    results, for replaying its history). Addresses matter: best fit breaks ties between free
    blocks of equal size by address. Without them (or once they run out) new segments lie
    where the driver puts them where `top_down` (`_reserve`), else each above the last."""

    retries_after_pending_frees = True
    capacity_only_at_limit = True
    block_fields = True

    def __init__(self, capacity_bytes: int, segment_addresses: Iterable[int] = (),
                 top_down: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.top_down = top_down
        self.pools: dict[tuple[str, int], BlockPool] = {}
        self._stream0: dict[str, BlockPool] = {}  # pools[(kind, 0)] by kind (no tuple per ask)
        self.next_addr = TOP_ADDR if top_down else BOTTOM_ADDR  # where the next one ends/starts
        self.va_free: list[tuple[int, int]] = []  # top_down: free (start, end) in reserved ranges
        self.segment_addresses = iter(segment_addresses)

    def _pool(self, pool: str, stream: int) -> BlockPool:
        found = self.pools.get((pool, stream))
        if found is None:  # (setdefault would build a BlockPool on every call)
            found = self.pools[(pool, stream)] = BlockPool()  # best fit only (no address order)
            if stream == 0:
                self._stream0[pool] = found
        return found

    def would_hit(self, size_bytes: int, stream: int = 0) -> bool:
        """Whether `malloc` would find no cached block and no room under the capacity for a
        new segment: PyTorch's allocator would then synchronize the device and free its cache
        (release_cached_blocks) before it calls cudaMalloc again (`malloc(searched=True)`)."""
        # (round_size and segment_size written out: the engine asks before most allocations
        # while a copy is in flight)
        size = MIN_BLOCK if size_bytes < MIN_BLOCK \
            else MIN_BLOCK * ((size_bytes + MIN_BLOCK - 1) // MIN_BLOCK)
        if size <= SMALL_SIZE:
            pool = self._stream0.get("small") if stream == 0 else self.pools.get(("small", stream))
            grow = SMALL_BUFFER
        else:
            pool = self._stream0.get("large") if stream == 0 else self.pools.get(("large", stream))
            grow = LARGE_BUFFER if size < MIN_LARGE_ALLOC \
                else ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)
        if pool is not None:
            by_size = pool.free.by_size
            if by_size and -by_size[0] >> ADDR_BITS >= size:
                return False
        return self.reserved_bytes + grow > self.capacity_bytes

    def malloc(self, size_bytes: int, stream: int = 0, searched: bool = False,
               unless_hit: bool = False) -> object | None:
        """`searched`: the request already found no cached block before the device was
        synchronized (would_hit): the blocks that came back since are not searched, as
        PyTorch's retry is a cudaMalloc after the cache is freed, not another search.
        `unless_hit`: where `would_hit` is true, None with nothing changed (the engine then
        synchronizes first); otherwise the block, which cannot fail then (a cached block, or
        a new segment under the capacity). One call where the engine asked would_hit and then
        malloc for most requests while a copy is in flight."""
        # round_size and BlockPool lookups written out: the engine calls this per tensor
        size = MIN_BLOCK if size_bytes < MIN_BLOCK \
            else MIN_BLOCK * ((size_bytes + MIN_BLOCK - 1) // MIN_BLOCK)
        kind = "small" if size <= SMALL_SIZE else "large"
        pool = self._stream0.get(kind) if stream == 0 else self.pools.get((kind, stream))
        if pool is None:
            pool = self._pool(kind, stream)
        if searched:
            return self._new_segment(size, kind, pool, stream)
        # a cached block: split when the rest is at least 512 B (small) or above 1 MiB (large)
        # (BlockPool.take_best written out: the caching pools keep no address order)
        free = pool.free
        by_size = free.by_size
        i = bisect_right(by_size, -(size << ADDR_BITS)) - 1  # the least key >= size's
        if i >= 0:
            found = free.blocks.pop(-by_size.pop(i) & ADDR_MASK)
            rest_size = found.size - size
            if rest_size >= (MIN_BLOCK if kind == "small" else SMALL_SIZE + 1):
                after = found.next
                rest = Block(found.addr + size, rest_size, found.segment, True, found, after)
                if after is not None:
                    after.prev = rest
                found.next = rest
                found.size = size
                insort(by_size, -(rest_size << ADDR_BITS | rest.addr))
                free.blocks[rest.addr] = rest
            found.free = False
            seg = found.segment
            if seg.blocks_in_use == 0:
                pool.free_segment_bytes -= seg.size
            seg.blocks_in_use += 1
            self.allocated_bytes += found.size
            return found
        if unless_hit and self.reserved_bytes + segment_size(size) > self.capacity_bytes:
            return None  # (would_hit: no cached block, no room for a segment)
        return self._new_segment(size, kind, pool, stream)

    def _new_segment(self, size: int, kind: str, pool: BlockPool, stream: int) -> Block | None:
        """No cached block fits: a new segment, after freeing the cache at the capacity."""
        grow = segment_size(size)
        if self.reserved_bytes + grow > self.capacity_bytes:
            self.capacity_hits += 1
            # release_cached_blocks: synchronize the device (the blocks whose stream events
            # had not been seen come back: `before_release`), cudaFree every free segment
            if self.before_release is not None:
                self.before_release()
            self.driver_calls.append(("sync", 0))
            self.driver_calls += [("free", s.size) for p in self.pools.values()
                                  for s in p.segments if s.is_free()]
            self._release_free_segments()
            if self.reserved_bytes + grow > self.capacity_bytes:
                return None
        addr = next(self.segment_addresses, None)
        if addr is None and self.top_down:
            addr = self._reserve(grow)
        elif addr is None:
            addr = self.next_addr
            self.next_addr += grow
        block = pool.add_segment(addr, grow, kind, stream)
        self.reserved_bytes += grow
        self.segment_allocs += 1
        self.driver_calls.append(("malloc", grow))
        remaining = block.size - size
        split = remaining >= MIN_BLOCK if kind == "small" else remaining > SMALL_SIZE
        pool.take(block, size, split)
        self.allocated_bytes += block.size
        return block

    def _reserve(self, size: int) -> int:
        """Where the driver puts a new segment of `size` bytes (top_down): the lowest free space
        of the ranges it holds, else the bottom of a new 32 MiB-aligned range below them."""
        for i, (lo, hi) in enumerate(self.va_free):
            if hi - lo >= size:
                if hi - lo == size:
                    del self.va_free[i]
                else:
                    self.va_free[i] = (lo + size, hi)
                return lo
        whole = -(-size // VA_CHUNK) * VA_CHUNK
        self.next_addr -= whole
        if whole > size:
            insort(self.va_free, (self.next_addr + size, self.next_addr + whole))
        return self.next_addr

    def _release_free_segments(self) -> int:
        """cudaFree every segment with no block in use (its range free again for the driver
        where top_down); the bytes given back."""
        if self.top_down:
            for p in self.pools.values():
                for seg in p.segments:
                    if seg.is_free():
                        self._unreserve(seg.addr, seg.addr + seg.size)
        released = sum(p.release_free_segments() for p in self.pools.values())
        self.reserved_bytes -= released
        return released

    def _unreserve(self, lo: int, hi: int) -> None:
        """A freed segment's range joins the free space, merged with its neighbours."""
        i = bisect_right(self.va_free, (lo, hi))
        if i < len(self.va_free) and self.va_free[i][0] == hi:
            hi = self.va_free.pop(i)[1]
        if i > 0 and self.va_free[i - 1][1] == lo:
            lo = self.va_free.pop(i - 1)[0]
            i -= 1
        self.va_free.insert(i, (lo, hi))

    def free(self, block: object) -> None:
        assert isinstance(block, Block) and not block.free
        self.allocated_bytes -= block.size
        owner = block.segment.owner
        assert owner is not None
        owner.give_back(block)  # its merge has the caching pools' steps written out

    # (a Block: no isinstance check, the engine asks twice per allocation and per release)
    def block_size(self, block: object) -> int:
        return block.size  # type: ignore[attr-defined, no-any-return]

    def block_addr(self, block: object) -> int:
        return block.addr  # type: ignore[attr-defined, no-any-return]

    def free_in_segments_bytes(self) -> int:
        return sum(b.size for p in self.pools.values() for b in p.free.blocks.values())

    def empty_cache(self) -> int:
        """torch.cuda.empty_cache(): cudaFree every segment with no block in use; the bytes
        given back."""
        return self._release_free_segments()

    def copy(self, capacity_bytes: int) -> tuple[CachingAllocator, dict[int, Block]]:
        """An allocator of `capacity_bytes` in this one's state (segments, blocks, addresses;
        counters reset), and per block of this one (by id) its copy. Built block by block: a
        segment's blocks are a linked list that copy.deepcopy would walk recursively."""
        new = CachingAllocator(capacity_bytes, top_down=self.top_down)
        new.va_free = list(self.va_free)
        new.host_events = self.host_events
        new.next_addr = self.next_addr
        new.reserved_bytes, new.allocated_bytes = self.reserved_bytes, self.allocated_bytes
        blocks: dict[int, Block] = {}
        for (kind, stream), pool in self.pools.items():
            to = new._pool(kind, stream)
            to.free_segment_bytes = pool.free_segment_bytes
            for seg in pool.segments:
                s = Segment(seg.addr, seg.size, seg.pool, seg.stream, seg.blocks_in_use)
                s.owner = to
                to.segments.append(s)
                b, prev = seg.head, None
                while b is not None:
                    c = Block(b.addr, b.size, s, b.free, prev)
                    if prev is None:
                        s.head = c
                    else:
                        prev.next = c
                    if c.free:
                        to.free.add(c)
                    blocks[id(b)] = c
                    prev, b = c, b.next
        return new, blocks

    def layout(self) -> object:
        """Segments in address order, each with its blocks (size, free) in address order."""
        segs = sorted((s for p in self.pools.values() for s in p.segments), key=lambda s: s.addr)
        out = []
        for seg in segs:
            blocks = []
            b = seg.head
            while b is not None:
                blocks.append((b.size, b.free))
                b = b.next
            out.append((seg.pool, seg.stream, seg.size, tuple(blocks)))
        return tuple(out)

    def serves_now(self, size_bytes: int) -> bool:
        # at once when the request's own pool has a free block that large (largest_free_bytes
        # is at least that) or the capacity has room for it; otherwise as the base class
        pool = self._stream0.get("small" if size_bytes <= SMALL_SIZE else "large")
        if pool is not None and pool.free.by_size \
                and -pool.free.by_size[0] >> ADDR_BITS >= size_bytes:
            return True
        if size_bytes <= self.capacity_bytes - self.reserved_bytes:
            return True
        return size_bytes <= self.largest_free_bytes()

    def largest_free_bytes(self) -> int:
        # (one pass: the engine asks on every request of a plan that waits for memory)
        cached = releasable = 0
        for p in self.pools.values():
            by_size = p.free.by_size  # (FreeIndex.largest written out)
            if by_size:
                largest = -by_size[0] >> ADDR_BITS
                if largest > cached:
                    cached = largest
            releasable += p.free_segment_bytes
        return max(cached, self.capacity_bytes - self.reserved_bytes + releasable)


@register_allocator
@dataclass(frozen=True)
class Caching(AllocatorSpec):
    name = "caching"
    pytorch_runtime = True
    description = ("PyTorch's CUDA caching allocator: 512 B rounding, small/large pools, "
                   "best-fit with splitting and merging, per-stream pools, segment growth; "
                   "a block freed while a copy stream used it comes back at the first "
                   "allocation the host issues after the copy ends (PyTorch's "
                   "process_events), or at a failed allocation's retry; events=gpu: when "
                   "the copy ends on the GPU's clock (before 2026-11-26); addresses=down: new "
                   "segments where the driver puts them (top-down 32 MiB ranges)")
    # "host" (default since 2026-11-26, sixth session): a block freed under record_stream
    # comes back when the allocator sees its event pass, at a malloc in host time
    # (vsim.engine.transfers' limbo); "gpu": when its copy ends on the GPU's clock
    events: str = choice("host", "gpu")
    # "up": each new segment above the last (the corpus's plans were made so); "down": where
    # the driver puts them (2026-11-28: replays every recorded history segment for segment;
    # the default once the 36 H100 validation plans it moves are measured again:
    # validation/allocator/README.md)
    addresses: str = choice("up", "down")

    def build(self, capacity_bytes: int) -> Allocator:
        alloc = CachingAllocator(capacity_bytes, top_down=self.addresses == "down")
        alloc.host_events = self.events == "host"
        return alloc
