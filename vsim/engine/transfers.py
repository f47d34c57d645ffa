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
        self.in_flight = 0
        self.host_blocking: list[simpy.Event] = []
        self._copied_out: dict[int, simpy.Event] = {}  # D2H copy finished
        self._released: dict[int, simpy.Event] = {}    # ... and the device copy given back
        self._prefetched: dict[int, simpy.Event] = {}  # H2D copy finished
        self._release_op: dict[int, int] = {}          # offloaded tensor -> its release_after
        self._releasing: dict[int, list[int]] = defaultdict(list)  # release op -> offloaded
        self._release_at_end: dict[int, list[int]] = defaultdict(list)  # ... copied out
        self._free_pending: set[int] = set()           # freed by the trace while copied
        self._procs: list[simpy.Process] = []          # offload and prefetch processes
        self._gens: list[Generator[simpy.Event, Any, Any]] = []  # ... and their generators
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

    def _start(self, gen: Generator[simpy.Event, Any, Any]) -> None:
        self._gens.append(gen)
        self._procs.append(self.env.process(gen))

    def close(self) -> None:
        """After the run: end every copy process still suspended (an out-of-memory run stops
        with copies in flight) and drop the engine's callbacks, so that no reference cycle
        keeps the run's records alive (Engine.run)."""
        for gen in self._gens:
            gen.close()
        self.allocate = self.stop = _has_run

    def alive(self) -> list[simpy.Process]:
        """Copy processes still running (the iteration ends when they do)."""
        return [p for p in self._procs if p.is_alive]

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
        for t in self._release_at_end.pop(oid, []):
            if self._copied_out[t].triggered:
                self._free_waits[t] = self._d2h_before()
                self._release_offloaded(t, oid)
        for t in self._releasing.pop(oid, []):
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
        self._start(self._offload(t, off.at_op, release_after))

    def _offload(self, t: int, at_op: int, release_after: int
                 ) -> Generator[simpy.Event, Any, None]:
        size = self.size[t]
        if self.plan.pinned_lazy:  # cudaMallocHost per buffer, before the copy can start
            yield self.env.timeout(self.hw.pinned_alloc_us_per_gib * size / 2**30)
        if not self.memory.pin(size):  # cudaMallocHost fails: the run ends there
            self.stop(self.memory.pinned_oom(at_op, t, size))
            return
        start, end = yield from self.link.copy("d2h", size, self.plan.pinned)
        self.in_flight -= 1
        self.copies.append(Copy(t, "d2h", size, start, end - start, D2H_STREAM))
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
        self._start(self._give_back(block, t, op, waits, done))

    def _give_back(self, block: object, t: int, op: int | None, waits: list[simpy.Event],
                   done: simpy.Event) -> Generator[simpy.Event, Any, None]:
        yield self.env.all_of(waits)
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
        self._start(self._prefetch(pre))

    def _prefetch(self, pre: Prefetch) -> Generator[simpy.Event, Any, None]:
        t = pre.tensor
        done = self._prefetched[t]
        pending = self._released.get(t)
        if pending is not None and not pending.triggered:
            yield pending  # the data must have left before it can come back
        if self.memory.where(t) is not HOST:
            self.in_flight -= 1
            done.succeed()
            return
        if not (yield from self.allocate(t, pre.at_op, PREFETCHING)):
            return
        self._h2d_active[t] = done
        self.h2d_used.add(t)
        size = self.size[t]
        start, end = yield from self.link.copy("h2d", size, self.plan.pinned)
        self.in_flight -= 1
        self._h2d_active.pop(t, None)
        self.copies.append(Copy(t, "h2d", size, start, end - start, H2D_STREAM))
        self.memory.unpin(size)
        self.memory.mark(t, DEVICE)
        if t in self._free_pending:
            self._free_pending.discard(t)
            self.h2d_used.discard(t)
            self.memory.release(t, self.env.now, pre.needed_by, FREED)
        done.succeed()


def _has_run(*_: object) -> Any:
    raise RuntimeError("the run is over: its copies can no longer allocate or stop it")
