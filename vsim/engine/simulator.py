"""Replay a trace under a plan on a SimPy model of one GPU: streams, copy engines, memory.

Each CUDA stream of the trace is a SimPy process that runs its ops in trace order. An op starts at
the latest of: the previous op on its stream ending plus the recorded launch gap (the GPU idle time
before it in the recording), its dependencies finishing, and the prefetches it needs arriving;
waiting beyond the gap is stall time. Then its outputs are allocated, the copies the plan issues
at it start, it runs for its (possibly retimed) duration, and the tensors it frees are released.
A failed allocation ends the run with an OutOfMemory result rather than an exception.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from ..allocator.base import Allocator
from ..hardware import Hardware
from ..policies.base import Offload, Plan, PlanIndex, Prefetch, Recompute, Retime
from ..trace.schema import Copy, Op, Tensor, Trace
from .link import Link
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
)

H2D_STREAM, D2H_STREAM = 1, 2


class PlanError(Exception):
    """The plan broke an invariant (an op read a tensor that was not on the GPU). A bug in a
    policy, not bad user input."""


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


class Engine:
    """One simulation. Build it, call run() once."""

    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, allocator: Allocator, *,
                 first_use: dict[int, list[int]] | None = None,
                 resident_blocks: dict[int, object] | None = None,
                 fallback: Mapping[int, Retime] | None = None) -> None:
        """`first_use` (a first iteration): resident tensors created as the given ops launch
        (vsim.allocator.first_use). `resident_blocks`: resident tensors already in `allocator`
        (left by a previous iteration), adopted instead of allocated. `fallback`: per
        convolution, its workspace-free algorithm, taken when its workspace cannot be had, as
        PyTorch falls back to another cuDNN engine (ops that did: `fell_back`)."""
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
        self.index = PlanIndex(plan)
        self.env = simpy.Environment()
        self.link = Link(self.env, hw)
        # Host buffers count as pinned only when allocated per copy; a pool is reported as a whole
        # (Plan.pinned_pool_bytes) and pageable staging pins nothing.
        self.memory = DeviceMemory(allocator,
                                   count_pinned=plan.pinned and not plan.pinned_pool_bytes)
        self.tensors: dict[int, Tensor] = trace.tensor_by_id()
        self.size = {t.id: t.size_bytes for t in trace.tensors}
        self.ops: dict[int, Op] = {op.id: op for op in trace.ops}
        self.streams = self._stream_steps()
        # SimPy events only for ops another stream waits for.
        self.done: dict[int, simpy.Event] = {
            d: self.env.event() for steps in self.streams.values() for *_, deps in steps
            for d in deps}
        self.completed: set[int] = set()              # ops past their end and any sync
        self.copied_out: dict[int, simpy.Event] = {}  # D2H copy finished
        self.released: dict[int, simpy.Event] = {}    # ... and the device copy given back
        self.prefetched: dict[int, simpy.Event] = {}  # H2D copy finished
        self.release_at_end: dict[int, list[int]] = defaultdict(list)  # op -> offloaded tensors
        self.finished: set[int] = set()               # ops that have ended
        self.free_pending: set[int] = set()           # freed by the trace while a copy reads it
        self.release_op: dict[int, int] = {}          # offloaded tensor -> its release_after
        self.releasing: dict[int, list[int]] = defaultdict(list)  # release op -> offloaded
        self.copy_procs: list[simpy.Process] = []     # offload and prefetch processes
        self.copies_in_flight = 0
        self.host_blocking: list[simpy.Event] = []    # pageable copies the host waits for
        self.executed: list[ExecutedOp] = []
        self.copies: list[Copy] = []
        self.oom: OutOfMemory | None = None
        self.halt = self.env.event()

    # ------------------------------------------------------------ setup

    def _stream_steps(self) -> dict[int, list[tuple[Op, float, tuple[int, ...], tuple[int, ...]]]]:
        """Per stream, its ops in order, each with what the short path needs, computed once:
        the GPU idle time before it in the recording on its stream (the launch gap), what it
        reads that it does not write itself (a trace may list an op's own output or workspace
        among its reads), and its deps on other streams (a dep on its own stream has ended
        before it: a stream runs its ops in order)."""
        streams: dict[int, list[tuple[Op, float, tuple[int, ...], tuple[int, ...]]]] = {}
        last_end: dict[int, float] = {}
        stream_of: dict[int, int] = {}
        for op in self.trace.ops:
            stream_of[op.id] = op.stream
            prev = last_end.get(op.stream, 0.0)
            gap = op.start_us - prev if op.start_us > prev else 0.0
            end = op.start_us + op.dur_us
            last_end[op.stream] = end if end > prev else prev
            reads = op.reads
            if op.writes and not set(op.writes).isdisjoint(reads):
                reads = tuple(t for t in reads if t not in op.writes)
            deps = tuple(d for d in op.deps if stream_of[d] != op.stream) if op.deps else ()
            streams.setdefault(op.stream, []).append((op, gap, reads, deps))
        return streams

    def run(self) -> EngineOutput:
        if self._allocate_resident():
            procs = [self.env.process(self._stream(steps)) for steps in self.streams.values()]
            self.env.process(self._finish(procs))
            try:
                self.env.run(until=self.halt)
            except RuntimeError:  # SimPy: no event left to happen, yet the run is not over
                if self.halt.triggered or self.env.peek() != float("inf"):
                    raise
                stuck = [op for op in self.trace.ops if op.id not in self.completed]
                raise PlanError(f"the plan deadlocks: op {stuck[0].id} ({stuck[0].name}) never "
                                f"finishes, nor {len(stuck) - 1} other ops (a sync or an "
                                "allocation waits for a copy or a release that waits for "
                                "them)") from None
        end = max([e.start_us + e.dur_us for e in self.executed] +
                  [c.start_us + c.dur_us for c in self.copies] + [0.0])
        return EngineOutput(self.executed, self.copies, self.memory, self.oom, end,
                            list(self.plan.notes))

    def _finish(self, procs: list[simpy.Process]) -> Generator[simpy.Event, Any, None]:
        yield self.env.all_of(procs)
        # Copies still in flight when the last op ends belong to this iteration too (its bytes,
        # its end): the iteration ends when they do, as at the synchronisation that ends a real
        # training step.
        while alive := [p for p in self.copy_procs if p.is_alive]:
            yield self.env.all_of(alive)
        if not self.halt.triggered:
            self.halt.succeed()

    def _allocate_resident(self) -> bool:
        """Weights, optimizer state, inputs: on the GPU before the first op (unless created at
        first use, or already there from a previous iteration)."""
        for t in self.trace.tensors:
            if t.producer is None and t.id not in self.awaiting:
                block = self.resident_blocks.get(t.id)
                if block is not None:
                    self.memory.adopt(t.id, block, self.env.now)
                elif not self._alloc(t.id, None):
                    return False
        return True

    def resident_left(self) -> dict[int, object]:
        """After run(): give back every block but the resident tensors'; their blocks (tensor
        -> block), for the next iteration to adopt."""
        resident = {t.id for t in self.trace.tensors if t.producer is None}
        kept = {}
        for t, block in list(self.memory.blocks.items()):
            if t in resident:
                kept[t] = block
            else:
                self.memory.allocator.free(block)
        return kept

    # ------------------------------------------------------------ memory helpers

    def _alloc(self, tensor: int, op: int | None, state: str = DEVICE) -> bool:
        if self.memory.allocate(tensor, self.size[tensor], self.env.now, op, state):
            return True
        self._out_of_memory(tensor, op)
        return False

    def _create_at_first_use(self, op: Op) -> bool:
        """Create, as the op launches, the resident tensors placed at it (first_use) and any
        it reads that no op has created yet. False when out of memory."""
        placed = self.first_use.pop(op.id, ())
        for t in [*placed, *(t for t in op.reads if t not in placed)]:
            if t in self.awaiting:
                self.awaiting.discard(t)
                if not self._alloc(t, op.id):
                    return False
        return True

    def _fall_back(self, tensor: int, op: int | None) -> bool:
        """The op's workspace cannot be had: run it without one, at its workspace-free
        algorithm's time, if it has one. True when it did."""
        t = self.tensors[tensor]
        if op is None or op not in self.fallback or t.kind != "workspace" \
                or any(c != op for c in t.consumers):  # a workspace is its op's alone
            return False
        self.index.retime[op] = self.fallback[op]
        self.index.acts_before.add(op)
        self.fell_back.append(op)
        return True

    def _out_of_memory(self, tensor: int, op: int | None) -> None:
        self.oom = self.memory.oom(op, tensor, self.size[tensor])
        if not self.halt.triggered:
            self.halt.succeed()

    def _free(self, tensor: int, op: int | None) -> None:
        """The trace (or a Release) frees the tensor wherever it is."""
        where = self.memory.state.get(tensor, UNBORN)
        if where == DEVICE or where == DROPPED:
            self.memory.release(tensor, self.env.now, op, FREED)
        elif where == OFFLOADING or where == PREFETCHING:
            self.free_pending.add(tensor)  # released when the copy ends
        elif where == HOST:
            self.memory.unpin(self.size[tensor])
            self.memory.release(tensor, self.env.now, op, FREED)

    # ------------------------------------------------------------ compute streams

    def _stream(self, steps: list[tuple[Op, float, tuple[int, ...], tuple[int, ...]]]
                ) -> Generator[simpy.Event, Any, None]:
        """Run a stream's ops in order. The common case (no action of the plan on the op, no
        copy or other stream to wait for, everything it reads on the GPU) stays on a short path:
        it is most ops of most runs, and the engine's speed is the speed of this loop."""
        env, index, state = self.env, self.index, self.memory.state
        acts_before, acts_after = index.acts_before, index.acts_after
        wait_for_memory = self.plan.wait_for_memory
        allocate, size, awaiting = self.memory.allocate, self.size, self.awaiting
        prev_end = 0.0
        for op, gap, reads_in, cross_deps in steps:
            oid = op.id
            ready = prev_end + gap
            if ready > env.now:
                yield env.timeout(ready - env.now)
            if awaiting and not self._create_at_first_use(op):
                return
            # Whether the plan hangs anything on the op (a workspace fallback below adds one)
            acted = oid in acts_before
            recomputes: Sequence[Recompute] = ()
            if acted:
                # Prefetches hang on the op's launch: issued before it waits for anything, so
                # that an op can also fetch what it needs itself (at_op == needed_by).
                for pre in index.prefetch_at.get(oid, ()):
                    self._issue_prefetch(pre)
                recomputes = index.recompute_before.get(oid, ())
            waits: list[simpy.Event] = []
            if self.host_blocking:
                # Pageable copies are synchronous for the host: nothing launches until they end.
                waits = [e for e in self.host_blocking if not e.triggered]
                self.host_blocking.clear()
            for d in cross_deps:
                if not self.done[d].triggered:
                    waits.append(self.done[d])
            if waits:
                yield env.all_of(waits)
            # Only now, with its deps done, is what it reads from other streams produced.
            on_device = True
            for t in reads_in:
                if state.get(t) != DEVICE:
                    on_device = False
                    break
            if not on_device or acted:
                waits = self._reads_ready(op, recomputes)
                if waits:
                    yield env.all_of(waits)
            stall = env.now - ready
            for rc in recomputes:
                if not (yield from self._recompute(rc, op)):
                    return
            wait_start = env.now
            if wait_for_memory or acted:
                if not (yield from self._allocate_outputs(op)):
                    return
                stall += env.now - wait_start  # waiting for offloads to give memory back
                for off in index.offload_at.get(oid, ()):
                    self._issue_offload(off)
                acted = oid in acts_before
            else:
                now = env.now
                for t in op.writes:
                    if not allocate(t, size[t], now, oid):
                        if not self._fall_back(t, oid):
                            self._out_of_memory(t, oid)
                            return
                        acted = True
            dur = self._duration(op) if acted or self.copies_in_flight else op.dur_us
            start = env.now
            if dur > 0:
                yield env.timeout(dur)
            executed = ExecutedOp(op, start, dur, stall)
            if acted and oid in index.retime and index.retime[oid].workspace_bytes == 0:
                executed.without_workspace = True
            self.executed.append(executed)
            self._after(op)
            if oid in acts_after and oid in index.sync_after:
                sync_start = env.now
                inflight = [e for e in [*self.copied_out.values(), *self.prefetched.values()]
                            if not e.triggered]
                if inflight:
                    yield env.all_of(inflight)
                self.executed[-1].stall_us += env.now - sync_start
            prev_end = env.now
            self.completed.add(oid)
            if oid in self.done:
                self.done[oid].succeed()

    def _reads_ready(self, op: Op, recomputes: Sequence[Recompute] = ()) -> list[simpy.Event]:
        """Events the op must wait for so that everything it reads is on the GPU.

        Tensors that a Recompute before the op brings back are not checked here; what those
        recomputed ops read from outside their own chain is (it must be on the GPU, or be
        prefetched, when the recomputation starts)."""
        waits = []
        rebuilt = {t for rc in recomputes for o in rc.ops for t in self.ops[o].writes}
        chain_reads = {t for rc in recomputes for o in rc.ops for t in self.ops[o].reads}
        # What the op itself writes is allocated just after these waits.
        needed = (set(op.reads) - set(op.writes) - rebuilt) | (chain_reads - rebuilt) \
            | set(self.index.needs.get(op.id, []))
        for t in sorted(needed):
            where = self.memory.where(t)
            # An offload whose release op has ended gives the device copy back as soon as its
            # copy ends, maybe while this op runs: for a reader it is already gone.
            leaving = where == OFFLOADING and self.release_op.get(t) in self.finished
            if where in RESIDENT and not leaving:
                continue
            if where == PREFETCHING or (t in self.prefetched and not self.prefetched[t].triggered):
                waits.append(self.prefetched[t])
            elif t in op.reads or t in chain_reads:
                who = "recomputation before it" if t not in op.reads else "op"
                state = (f"being offloaded and released after op {self.release_op[t]}"
                         if leaving else where)
                raise PlanError(f"op {op.id} ({op.name}, layer {op.layer}): its {who} reads "
                                f"tensor {t} which is {state}, and no prefetch brings it back")
        return waits

    def _allocate_outputs(self, op: Op) -> Generator[simpy.Event, Any, bool]:
        retime = self.index.retime.get(op.id)
        for t in op.writes:
            if retime is not None and retime.workspace_bytes == 0 \
                    and self.tensors[t].kind == "workspace":
                continue  # the workspace-free algorithm needs none
            if not (yield from self._alloc_waiting(t, op.id, fall_back=True)):
                return False
        return True

    def _alloc_waiting(self, tensor: int, op: int | None, state: str = DEVICE,
                       fall_back: bool = False) -> Generator[simpy.Event, Any, bool]:
        """Allocate; under Plan.wait_for_memory a request that does not fit waits for offloads
        in flight (whose op has ended, so that only their copy holds the memory) to give their
        device copy back, and retries. Out of memory when nothing in flight can free memory."""
        size = self.size[tensor]
        while self.plan.wait_for_memory and size > self.memory.allocator.largest_free_bytes():
            # Only offloads whose release op has ended: the others also wait for an op, maybe
            # this one or one after it on this stream, and waiting for them could deadlock.
            pending = [self.released[t] for t, ev in self.copied_out.items()
                       if not self.released[t].triggered and not ev.triggered
                       and self.release_op[t] in self.finished]
            if not pending:
                break
            yield self.env.any_of(pending)
        if self.memory.allocate(tensor, size, self.env.now, op, state) or \
                (fall_back and self._fall_back(tensor, op)):
            return True
        self._out_of_memory(tensor, op)
        return False

    def _duration(self, op: Op) -> float:
        retime = self.index.retime.get(op.id)
        dur = retime.dur_us if retime is not None else op.dur_us
        # Copies take DRAM bandwidth from compute (vDNN Sec. 5: at most link/DRAM bandwidth).
        if self.copies_in_flight and self.hw.copy_interference:
            dur *= 1.0 + self.hw.copy_interference
        return dur

    def _after(self, op: Op) -> None:
        oid = op.id
        self.finished.add(oid)
        if self.release_at_end or self.releasing:
            self._release_copied(oid)
        acted = oid in self.index.acts_after
        if acted:  # an offload issued after the op sees the tensors it frees still there
            for off in self.index.offload_after.get(oid, ()):
                self._issue_offload(off)
        state = self.memory.state
        for t in op.frees:
            if state.get(t) == DEVICE:  # the common case, without _free's other branches
                self.memory.release(t, self.env.now, oid, FREED)
            else:
                self._free(t, oid)
        if not acted:
            return
        for t in self.index.release_after.get(oid, ()):
            self._free(t, oid)
        for t in self.index.drop_after.get(oid, ()):
            if self.memory.where(t) == DEVICE:
                self.memory.release(t, self.env.now, oid, DROPPED)

    def _release_copied(self, oid: int) -> None:
        """Offloads whose release op `oid` just ended: copied out, their device copy goes back;
        still copying, the program frees them now (PyTorch's memory_allocated drops:
        free_requested) but the block is reused only when the copy ends (record_stream;
        free_completed, by the offload process)."""
        for t in self.release_at_end.pop(oid, []):
            if self.copied_out[t].triggered:
                self._release_offloaded(t, oid)
        for t in self.releasing.pop(oid, []):
            if not self.copied_out[t].triggered and self.memory.where(t) == OFFLOADING:
                self.memory.request_free(t, self.env.now, oid)

    def _recompute(self, rc: Recompute, before: Op) -> Generator[simpy.Event, Any, bool]:
        """Re-run forward ops. `rc.tensors` (dropped) come back and stay; any other tensor the
        chain writes that is not on the GPU (an intermediate the forward pass freed, a workspace,
        or a dropped tensor another Recompute brings back later) is allocated while the chain
        runs and given back at its end, in its former state."""
        for t in rc.tensors:
            if self.memory.where(t) != DROPPED:
                continue
            if not (yield from self._alloc_waiting(t, before.id)):
                return False
        transient: list[tuple[int, str]] = []
        retimes = self.index.retime
        for op_id in rc.ops:
            op = self.ops[op_id]
            for t in op.writes:
                where = self.memory.where(t)
                if where not in (FREED, DROPPED) or t in rc.tensors:
                    continue
                if self.tensors[t].kind == "workspace" and op_id in retimes \
                        and retimes[op_id].workspace_bytes == 0:
                    continue
                if not (yield from self._alloc_waiting(t, before.id)):
                    return False
                transient.append((t, where))
            start = self.env.now
            dur = self._duration(op)
            if dur > 0:
                yield self.env.timeout(dur)
            self.executed.append(ExecutedOp(op, start, dur, 0.0, recompute_of=op_id))
        for t, former in transient:
            self.memory.release(t, self.env.now, before.id, former)
        return True

    # ------------------------------------------------------------ copies

    def _issue_offload(self, off: Offload) -> None:
        """Start the D2H copy now (synchronously marked, so the op that issues it already sees
        the link busy); the device copy is given back when both the copy and op
        `release_after` have ended, whichever is later."""
        t = off.tensor
        if self.memory.where(t) != DEVICE:
            return  # already away or not born: nothing to copy
        self.memory.state[t] = OFFLOADING
        self.copied_out[t] = self.env.event()
        self.released[t] = self.env.event()
        release_after = off.release_after if off.release_after is not None else off.at_op
        self.release_op[t] = release_after
        self.releasing[release_after].append(t)
        self.copies_in_flight += 1
        if not self.plan.pinned:
            self.host_blocking.append(self.copied_out[t])
        self.copy_procs.append(self.env.process(self._offload(t, release_after)))

    def _offload(self, t: int, release_after: int) -> Generator[simpy.Event, Any, None]:
        size = self.tensors[t].size_bytes
        if self.plan.pinned_lazy:  # cudaMallocHost per buffer, before the copy can start
            yield self.env.timeout(self.hw.pinned_alloc_us_per_gib * size / 2**30)
        self.memory.pin(size)
        start, end = yield from self.link.copy("d2h", size, self.plan.pinned)
        self.copies_in_flight -= 1
        self.copies.append(Copy(t, "d2h", size, start, end - start, D2H_STREAM))
        self.copied_out[t].succeed()
        if release_after in self.finished:
            self._release_offloaded(t, release_after)
        else:
            self.release_at_end[release_after].append(t)

    def _release_offloaded(self, t: int, op: int) -> None:
        if t in self.free_pending:  # the trace freed it meanwhile: no need to keep the host copy
            self.free_pending.discard(t)
            self.memory.unpin(self.tensors[t].size_bytes)
            self.memory.release(t, self.env.now, op, FREED)
        else:
            self.memory.release(t, self.env.now, op, HOST)
        self.released[t].succeed()

    def _issue_prefetch(self, pre: Prefetch) -> None:
        t = pre.tensor
        if t in self.prefetched and not self.prefetched[t].triggered:
            return  # already on its way
        self.prefetched[t] = self.env.event()
        self.copies_in_flight += 1
        if not self.plan.pinned:
            self.host_blocking.append(self.prefetched[t])
        self.copy_procs.append(self.env.process(self._prefetch(pre)))

    def _prefetch(self, pre: Prefetch) -> Generator[simpy.Event, Any, None]:
        t = pre.tensor
        done = self.prefetched[t]
        pending = self.released.get(t)
        if pending is not None and not pending.triggered:
            yield pending  # the data must have left before it can come back
        if self.memory.where(t) != HOST:
            self.copies_in_flight -= 1
            done.succeed()
            return
        if not (yield from self._alloc_waiting(t, pre.at_op, PREFETCHING)):
            return
        size = self.tensors[t].size_bytes
        start, end = yield from self.link.copy("h2d", size, self.plan.pinned)
        self.copies_in_flight -= 1
        self.copies.append(Copy(t, "h2d", size, start, end - start, H2D_STREAM))
        self.memory.unpin(size)
        self.memory.state[t] = DEVICE
        if t in self.free_pending:
            self.free_pending.discard(t)
            self.memory.release(t, self.env.now, pre.needed_by, FREED)
        done.succeed()
