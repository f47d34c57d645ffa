"""`cnmem` and `first-fit`: one pool reserved up front at the full capacity, carved into blocks.

- cnmem (NVIDIA's library, what vDNN used): best fit, split every block, merge on free; sizes
  rounded to its 512 B granularity (CNMEM_GRANULARITY).
- first-fit (SuperNeurons' tensor pool): the free block with the lowest address that is large
  enough; same splitting, merging and rounding.
Reserved bytes are the whole pool from the start, so peak reserved is the capacity; a request
fails when no single free block is large enough (external fragmentation), even if the free bytes
add up.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Allocator, AllocatorSpec, register_allocator
from .blocks import Block, BlockPool

GRANULARITY = 512


class PooledAllocator(Allocator):
    block_fields = True

    def __init__(self, capacity_bytes: int, first_fit: bool) -> None:
        super().__init__(capacity_bytes)
        self.first_fit = first_fit
        self.pool = BlockPool(by_address=first_fit)
        self.pool.add_segment(1 << 32, capacity_bytes, "pool", 0)
        self.reserved_bytes = capacity_bytes
        self.segment_allocs = 1

    def malloc(self, size_bytes: int, stream: int = 0) -> object | None:
        size = GRANULARITY * max(1, -(-size_bytes // GRANULARITY))
        find = self.pool.free.first_fit if self.first_fit else self.pool.free.best_fit
        block = find(size)
        if block is None:
            return None
        self.pool.take(block, size, split=True)
        self.allocated_bytes += block.size
        return block

    def free(self, block: object) -> None:
        assert isinstance(block, Block) and not block.free
        self.allocated_bytes -= block.size
        self.pool.give_back(block)

    def block_size(self, block: object) -> int:
        assert isinstance(block, Block)
        return block.size

    def block_addr(self, block: object) -> int:
        assert isinstance(block, Block)
        return block.addr

    def free_in_segments_bytes(self) -> int:
        return sum(b.size for b in self.pool.free.blocks.values())

    def largest_free_bytes(self) -> int:
        return self.pool.free.largest()


@register_allocator
@dataclass(frozen=True)
class Cnmem(AllocatorSpec):
    name = "cnmem"
    description = "best-fit pool pre-sized to the capacity (NVIDIA cnmem, as vDNN used)"

    def build(self, capacity_bytes: int) -> Allocator:
        return PooledAllocator(capacity_bytes, first_fit=False)


@register_allocator
@dataclass(frozen=True)
class FirstFit(AllocatorSpec):
    name = "first-fit"
    description = "first-fit pool pre-sized to the capacity (SuperNeurons' tensor pool)"

    def build(self, capacity_bytes: int) -> Allocator:
        return PooledAllocator(capacity_bytes, first_fit=True)
