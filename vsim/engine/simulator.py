"""Replay a trace under a plan on a SimPy model of one GPU: streams, copy engines, memory.

Each CUDA stream of the trace is a SimPy process that runs its ops in trace order. An op starts at
the latest of: the previous op on its stream ending plus the recorded launch gap (the GPU idle time
before it in the recording), its dependencies finishing, and the prefetches it needs arriving;
waiting beyond the gap is stall time. Then its outputs are allocated, the copies the plan issues
at it start, it runs for its (possibly retimed) duration, and the tensors it frees are released.
A failed allocation ends the run with an OutOfMemory result rather than an exception.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from ..allocator.base import Allocator
from ..hardware import Hardware
from ..host import HostModel
from ..plan import Plan, PlanIndex, Recompute, Retime
from ..trace.schema import Copy, Op, Tensor, Trace
from .hostclock import HostClock
from .memory import (
    DEVICE,
    DROPPED,
    FREED,
    HOST,
    OFFLOADING,
    PREFETCHING,
    RESIDENT,
    UNBORN,
    DeviceMemory,
    OutOfMemory,
    Residency,
)
from .prep import Step, trace_prep
from .sim import Environment
from .transfers import D2H_STREAM, H2D_STREAM, Transfers

__all__ = ["D2H_STREAM", "H2D_STREAM", "Engine", "EngineOutput", "ExecutedOp", "PlanError"]


class PlanError(Exception):
    """The plan broke an invariant (an op read a tensor that was not on the GPU). A bug in a
    policy, not bad user input."""


# The allocator's driver calls (Allocator.driver_calls) counted as PyTorch's memory_stats counts
# them (torch.cuda.memory_stats; a measured run's allocator_churn): a call's counter and the
# counter of its bytes (reserved_bytes.all.allocated / .freed: memory mapped or cudaMalloc'd,
# unmapped or cudaFree'd)
CHURN_CALLS = {"sync": ("num_alloc_retries", ""),
               "malloc": ("num_device_alloc", "reserved_bytes.all.allocated"),
               "map": ("num_device_alloc", "reserved_bytes.all.allocated"),
               "free": ("num_device_free", "reserved_bytes.all.freed"),
               "unmap": ("num_device_free", "reserved_bytes.all.freed")}
CHURN = tuple(dict.fromkeys(k for keys in CHURN_CALLS.values() for k in keys if k))


@dataclass(slots=True)
class ExecutedOp:
    op: Op
    start_us: float
    dur_us: float
    stall_us: float
    recompute_of: int | None = None
    without_workspace: bool = False  # ran its workspace-free algorithm (a Retime or fallback)


@dataclass
class EngineOutput:
    """Raw outcome of a run; vsim.engine.run turns it into a predicted trace and a report."""

    executed: list[ExecutedOp]
    copies: list[Copy]
    memory: DeviceMemory
    oom: OutOfMemory | None
    end_us: float
    notes: list[str] = field(default_factory=list)
    # The ends of the iterations a measurement times (4 to 13: 3 warm-up, 10 timed), this one's
    # included, when the run simulated from a first iteration (vsim.engine._Run); empty
    # otherwise
    timed_ends_us: list[float] = field(default_factory=list)
    # The iterations the run simulated, the first one included (its last is this one)
    iterations: int = 1
    # This iteration's allocator driver calls, under PyTorch's memory_stats names: retries (a
    # device-wide synchronize, then the cache freed or pages unmapped), cudaMalloc or page
    # maps, cudaFree or page unmaps, and their bytes (vsim.runtime.results.CHURN_COUNTERS);
    # in a run from a first iteration, their mean over the timed iterations (vsim.engine._Run)
    churn: dict[str, float] = field(default_factory=dict)


class Engine:
    """One simulation. Build it, call run() once."""

    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, allocator: Allocator, *,
                 first_use: dict[int, list[int]] | None = None,
                 resident_blocks: dict[int, object] | None = None,
                 fallback: Mapping[int, Retime] | None = None,
                 host: HostModel | None = None, tracked: bool = False,
                 clock: HostClock | None = None, index: PlanIndex | None = None,
                 transients: Mapping[int, int] | None = None,
                 scale: Mapping[int, float] | None = None, host_scale: float = 1.0,
                 logged: bool = True) -> None:
        """`first_use` (a first iteration): resident tensors created as the given ops launch
        (vsim.allocator.first_use). `resident_blocks`: resident tensors already in `allocator`
        (left by a previous iteration), adopted instead of allocated. `fallback`: per
        convolution, its workspace-free algorithm, taken when its workspace cannot be had, as
        PyTorch falls back to another cuDNN engine (ops that did: `fell_back`). `host`: the
        host's own time (vsim.engine.hostclock); None: the recorded launch gaps alone.
        `clock`: an earlier iteration's clock of the same plan and host (HostClock.fresh: its
        issue times are reused), instead of building one from `host`. `index`: the plan's
        PlanIndex, if made already. `transients`: per op,
        a block it allocates and frees before its workspace (run_plan's `dgrad_workspace`).
        `scale`, `host_scale`: a timing draw's iteration (run_plan's `draw`): per op, its
        duration as a multiple of the recorded one; the host's issue times, likewise.
        `logged` False: no memory log, no ExecutedOp or Copy records, only the run's end
        (run_plan's)."""
        self.trace = trace
        self.fallback: Mapping[int, Retime] = {} if fallback is None else fallback
        self.fell_back: list[int] = []
        self.first_use = dict(first_use or {})
        # Tensors created at first use and not yet created: an op that reads one creates it
        # (the op placed to create it may run later, on another stream).
        self.awaiting = {t for ts in self.first_use.values() for t in ts}
        self.resident_blocks = resident_blocks or {}
        self.hw = hw
        self.plan = plan
        # read only: what the run changes is the engine's (`index`: PlanIndex(plan) from an
        # earlier iteration of the same plan)
        self.index = PlanIndex(plan) if index is None else index
        # The plan's retimes and, added as ops fall back, their workspace-free algorithms.
        self.retime: dict[int, Retime] = dict(self.index.retime)
        # per op with prefetches to wait for, what it waits to have on the GPU (_reads_ready)
        self._needed: dict[int, tuple[int, ...]] = self.index.memo.setdefault("reads needed", {})
        self.env = Environment()
        # Host buffers count as pinned only when allocated per copy; a pool is reported as a whole
        # (Plan.pinned_pool_bytes) and pageable staging pins nothing.
        self.memory = DeviceMemory(allocator,
                                   count_pinned=plan.pinned and not plan.pinned_pool_bytes,
                                   pinned_limit_bytes=hw.pinned_limit_bytes, logged=logged)
        prep = trace_prep(trace)  # read only, shared by every run on the trace
        self.prep = prep
        self.tensors: dict[int, Tensor] = prep.tensors
        self.size = prep.size
        # Micro-batched convolutions (a Retime with parts > 1) ask for memory as their calls
        # do (vsim.runtime.microbatch): per part, its results, then its workspaces, each freed
        # at once; the whole batch's results after the first part's, whose are freed then
        # (_part_round). Their recorded workspace tensor is none of these: it is never
        # allocated (skipped where outputs are, as a workspace-free op's).
        self.parts: dict[int, tuple[int, tuple[int, ...]]] = {}
        for r in self.retime.values():
            if r.parts > 1:
                op = prep.ops[r.op]
                ws = [t for t in op.writes if prep.tensors[t].kind == "workspace"]
                results = sum(prep.size[t] for t in op.writes if t not in ws)
                # a backward convolution's data-gradient workspace before its weight-gradient
                # one (_transient_of), each a part's
                calls = [(transients or {}).get(op.id, 0), sum(prep.size[t] for t in ws)]
                self.parts[op.id] = (-(-results // r.parts),
                                     tuple(-(-b // r.parts) for b in calls if b))
        self.ops: dict[int, Op] = prep.ops
        self.streams = prep.streams
        # SimPy events only for ops another stream waits for.
        event = self.env.event
        self.done: dict[int, simpy.Event] = {d: event() for d in prep.waited}
        self.completed: set[int] = set()              # ops past their end and any sync
        self.finished: set[int] = set()               # ops that have ended
        self.transfers = Transfers(self.env, hw, plan, self.memory, self.size, self.finished,
                                   self._alloc_waiting, self._stop)
        self.executed: list[ExecutedOp] = []
        # (logged False: no ExecutedOp records either, only the latest end of an op: a
        # profiling run's verdict needs its end alone)
        self.logged = logged
        self.ops_end_us = 0.0
        self.host_wait_us = 0.0  # GPU idle on a stream waiting for the host to issue its op
        self.churn: dict[str, float] = dict.fromkeys(CHURN, 0)  # EngineOutput.churn
        self.oom: OutOfMemory | None = None
        self.halt = self.env.event()
        self.clock = clock.fresh(host_scale) if clock is not None else \
            None if host is None else HostClock(trace, host, tracked, self.index).fresh(host_scale)
        # A timing draw's (vsim.engine.TimingDraw): each op's duration this iteration, as a
        # multiple of its recorded one; None: as recorded.
        self.scale = scale
        self.allocator = allocator
        allocator.driver_calls.clear()  # a previous iteration's were charged there
        # PyTorch's allocator sees a freed block's stream event pass only at a malloc, in host
        # time (Transfers.limbo): with a host clock to say when the host allocates
        events = allocator.host_events and self.clock is not None
        self.transfers.host_events = events
        allocator.before_release = self.transfers.process_events if events else None
        # ... and a request that finds no cached block and no room under the capacity makes it
        # synchronize the device first, waiting for every copy in flight, then free its cache
        # and retry (release_cached_blocks): the copies' blocks come back before the cache is
        # freed. Plan.wait_for_memory is that, not a wait of the runtime's own (vsim.runtime).
        self.sync_at_capacity = events
        # Blocks an op allocates and frees after its gradients, before its recorded workspace
        # (op -> bytes), which the trace merged into that workspace: a backward convolution's
        # data-gradient workspace (TracePrep.dgrad_workspaces)
        self.transient_before: Mapping[int, int] = transients or {}
        # (the op being allocated's transient: _transient_of)
        self._pending_transient: tuple[int, int, int] | None = None
        # Ops whose transient could not be had: PyTorch's data-gradient call then walked to
        # another engine and cached it for the shape, so later iterations ask none (_Run)
        self.transient_fell_back: list[int] = []

    # ------------------------------------------------------------ setup

    def run(self) -> EngineOutput:
        pool = self.plan.pinned_pool_bytes
        if pool > self.hw.pinned_limit_bytes:  # the pool is pinned before anything runs
            self._stop(OutOfMemory(None, -1, pool, self.hw.pinned_limit_bytes,
                                   self.hw.pinned_limit_bytes, memory="pinned host"))
        elif self._allocate_resident():
            gens = [self._stream(steps) for steps in self.streams.values()]
            procs = [self.env.process(gen) for gen in gens]
            gens.append(self._finish(procs))
            self.env.process(gens[-1])
            try:
                self.env.run_until(self.halt)
            except RuntimeError:  # SimPy: no event left to happen, yet the run is not over
                if self.halt.triggered or self.env.peek() != float("inf"):
                    raise
                stuck = [op for op in self.trace.ops if op.id not in self.completed]
                raise PlanError(f"the plan deadlocks: op {stuck[0].id} ({stuck[0].name}) never "
                                f"finishes, nor {len(stuck) - 1} other ops (a sync or an "
                                "allocation waits for a copy or a release that waits for "
                                "them)") from None
            finally:
                # No reference cycle outlives the run: a stream stopped part-way (out of memory)
                # holds the engine in its frame, which SimPy's queue holds, and the copies call
                # back into it (Transfers.close). Left alone, the engine with its records (a
                # 1M-op run: millions) and the trace waited for the cyclic collector (3 s at
                # exit on such a run).
                for gen in gens:
                    gen.close()
                self.transfers.close()
        self.transfers.process_events()  # the next iteration's first malloc sees them
        self.allocator.before_release = None
        self.transfers.close()
        copies = self.transfers.copies
        end = max([e.start_us + e.dur_us for e in self.executed] +
                  [c.start_us + c.dur_us for c in copies] +
                  [self.ops_end_us, self.transfers.copies_end_us, 0.0])
        notes = list(self.plan.notes)
        if self.clock is not None and end > 0 and self.host_wait_us > 0.05 * end:
            notes.append(f"host-bound: the GPU waited {self.host_wait_us / 1e3:.2f} ms of the "
                         f"{end / 1e3:.2f} ms iteration for the host to issue ops (the host "
                         f"model, hardware/host/{self.clock.model.name}.yaml"
                         + (", with vsim's runtime's tracker and per-action work; "
                            "--no-runtime-cost: without" if self.clock.tracked else "") + ")")
        if self.oom is not None and self.oom.memory != "device":
            what = "the pinned pool" if self.oom.tensor < 0 else f"tensor {self.oom.tensor}"
            notes.append(f"out of pinned host memory: pinning {what} ({self.oom.need_bytes} B) "
                         f"would exceed the profile's host.pinned_limit "
                         f"({self.hw.pinned_limit_bytes} B, {self.oom.free_bytes} B left)")
        # the calls no op's launch charged (all of them without a host clock): counted, not
        # charged; the next iteration's engine clears them
        self._count_churn(self.allocator.driver_calls)
        return EngineOutput(self.executed, copies, self.memory, self.oom, end, notes,
                            churn=dict(self.churn))

    def _finish(self, procs: list[simpy.Process]) -> Generator[simpy.Event, Any, None]:
        yield self.env.all_of(procs)
        # Copies still in flight when the last op ends belong to this iteration too (its bytes,
        # its end): the iteration ends when they do, as at the synchronisation that ends a real
        # training step.
        while alive := self.transfers.alive():
            yield self.env.all_of(alive)
        if not self.halt.triggered:
            self.halt.succeed()

    def _allocate_resident(self) -> bool:
        """Weights, optimizer state, inputs: on the GPU before the first op (unless created at
        first use, or already there from a previous iteration)."""
        # (_alloc written out, with the memory's methods and the clock read once: every
        # profiling run's first iteration allocates every weight and input here)
        awaiting, blocks, size, now = self.awaiting, self.resident_blocks, self.size, self.env.now
        adopt, allocate = self.memory.adopt, self.memory.allocate
        for t in self.prep.resident:
            if t not in awaiting:
                block = blocks.get(t)
                if block is not None:
                    adopt(t, block, now)
                elif not allocate(t, size[t], now, None):
                    self._out_of_memory(t, None)
                    return False
        return True

    def discard(self) -> None:
        """After run() and resident_left(), for an iteration that is not reported: drop its
        logs and per-op records. The engine sits in reference cycles (its SimPy processes
        hold it), so without this they would wait for the cyclic collector, whose pass over
        them cost more than the drop (a 1M-op run: millions of records)."""
        self.executed.clear()
        self.memory.log.clear()
        self.memory.state.clear()
        self.memory.blocks.clear()
        self.completed.clear()
        self.finished.clear()
        self.done.clear()

    def resident_left(self) -> dict[int, object]:
        """After run(): give back every block but the resident tensors'; their blocks (tensor
        -> block), for the next iteration to adopt."""
        resident = set(self.prep.resident)
        kept = {}
        for t, block in list(self.memory.blocks.items()):
            if t in resident:
                kept[t] = block
            else:
                self.memory.allocator.free(block)
        return kept

    # ------------------------------------------------------------ memory helpers

    def _alloc(self, tensor: int, op: int | None) -> bool:
        if self.memory.allocate(tensor, self.size[tensor], self.env.now, op):
            return True
        self._out_of_memory(tensor, op)
        return False

    def _create_at_first_use(self, op: Op) -> bool:
        """Create, as the op launches, the resident tensors placed at it (first_use) and any
        it reads that no op has created yet. False when out of memory."""
        placed = self.first_use.pop(op.id, ())
        # (membership in a set: the first optimizer op places every optimizer state and reads
        # as many tensors, quadratic in a list, 3% of a profiling run on resnet152)
        also: Sequence[int] = op.reads
        if placed:
            gone = set(placed)
            also = [t for t in op.reads if t not in gone]
        for t in [*placed, *also]:
            if t in self.awaiting:
                self.awaiting.discard(t)
                if not self._alloc(t, op.id):
                    return False
        return True

    def _fall_back(self, tensor: int, op: int | None) -> bool:
        """The op's workspace cannot be had: run it without one, at its workspace-free
        algorithm's time, if it has one. True when it did."""
        t = self.tensors[tensor]
        if op is None or t.kind != "workspace" \
                or any(c != op for c in t.consumers):  # a workspace is its op's alone
            return False
        return self._without_workspace(op)

    def _without_workspace(self, op: int) -> bool:
        """Op `op` runs its workspace-free algorithm from now on, where it has one (PyTorch's
        cuDNN call walked to an engine that needs none); True when it does."""
        if op not in self.fallback:
            return False
        self.retime[op] = self.fallback[op]
        self.fell_back.append(op)
        return True

    def _out_of_memory(self, tensor: int, op: int | None) -> None:
        self._stop(self.memory.oom(op, tensor, self.size[tensor]))

    def _stop(self, oom: OutOfMemory) -> None:
        """End the run out of memory (a result)."""
        self.oom = oom
        if not self.halt.triggered:
            self.halt.succeed()

    def _free(self, tensor: int, op: int | None) -> None:
        """The trace (or a Release) frees the tensor wherever it is."""
        where = self.memory.where(tensor)
        if where is DEVICE and tensor in self.transfers.h2d_used \
                and self.transfers.free_after_copies(tensor, op, FREED):
            return
        if where is DEVICE or where is DROPPED:
            self.memory.release(tensor, self.env.now, op, FREED)
        elif where is OFFLOADING or where is PREFETCHING:
            self.transfers.free_when_copied(tensor)
        elif where is HOST:
            self.memory.unpin(self.size[tensor])
            self.memory.release(tensor, self.env.now, op, FREED)

    # ------------------------------------------------------------ compute streams

    def _stream(self, steps: list[Step]) -> Generator[simpy.Event, Any, None]:
        """Run a stream's ops in order. The common case (no action of the plan on the op, no
        copy or other stream to wait for, everything it reads on the GPU) stays on a short path:
        it is most ops of most runs, and the engine's speed is the speed of this loop."""
        env, index, state, transfers = self.env, self.index, self.memory.state, self.transfers
        queue = env._queue  # noqa: SLF001  (SimPy's event heap: (time, priority, id, event))
        acts_before, acts_after, retime = index.acts_before, index.acts_after, self.retime
        sync_cap = self.sync_at_capacity
        transient_before, parts = self.transient_before, self.parts
        wait_for_memory = self.plan.wait_for_memory and not sync_cap
        allocate, size, awaiting = self.memory.allocate, self.size, self.awaiting
        first_use = self.first_use
        clock, driver_calls = self.clock, self.allocator.driver_calls
        retries = self.allocator.retries_after_pending_frees
        done, completed = self.done, self.completed
        executed_append, finished_add = self.executed.append, self.finished.add
        state_get, h2d_used, release = state.get, transfers.h2d_used, self.memory.release
        tensors, serves_now = self.tensors, self.allocator.serves_now
        # Transfers.awaiting_release, read per op without a property call (the two tables are
        # changed in place, never replaced)
        release_at_end, releasing = transfers._release_at_end, transfers._releasing  # noqa: SLF001
        scaled = self.scale is not None
        logged = self.logged
        # the clock's issue times (HostClock.issue, not replaced during a run)
        clock_issue = clock.issue if clock is not None else {}
        prev_end = 0.0
        for op, gap, reads_in, cross_deps in steps:
            oid = op.id
            ready = prev_end + gap
            if clock is not None:  # (HostClock.ready_us written out)
                issued = clock_issue[oid] + clock.extra_us
                if issued > ready:  # the GPU waits for the host to issue it
                    self.host_wait_us += issued - (ready if ready > env._now else env._now)
                    ready = issued
            now = env._now  # noqa: SLF001
            if ready > now:
                # Fast-forward: a timeout that would be the next event processed (the queue
                # holds nothing until its time) is skipped and the clock set as processing it
                # would set it (SimPy: now + delay); this process is always resumed by an event
                # it alone waits for, so no other callback runs between. Half the SimPy
                # events of a run with one busy stream.
                then = now + (ready - now)
                if queue and queue[0][0] <= then:
                    yield env.timeout(ready - now)
                else:
                    env._now = then  # noqa: SLF001
            # (an op with nothing placed at it and no read awaited creates nothing: the first
            # iteration's common case, asked without the call)
            if awaiting and (oid in first_use or not awaiting.isdisjoint(op.reads)) \
                    and not self._create_at_first_use(op):
                return
            # Whether the plan hangs anything on the op (a workspace fallback below adds one)
            acted = oid in acts_before
            recomputes: Sequence[Recompute] = ()
            if acted:
                # Prefetches hang on the op's launch: issued before it waits for anything, so
                # that an op can also fetch what it needs itself (at_op == needed_by).
                for pre in index.prefetch_at.get(oid, ()):
                    transfers.prefetch(pre)
                recomputes = index.recompute_before.get(oid, ())
            if transfers.host_blocking or cross_deps:
                waits: list[simpy.Event] = []
                if transfers.host_blocking:
                    # Pageable copies are synchronous for the host: nothing launches until
                    # they end.
                    waits = transfers.take_host_blocking()
                for d in cross_deps:
                    if not done[d].triggered:
                        waits.append(done[d])
                if waits:
                    yield env.all_of(waits)
            # Only now, with its deps done, is what it reads from other streams produced.
            on_device = True
            for t in reads_in:
                if state.get(t) is not DEVICE:
                    on_device = False
                    break
            if not on_device or acted:
                waits = self._reads_ready(op, recomputes)
                if waits:
                    yield env.all_of(waits)
            stall = env._now - ready  # noqa: SLF001
            for rc in recomputes:
                if not (yield from self._recompute(rc, op)):
                    return
            wait_start = env._now  # noqa: SLF001
            if transfers.limbo:
                transfers.process_events(clock.ready_us(oid))  # type: ignore[union-attr]
            pending = None  # (the op's transient, asked for before its workspace)
            if transient_before and oid in transient_before:
                pending = self._pending_transient = self._transient_of(op, retime.get(oid))
            held = None  # (a micro-batched op's first part, asked for before its results)
            if parts and oid in parts:
                held = self._part_round(op, hold=True)
                if held is False:
                    self._stop(self.memory.oom(oid, op.writes[0], parts[oid][0]))
                    return
                acted = True
            if wait_for_memory or acted:
                # _allocate_outputs' common case written out (each output served at once, no
                # wait), the rest from the first output that is not
                op_retime = retime.get(oid)
                # (the workspace-free algorithm needs none; micro-batches ask their own)
                no_ws = op_retime is not None and (op_retime.workspace_bytes == 0
                                                   or op_retime.parts > 1)
                k, failed = 0, False
                for t in op.writes:
                    if no_ws and tensors[t].kind == "workspace":
                        k += 1
                        continue
                    if pending is not None:
                        self._transient_at(t)
                    if wait_for_memory and not serves_now(size[t]):
                        break
                    # (_syncs_for and Transfers.copying written out; where the request
                    # would synchronize, the allocation does nothing and says so)
                    if sync_cap and (transfers.in_flight or transfers.limbo
                                     or transfers._returning):  # noqa: SLF001
                        if not allocate(t, size[t], wait_start, oid, DEVICE, False, True):
                            break  # _allocate_outputs synchronizes
                    elif not allocate(t, size[t], wait_start, oid):
                        failed = True
                        break
                    k += 1
                if k < len(op.writes) and not (
                        yield from self._allocate_outputs(op, op_retime, k, failed)):
                    return
                stall += env._now - wait_start  # waiting for offloads to give memory back
                for off in index.offload_at.get(oid, ()):
                    transfers.offload(off)
                acted = acted or oid in retime  # or it fell back
            else:
                now = wait_start
                for i, t in enumerate(op.writes):
                    if pending is not None:
                        self._transient_at(t)
                    if sync_cap and (transfers.in_flight or transfers.limbo
                                     or transfers._returning):  # noqa: SLF001  (ditto)
                        syncs = failed = not allocate(t, size[t], now, oid, DEVICE, False, True)
                    else:
                        syncs, failed = False, not allocate(t, size[t], now, oid)
                    if failed:
                        if syncs or retries and transfers.releasing_memory("any"):
                            # the allocator synchronizes at the cap (sync_at_capacity), or
                            # waits for blocks freed while a copy ran
                            for t2 in op.writes[i:]:
                                if pending is not None:
                                    self._transient_at(t2)
                                if not (yield from self._alloc_waiting(t2, oid, fall_back=True)):
                                    return
                            stall += env.now - wait_start
                            acted = True
                            break
                        if not self._fall_back(t, oid):
                            self._out_of_memory(t, oid)
                            return
                        acted = True
            if held is not None and not self._part_end(op, held):
                self._stop(self.memory.oom(oid, op.writes[0], parts[oid][0]))
                return
            if clock is not None and driver_calls:
                churn_start = env.now
                yield from self._driver_calls(oid)
                stall += env.now - churn_start
            dur = self._duration(op) if acted or transfers.in_flight or scaled else op.dur_us
            start = env._now  # noqa: SLF001
            if dur > 0:
                then = start + dur  # fast-forward, as above
                if queue and queue[0][0] <= then:
                    yield env.timeout(dur)
                else:
                    env._now = then  # noqa: SLF001
            if logged:
                executed = ExecutedOp(op, start, dur, stall)
                if acted and oid in retime and retime[oid].workspace_bytes == 0:
                    executed.without_workspace = True
                executed_append(executed)
            elif start + dur > self.ops_end_us:  # (the ExecutedOp's start_us + dur_us)
                self.ops_end_us = start + dur
            if oid in acts_after or release_at_end or releasing:
                self._after(op)
            else:  # _after's common case: no copy waits for the op, no action after it
                finished_add(oid)
                if op.frees:
                    now = env._now  # noqa: SLF001
                    for t in op.frees:
                        if state_get(t) is DEVICE and t not in h2d_used:
                            release(t, now, oid, FREED)
                        else:
                            self._free(t, oid)
            if oid in acts_after and oid in index.sync_after:
                sync_start = env.now
                inflight = transfers.in_flight_events()
                if inflight:
                    yield env.all_of(inflight)
                if logged:
                    self.executed[-1].stall_us += env.now - sync_start
            prev_end = env._now  # noqa: SLF001
            completed.add(oid)
            if oid in done:
                done[oid].succeed()

    def _transient_of(self, op: Op, retime: Retime | None) -> tuple[int, int, int] | None:
        """(the workspace tensor it comes before, bytes, op) of the op's data-gradient workspace
        (transient_before), as PyTorch's calls ask for it: after the op's gradients, before
        the weight-gradient kernel's workspace (the op's last write); none where the op runs
        its workspace-free algorithm (the squeeze or a fallback cached that engine for the
        shape), a part's where it runs as micro-batches."""
        size = self.transient_before[op.id]
        if retime is not None and (not retime.workspace_bytes or retime.parts > 1):
            return None  # (a micro-batched op asks for it per part: _part_round)
        workspace = op.writes[-1]
        if not size or self.tensors[workspace].kind != "workspace":
            return None
        return workspace, size, op.id

    def _transient_at(self, tensor: int) -> None:
        """The pending transient, if `tensor` is the one it comes before."""
        pending = self._pending_transient
        if pending is not None and pending[0] == tensor:
            self._pending_transient = None
            if not self._transient(pending[1]):
                self.transient_fell_back.append(pending[2])

    def _part_round(self, op: Op, hold: bool) -> object:
        """A micro-batched op's part (Engine.parts), as its calls ask for memory: the part's
        results, then each workspace allocated and freed. `hold`: the first part, whose results
        stay allocated until the whole batch's are (the block, to give to `_part_end`); else a
        later part's, its results freed too (True). False where the part's results cannot be
        had; a workspace that cannot be had makes the op fall back to its workspace-free
        algorithm, as PyTorch's cuDNN call walks to an engine that needs none."""
        memory, now = self.memory, self.env.now
        results, workspaces = self.parts[op.id]
        held = memory.scratch(results, now, op.id)
        if held is None:
            return False
        for size in workspaces:
            block = memory.scratch(size, now, op.id)
            if block is None:
                self._without_workspace(op.id)
                break
            memory.scratch_free(block, now, op.id)
        if hold:
            return held
        memory.scratch_free(held, now, op.id)
        return True

    def _part_end(self, op: Op, held: object) -> bool:
        """After the whole batch's results: the first part's results freed, and a later part
        asked for (it finds the whole batch's results allocated: the op's peak); False where
        it cannot be had."""
        self.memory.scratch_free(held, self.env.now, op.id)
        if self.retime[op.id].parts < 2:  # fell back: one call, no part
            return True
        return bool(self._part_round(op, hold=False))

    def _transient(self, size: int) -> bool:
        """A block allocated and freed at once (transient_before): what it leaves is the
        allocator's state, a segment it opened. False where it cannot be had (skipped)."""
        block = self.allocator.malloc(size)
        if block is not None:
            self.allocator.free(block)
        return block is not None

    def _reads_ready(self, op: Op, recomputes: Sequence[Recompute] = ()) -> list[simpy.Event]:
        """Events the op must wait for so that everything it reads is on the GPU.

        Tensors that a Recompute before the op brings back are not checked here; what those
        recomputed ops read from outside their own chain is (it must be on the GPU, or be
        prefetched, when the recomputation starts)."""
        waits = []
        if not recomputes:
            # The common case (no recomputation before the op) with where and leaving written
            # out: a tensor on the GPU and not leaving needs no wait (an offloading plan's
            # every op comes here)
            # (sorted(set(op.reads).difference(op.writes)), made once per trace)
            needed = self.prep.reads_sorted[op.id]
            needs = self.index.needs.get(op.id)
            if needs:  # (with what prefetches bring it: once per plan, not per iteration)
                got = self._needed.get(op.id)
                if got is None:
                    got = self._needed[op.id] = tuple(sorted(set(needed).union(needs)))
                needed = got
            state_get, finished = self.memory.state.get, self.transfers.finished
            release_op_get = self.transfers._release_op.get  # noqa: SLF001
            for t in needed:
                where = state_get(t, UNBORN)
                if where is DEVICE or where is OFFLOADING and release_op_get(t) not in finished:
                    continue
                leaving = where is OFFLOADING  # (and its release op has ended)
                arriving = self.transfers.arriving(t)
                if arriving is not None:
                    waits.append(arriving)
                elif t in op.reads:
                    state = (f"being offloaded and released after op "
                             f"{self.transfers.release_op(t)}" if leaving else where.value)
                    raise PlanError(f"op {op.id} ({op.name}, layer {op.layer}): its op reads "
                                    f"tensor {t} which is {state}, and no prefetch brings it "
                                    f"back")
            return waits
        rebuilt = {t for rc in recomputes for o in rc.ops for t in self.ops[o].writes}
        chain_reads = {t for rc in recomputes for o in rc.ops for t in self.ops[o].reads}
        # What the op itself writes is allocated just after these waits.
        wanted = (set(op.reads) - set(op.writes) - rebuilt) | (chain_reads - rebuilt) \
            | set(self.index.needs.get(op.id, []))
        for t in sorted(wanted):
            where = self.memory.where(t)
            # An offload whose release op has ended gives the device copy back as soon as its
            # copy ends, maybe while this op runs: for a reader it is already gone.
            leaving = self.transfers.leaving(t)
            if where in RESIDENT and not leaving:
                continue
            arriving = self.transfers.arriving(t)
            if arriving is not None:
                waits.append(arriving)
            elif t in op.reads or t in chain_reads:
                who = "recomputation before it" if t not in op.reads else "op"
                state = (f"being offloaded and released after op {self.transfers.release_op(t)}"
                         if leaving else where.value)
                raise PlanError(f"op {op.id} ({op.name}, layer {op.layer}): its {who} reads "
                                f"tensor {t} which is {state}, and no prefetch brings it back")
        return waits

    def _allocate_outputs(self, op: Op, retime: Retime | None, first: int = 0,
                          failed: bool = False) -> Generator[simpy.Event, Any, bool]:
        """Allocate the op's outputs from `first` on (`retime`: the op's as it launched; the
        stream allocated those before); `failed`: the allocation of output `first` was tried
        and failed (the allocator's state is as that failure left it)."""
        memory, size = self.memory, self.size
        wait = self.plan.wait_for_memory and not self.sync_at_capacity
        for t in op.writes[first:]:
            if retime is not None and (retime.workspace_bytes == 0 or retime.parts > 1) \
                    and self.tensors[t].kind == "workspace":
                continue  # the workspace-free algorithm needs none; micro-batches ask their own
            if self._pending_transient is not None:
                self._transient_at(t)
            if failed:
                failed = False
                ok = yield from self._after_failed_alloc(t, op.id, DEVICE, fall_back=True)
            # _alloc_waiting's first steps inline (most requests are served at once): no need
            # to wait for memory, and the allocation succeeds
            elif wait and not memory.allocator.serves_now(size[t]) or self._syncs_for(size[t]):
                ok = yield from self._alloc_waiting(t, op.id, fall_back=True)
            elif memory.allocate(t, size[t], self.env.now, op.id):
                continue
            else:
                ok = yield from self._after_failed_alloc(t, op.id, DEVICE, fall_back=True)
            if not ok:
                return False
        return True

    def _alloc_waiting(self, tensor: int, op: int | None,
                       state: Residency = DEVICE,
                       fall_back: bool = False) -> Generator[simpy.Event, Any, bool]:
        """Allocate; under Plan.wait_for_memory a request that does not fit waits for offloads
        in flight (whose op has ended, so that only their copy holds the memory) to give their
        device copy back, and retries. Out of memory when nothing in flight can free memory."""
        size = self.size[tensor]
        if self._syncs_for(size):
            # PyTorch's failed request: a device-wide synchronize (every copy in flight ends,
            # the blocks they held come back), then the cache freed and cudaMalloc retried
            waits = self.transfers.copies_under_way() + self.transfers.releasing_memory()
            if waits:
                yield self.env.all_of(waits)
            self.transfers.process_events()
            if self.memory.allocate(tensor, size, self.env.now, op, state, searched=True):
                return True
            return (yield from self._after_failed_alloc(tensor, op, state, fall_back))
        while self.plan.wait_for_memory and not self.sync_at_capacity \
                and not self.memory.allocator.serves_now(size):
            # Only offloads whose release op has ended: the others also wait for an op, maybe
            # this one or one after it on this stream, and waiting for them could deadlock.
            pending = self.transfers.releasing_memory("any")
            if not pending:
                break
            yield self.env.any_of(pending)
            self.transfers.process_events()
        if self.memory.allocate(tensor, size, self.env.now, op, state):
            return True
        return (yield from self._after_failed_alloc(tensor, op, state, fall_back))

    def _syncs_for(self, size: int) -> bool:
        """A request PyTorch's allocator meets with a device-wide synchronize before it frees
        its cache (sync_at_capacity): no cached block, no room, and copies whose end would
        change what comes back (without any, the allocator's own release is the same)."""
        return self.sync_at_capacity and self.transfers.copying() \
            and self.allocator.would_hit(size)

    def _after_failed_alloc(self, tensor: int, op: int | None, state: Residency,
                            fall_back: bool) -> Generator[simpy.Event, Any, bool]:
        """An allocation just failed: PyTorch's allocator, before it gives up, waits for every
        block freed while its copy ran (record_stream) and retries
        (Allocator.retries_after_pending_frees); then the workspace fallback, else out of
        memory."""
        size = self.size[tensor]
        while True:
            pending = self.transfers.releasing_memory("all") \
                if self.allocator.retries_after_pending_frees else []
            if not pending:
                if fall_back and self._fall_back(tensor, op):
                    return True
                self._out_of_memory(tensor, op)
                return False
            yield self.env.all_of(pending)
            self.transfers.process_events()
            if self.memory.allocate(tensor, size, self.env.now, op, state):
                return True

    def _duration(self, op: Op) -> float:
        retime = self.retime.get(op.id)
        dur = retime.dur_us if retime is not None else op.dur_us
        if self.scale is not None:
            dur *= self.scale.get(op.id, 1.0)
        # Copies take DRAM bandwidth from compute (vDNN Sec. 5: at most link/DRAM bandwidth).
        if self.transfers.in_flight and self.hw.copy_interference:
            dur *= 1.0 + self.hw.copy_interference
        return dur

    def _after(self, op: Op) -> None:
        oid = op.id
        self.finished.add(oid)
        transfers = self.transfers
        if transfers.awaiting_release:
            transfers.op_ended(oid)
        acted = oid in self.index.acts_after
        if acted:  # an offload issued after the op sees the tensors it frees still there
            for off in self.index.offload_after.get(oid, ()):
                transfers.offload(off)
        h2d_used = transfers.h2d_used
        if op.frees:
            memory = self.memory
            state, now = memory.state, self.env.now
            for t in op.frees:
                if state.get(t) is DEVICE and t not in h2d_used:  # the common case
                    memory.release(t, now, oid, FREED)
                else:
                    self._free(t, oid)
        if not acted:
            return
        for t in self.index.release_after.get(oid, ()):
            self._free(t, oid)
        for t in self.index.drop_after.get(oid, ()):
            if self.memory.where(t) is DEVICE and not (
                    t in h2d_used and transfers.free_after_copies(t, oid, DROPPED)):
                self.memory.release(t, self.env.now, oid, DROPPED)

    def _driver_calls(self, op: int) -> Generator[simpy.Event, Any, None]:
        """The allocator's driver calls while `op`'s outputs were allocated, on the host: a
        device-wide synchronize waits for every copy in flight (the compute stream is idle
        here), then each cudaFree and cudaMalloc (page unmaps and maps with expandable
        segments) takes its probed time; the op launches after
        them, and the host has no lead left (vsim.engine.hostclock)."""
        assert self.clock is not None
        costs = self.clock.alloc
        calls = list(self.allocator.driver_calls)
        self.allocator.driver_calls.clear()
        self._count_churn(calls)
        if costs is None:
            return
        synced = False
        spent = 0.0
        for what, size in calls:
            if what == "sync":
                inflight = self.transfers.in_flight_events()
                if inflight:
                    yield self.env.all_of(inflight)
                spent += costs.device_sync_us
                synced = True
            elif what == "free":
                spent += costs.cuda_free.us(size)
            elif what == "map":  # expandable segments' pages
                spent += costs.expandable_map.us(size)
            elif what == "unmap":
                spent += costs.expandable_unmap.us(size)
            else:
                spent += costs.cuda_malloc.us(size)
        self.clock.spend(spent)
        if synced:
            self.clock.synced(op, self.env.now + spent)
        ready = self.clock.ready_us(op)
        if ready > self.env.now:
            yield self.env.timeout(ready - self.env.now)

    def _count_churn(self, calls: Sequence[tuple[str, int]]) -> None:
        """Adds driver calls to this iteration's churn (EngineOutput.churn)."""
        churn = self.churn
        for what, size in calls:
            count, bytes_key = CHURN_CALLS[what]
            churn[count] += 1
            if bytes_key:
                churn[bytes_key] += size

    def _wait(self, delay: float) -> Generator[simpy.Event, Any, None]:
        """A timeout of a stream's own (a recomputed op, its issue), fast-forwarded as _stream's
        are when nothing is queued until its end: the stream process alone waits for it."""
        env = self.env
        then = env._now + delay  # noqa: SLF001  (as SimPy schedules it: now + delay)
        queue = env._queue  # noqa: SLF001
        if queue and queue[0][0] <= then:
            yield env.timeout(delay)
        else:
            env._now = then  # noqa: SLF001

    def _recompute(self, rc: Recompute, before: Op) -> Generator[simpy.Event, Any, bool]:
        """Re-run forward ops. `rc.tensors` (dropped) come back and stay; any other tensor the
        chain writes that is not on the GPU (an intermediate the forward pass freed, a workspace,
        or a dropped tensor another Recompute brings back later) is allocated while the chain
        runs and given back at its end, in its former state."""
        for t in rc.tensors:
            if self.memory.where(t) is not DROPPED:
                continue
            if not (yield from self._alloc_waiting(t, before.id)):
                return False
        transient: list[tuple[int, Residency]] = []
        retimes = self.retime
        for op_id in rc.ops:
            op = self.ops[op_id]
            held = self._part_round(op, hold=True) if op_id in self.parts else None
            if held is False:
                self._stop(self.memory.oom(before.id, op.writes[0], self.parts[op_id][0]))
                return False
            for t in op.writes:
                where = self.memory.where(t)
                if where not in (FREED, DROPPED) or t in rc.tensors:
                    continue
                if self.tensors[t].kind == "workspace" and op_id in retimes \
                        and (retimes[op_id].workspace_bytes == 0 or retimes[op_id].parts > 1):
                    continue
                if not (yield from self._alloc_waiting(t, before.id)):
                    return False
                transient.append((t, where))
            if held is not None and not self._part_end(op, held):
                self._stop(self.memory.oom(before.id, op.writes[0], self.parts[op_id][0]))
                return False
            if self.clock is not None:  # the host issues the recomputed op first
                self.clock.recompute(op)
                if self.clock.ready_us(before.id) > self.env.now:
                    self.host_wait_us += self.clock.ready_us(before.id) - self.env.now
                    yield from self._wait(self.clock.ready_us(before.id) - self.env.now)
            start = self.env.now
            dur = self._duration(op)
            if dur > 0:
                yield from self._wait(dur)
            if self.logged:
                self.executed.append(ExecutedOp(op, start, dur, 0.0, recompute_of=op_id))
            elif start + dur > self.ops_end_us:
                self.ops_end_us = start + dur
        for t, former in transient:
            self.memory.release(t, self.env.now, before.id, former)
        return True
