"""The plan's copies between device and host: offloads (D2H) and prefetches (H2D) in flight, the
releases of device copies they wait for, and what the engine asks of them.

The engine issues copies (`offload`, `prefetch`), tells the component when an op has ended
(`op_ended`, needed only while `awaiting_release`) or when the trace frees a tensor a copy still
reads (`free_when_copied`), and asks what to wait for: a prefetch arriving (`arriving`), device
memory coming back (`releasing_memory`), copies in flight (`in_flight_events`,
`host_blocking`). All copy state lives here; the engine keeps the ops' progress (`finished`,
shared read-only).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Generator
from typing import Any

import simpy
from simpy.events import URGENT

from ..hardware import Hardware
from ..plan import Offload, Plan, Prefetch
from ..trace.schema import Copy
from .link import Link
from .memory import (
    DEVICE,
    FREED,
    HOST,
    OFFLOADING,
    PREFETCHING,
    DeviceMemory,
    OutOfMemory,
    Residency,
)

H2D_STREAM, D2H_STREAM = 1, 2

# The engine's allocation that may wait for memory: (tensor, op, state) -> fits.
Allocate = Callable[[int, "int | None", Residency], Generator[simpy.Event, Any, bool]]


class Transfers:
    """Copies of one run. `copies`: the finished ones, as run; `in_flight`: issued and not
    finished (compute runs slower meanwhile); `host_blocking`: pageable copies the host has not
    yet waited for (read it; `take_host_blocking` empties it)."""

    def __init__(self, env: simpy.Environment, hw: Hardware, plan: Plan, memory: DeviceMemory,
                 size: dict[int, int], finished: set[int], allocate: Allocate,
                 stop: Callable[[OutOfMemory], None]) -> None:
        """`allocate`: the engine's allocation that may wait for memory; `stop`: end the run
        out of memory (pinned host memory over the profile's limit)."""
        self.env = env
        self.hw = hw
        self.plan = plan
        self.link = Link(env, hw)
        self.memory = memory
        self.size = size
        self.finished = finished  # the engine's ops that have ended
        self.allocate = allocate
        self.stop = stop
        self.copies: list[Copy] = []
        # (a run without its memory log keeps no Copy records, only their latest end: its
        # verdict's iteration end, Engine.run)
        self.logged = memory.logged
        self.copies_end_us = 0.0
        self.in_flight = 0
        self.host_blocking: list[simpy.Event] = []
        self._copied_out: dict[int, simpy.Event] = {}  # D2H copy finished
        self._released: dict[int, simpy.Event] = {}    # ... and the device copy given back
        self._prefetched: dict[int, simpy.Event] = {}  # H2D copy finished
        self._release_op: dict[int, int] = {}          # offloaded tensor -> its release_after
        self._releasing: dict[int, list[int]] = defaultdict(list)  # release op -> offloaded
        self._release_at_end: dict[int, list[int]] = defaultdict(list)  # ... copied out
        self._free_pending: set[int] = set()           # freed by the trace while copied
        self._alive: dict[_Job, None] = {}             # copies (and give-backs) not ended
        self._suspended: dict[Generator[simpy.Event, Any, Any], None] = {}  # their waits
        # Copy streams' events on freed blocks (record_stream): PyTorch records an event on each
        # stream that used a block when the program frees it, and reuses the block only once
        # that event has passed, i.e. once every copy issued on that stream before the free has
        # ended, not only the block's own (see free_after_copies).
        self._d2h_active: dict[int, simpy.Event] = {}  # D2H copies issued, not ended
        self._h2d_active: dict[int, simpy.Event] = {}  # H2D copies with their block, not ended
        self._free_waits: dict[int, list[simpy.Event]] = {}  # offload freed: copies before it
        self._requested: set[int] = set()              # free_requested already logged
        self._returning: list[simpy.Event] = []        # detached blocks not yet given back
        # Blocks whose stream event has passed on the GPU but that PyTorch's allocator has not
        # seen pass: it queries events (process_events) at the start of each malloc, in host
        # time, and all of them (synchronize_and_free_events) before it frees its cached
        # segments on a failed allocation. (event time, block, tensor, op), in event order;
        # used only with `host_events` on (run_plan's).
        self.limbo: deque[tuple[float, object, int, int | None]] = deque()
        self.host_events = False
        self.h2d_used: set[int] = set()                # blocks a prefetch wrote (record_stream)

    # ------------------------------------------------------------ what the engine asks

    def close(self) -> None:
        """After the run: let go of every copy not ended (an out-of-memory run stops with
        copies in flight), close the waits still suspended and drop the engine's callbacks,
        so that no reference cycle keeps the run's records alive (Engine.run)."""
        for job in self._alive:
            job.tr = None
        self._alive.clear()
        for gen in self._suspended:
            gen.close()
        self._suspended.clear()
        self.link.close()
        self.allocate = self.stop = _has_run

    def alive(self) -> list[simpy.Event]:
        """The ends of the copies still running (the iteration ends when they do)."""
        ends = []
        for job in self._alive:
            if job.end is None:
                job.end = self.env.event()
            ends.append(job.end)
        return ends

    def take_host_blocking(self) -> list[simpy.Event]:
        """Pageable copies not yet finished that the host must wait for; forgets them all."""
        waits = [e for e in self.host_blocking if not e.triggered]
        self.host_blocking.clear()
        return waits

    def copying(self) -> bool:
        """Copies in flight or blocks waiting for their stream events: what a device-wide
        synchronize would bring back."""
        return bool(self.in_flight or self.limbo or self._returning)

    def copies_under_way(self) -> list[simpy.Event]:
        """The copies a device-wide synchronize waits for: every D2H copy issued and every
        H2D copy that holds its device block (one still waiting for memory is not on the GPU
        yet, and waiting for it could deadlock)."""
        return [*self._d2h_active.values(), *self._h2d_active.values()]

    def in_flight_events(self) -> list[simpy.Event]:
        """Copies not yet finished, both ways (what a Sync waits for)."""
        # (_d2h_active: the D2H copies not yet finished, without a scan of every offload)
        return [*self._d2h_active.values(),
                *(e for e in self._prefetched.values() if not e.triggered)]

    def releasing_memory(self, wait: str = "") -> list[simpy.Event]:
        """Device copies that will be given back once their D2H copy ends: only offloads whose
        release op has ended (the others also wait for an op, maybe the one allocating).
        `wait` "any" or "all": only what a Condition of that kind over them needs (the same
        step triggers it): of the offloads, the first (any) or the last (all) in issue order,
        whose copies end in that order (see _d2h_before), with every deferred block."""
        self._returning = [e for e in self._returning if not e.triggered]
        # Those still copying are the D2H copies not yet finished (_d2h_active: a scan of every
        # offload of the run here was a tenth of a profiling run); a device copy is given back
        # only once its copy has finished.
        finished, release_op = self.finished, self._release_op
        if wait == "any" and not self.plan.pinned_lazy:
            first = next((t for t in self._d2h_active if release_op[t] in finished), None)
            return ([] if first is None else [self._released[first]]) + self._returning
        copies = [self._released[t] for t in self._d2h_active if release_op[t] in finished]
        if wait == "all" and not self.plan.pinned_lazy:
            copies = copies[-1:]
        return copies + self._returning

    def _d2h_before(self) -> list[simpy.Event]:
        """What waiting for every D2H copy issued so far and not finished amounts to: the last
        one issued. One D2H engine serves copies in the order they ask for it and each copy's
        event succeeds in the step its copy ends, so the last one's event is processed last
        and a Condition over it triggers in the same step as one over all of them (a
        Condition over hundreds of copies per freed tensor was a sixth of an offloading
        run). Not so when buffers are pinned per copy first (Plan.pinned_lazy: a copy asks
        for the engine only after its own pinning time): then all of them."""
        if not self._d2h_active:
            return []
        if self.plan.pinned_lazy:
            return list(self._d2h_active.values())
        return [next(reversed(self._d2h_active.values()))]

    def leaving(self, tensor: int) -> bool:
        """Being offloaded past its release op: gone for a reader (it leaves when the copy
        ends, maybe while the reader runs)."""
        return self.memory.where(tensor) is OFFLOADING \
            and self._release_op.get(tensor) in self.finished

    def release_op(self, tensor: int) -> int:
        return self._release_op[tensor]

    def arriving(self, tensor: int) -> simpy.Event | None:
        """The prefetch of the tensor still in flight, if any."""
        ev = self._prefetched.get(tensor)
        if ev is not None and (not ev.triggered
                               or self.memory.where(tensor) is PREFETCHING):
            return ev
        return None

    # ------------------------------------------------------------ what the engine tells

    @property
    def awaiting_release(self) -> bool:
        """Some offload waits for its release op to end (else op_ended has nothing to do)."""
        return bool(self._release_at_end or self._releasing)

    def free_when_copied(self, tensor: int) -> None:
        """The trace frees a tensor a copy still reads: released when the copy ends."""
        self._free_pending.add(tensor)

    def op_ended(self, oid: int) -> None:
        """Offloads whose release op `oid` just ended: copied out, their device copy goes back;
        still copying, the program frees them now (PyTorch's memory_allocated drops:
        free_requested) but the block is reused only when the copy ends (record_stream;
        free_completed, by the offload process)."""
        for t in self._release_at_end.pop(oid, ()):
            if self._copied_out[t].triggered:
                self._free_waits[t] = self._d2h_before()
                self._release_offloaded(t, oid)
        for t in self._releasing.pop(oid, ()):
            if not self._copied_out[t].triggered \
                    and self.memory.where(t) is OFFLOADING:
                self.memory.request_free(t, self.env.now, oid)
                self._requested.add(t)
                self._free_waits[t] = self._d2h_before()

    # ------------------------------------------------------------ offloads

    def offload(self, off: Offload) -> None:
        """Start the D2H copy now (synchronously marked, so the op that issues it already sees
        the link busy); the device copy is given back when both the copy and op
        `release_after` have ended, whichever is later."""
        t = off.tensor
        if self.memory.where(t) is not DEVICE:
            return  # already away or not born: nothing to copy
        self.memory.mark(t, OFFLOADING)
        self._copied_out[t] = self.env.event()
        self._released[t] = self.env.event()
        release_after = off.release_after if off.release_after is not None else off.at_op
        self._release_op[t] = release_after
        if release_after in self.finished:
            # Issued after its release op ended (Offload(after=True) released by its own op,
            # as Layrub's are): the program frees it now, as the executor does at the op's end
            # (memory_allocated drops); the block comes back when the copy ends.
            self.memory.request_free(t, self.env.now, release_after)
            self._requested.add(t)
            self._free_waits[t] = [self._copied_out[t]] if not self.plan.pinned_lazy else \
                [*self._d2h_active.values(), self._copied_out[t]]  # (its own copy is the last)
        else:
            self._releasing[release_after].append(t)
        self._d2h_active[t] = self._copied_out[t]
        self.in_flight += 1
        if not self.plan.pinned:
            self.host_blocking.append(self._copied_out[t])
        _Offload(self, t, off.at_op, release_after)

    def _copied(self, t: int, release_after: int, start: float, end: float) -> None:
        """An offload's D2H copy has ended."""
        size = self.size[t]
        self.in_flight -= 1
        if self.logged:
            self.copies.append(Copy(t, "d2h", size, start, end - start, D2H_STREAM))
        elif start + (end - start) > self.copies_end_us:  # (the Copy's start_us + dur_us)
            self.copies_end_us = start + (end - start)
        self._d2h_active.pop(t, None)
        self._copied_out[t].succeed()
        if release_after in self.finished:
            self._release_offloaded(t, release_after)
        else:
            self._release_at_end[release_after].append(t)

    def _release_offloaded(self, t: int, op: int) -> None:
        waits = [e for e in self._free_waits.pop(t, ()) if not e.triggered]
        requested = t in self._requested
        self._requested.discard(t)
        self.h2d_used.discard(t)
        state = HOST
        if t in self._free_pending:  # the trace freed it meanwhile: no need for the host copy
            self._free_pending.discard(t)
            self.memory.unpin(self.size[t])
            state = FREED
        if waits:  # other copies issued before the free still run: the event has not passed
            self._defer(self.memory.detach(t, self.env.now, op, state, requested), t, op, waits)
        elif self.host_events:
            block = self.memory.detach(t, self.env.now, op, state, requested)
            if block is not None:
                self.limbo.append((self.env.now, block, t, op))
        else:
            self.memory.release(t, self.env.now, op, state)
        self._released[t].succeed()

    def free_after_copies(self, t: int, op: int | None, state: Residency) -> bool:
        """The program frees `t`, whose block a prefetch wrote (the executor's record_stream on
        the H2D stream): PyTorch records an event on that stream at the free and reuses the
        block only once it has passed, after every H2D copy issued before the free. True when
        some still run: the block is detached now (free_requested) and given back when they
        end (free_completed); False: nothing to wait for, the caller frees it."""
        self.h2d_used.discard(t)
        # (the last H2D copy issued ends last: one engine, asked in the order they were
        # issued, each event succeeding as its copy ends; see _d2h_before)
        waits = [next(reversed(self._h2d_active.values()))] if self._h2d_active else []
        if not waits:
            return False
        self._defer(self.memory.detach(t, self.env.now, op, state), t, op, waits)
        return True

    def _defer(self, block: object | None, t: int, op: int | None,
               waits: list[simpy.Event]) -> None:
        if block is None:
            return
        done = self.env.event()
        self._returning.append(done)
        _GiveBack(self, block, t, op, waits, done)

    def _given_back(self, block: object, t: int, op: int | None, done: simpy.Event) -> None:
        """A detached block's stream events have passed."""
        if self.host_events:
            self.limbo.append((self.env.now, block, t, op))
        else:
            self.memory.give_back(block, t, self.env.now, op)
        done.succeed()

    def process_events(self, host_us: float = float("inf")) -> None:
        """The allocator queries its blocks' events at `host_us` (a malloc the host issues
        then; inf: all of them, as before it frees its cached segments): the blocks whose event
        had passed come back."""
        limbo, now, give_back = self.limbo, self.env.now, self.memory.give_back
        while limbo and limbo[0][0] <= host_us:
            _, block, t, op = limbo.popleft()
            give_back(block, t, now, op)

    # ------------------------------------------------------------ prefetches

    def prefetch(self, pre: Prefetch) -> None:
        t = pre.tensor
        if t in self._prefetched and not self._prefetched[t].triggered:
            return  # already on its way
        self._prefetched[t] = self.env.event()
        self.in_flight += 1
        if not self.plan.pinned:
            self.host_blocking.append(self._prefetched[t])
        _Prefetch(self, pre, self._prefetched[t])

    def _arrived(self, pre: Prefetch, done: simpy.Event, start: float, end: float) -> None:
        """A prefetch's H2D copy has ended."""
        t = pre.tensor
        size = self.size[t]
        self.in_flight -= 1
        self._h2d_active.pop(t, None)
        if self.logged:
            self.copies.append(Copy(t, "h2d", size, start, end - start, H2D_STREAM))
        elif start + (end - start) > self.copies_end_us:  # (likewise)
            self.copies_end_us = start + (end - start)
        self.memory.unpin(size)
        self.memory.mark(t, DEVICE)
        if t in self._free_pending:
            self._free_pending.discard(t)
            self.h2d_used.discard(t)
            self.memory.release(t, self.env.now, pre.needed_by, FREED)
        done.succeed()


class _Job:
    """A copy (or a detached block's return) as the callbacks of the events it waits for, in
    place of a SimPy process (the copies' processes were a fifth of an offloading plan's
    SimPy events, and their resumptions more): it starts in an event of SimPy's Initialize
    priority (URGENT) scheduled where the process would have been, and goes on in the steps
    the process would have been resumed in, in the same order among each event's callbacks.
    Its end is an event only where something waits for it (Transfers.alive); a process's end
    was an event for every copy, processed with nothing to call."""

    __slots__ = ("tr", "end")

    def __init__(self, tr: Transfers) -> None:
        self.tr: Transfers | None = tr
        self.end: simpy.Event | None = None
        env = tr.env
        start = simpy.Event(env)
        start._ok, start._value = True, None  # noqa: SLF001
        start.callbacks.append(self.begin)  # type: ignore[union-attr]
        env.schedule(start, URGENT)
        tr._alive[self] = None  # noqa: SLF001

    def begin(self, _: object) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Its last step (where its process ended)."""
        assert self.tr is not None
        del self.tr._alive[self]  # noqa: SLF001
        if self.end is not None:
            self.end.succeed()


def _on(event: simpy.Event, then: Callable[[Any], None]) -> None:
    """`then(event)` once the event is processed, as a process that yields it is resumed (at
    once where it already was)."""
    if event.callbacks is not None:
        event.callbacks.append(then)
    else:
        then(event)


class _Offload(_Job):
    __slots__ = ("t", "at_op", "release_after")

    def __init__(self, tr: Transfers, t: int, at_op: int, release_after: int) -> None:
        self.t, self.at_op, self.release_after = t, at_op, release_after
        super().__init__(tr)

    def begin(self, _: object) -> None:
        tr = self.tr
        assert tr is not None
        if tr.plan.pinned_lazy:  # cudaMallocHost per buffer, before the copy can start
            _on(tr.env.timeout(tr.hw.pinned_alloc_us_per_gib * tr.size[self.t] / 2**30),
                self.pin)
        else:
            self.pin(None)

    def pin(self, _: object) -> None:
        tr, t = self.tr, self.t
        assert tr is not None
        size = tr.size[t]
        if not tr.memory.pin(size):  # cudaMallocHost fails: the run ends there
            tr.stop(tr.memory.pinned_oom(self.at_op, t, size))
            self.finish()
            return
        tr.link.start("d2h", size, tr.plan.pinned, self.copied)

    def copied(self, start: float, end: float) -> None:
        tr = self.tr
        assert tr is not None
        tr._copied(self.t, self.release_after, start, end)  # noqa: SLF001
        self.finish()


class _Prefetch(_Job):
    __slots__ = ("pre", "done", "gen")

    def __init__(self, tr: Transfers, pre: Prefetch, done: simpy.Event) -> None:
        self.pre, self.done = pre, done
        self.gen: Generator[simpy.Event, Any, bool] | None = None
        super().__init__(tr)

    def begin(self, _: object) -> None:
        tr = self.tr
        assert tr is not None
        pending = tr._released.get(self.pre.tensor)  # noqa: SLF001
        if pending is not None and not pending.triggered:
            _on(pending, self.fetch)  # the data must have left before it can come back
        else:
            self.fetch(None)

    def fetch(self, _: object) -> None:
        tr, pre = self.tr, self.pre
        assert tr is not None
        if tr.memory.where(pre.tensor) is not HOST:
            tr.in_flight -= 1
            self.done.succeed()
            self.finish()
            return
        self.gen = tr.allocate(pre.tensor, pre.at_op, PREFETCHING)
        self.allocating(None)

    def allocating(self, event: simpy.Event | None) -> None:
        """Its allocation (the engine's, which may wait for memory) run as a SimPy process
        would run it from here, resumed by the events it yields (most yield none)."""
        tr, gen = self.tr, self.gen
        assert tr is not None and gen is not None
        while True:
            try:
                event = gen.send(None if event is None else event._value)  # noqa: SLF001
            except StopIteration as stop:
                if event is not None:
                    tr._suspended.pop(gen, None)  # noqa: SLF001
                self.gen = None
                self.allocated(stop.value)
                return
            if event.callbacks is not None:
                event.callbacks.append(self.allocating)
                tr._suspended[gen] = None  # noqa: SLF001
                return

    def allocated(self, ok: bool) -> None:
        tr, t = self.tr, self.pre.tensor
        assert tr is not None
        if not ok:
            self.finish()
            return
        tr._h2d_active[t] = self.done  # noqa: SLF001
        tr.h2d_used.add(t)
        tr.link.start("h2d", tr.size[t], tr.plan.pinned, self.arrived)

    def arrived(self, start: float, end: float) -> None:
        tr = self.tr
        assert tr is not None
        tr._arrived(self.pre, self.done, start, end)  # noqa: SLF001
        self.finish()


class _GiveBack(_Job):
    __slots__ = ("block", "t", "op", "waits", "done")

    def __init__(self, tr: Transfers, block: object, t: int, op: int | None,
                 waits: list[simpy.Event], done: simpy.Event) -> None:
        self.block, self.t, self.op, self.waits, self.done = block, t, op, waits, done
        super().__init__(tr)

    def begin(self, _: object) -> None:
        assert self.tr is not None
        _on(self.tr.env.all_of(self.waits), self.back)

    def back(self, _: object) -> None:
        tr = self.tr
        assert tr is not None
        tr._given_back(self.block, self.t, self.op, self.done)  # noqa: SLF001
        self.finish()


def _has_run(*_: object) -> Any:
    raise RuntimeError("the run is over: its copies can no longer allocate or stop it")
