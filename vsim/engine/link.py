"""The host link: one copy engine per direction, sharing a duplex limit, as a fluid model.

Each direction is a SimPy Resource of capacity 1 (one DMA engine, copies in issue order). A copy
first pays its per-copy latency, then moves bytes at the direction's effective bandwidth for its
size (Hardware.CopyPath). While both directions move bytes, their rates are scaled down together
so that their sum stays within the duplex limit (measured on the H100 machine: 90 GB/s together
instead of 2 x 55). Rates change only when a transfer starts or ends; at each change the running
transfers are interrupted, their remaining bytes updated and their timers restarted.

A copy is driven by the callbacks of the events it waits for (`Link.start`), not by a SimPy
process of its own: the same events at the same steps (the engine's grant, the latency and
transfer timeouts, an interruption at SimPy's URGENT priority), without a generator to resume
at each (`Link.copy` is the generator form, for a process that waits for its copy).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator

import simpy
from simpy.events import URGENT

from ..hardware import CopyPath, Hardware
from .sim import Event


class _Transfer:
    """One copy (Link.start): its engine's grant, its latency, then its bytes at the rate the
    link gives it, restarted whenever that rate changes."""

    __slots__ = ("link", "direction", "size", "path", "rates", "then", "remaining_bytes",
                 "own_rate", "rate", "since_us", "start_us", "pending")

    def __init__(self, link: Link, direction: str, size: int, pinned: bool,
                 then: Callable[[float, float], None]) -> None:
        self.link = link
        self.direction = direction
        self.size = size
        self.path, self.rates = link._paths[(direction, pinned)]  # noqa: SLF001
        self.then: Callable[[float, float], None] | None = then
        self.remaining_bytes = float(size)
        self.own_rate = 0.0  # bytes/us this copy would get alone
        self.rate = 0.0
        self.since_us = 0.0
        self.start_us = 0.0
        self.pending: simpy.Event | None = None  # the timeout its bytes wait for

    def granted(self, _: object) -> None:
        """The engine is this copy's: its latency, then its bytes. A timeout that would be the
        next event processed (nothing queued until its time) is skipped and the clock set as
        processing it would set it, as Engine._stream does: the compute streams mostly wait
        for the copies, and four in five of the copies' timeouts were such (superneurons,
        accudnn on GPT-2)."""
        env = self.link.env
        self.start_us = now = env._now  # noqa: SLF001
        if self.size <= 0:
            self.ended()
            return
        latency = self.path.latency_us
        then = now + latency
        queue = env._queue  # noqa: SLF001  (SimPy's event heap, as Engine._stream reads it)
        if queue and queue[0][0] <= then:
            env.timeout(latency).callbacks.append(self.moving)  # type: ignore[union-attr]
            return
        env._now = then  # noqa: SLF001
        self.moving(None)

    def moving(self, _: object) -> None:
        """Its latency paid: its bytes join the link's."""
        link, size = self.link, self.size
        rate = self.rates.get(size)
        if rate is None:
            path = self.path
            rate = self.rates[size] = path.bandwidth_bytes_per_us * path.efficiency_at(size)
        self.own_rate = rate
        active = link.active
        active.append(self)
        if len(active) > 1:
            link._rebalance()  # noqa: SLF001
        else:  # alone on the link: _rebalance's outcome
            self.since_us = link.env._now  # noqa: SLF001
            self.rate = rate
        self.wait()

    def wait(self) -> None:
        """Wait for its remaining bytes at its rate (fast-forwarded as `granted`)."""
        env = self.link.env
        # Round to whole picoseconds so that float noise cannot leave 1e-12 B behind.
        wait = max(0.0, round(self.remaining_bytes / self.rate, 6))
        then = env._now + wait  # noqa: SLF001
        queue = env._queue  # noqa: SLF001
        if queue and queue[0][0] <= then:
            self.pending = env.timeout(wait)
            self.pending.callbacks.append(self.moved)  # type: ignore[union-attr]
            return
        env._now = then  # noqa: SLF001
        self.moved(None)

    def interrupt(self) -> None:
        """Its rate changed: an interruption at SimPy's URGENT priority (simpy's Interruption,
        which interrupted the copy's process) restarts its timer."""
        env = self.link.env
        event = simpy.Event(env)
        event._ok, event._value = True, None  # noqa: SLF001
        event.callbacks.append(self.interrupted)  # type: ignore[union-attr]
        env.schedule(event, URGENT)

    def interrupted(self, _: object) -> None:
        pending = self.pending
        if pending is None:  # already ended (SimPy ignores an interruption of a dead process)
            return
        pending.callbacks.remove(self.moved)  # type: ignore[union-attr]
        self.pending = None
        self.wait()  # _rebalance already updated remaining_bytes

    def moved(self, _: object) -> None:
        self.pending = None
        link = self.link
        active = link.active
        active.remove(self)
        if active:
            link._rebalance()  # noqa: SLF001
        self.ended()

    def ended(self) -> None:
        link = self.link
        end = link.env._now  # noqa: SLF001
        link.busy_us[self.direction] += end - self.start_us
        link.engines[self.direction].release()
        then, self.then = self.then, None
        assert then is not None
        then(self.start_us, end)


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
        slot = Event(self.env)
        self.waiting.append(slot)
        if not self.busy:
            self._grant(None)
        return slot

    def _grant(self, _: object) -> None:
        if not self.busy and self.waiting:
            self.busy = True
            self.waiting.popleft().succeed()

    def release(self) -> None:
        """The engine is free again. Its grant to the oldest waiting request is an event; with
        none waiting there is none: a request made before that event's step finds the engine
        free and takes it at once (its own grant comes after that event, which then finds the
        engine busy), so the event would grant nothing."""
        self.busy = False
        if self.waiting:
            done = Event(self.env)
            done.callbacks.append(self._grant)  # type: ignore[union-attr]
            done.succeed()


class Link:
    """Copy engines for 'h2d' and 'd2h'. `start()` runs a copy and calls back at its end;
    `copy()` is its SimPy process generator form."""

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

    def start(self, direction: str, size_bytes: int, pinned: bool,
              then: Callable[[float, float], None]) -> None:
        """Ask `direction`'s engine for a copy of `size_bytes` and move them; `then(start_us,
        end_us)` (on the copy engine) is called in the step the copy ends, once the engine is
        given back, as a process's `yield from copy(...)` goes on."""
        transfer = _Transfer(self, direction, size_bytes, pinned, then)
        self.engines[direction].request().callbacks.append(  # type: ignore[union-attr]
            transfer.granted)

    def copy(self, direction: str, size_bytes: int, pinned: bool = True
             ) -> Generator[simpy.Event, object, tuple[float, float]]:
        """Move `size_bytes` in `direction`; returns (start_us, end_us) on the copy engine."""
        done = self.env.event()

        def ended(start: float, end: float) -> None:
            done.succeed((start, end))
        self.start(direction, size_bytes, pinned, ended)
        times = yield done
        assert isinstance(times, tuple)
        return times

    def close(self) -> None:
        """After the run: forget the copies still under way (their callbacks point back at
        whoever waits for them)."""
        for transfer in self.active:
            transfer.then = None
        self.active.clear()
        for engine in self.engines.values():
            engine.waiting.clear()

    def active_directions(self) -> int:
        return len({t.direction for t in self.active})

    def _rebalance(self) -> None:
        """Account the bytes moved so far, set new rates, restart the others' timers (the copy
        that calls, starting or ending, keeps or has left its own)."""
        now = self.env._now  # noqa: SLF001
        for t in self.active:
            t.remaining_bytes = max(0.0, t.remaining_bytes - t.rate * (now - t.since_us))
            t.since_us = now
        total = math.fsum(t.own_rate for t in self.active)
        scale = 1.0
        if len({t.direction for t in self.active}) == 2 and total > self.hw.duplex_bytes_per_us:
            scale = self.hw.duplex_bytes_per_us / total
        for t in self.active:
            new_rate = t.own_rate * scale
            if new_rate != t.rate:
                changed = t.rate != 0.0  # (0: the copy just starting, which calls)
                t.rate = new_rate
                if changed:
                    t.interrupt()
