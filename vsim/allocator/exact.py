"""`exact`: no fragmentation and no rounding. The optimistic bound: a request fails only when the
bytes of live tensors would exceed the capacity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from .base import Allocator, AllocatorSpec, register_allocator


class ExactAllocator(Allocator):
    has_segments = False
    capacity_only_at_limit = True

    def malloc(self, size_bytes: int, stream: int = 0) -> object | None:
        if self.allocated_bytes + size_bytes > self.capacity_bytes:
            self.capacity_hits += 1
            return None
        self.allocated_bytes += size_bytes
        self.reserved_bytes = self.allocated_bytes
        return size_bytes

    # A block is its size in bytes (an int).
    def free(self, block: object) -> None:
        self.allocated_bytes -= cast(int, block)
        self.reserved_bytes = self.allocated_bytes

    def block_size(self, block: object) -> int:
        return cast(int, block)

    def largest_free_bytes(self) -> int:
        return self.capacity_bytes - self.allocated_bytes


@register_allocator
@dataclass(frozen=True)
class Exact(AllocatorSpec):
    name = "exact"
    description = "no fragmentation, no rounding: fails only when live bytes exceed the capacity"

    def build(self, capacity_bytes: int) -> Allocator:
        return ExactAllocator(capacity_bytes)
