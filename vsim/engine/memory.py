"""Device memory as the engine sees it: the allocator, where each tensor lives, pinned host bytes,
and the log of allocator events from which the predicted trace and its metrics are built.

The log holds plain tuples in MemEvent's field order (action, time_us, addr, size_bytes, stream,
tensor, op): building a frozen dataclass per event cost a microsecond each, a quarter of the
engine's time per op; the predicted trace turns them into MemEvents only when it is asked for."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..allocator.base import Allocator


class Residency(enum.Enum):
    """Where a tensor is. OFFLOADING: on the device with a D2H copy in flight; PREFETCHING:
    device memory taken, H2D copy in flight. The value is how messages write it."""

    UNBORN = "unborn"
    DEVICE = "device"
    OFFLOADING = "offloading"
    HOST = "host"
    PREFETCHING = "prefetching"
    DROPPED = "dropped"
    FREED = "freed"

    def __str__(self) -> str:
        return self.value


# The members as module constants: in Python 3.11 reading Residency.DEVICE costs ~0.15 us (the
# enum's class attribute lookup), a constant ~0.04 us, and the engine reads them on every op.
UNBORN, DEVICE, OFFLOADING, HOST = (Residency.UNBORN, Residency.DEVICE, Residency.OFFLOADING,
                                    Residency.HOST)
PREFETCHING, DROPPED, FREED = Residency.PREFETCHING, Residency.DROPPED, Residency.FREED
EVENT_FIELDS = 7  # (action, time_us, addr, size_bytes, stream, tensor, op): DeviceMemory.log

# On the device for a reader: its data is there, whatever copy is in flight.
RESIDENT = (DEVICE, OFFLOADING)


@dataclass(frozen=True)
class OutOfMemory:
    """Where the run stopped: the op (None: before the first op), the request, what was free.
    `memory`: "device", or "pinned host" when pinning host memory would exceed the profile's
    host.pinned_limit (then the free bytes are the limit's, and tensor -1 stands for a pinned
    pool allocated up front; the JSON names `memory` only then, so device results read as
    before)."""

    op: int | None
    tensor: int
    need_bytes: int
    free_bytes: int
    largest_free_bytes: int
    memory: str = "device"

    def to_json(self) -> dict[str, int | str | None]:
        out: dict[str, int | str | None] = {
            "op": self.op, "tensor": self.tensor, "need_bytes": self.need_bytes,
            "free_bytes": self.free_bytes, "largest_free_bytes": self.largest_free_bytes}
        if self.memory != "device":
            out["memory"] = self.memory
        return out


class DeviceMemory:
    """Allocator plus residency. Methods return False/None instead of raising on out of memory
    so that the engine can turn it into a result."""

    def __init__(self, allocator: Allocator, count_pinned: bool = True,
                 pinned_limit_bytes: int | None = None, logged: bool = True) -> None:
        """`logged` False: no log kept (a profiling run whose verdict alone is read,
        vsim.engine.SimResult.verdict: the log is what its report would be built from)."""
        self.allocator = allocator
        self.logged = logged
        self.count_pinned = count_pinned
        self.pinned_limit_bytes = pinned_limit_bytes
        self.blocks: dict[int, object] = {}
        self.state: dict[int, Residency] = {}
        # The log, flat: each event is EVENT_FIELDS consecutive items in MemEvent's order (a
        # tuple per event made millions of containers the cyclic collector walked after the
        # run, and 100 MB on a 1M-op run); `events` gives the tuples.
        self.log: list[object] = []
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self._reserved_seen = 0
        # The allocator's methods bound once: allocate and release run per tensor.
        self._malloc, self._free = allocator.malloc, allocator.free
        self._addr, self._size = allocator.block_addr, allocator.block_size
        self._segments = allocator.has_segments
        self._fields = allocator.block_fields  # blocks' addr and size read directly

    @property
    def events(self) -> list[tuple[str, float, int, int, int, int | None, int | None]]:
        """The log as tuples in MemEvent's field order (built on each call)."""
        log = self.log
        return list(zip(*(log[i::EVENT_FIELDS] for i in range(EVENT_FIELDS)),  # type: ignore
                        strict=True))

    @property
    def event_count(self) -> int:
        return len(self.log) // EVENT_FIELDS

    def where(self, tensor: int) -> Residency:
        return self.state.get(tensor, UNBORN)

    def mark(self, tensor: int, state: Residency) -> None:
        """A change of state that moves no memory (a copy starting or ending)."""
        self.state[tensor] = state

    def allocate(self, tensor: int, size_bytes: int, now: float, op: int | None,
                 state: Residency = DEVICE, searched: bool = False,
                 unless_hit: bool = False) -> bool:
        """`searched`: the retry after a device-wide synchronize; `unless_hit`: False, with
        nothing changed, where the request would synchronize first (both
        CachingAllocator.malloc's)."""
        if searched:  # (the caching model's: only its runs sync at the capacity)
            block = self.allocator.malloc(size_bytes, searched=True)  # type: ignore[call-arg]
        elif unless_hit:  # (likewise)
            block = self.allocator.malloc(size_bytes, unless_hit=True)  # type: ignore[call-arg]
        else:
            block = self._malloc(size_bytes)
        if block is None:
            return False
        self.blocks[tensor] = block
        self.state[tensor] = state
        if self._segments and self.allocator.reserved_bytes != self._reserved_seen:
            self._segment_change(now)
        if not self.logged:
            pass
        elif self._fields:
            self.log += ("alloc", now, block.addr, block.size, 0, tensor, op)  # type: ignore
        else:
            self.log += ("alloc", now, self._addr(block), self._size(block), 0, tensor, op)
        return True

    def adopt(self, tensor: int, block: object, now: float) -> None:
        """A block the allocator already holds (left by a previous iteration) becomes this
        run's: logged as allocated now, with the segments reserved so far."""
        a = self.allocator
        self.blocks[tensor] = block
        self.state[tensor] = DEVICE
        if self._segments and a.reserved_bytes != self._reserved_seen:  # (as _segment_change)
            self._segment_change(now)
        if not self.logged:
            pass
        elif self._fields:  # (every resident tensor of every steady iteration comes here)
            self.log += ("alloc", now, block.addr, block.size, 0, tensor, None)  # type: ignore
        else:
            self.log += ("alloc", now, a.block_addr(block), a.block_size(block), 0, tensor, None)

    def scratch(self, size_bytes: int, now: float, op: int | None) -> object | None:
        """A block of no trace tensor (a micro-batch's part: Engine._part_round), logged as
        allocated like a tensor's so that it counts in the memory curve; None where it cannot
        be had (nothing changed but what the allocator's attempt changed)."""
        block = self._malloc(size_bytes)
        if block is None:
            return None
        if self._segments and self.allocator.reserved_bytes != self._reserved_seen:
            self._segment_change(now)
        if self.logged:
            self.log += ("alloc", now, self._addr(block), self._size(block), 0, None, op)
        return block

    def scratch_free(self, block: object, now: float, op: int | None) -> None:
        """A scratch block back to the allocator (free_completed)."""
        self.give_back(block, None, now, op)  # type: ignore[arg-type]

    def request_free(self, tensor: int, now: float, op: int | None) -> None:
        """The program frees the tensor while a copy still reads its block: PyTorch counts it
        no longer allocated (free_requested) but keeps the block until `release`
        (free_completed)."""
        block = self.blocks[tensor]
        if self.logged:
            self.log += ("free_requested", now, self.allocator.block_addr(block),
                         self.allocator.block_size(block), 0, tensor, op)

    def detach(self, tensor: int, now: float, op: int | None, new_state: Residency,
               requested: bool = False) -> object | None:
        """The program frees the tensor but its block stays out of the allocator's reach until
        `give_back` (a copy stream's event pending on it, record_stream): logged free_requested
        now (unless `requested` already), the tensor moves to `new_state`; returns the block."""
        block = self.blocks.pop(tensor, None)
        if block is not None and not requested and self.logged:
            self.log += ("free_requested", now, self.allocator.block_addr(block),
                         self.allocator.block_size(block), 0, tensor, op)
        self.state[tensor] = new_state
        return block

    def give_back(self, block: object, tensor: int, now: float, op: int | None) -> None:
        """A detached block returns to the allocator (free_completed)."""
        if not self.logged:
            self._free(block)
        else:
            if self._fields:
                size, addr = block.size, block.addr  # type: ignore[attr-defined]
            else:
                size, addr = self._size(block), self._addr(block)
            self._free(block)
            self.log += ("free_completed", now, addr, size, 0, tensor, op)
        if self._segments and self.allocator.reserved_bytes != self._reserved_seen:
            self._segment_change(now)

    def release(self, tensor: int, now: float, op: int | None, new_state: Residency) -> None:
        """Return the device copy (if any) and move the tensor to `new_state`."""
        block = self.blocks.pop(tensor, None)
        if block is not None:
            self.give_back(block, tensor, now, op)
        self.state[tensor] = new_state

    def _segment_change(self, now: float) -> None:
        """A segment event when reserved bytes changed (allocators without segments reserve
        what they allocate: no segment events, and the metrics read it that way)."""
        reserved = self.allocator.reserved_bytes
        if reserved != self._reserved_seen:
            if self.logged:
                action = "segment_alloc" if reserved > self._reserved_seen else "segment_free"
                self.log += (action, now, 0, abs(reserved - self._reserved_seen), 0, None, None)
            self._reserved_seen = reserved

    def pin(self, size_bytes: int) -> bool:
        """Pin host memory for a copy; False (nothing pinned) when it would exceed the limit."""
        if not self.count_pinned:
            return True
        if self.pinned_limit_bytes is not None \
                and self.host_bytes + size_bytes > self.pinned_limit_bytes:
            return False
        self.host_bytes += size_bytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        return True

    def unpin(self, size_bytes: int) -> None:
        if self.count_pinned:
            self.host_bytes -= size_bytes

    def pinned_oom(self, op: int | None, tensor: int, need_bytes: int) -> OutOfMemory:
        """Pinning `need_bytes` more would exceed the pinned host limit."""
        free = max(0, (self.pinned_limit_bytes or 0) - self.host_bytes)
        return OutOfMemory(op=op, tensor=tensor, need_bytes=need_bytes, free_bytes=free,
                           largest_free_bytes=free, memory="pinned host")

    def oom(self, op: int | None, tensor: int, need_bytes: int) -> OutOfMemory:
        a = self.allocator
        return OutOfMemory(op=op, tensor=tensor, need_bytes=need_bytes,
                           free_bytes=a.capacity_bytes - a.allocated_bytes,
                           largest_free_bytes=a.largest_free_bytes())
