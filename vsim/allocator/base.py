"""The allocator interface the engine drives, and the registry of allocator models.

An allocator manages device memory of a fixed capacity. `malloc` returns a block handle or None
when the request cannot be served (out of memory); `free` returns a block. `allocated_bytes` is
what live blocks hold (PyTorch's memory_allocated), `reserved_bytes` what the allocator took from
the device (memory_reserved). For every allocator: allocated + free inside segments == reserved
<= capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ..spec import describe, parse_spec


class Allocator:
    """Base of the allocator models. Subclasses are mutable state machines; their config is
    given by the frozen spec dataclass that builds them. `has_segments` False: the model
    reserves exactly what it allocates (no segments to report)."""

    has_segments = True
    # A failed request first waits for the blocks the program freed while a copy still used
    # them (record_stream), then retries: PyTorch's release_cached_blocks synchronizes every
    # outstanding event of a freed block (synchronize_and_free_events) before it frees the cache
    # and calls cudaMalloc again. False: out of memory at once (cnmem, a pool).
    retries_after_pending_frees = False
    # The capacity enters the model only where a request would pass it, each time counted in
    # `capacity_hits`: a run with none would have run the same on a larger card (vsim run
    # reuses it as its ample-memory baseline). False: the capacity shapes the state otherwise
    # (a pool pre-sized to it), so no run is known to be the same on another capacity.
    capacity_only_at_limit = False
    # Blocks are vsim.allocator.blocks.Block, whose `addr` and `size` are block_addr() and
    # block_size() (DeviceMemory reads them directly: the engine logs both per tensor).
    block_fields = False

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.capacity_hits = 0  # requests the capacity refused or made free the cache
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.segment_allocs = 0  # cudaMalloc calls, for their time cost
        # Driver calls since the engine last looked, for their host time (vsim.host):
        # ("sync", 0) a device-wide synchronize, ("malloc" | "free", segment bytes), ("map" |
        # "unmap", page bytes) with expandable segments.
        self.driver_calls: list[tuple[str, int]] = []
        # Called before a failed request frees the cache (PyTorch's release_cached_blocks
        # first synchronizes and frees the blocks whose stream events were pending): the
        # engine gives back the blocks it holds for host-time event processing
        self.before_release: Callable[[], None] | None = None
        # Whether a block freed while a copy used it comes back only when the host allocates
        # after its event has passed (Caching's events=host, its default; Transfers.limbo)
        self.host_events = False

    def malloc(self, size_bytes: int, stream: int = 0) -> object | None:
        raise NotImplementedError

    def would_hit(self, size_bytes: int, stream: int = 0) -> bool:
        """Whether the request would meet the capacity in a way that synchronizes the device
        first (CachingAllocator: PyTorch's release_cached_blocks); False for models without."""
        return False

    def free(self, block: object) -> None:
        raise NotImplementedError

    def block_size(self, block: object) -> int:
        raise NotImplementedError

    def block_addr(self, block: object) -> int:
        """Device address of a block (0 where the model has no addresses)."""
        return 0

    def free_in_segments_bytes(self) -> int:
        """Bytes reserved but not allocated (cached in free blocks)."""
        return self.reserved_bytes - self.allocated_bytes

    def largest_free_bytes(self) -> int:
        """The largest request that would succeed now (for out-of-memory reports)."""
        raise NotImplementedError

    def serves_now(self, size_bytes: int) -> bool:
        """size_bytes <= largest_free_bytes() (a plan that waits for memory asks it per
        request; a model may know it sooner)."""
        return size_bytes <= self.largest_free_bytes()

    def layout(self) -> object:
        """What of the allocator's state a next iteration depends on, comparable between
        iterations (addresses relative): equal layouts at the start of two iterations make the
        two iterations equal. None: the model carries nothing between iterations that changes
        the next one (no fragmentation builds up), so one steady iteration tells it all."""
        return None


@dataclass(frozen=True)
class AllocatorSpec:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # The model is PyTorch's own allocator: simulate() then runs PyTorch's first iteration and
    # its cuDNN workspace fallback by default (vsim.engine.simulate).
    pytorch_runtime: ClassVar[bool] = False

    def build(self, capacity_bytes: int) -> Allocator:
        raise NotImplementedError


_ALLOCATORS: dict[str, type[AllocatorSpec]] = {}


def register_allocator(cls: type[AllocatorSpec]) -> type[AllocatorSpec]:
    if cls.name in _ALLOCATORS:
        raise TypeError(f"allocator {cls.name!r} registered twice")
    _ALLOCATORS[cls.name] = cls
    return cls


def allocator_registry() -> dict[str, type[AllocatorSpec]]:
    return dict(_ALLOCATORS)


def make_allocator(spec: str) -> AllocatorSpec:
    """'caching:round=512' -> the spec object; PolicyError lists valid names and keys."""
    result: AllocatorSpec = parse_spec(spec, _ALLOCATORS, "allocator")
    return result


def describe_allocator(cls: type[AllocatorSpec]) -> dict[str, object]:
    return describe(cls)
