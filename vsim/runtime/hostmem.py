"""Host buffers for offloaded tensors: one pinned pool handed out in slots (vDNN++'s)."""

from __future__ import annotations

import gc
from typing import Any

import torch


class PinnedPool:
    """One pinned host buffer, handed out in slots (first fit, merged on return). A slot comes
    back when the event of its last copy has completed (vDNN++'s reused pool)."""

    def __init__(self, size_bytes: int, pin: bool) -> None:
        self.size = int(size_bytes)
        self.buffer = torch.empty(self.size, dtype=torch.uint8, pin_memory=pin)
        self.free: list[tuple[int, int]] = [(0, self.size)]
        self.pending: list[tuple[Any, int, int]] = []  # (event or None, offset, size)

    def reset(self) -> None:
        self.free = [(0, self.size)]
        self.pending = []

    def _give_back(self, offset: int, size: int) -> None:
        self.free.append((offset, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.free = merged

    def _collect(self, wait: bool) -> bool:
        done = [p for p in self.pending if p[0] is None or p[0].query()]
        if not done and wait and self.pending:
            self.pending[0][0].synchronize()
            done = [self.pending[0]]
        for p in done:
            self.pending.remove(p)
            self._give_back(p[1], p[2])
        return bool(done)

    def take(self, size: int) -> int | None:
        """The offset of a slot of `size` bytes in `buffer` (waiting for copies to end where
        none is free yet), or None where the pool cannot hold it."""
        size = (int(size) + 511) // 512 * 512
        while True:
            for n, (o, s) in enumerate(self.free):
                if s >= size:
                    self.free[n] = (o + size, s - size)
                    if s == size:
                        del self.free[n]
                    return o
            if not self._collect(wait=True):
                return None

    def put(self, offset: int, size: int, event: Any) -> None:
        self.pending.append((event, offset, (int(size) + 511) // 512 * 512))


_POOLS: dict[bool, PinnedPool] = {}  # pinned -> the process's pool, reused by every executor


def process_pool(size_bytes: int, pin: bool) -> PinnedPool | None:
    """The process's pinned pool (pageable where `pin` is false) of at least `size_bytes`,
    replaced by a larger one when a plan needs more (cudaHostAlloc costs about 0.65 s per GiB on
    the H100 machine: paid once per process, outside any timing); None for a plan without one
    (`size_bytes` 0). Executors whose iterations do not overlap share it (each resets it)."""
    if size_bytes <= 0:
        return None
    pool = _POOLS.get(pin)
    if pool is None or pool.size < size_bytes:
        _POOLS.pop(pin, None)
        pool = None
        gc.collect()
        pool = _POOLS[pin] = PinnedPool(size_bytes, pin=pin)
    return pool
