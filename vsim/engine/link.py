"""The host link: one copy engine per direction, sharing a duplex limit, as a fluid model.

Each direction is a SimPy Resource of capacity 1 (one DMA engine, copies in issue order). A copy
first pays its per-copy latency, then moves bytes at the direction's effective bandwidth for its
size (Hardware.CopyPath). While both directions move bytes, their rates are scaled down together
so that their sum stays within the duplex limit (measured on the H100 machine: 90 GB/s together
instead of 2 x 55). Rates change only when a transfer starts or ends; at each change the running
transfers are interrupted, their remaining bytes updated and their timers restarted.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import simpy

from ..hardware import CopyPath, Hardware


@dataclass
class _Transfer:
    direction: str
    remaining_bytes: float
    own_rate: float  # bytes/us this copy would get alone
    rate: float = 0.0
    since_us: float = 0.0
    process: simpy.Process | None = None


class Link:
    """Copy engines for 'h2d' and 'd2h'. `copy()` is a SimPy process generator."""

    def __init__(self, env: simpy.Environment, hw: Hardware) -> None:
        self.env = env
        self.hw = hw
        self.engines = {"h2d": simpy.Resource(env, capacity=1),
                        "d2h": simpy.Resource(env, capacity=1)}
        self.active: list[_Transfer] = []
        self.busy_us = {"h2d": 0.0, "d2h": 0.0}

    def path(self, direction: str, pinned: bool) -> CopyPath:
        link = self.hw.h2d if direction == "h2d" else self.hw.d2h
        return link.pinned if pinned else link.pageable

    def copy(self, direction: str, size_bytes: int, pinned: bool = True
             ) -> Generator[simpy.Event, object, tuple[float, float]]:
        """Move `size_bytes` in `direction`; returns (start_us, end_us) on the copy engine."""
        path = self.path(direction, pinned)
        with self.engines[direction].request() as slot:
            yield slot
            start = self.env.now
            if size_bytes > 0:
                yield self.env.timeout(path.latency_us)
                rate = path.bandwidth_bytes_per_us * path.efficiency_at(size_bytes)
                transfer = _Transfer(direction, float(size_bytes), rate)
                yield from self._move(transfer)
            end = self.env.now
            self.busy_us[direction] += end - start
        return start, end

    def active_directions(self) -> int:
        return len({t.direction for t in self.active})

    def _move(self, transfer: _Transfer) -> Generator[simpy.Event, object, None]:
        transfer.process = self.env.active_process
        self.active.append(transfer)
        self._rebalance()
        while True:
            try:
                # Round to whole picoseconds so that float noise cannot leave 1e-12 B behind.
                wait = max(0.0, round(transfer.remaining_bytes / transfer.rate, 6))
                yield self.env.timeout(wait)
                break
            except simpy.Interrupt:
                continue  # rates changed; _rebalance already updated remaining_bytes
        self.active.remove(transfer)
        self._rebalance()

    def _rebalance(self) -> None:
        """Account the bytes moved so far, set new rates, restart the others' timers."""
        now = self.env.now
        for t in self.active:
            t.remaining_bytes = max(0.0, t.remaining_bytes - t.rate * (now - t.since_us))
            t.since_us = now
        total = sum(t.own_rate for t in self.active)
        scale = 1.0
        if len({t.direction for t in self.active}) == 2 and total > self.hw.duplex_bytes_per_us:
            scale = self.hw.duplex_bytes_per_us / total
        current = self.env.active_process
        for t in self.active:
            new_rate = t.own_rate * scale
            if new_rate != t.rate:
                changed = t.rate != 0.0
                t.rate = new_rate
                if changed and t.process is not current and t.process is not None \
                        and t.process.is_alive:
                    t.process.interrupt()
