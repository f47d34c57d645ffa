"""The host link: one copy engine per direction, sharing a duplex limit, as a fluid model.

Each direction is a SimPy Resource of capacity 1 (one DMA engine, copies in issue order). A copy
first pays its per-copy latency, then moves bytes at the direction's effective bandwidth for its
size (Hardware.CopyPath). While both directions move bytes, their rates are scaled down together
so that their sum stays within the duplex limit (measured on the H100 machine: 90 GB/s together
instead of 2 x 55). Rates change only when a transfer starts or ends; at each change the running
transfers are interrupted, their remaining bytes updated and their timers restarted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass

import simpy

from ..hardware import CopyPath, Hardware


@dataclass(slots=True)
class _Transfer:
    direction: str
    remaining_bytes: float
    own_rate: float  # bytes/us this copy would get alone
    rate: float = 0.0
    since_us: float = 0.0
    process: simpy.Process | None = None


class _CopyEngine:
    """One DMA engine: simpy.Resource(capacity=1) as the link uses it, with its events and their
    order (a request is granted, as an event scheduled then, when made if the engine is free
    and no earlier request waits; a release schedules an event whose processing grants the
    oldest waiting request, unless a request made meanwhile already did), without its
    Request/Release objects, queues of both kinds and context managers (a fifth of an
    offloading plan's run)."""

    __slots__ = ("env", "busy", "waiting")

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.busy = False
        self.waiting: deque[simpy.Event] = deque()

    def request(self) -> simpy.Event:
        slot = simpy.Event(self.env)
        self.waiting.append(slot)
        if not self.busy:
            self._grant(None)
        return slot

    def _grant(self, _: object) -> None:
        if not self.busy and self.waiting:
            self.busy = True
            self.waiting.popleft().succeed()

    def release(self) -> None:
        self.busy = False
        done = simpy.Event(self.env)
        done.callbacks.append(self._grant)  # type: ignore[union-attr]
        done.succeed()


class Link:
    """Copy engines for 'h2d' and 'd2h'. `copy()` is a SimPy process generator."""

    def __init__(self, env: simpy.Environment, hw: Hardware) -> None:
        self.env = env
        self.hw = hw
        self.engines = {"h2d": _CopyEngine(env), "d2h": _CopyEngine(env)}
        self.active: list[_Transfer] = []
        self.busy_us = {"h2d": 0.0, "d2h": 0.0}
        # per (direction, pinned): the path and its rate by size (CopyPath.efficiency_at per
        # copy was a tenth of the link's time)
        self._paths: dict[tuple[str, bool], tuple[CopyPath, dict[int, float]]] = {
            (d, p): (self.path(d, p), {}) for d in ("h2d", "d2h") for p in (True, False)}

    def path(self, direction: str, pinned: bool) -> CopyPath:
        link = self.hw.h2d if direction == "h2d" else self.hw.d2h
        return link.pinned if pinned else link.pageable

    def copy(self, direction: str, size_bytes: int, pinned: bool = True
             ) -> Generator[simpy.Event, object, tuple[float, float]]:
        """Move `size_bytes` in `direction`; returns (start_us, end_us) on the copy engine."""
        path, rates = self._paths[(direction, pinned)]
        engine = self.engines[direction]
        env = self.env
        queue = env._queue  # noqa: SLF001  (SimPy's event heap, as Engine._stream reads it)
        yield engine.request()
        # Resumed by the grant, then by its own timeouts (or an interruption): events that
        # this process alone waits for. So a timeout that would be the next event processed
        # (nothing queued until its time) is skipped and the clock set as processing it would
        # set it, as Engine._stream does: the compute streams mostly wait for the copies, and
        # four in five of the copies' timeouts were such (superneurons, accudnn on GPT-2).
        start = env.now
        if size_bytes > 0:
            now = env._now  # noqa: SLF001
            then = now + path.latency_us
            if queue and queue[0][0] <= then:
                yield env.timeout(path.latency_us)
            else:
                env._now = then  # noqa: SLF001
            rate = rates.get(size_bytes)
            if rate is None:
                rate = rates[size_bytes] = \
                    path.bandwidth_bytes_per_us * path.efficiency_at(size_bytes)
            # (_move written out: one generator frame less per copy)
            transfer = _Transfer(direction, float(size_bytes), rate)
            transfer.process = env.active_process
            active = self.active
            active.append(transfer)
            if len(active) > 1:
                self._rebalance()
            else:  # alone on the link: _rebalance's outcome
                transfer.since_us = env.now
                transfer.rate = rate
            while True:
                try:
                    # Round to whole picoseconds so that float noise cannot leave 1e-12 B
                    # behind.
                    wait = max(0.0, round(transfer.remaining_bytes / transfer.rate, 6))
                    now = env._now  # noqa: SLF001
                    then = now + wait
                    if queue and queue[0][0] <= then:
                        yield env.timeout(wait)
                    else:
                        env._now = then  # noqa: SLF001
                    break
                except simpy.Interrupt:
                    continue  # rates changed; _rebalance already updated remaining_bytes
            active.remove(transfer)
            if active:
                self._rebalance()
        end = env.now
        self.busy_us[direction] += end - start
        engine.release()
        return start, end

    def active_directions(self) -> int:
        return len({t.direction for t in self.active})

    def _rebalance(self) -> None:
        """Account the bytes moved so far, set new rates, restart the others' timers."""
        now = self.env.now
        for t in self.active:
            t.remaining_bytes = max(0.0, t.remaining_bytes - t.rate * (now - t.since_us))
            t.since_us = now
        total = math.fsum(t.own_rate for t in self.active)
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
