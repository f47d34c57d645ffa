"""Segments split into address-ordered blocks, with a best-fit / first-fit index of free blocks.

The shared machinery of the pool allocators (caching, cnmem, first-fit): a segment is one
cudaMalloc; a block is a piece of a segment, free or in use; freeing merges a block with free
neighbours in the same segment (PyTorch's try_merge_blocks, cnmem's and SuperNeurons' merge).
"""

from __future__ import annotations

import bisect
from bisect import bisect_left, insort
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Block:
    addr: int
    size: int
    segment: Segment
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


@dataclass(eq=False, slots=True)
class Segment:
    addr: int
    size: int
    pool: str
    stream: int
    blocks_in_use: int = 0
    head: Block | None = field(default=None, repr=False)
    owner: BlockPool | None = field(default=None, repr=False)  # the pool it belongs to

    def is_free(self) -> bool:
        return self.blocks_in_use == 0


# A free block's sort key: (size, addr) packed into one int, size << 64 | addr, which orders as
# the tuple does for addresses below 2^64 (BlockPool.add_segment checks): comparing ints is
# cheaper than comparing tuples, and the engine adds and removes two free blocks per tensor.
# The index keeps the keys negated, in ascending order (so largest first): a training
# iteration's allocations and frees come and go at the small end (the block just split, the
# tensor just freed) while the free segments sit still at the large end, and a list inserts
# and deletes at a cost proportional to what lies after the place (a 1M-op chain: thousands of
# free 2 MiB segments, a memmove of all of them per request in ascending order).
_ADDR_BITS = 64
ADDR_BITS = _ADDR_BITS  # (for the caching allocator's inlined lookups)
_ADDR_MASK = (1 << _ADDR_BITS) - 1
ADDR_MASK = _ADDR_MASK


class FreeIndex:
    """Free blocks of one pool and stream, sorted by (size, addr) for best fit and, when
    `by_address` (a first-fit allocator), kept in a second list by address for first fit (the
    caching allocator's pools skip that list: two bisections per block in the engine's
    hottest path)."""

    def __init__(self, by_address: bool = False) -> None:
        self.by_size: list[int] = []  # -(size << 64 | addr), ascending
        self.by_addr: list[int] | None = [] if by_address else None
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        bisect.insort(self.by_size, -(block.size << _ADDR_BITS | block.addr))
        if self.by_addr is not None:
            bisect.insort(self.by_addr, block.addr)
        self.blocks[block.addr] = block

    def remove(self, block: Block) -> None:
        by_size = self.by_size
        del by_size[bisect.bisect_left(by_size, -(block.size << _ADDR_BITS | block.addr))]
        if self.by_addr is not None:
            del self.by_addr[bisect.bisect_left(self.by_addr, block.addr)]
        del self.blocks[block.addr]

    def best_fit(self, size: int) -> Block | None:
        """The smallest free block of at least `size` bytes (lowest address on ties)."""
        by_size = self.by_size
        i = bisect.bisect_right(by_size, -(size << _ADDR_BITS)) - 1  # the least key >= size's
        return self.blocks[-by_size[i] & _ADDR_MASK] if i >= 0 else None

    def first_fit(self, size: int) -> Block | None:
        """The free block of at least `size` bytes with the lowest address."""
        if self.by_addr is None:
            raise ValueError("first_fit on a FreeIndex made without by_address")
        for addr in self.by_addr:
            block = self.blocks[addr]
            if block.size >= size:
                return block
        return None

    def largest(self) -> int:
        return -self.by_size[0] >> _ADDR_BITS if self.by_size else 0

    def __len__(self) -> int:
        return len(self.by_size)


class BlockPool:
    """Segments and their blocks for one (pool, stream); split and merge."""

    def __init__(self, by_address: bool = False) -> None:
        self.free = FreeIndex(by_address)
        self.segments: list[Segment] = []
        # Bytes of the segments with no block in use, kept as blocks are taken and given back
        # (the caching allocator's largest_free_bytes asks for it on every request of a plan
        # that waits for memory: summing over the segments there was half a profiling run).
        self.free_segment_bytes = 0

    def add_segment(self, addr: int, size: int, pool: str, stream: int) -> Block:
        if addr < 0 or addr + size > 1 << _ADDR_BITS:
            raise ValueError(f"segment at {addr:#x} of {size} B is outside 64-bit addresses")
        seg = Segment(addr, size, pool, stream)
        block = Block(addr, size, seg)
        seg.head = block
        seg.owner = self
        self.segments.append(seg)
        self.free.add(block)
        self.free_segment_bytes += size
        return block

    def take(self, block: Block, size: int, split: bool) -> Block:
        """Mark `block` used; if `split`, its tail beyond `size` becomes a new free block."""
        free = self.free
        free.remove(block)
        if split and block.size > size:
            after = block.next
            rest = Block(block.addr + size, block.size - size, block.segment, True, block, after)
            if after is not None:
                after.prev = rest
            block.next = rest
            block.size = size
            free.add(rest)
        block.free = False
        if block.segment.blocks_in_use == 0:
            self.free_segment_bytes -= block.segment.size
        block.segment.blocks_in_use += 1
        return block

    def take_at(self, block: Block, addr: int, size: int) -> Block:
        """`take` of exactly the `size` bytes at `addr` inside free `block`: the bytes before
        and after stay free blocks of their own (an expandable segment's allocation from a
        mapped run or a hole inside a merged free block)."""
        if addr > block.addr:
            free = self.free
            free.remove(block)
            rest = Block(addr, block.addr + block.size - addr, block.segment, True, block,
                         block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = addr - block.addr
            free.add(block)
            free.add(rest)
            block = rest
        return self.take(block, size, True)

    def take_best(self, size: int, split_from: int) -> Block | None:
        """`take` of the best-fitting free block for `size` bytes (FreeIndex.best_fit), split
        when at least `split_from` (> 0) bytes would remain; None when no free block fits.
        One bisection instead of best_fit's and take's (the caching allocator's every
        request)."""
        free = self.free
        if free.by_addr is not None:
            found = free.best_fit(size)
            if found is not None:
                self.take(found, size, found.size - size >= split_from)
            return found
        by_size = free.by_size
        i = bisect.bisect_right(by_size, -(size << _ADDR_BITS)) - 1  # as best_fit
        if i < 0:
            return None
        block = free.blocks.pop(-by_size.pop(i) & _ADDR_MASK)
        rest_size = block.size - size
        if rest_size >= split_from:
            after = block.next
            rest = Block(block.addr + size, rest_size, block.segment, True, block, after)
            if after is not None:
                after.prev = rest
            block.next = rest
            block.size = size
            bisect.insort(by_size, -(rest_size << _ADDR_BITS | rest.addr))
            free.blocks[rest.addr] = rest
        block.free = False
        if block.segment.blocks_in_use == 0:
            self.free_segment_bytes -= block.segment.size
        block.segment.blocks_in_use += 1
        return block

    def give_back(self, block: Block) -> None:
        """Free a block and merge it with free neighbours in its segment."""
        block.free = True
        seg = block.segment
        seg.blocks_in_use -= 1
        if seg.blocks_in_use == 0:
            self.free_segment_bytes += seg.size
        prev, after = block.prev, block.next
        free = self.free
        if free.by_addr is None:  # the loop below with FreeIndex's steps written out
            by_size, blocks = free.by_size, free.blocks
            if prev is not None and prev.free:
                del by_size[bisect_left(by_size, -(prev.size << _ADDR_BITS | prev.addr))]
                del blocks[prev.addr]
                prev.size += block.size
                prev.next = after
                if after is not None:
                    after.prev = prev
                block = prev
            if after is not None and after.free:
                del by_size[bisect_left(by_size, -(after.size << _ADDR_BITS | after.addr))]
                del blocks[after.addr]
                block.size += after.size
                nxt = block.next = after.next
                if nxt is not None:
                    nxt.prev = block
            insort(by_size, -(block.size << _ADDR_BITS | block.addr))
            blocks[block.addr] = block
            return
        for neighbour in (prev, after):
            if neighbour is not None and neighbour.free:
                self.free.remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self.free.add(block)

    def release_free_segments(self) -> int:
        """cudaFree every segment with no block in use; returns the bytes given back."""
        released = 0
        for seg in [s for s in self.segments if s.is_free()]:
            assert seg.head is not None and seg.head.size == seg.size
            self.free.remove(seg.head)
            self.segments.remove(seg)
            released += seg.size
        self.free_segment_bytes -= released
        return released
