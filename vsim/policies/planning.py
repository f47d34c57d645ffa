"""Planning tools shared by the capacity-aware policies: a static device-memory profile, copy-time
estimates from the trace's own timeline, prefetch placement under a budget, recomputation chains,
and a check of a plan against the engine.

The static profile is what the policies reason with (like the papers' profiling passes): bytes on
the device in every slot (see layers.py), from the trace's allocations and frees, with the device
copies that a plan removes taken out. It ignores copies still in flight, which is why the
policies that need a guarantee check their plan with `fitted.check()` (one simulated iteration, the
profiling run of Capuchin or vDNN_dyn: policies.fitted) and tighten their budget when it fails.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..hardware import Hardware
from ..plan import Action, Drop, Offload, Plan, Prefetch, Recompute, Release, Retime
from ..trace.schema import Trace
from ..workspace_free import (
    MICROBATCH_PARTS,
    SLOWDOWN_NOTE,
    memory_optimal_retimes,
    microbatch_retime,
    workspace_bytes,
)
from .layers import TraceView


def algorithm_retimes(trace: Trace, hw: Hardware, view: TraceView, algo: str, budget: int,
                      forced: frozenset[int] = frozenset()) -> tuple[list[Retime], list[str]]:
    """Convolution algorithms for algo=performance (as recorded), memory (every convolution
    without workspace, vDNN's (m)) or auto: only the convolutions whose working set cannot fit
    the budget with their recorded workspace whatever is moved away, i.e. what the device must
    hold while they run (everything the trace has alive then but the feature maps they neither
    read nor write) plus the workspace exceeds the budget. That is what cuDNN-based frameworks
    do when a workspace cannot be allocated (PyTorch falls back to an algorithm that needs
    less; SuperNeurons sizes the workspace to the free memory). Under auto, the ops in `forced`
    (whose workspace a profiling run could not allocate) are downgraded too. microbatch: as
    auto, but a convolution whose working set would fit as micro-batches runs so instead
    (microbatch_instead; `forced` ones still without workspace)."""
    if algo == "performance":
        return [], []
    retimes, notes = memory_optimal_retimes(trace, hw)
    if algo == "memory":
        return retimes, notes
    least = least_working_sets(view, [r.op for r in retimes])
    keep = [r for r in retimes if r.op in least and (least[r.op] > budget or r.op in forced)]
    if algo == "microbatch":
        keep = [r if r.op in forced else microbatch_instead(view, hw, r, least[r.op], budget)
                for r in keep]
    split = [r for r in keep if r.parts > 1]
    free = [r for r in keep if r.parts == 1]
    out = []
    if split:
        out.append(f"algo=microbatch: {len(split)} convolution(s) run as micro-batches with "
                   f"their recorded algorithm, as their working set would not fit otherwise: "
                   + ", ".join(f"{view.op[r.op].layer} {view.op[r.op].phase} in {r.parts}"
                               for r in split))
    if free:
        names = ", ".join(f"{view.op[r.op].layer} {view.op[r.op].phase}" for r in free)
        how = {n: sum(r.note == n for r in free) for n in ("measured", "modelled", "estimated")}
        times = ", ".join(f"{k} {v}" for k, v in how.items() if v)
        out.append(f"algo=auto: {len(free)} convolution(s) run without workspace, as their "
                   f"working set would not fit otherwise: {names} (their times: {times})")
        if how["estimated"]:
            out.append(f"{SLOWDOWN_NOTE} ({how['estimated']} ops)")
    return keep, out


def microbatch_instead(view: TraceView, hw: Hardware, free: Retime, least: int,
                       budget: int) -> Retime:
    """algo=microbatch: the convolution `free` (its workspace-free retime) run instead as the
    fewest micro-batches (workspace_free.MICROBATCH_PARTS) whose working set, `least` with one
    part's workspace and results in place of its workspace, fits the budget and that are
    faster than running it without workspace; `free` itself where none is."""
    op = view.op[free.op]
    ws = workspace_bytes(op, view.tensor)
    for parts in MICROBATCH_PARTS:
        got = microbatch_retime(op, view.tensor, hw, parts)
        if got is None or got.dur_us >= free.dur_us:
            break
        if least - ws + (got.workspace_bytes or 0) <= budget:
            return got
    return free


def least_working_sets(view: TraceView, ops: Iterable[int]) -> dict[int, int]:
    """Per op of `ops` that writes a workspace: what the device must hold while it runs with
    it, whatever is moved away (the trace's bytes then, less the saved feature maps it neither
    reads nor writes). Independent of the budget: memoised on the view (algo=auto asks it for
    every budget a profiling loop tries)."""
    ops = list(ops)
    memo: dict[int, int] = view.memo.setdefault("least_working_sets", {})
    todo = [o for o in ops if o not in memo]
    if todo:
        usage = Usage(view)
        # The saved maps alive at each slot, in bytes (exact integer sums, as a prefix sum of
        # their allocations and frees): the maps an op can move away are those less the ones
        # it touches (a sum over every saved map per op was most of algo=auto's planning on
        # ResNet-1517: 2,000 convolutions x 6,000 maps).
        delta = [0] * (view.n_slots + 1)
        saved = set(view.saved)
        for t in view.saved:
            lo, hi = view.alloc_slot(t), view.free_slot(t)
            if lo < hi:  # (alive in no slot otherwise)
                size = view.tensor[t].size_bytes
                delta[lo] += size
                delta[hi] -= size
        alive = list(itertools.accumulate(delta))
        for o in todo:
            op = view.op[o]
            if not any(view.tensor[t].kind == "workspace" for t in op.writes):
                memo[o] = -1
                continue
            slot = view.start(o)
            touched = set(op.reads) | set(op.writes)
            movable = alive[slot] - sum(view.tensor[t].size_bytes for t in touched
                                        if t in saved and alive_in_trace(view, t, slot))
            memo[o] = int(usage.bytes[slot]) - movable
    return {o: memo[o] for o in ops if memo[o] >= 0}


def span_sums(length: int, los: Sequence[int], his: Sequence[int],
              sizes: Sequence[int]) -> np.ndarray:
    """Per slot of [0, length), the sum of `sizes[i]` over the spans [los[i], his[i]) that
    cover it (every end at most `length`), as integers. The spans' ends are added at once
    (np.add.at): the same sums as a slice update per span, which took several ms per planning
    for a trace's every tensor."""
    delta = np.zeros(length + 1, dtype=np.int64)
    if len(sizes):
        size = np.array(sizes, dtype=np.int64)
        np.add.at(delta, np.array(los, dtype=np.int64), size)
        np.subtract.at(delta, np.array(his, dtype=np.int64), size)
    out: np.ndarray = np.cumsum(delta[:-1])
    return out


def interval_profile(view: TraceView, tensors: Iterable[int]) -> np.ndarray:
    """Per slot, the bytes of `tensors` allocated then (each from its allocation slot up to its
    free slot), as integers."""
    ts = list(tensors)
    return span_sums(view.n_slots, [view.alloc_slot(t) for t in ts],
                     [view.free_slot(t) for t in ts], [view.tensor[t].size_bytes for t in ts])


class Usage:
    """Bytes on the device per slot. Starts from the trace as recorded (less workspaces that
    retimes remove); `remove`/`add` change spans of slots."""

    def __init__(self, view: TraceView, retimes: Iterable[Retime] = ()) -> None:
        self.view = view
        retimes = list(retimes)
        no_ws = frozenset(r.op for r in retimes if r.workspace_bytes == 0)
        # micro-batched convolutions: (op, the workspace one part needs)
        split = frozenset((r.op, r.workspace_bytes or 0) for r in retimes if r.parts > 1)
        # per set of workspace-free ops, memoised on the view (a profiling loop plans with the
        # same few sets at every budget); each Usage has its own copy
        key = ("usage", no_ws) if not split else ("usage", no_ws, split)
        base = view.memo.get(key)
        if base is None:
            full = view.memo.get(("usage", frozenset()))
            if full is None:
                counted = [t.id for t in view.trace.tensors
                           if view.tensor[t.id].producer is None
                           or view.tensor[t.id].producer in view.pos]
                workspaces: dict[int, list[int]] = {}  # op -> the workspaces counted
                for t in counted:
                    ten = view.tensor[t]
                    if ten.kind == "workspace" and ten.producer is not None:
                        workspaces.setdefault(ten.producer, []).append(t)
                full = view.memo[("usage", frozenset())] = interval_profile(view, counted)
                view.memo["usage workspaces"] = workspaces
            # the full profile less the workspaces of `no_ws` (integers: the same bytes as a
            # sum over every other tensor; one pass over the trace per view, not per set)
            ws = view.memo["usage workspaces"]
            base = full - interval_profile(view, [t for op in no_ws for t in ws.get(op, ())])
            for op, part in split:  # a part's workspace in place of the whole one
                for i, t in enumerate(ws.get(op, ())):
                    lo, hi = view.alloc_slot(t), view.free_slot(t)
                    if hi > lo:
                        base[lo:hi] -= view.tensor[t].size_bytes - (part if i == 0 else 0)
            view.memo[key] = base
        self.bytes = base.copy()

    def copy(self) -> Usage:
        """An independent copy (the profile's bytes copied, the view shared)."""
        u = Usage.__new__(Usage)
        u.view, u.bytes = self.view, self.bytes.copy()
        return u

    def remove(self, size: int, lo: int, hi: int) -> None:
        if hi > lo:
            self.bytes[lo:hi] -= size

    def add(self, size: int, lo: int, hi: int) -> None:
        if hi > lo:
            self.bytes[lo:hi] += size

    @property
    def peak(self) -> int:
        return int(self.bytes.max()) if len(self.bytes) else 0

    def over(self, budget: int, start: int = 0) -> int | None:
        """The first slot above the budget, or None. `start`: a slot before which none is
        above it (a planner that only takes bytes off passes the last slot it got)."""
        if start < len(self.bytes) and self.bytes[start] > budget:
            return start  # the common case of a planner taking bytes off one slot at a time
        # (the first True of the mask by argmax, which stops there, instead of every index
        # of np.flatnonzero: planners ask this once per eviction)
        over = self.bytes[start:] > budget
        i = int(over.argmax()) if len(over) else 0
        return start + i if len(over) and over[i] else None


@dataclass
class Swap:
    """One tensor's trip to the host and back, in slots and ops."""

    tensor: int
    offload_op: int          # the copy starts at this op (after=True: when it ends)
    after: bool
    release_after: int       # the device copy goes once this op ended and the copy is done
    release_slot: int        # estimated slot from which the device copy is gone
    need_op: int             # first op (or recomputation) that reads it again
    prefetch_op: int | None = None
    copy_done_us: float = 0.0  # estimated end of the D2H copy, on the trace's clock

    def copy(self) -> Swap:
        """An independent copy (the constructor with every field: dataclasses.replace
        per swap was most of copying a planner's few hundred swaps)."""
        return Swap(self.tensor, self.offload_op, self.after, self.release_after,
                    self.release_slot, self.need_op, self.prefetch_op, self.copy_done_us)

    def actions(self) -> list[Action]:
        return [self.offload(), self.prefetch()]

    def offload(self) -> Offload:
        return Offload(self.tensor, self.offload_op, self.after, self.release_after)

    def prefetch(self) -> Prefetch:
        return Prefetch(self.tensor, self.prefetch_op if self.prefetch_op is not None
                        else self.need_op, self.need_op)


class Timeline:
    """Copy-time estimates against the trace's own clock (op start times as recorded)."""

    def __init__(self, view: TraceView, hw: Hardware) -> None:
        self.view = view
        self.hw = hw
        starts = [o.start_us for o in view.ops]
        self.starts = list(np.maximum.accumulate(starts)) if starts else []
        self._d2h: dict[int, float] = {}  # by size: planners ask for the same sizes often
        self._h2d: dict[int, float] = {}

    def d2h_us(self, size: int) -> float:
        if size not in self._d2h:
            self._d2h[size] = self.hw.d2h.pinned.copy_time_us(size)
        return self._d2h[size]

    def h2d_us(self, size: int) -> float:
        if size not in self._h2d:
            self._h2d[size] = self.hw.h2d.pinned.copy_time_us(size)
        return self._h2d[size]

    def op_at(self, time_us: float) -> int:
        """Position of the op running at `time_us` (the last one started by then)."""
        return max(0, bisect.bisect_right(self.starts, time_us) - 1)

    def release_slots(self, swaps: list[Swap]) -> None:
        """Estimate when each offload's device copy goes: copies run one after another on the
        D2H engine in issue order; the copy is gone after the later of its copy's end and its
        release op's end."""
        view = self.view
        free_at = 0.0
        for s in sorted(swaps, key=lambda s: (view.pos[s.offload_op], s.after, s.tensor)):
            issue = view.end_time(s.offload_op) if s.after else view.time_at(s.offload_op)
            start = max(issue, free_at)
            free_at = start + self.d2h_us(view.tensor[s.tensor].size_bytes)
            s.copy_done_us = free_at
            done_pos = self.op_at(free_at)
            s.release_slot = max(view.end(s.release_after), 2 * done_pos + 1)


def place_prefetch(usage: Usage, size: int, earliest: int, need: int, budget: int) -> int:
    """The earliest op-start slot in [earliest, need] from which holding `size` more bytes up
    to `need` keeps every slot within the budget; `need` when none is."""
    earliest = max(0, earliest + (earliest & 1))
    if earliest >= need:
        return need
    # (bytes + size > budget as bytes > budget - size: integers, the same slots without a
    # window array per prefetch)
    bad = (usage.bytes[earliest:need] > budget - size).nonzero()[0]
    if not len(bad):
        return earliest
    slot = earliest + int(bad[-1]) + 1
    slot += slot & 1
    return min(slot, need)


def anchor_prefetches(view: TraceView, plan: Plan) -> Plan:
    """The plan with every prefetch of an offloaded tensor issued at an op of the offloading
    op's stream that comes after the offload in trace order. A prefetch hangs on its op's
    launch, before the op waits for its deps: hung on an op of another stream (a backward
    convolution on a side stream), it can be issued before the offload has even started, finds
    the tensor still on the device (or unborn) and does nothing, and the reader then finds it
    on the host with no prefetch (PlanError). Ops of one stream launch in trace order, so the
    last op of the offload's stream at or before the chosen one launches after the offload.
    That op must also come after the release: where the offload's stream has none (a forward
    convolution alone on a side stream, RegNet's), the prefetch stays where it was."""
    offloads = {a.tensor: a for a in plan.actions if isinstance(a, Offload)}
    if not offloads:
        return plan
    # per stream, its ops' positions (the trace's alone: once per view, not per plan)
    by_stream: dict[int, list[int]] | None = view.memo.get("ops by stream")
    if by_stream is None:
        by_stream = view.memo["ops by stream"] = {}
        for i, o in enumerate(view.ops):
            by_stream.setdefault(o.stream, []).append(i)
    changed = False
    acts: list[Action] = []
    for act in plan.actions:
        off = offloads.get(act.tensor) if isinstance(act, Prefetch) else None
        if isinstance(act, Prefetch) and off is not None:
            stream = view.op[off.at_op].stream
            lo = view.pos[off.at_op] + (1 if off.after else 0)
            if off.release_after is not None:  # issued at or before the release, it finds the
                lo = max(lo, view.pos[off.release_after] + 1)  # tensor still on the device
            at = view.pos[act.at_op]
            if view.op[act.at_op].stream != stream or at < lo:
                same = by_stream[stream]
                k = bisect.bisect_right(same, at) - 1
                if k >= 0 and same[k] >= lo:
                    act = Prefetch(act.tensor, view.ops[same[k]].id, act.needed_by)
                    changed = True
        acts.append(act)
    return dataclasses.replace(plan, actions=tuple(acts)) if changed else plan


def recompute_chain(view: TraceView, t: int) -> tuple[int, ...]:
    """Forward ops that rebuild `t`: its producer and the ops that later update it in place (a
    ReLU applied in place to a convolution's output), in trace order; and, for each of those
    that updates another tensor in place (an in-place SiLU writes autograd's copy of its input
    and updates the batch norm's output), that tensor's producer and updates too: the state it
    read is not on the device any more (see stale_inputs)."""
    producer = view.tensor[t].producer
    if producer is None:
        return ()
    chain = {producer, *view.updates(t)}
    todo = list(chain)
    while todo:
        for u in view.mutates.get(todo.pop(), ()):
            p = view.tensor[u].producer
            for o in ([] if p is None else [p]) + list(view.updates(u)):
                if o not in chain:
                    chain.add(o)
                    todo.append(o)
    return tuple(sorted(chain, key=view.pos.__getitem__))


def rebuild_chain(view: TraceView, ops: Iterable[int], targets: Iterable[int], slot: int,
                  gone: Iterable[int] = ()) -> tuple[int, ...]:
    """The fewest of `ops` (forward ops, trace order) that rebuild `targets` at `slot`: the ops
    that write a target or update one in place, and, recursively, those that write what they
    read when it is no longer on the device at `slot` (by the trace, or because it is in `gone`:
    dropped by the plan though the trace still holds it). What a chosen op updates in place is
    never on the device in the state the op read (it holds the op's result, or a later one):
    it is rebuilt too, from its producer (stale_inputs says when that is not among `ops`)."""
    ops = list(ops)
    among = set(ops)
    gone = set(gone)
    needed = set(targets)
    chosen: list[int] = []
    # (the DP's segment shapes call this thousands of times: names bound once)
    by_id, tensor, mutates_of = view.op, view.tensor, view.mutates
    alloc, free = view._alloc_slot, view._free_slot  # noqa: SLF001  (alloc_slot's dicts)
    for o in reversed(ops):
        op = by_id[o]
        mutates = mutates_of.get(o)  # (most ops update nothing in place)
        if not needed.isdisjoint(op.writes) or (mutates is not None
                                                 and not needed.isdisjoint(mutates)):
            chosen.append(o)
            if mutates is not None:
                needed |= mutates
            for t in op.reads:
                if tensor[t].producer in among and (t in gone or not
                                                    alloc[t] <= slot < free[t]):
                    needed.add(t)
    return tuple(reversed(chosen))


def chain_inputs(view: TraceView, chain: Iterable[int]) -> set[int]:
    """Tensors the chain reads that it does not write itself."""
    ops = [view.op[o] for o in chain]
    written = {t for o in ops for t in o.writes}
    return {t for o in ops for t in o.reads if t not in written}


def stale_inputs(view: TraceView, chain: Iterable[int],
                 inputs: set[int] | None = None) -> set[int]:
    """Inputs of the chain that a forward op updates in place at or after a chain op that reads
    them: by the recomputation the device holds a later state than the one the chain read (a
    chain that starts at an in-place SiLU and keeps the batch norm's output, which holds SiLU's
    result by then). The runtime refuses such a chain (ExecutorError); a plan must not hold
    one. `inputs`: chain_inputs(view, chain), if the caller has it."""
    chain = list(chain)
    # only inputs that some op updates in place can be stale (most have none: the DP asks this
    # for thousands of segments)
    has_updates = view._updates  # noqa: SLF001  (view.updates(t) is non-empty iff t is a key)
    if inputs is None:
        inputs = chain_inputs(view, chain)
    if has_updates.keys().isdisjoint(inputs):  # (the common case, without a pass in Python)
        return set()
    updated = [t for t in inputs if t in has_updates]
    pos, by_id, wanted = view.pos, view.op, set(updated)
    first: dict[int, int] = {}  # per updated input, the first chain op that reads it
    for o in chain:
        p = pos[o]
        for t in by_id[o].reads:
            if t in wanted:
                f = first.get(t)
                if f is None or p < f:
                    first[t] = p
    # (view.updates(t) is in trace order: some update at or after the first read iff the last)
    return {t for t in updated if pos[has_updates[t][-1]] >= first[t]}


def inseparable(view: TraceView) -> frozenset[int]:
    """Forward layers (indices in view.fwd) after which a checkpoint must not be cut: the cut
    would part an in-place update that also writes a tensor of its own (an in-place SiLU:
    autograd's copy of its input) from the producer of what it updates (the batch norm). The
    segment after the cut would keep the batch norm's output as its checkpoint, which holds
    SiLU's result by then, and could not re-run SiLU (stale_inputs); so the cut goes before the
    producer (recompute's segments)."""
    got = view.memo.get("inseparable")
    if got is None:
        cut: set[int] = set()
        for o, targets in view.mutates.items():
            b = view.fwd_layer_of(o)
            if b is None or not any(view.readers.get(w) for w in view.op[o].writes):
                continue
            for t in targets:
                p = view.tensor[t].producer
                a = None if p is None else view.fwd_layer_of(p)
                if a is not None:
                    cut.update(range(a, b))
        got = view.memo["inseparable"] = frozenset(cut)
    return got


def alive_in_trace(view: TraceView, t: int, slot: int) -> bool:
    return view.alloc_slot(t) <= slot < view.free_slot(t)


def liveness_releases(view: TraceView, kinds: tuple[str, ...] = (
        "activation", "gradient", "temporary", "workspace")) -> list[Release]:
    """Free each tensor after its last reader when the trace keeps it longer (SuperNeurons'
    liveness analysis): tensors the trace never frees, or frees after a later op. Memoised on
    the view (independent of the budget: the profiling loop plans for many); a fresh list."""
    key = ("liveness_releases", kinds)
    got = view.memo.get(key)
    if got is None:
        got = view.memo[key] = _liveness_releases(view, kinds)
    return list(got)


def _liveness_releases(view: TraceView, kinds: tuple[str, ...]) -> list[Release]:
    out = []
    for ten in view.trace.tensors:
        if ten.kind not in kinds or ten.producer is None or ten.producer not in view.pos:
            continue
        last = view.last_reader(ten.id)
        last = ten.producer if last is None else last
        if view.pos[last] < view.pos[ten.producer]:
            last = ten.producer
        if view.end(last) < view.free_slot(ten.id):
            out.append(Release(ten.id, last))
    return out


def apply_releases(usage: Usage, view: TraceView, releases: Iterable[Release]) -> None:
    for r in releases:
        usage.remove(view.tensor[r.tensor].size_bytes, view.end(r.after_op),
                     view.free_slot(r.tensor))


def host_pool_bytes(view: TraceView, swaps: Iterable[Swap]) -> int:
    """Most bytes held on the host at once, from each offload's start to its prefetch's need:
    the size of a pinned pool whose buffers are reused (vDNN++, SuperNeurons)."""
    sw = list(swaps)
    # (a span may end one past the last slot: the need's slot included)
    return int(span_sums(view.n_slots + 1,
                         [view.end(s.offload_op) if s.after else view.start(s.offload_op)
                          for s in sw],
                         [view.start(s.need_op) + 1 for s in sw],
                         [view.tensor[s.tensor].size_bytes for s in sw]).max())


class Evictions:
    """Swaps and drops chosen against a budget, over a base profile (the trace after liveness
    releases and planned recomputations). Each eviction frees the tensor's device copy from
    when it can go (the copy is estimated done / after its last forward reader) to when the next
    reader (`need`) takes it back; prefetches are then placed as early as the policy wants and
    the budget allows."""

    def __init__(self, view: TraceView, hw: Hardware, base: Usage, budget: int,
                 blocking: bool = False) -> None:
        self.view = view
        self.blocking = blocking
        self.timeline = Timeline(view, hw)
        self.base = base
        self.budget = budget
        self.swaps: dict[int, Swap] = {}
        self.drops: dict[int, tuple[int, tuple[int, ...]]] = {}  # t -> (drop_after, chain)
        self.needs: dict[int, int] = {}  # t -> op, when something reads it before its bwd reader
        self._issues: dict[int, tuple[tuple[int, bool, int], float, float]] = {}
        self._key_base = max((t.id for t in view.trace.tensors), default=0) + 1
        self._queue_np: tuple[np.ndarray, np.ndarray] | None = None  # the queue, as arrays
        self.usage = self.profile()

    def copy(self, budget: int) -> Evictions:
        """An independent copy with another budget: the same swaps (copied), drops, needs,
        profile and D2H queue; the view, base profile and timeline shared (none of them is
        changed by an Evictions). Nothing but place_prefetches reads the budget, so a planner
        whose swaps and drops do not depend on it (vDNN++) chooses them once per base profile
        and copies them for each budget: the same state as choosing them again."""
        ev = Evictions.__new__(Evictions)
        ev.__dict__.update(self.__dict__)
        ev.budget = budget
        twins = {id(s): s.copy() for s in self.swaps.values()}

        def twin(s: Swap) -> Swap:
            got = twins.get(id(s))
            if got is None:  # (a queued swap no longer in `swaps`: only while stale)
                got = twins[id(s)] = s.copy()
            return got
        ev.swaps = {t: twin(s) for t, s in self.swaps.items()}
        ev.drops, ev.needs, ev._issues = dict(self.drops), dict(self.needs), dict(self._issues)
        ev.usage = self.usage.copy()
        ev._queue_keys, ev._queue_ends = list(self._queue_keys), list(self._queue_ends)
        ev._queue_enc, ev._queue_cost = list(self._queue_enc), list(self._queue_cost)
        ev._queue_swaps = [twin(s) for s in self._queue_swaps]
        return ev  # (_queue_np: arrays replaced, never changed in place; shared)

    def need(self, t: int) -> int:
        first = self.view.first_bwd_reader(t)
        extra = self.needs.get(t)
        if first is None:
            assert extra is not None
            return extra
        if extra is None:
            return first
        return min(first, extra, key=self.view.pos.__getitem__)

    def last_fwd_use(self, t: int) -> int:
        lfr = self.view.last_fwd_reader(t)
        producer = self.view.tensor[t].producer
        if lfr is None:
            assert producer is not None
            return producer
        return lfr

    def swap(self, t: int) -> Swap:
        last = self.last_fwd_use(t)
        return Swap(t, last, True, last, self.view.end(last), self.need(t))

    def trial_swap(self, t: int) -> Swap:
        """The swap of `t` as it would be, behind the swaps already chosen on the D2H engine
        (those issued before it; it does not see how it would delay later ones)."""
        s = self.swap(t)
        view, tl = self.view, self.timeline
        key = (view.pos[s.offload_op], s.after, s.tensor)
        i = bisect.bisect_left(self._queue_keys, key)
        issue = view.end_time(s.offload_op) if s.after else view.time_at(s.offload_op)
        start = max(issue, self._queue_ends[i - 1] if i else 0.0)
        s.copy_done_us = start + tl.d2h_us(view.tensor[t].size_bytes)
        s.release_slot = max(view.end(s.release_after), 2 * tl.op_at(s.copy_done_us) + 1)
        return s

    def gone_from(self, s: Swap) -> int:
        """First slot without the device copy. Blocking (Plan.wait_for_memory): an op that
        needs the memory waits for the copy, so the memory counts as free right after the last
        forward reader; otherwise from when the copy is estimated done."""
        return self.view.end(s.release_after) if self.blocking else s.release_slot

    def swap_window(self, t: int) -> tuple[int, int]:
        """Slots in which the tensor is off the device if swapped now."""
        s = self.swap(t) if self.blocking else self.trial_swap(t)
        return self.gone_from(s), self.view.start(s.need_op)

    def blocking_us(self, t: int, slot: int) -> float:
        """How long an op at `slot` would wait for the swap of `t` to leave (0 if it is gone
        by then, by the trace's clock)."""
        # trial_swap's copy end without building the swap: where the copy is issued does not
        # depend on the need (planners ask this per candidate per eviction)
        view = self.view
        key, issue, d2h = self._issue(t)
        i = bisect.bisect_left(self._queue_keys, key)
        copy_done = max(issue, self._queue_ends[i - 1] if i else 0.0) + d2h
        return max(0.0, copy_done - view.time_at(view.ops[slot // 2].id))

    def issue_table(self, tensors: Iterable[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per tensor, where its swap's copy would join the D2H queue (its queue key, encoded as
        one integer in the same order), when it is issued and how long it takes (us): what
        blocking_us_many needs, computed once for a planner's candidates."""
        enc, issue, d2h = [], [], []
        for t in tensors:
            key, at, dur = self._issue(t)
            enc.append(self._encode(key))
            issue.append(at)
            d2h.append(dur)
        return (np.array(enc, dtype=np.int64), np.array(issue, dtype=np.float64),
                np.array(d2h, dtype=np.float64))

    def blocking_us_many(self, table: tuple[np.ndarray, np.ndarray, np.ndarray],
                         slot: int) -> np.ndarray:
        """blocking_us for each tensor of an issue_table (rows of it), at `slot`: the same
        values, for all candidates at once."""
        enc, issue, d2h = table
        if self._queue_np is None:
            self._queue_np = (np.array(self._queue_enc, dtype=np.int64),
                              np.array([0.0, *self._queue_ends], dtype=np.float64))
        keys, ends = self._queue_np
        before = ends[np.searchsorted(keys, enc, side="left")]  # ends[0]: nothing before
        copy_done = np.maximum(issue, before) + d2h
        view = self.view
        return np.maximum(0.0, copy_done - view.time_at(view.ops[slot // 2].id))

    def _encode(self, key: tuple[int, bool, int]) -> int:
        """A D2H queue key (op position, after, tensor) as one integer of the same order."""
        pos, after, t = key
        return (2 * pos + after) * self._key_base + t

    def _issue(self, t: int) -> tuple[tuple[int, bool, int], float, float]:
        got = self._issues.get(t)
        if got is None:
            view = self.view
            last = self.last_fwd_use(t)
            got = self._issues[t] = ((view.pos[last], True, t), view.end_time(last),
                                     self.timeline.d2h_us(view.tensor[t].size_bytes))
        return got

    def drop_window(self, t: int) -> tuple[int, int]:
        return self.view.end(self.last_fwd_use(t)), self.view.before(self.need(t))

    def add_swap(self, t: int, swap: Swap | None = None, update: bool = True) -> None:
        self._slots_fresh = False
        new = t not in self.swaps
        s = self.swaps[t] = swap or self.swap(t)
        if not update:
            self._stale = True  # until refresh()
            return
        if not (new and self.blocking and s.prefetch_op is None):
            self.usage = self.profile()
            return
        # Blocking: the new swap's window does not depend on the D2H queue, and it does not
        # move anyone else's: update the profile and the queue in place.
        view = self.view
        self.usage.remove(view.tensor[t].size_bytes, self.gone_from(s), view.start(s.need_op))
        key = (view.pos[s.offload_op], s.after, s.tensor)
        i = bisect.bisect_left(self._queue_keys, key)
        self._queue_keys.insert(i, key)
        self._queue_enc.insert(i, self._encode(key))
        self._queue_ends.insert(i, 0.0)
        self._queue_swaps.insert(i, s)
        self._queue_cost.insert(i, self._copy_cost(s))
        free_at = self._queue_ends[i - 1] if i else 0.0
        ends_list, swaps, stop = self._queue_ends, self._queue_swaps, len(self._queue_keys)
        cost = self._queue_cost
        for j in range(i, stop):
            issue, d2h = cost[j]
            free_at = max(issue, free_at) + d2h
            if j > i and ends_list[j] == free_at:
                # each end follows from the one before alone (max(issue, previous end) + copy
                # time): from an end that does not move on, none does
                stop = j
                break
            ends_list[j] = swaps[j].copy_done_us = free_at
        if self._queue_np is not None:  # the arrays likewise, from i to stop (not rebuilt)
            keys, ends = self._queue_np
            # (np.insert's own overhead was a third of the insertion: concatenated instead)
            self._queue_np = (
                np.concatenate((keys[:i], np.array((self._queue_enc[i],), dtype=np.int64),
                                keys[i:])),
                np.concatenate((ends[:i + 1], np.array(ends_list[i:stop], dtype=np.float64),
                                ends[stop:])))

    def _copy_cost(self, s: Swap) -> tuple[float, float]:
        """When the swap's D2H copy is issued (the trace's clock) and how long it takes: what
        re-timing the queue behind an insertion needs of each queued swap."""
        view = self.view
        issue = view.end_time(s.offload_op) if s.after else view.time_at(s.offload_op)
        return issue, self.timeline.d2h_us(view.tensor[s.tensor].size_bytes)

    def add_drop(self, t: int, chain: tuple[int, ...]) -> None:
        after = self.last_fwd_use(t)
        self.drops[t] = (after, chain)
        if self.blocking and not self._stale:
            # Blocking: nothing else's window moves (profile() would give the same bytes; a
            # rebuild per drop was most of hybrid's planning on ResNet-1001)
            view = self.view
            self.usage.remove(view.tensor[t].size_bytes, view.end(after),
                              view.before(self.need(t)))
        else:
            self.usage = self.profile()

    def move_need(self, t: int, op: int) -> None:
        """`t` is read again at `op`, before it would be otherwise (a planned recomputation
        reads it): its need moves there, and a swap of it comes back by then. Blocking, with
        its prefetch not yet placed: the profile and the D2H queue are updated in place (the
        copy out does not move; the window off the device ends earlier)."""
        self.needs[t] = op
        self._slots_fresh = False
        old = self.swaps.get(t)
        if old is None:
            return
        new = self.swaps[t] = self.swap(t)
        if not (self.blocking and not self._stale and old.prefetch_op is None):
            self.usage = self.profile()
            return
        view = self.view
        size = view.tensor[t].size_bytes
        self.usage.add(size, self.gone_from(old), view.start(old.need_op))
        self.usage.remove(size, self.gone_from(new), view.start(new.need_op))
        new.copy_done_us, new.release_slot = old.copy_done_us, old.release_slot
        i = bisect.bisect_left(self._queue_keys, (view.pos[new.offload_op], new.after, t))
        self._queue_swaps[i] = new

    def refresh(self) -> None:
        """Recompute `usage` from the base profile and every swap and drop chosen (after
        add_swap/drops changed with update=False)."""
        self.usage = self.profile()

    def profile(self) -> Usage:
        """The base profile less what the chosen swaps and drops take off the device (the D2H
        queue's estimates are brought up to date on the way)."""
        u = self.base.copy()
        self.timeline.release_slots(list(self.swaps.values()))
        # the swaps' release slots as release_slots sets them, until a swap is added or moved
        self._slots_fresh = True
        view = self.view
        queue = sorted(self.swaps.values(),
                       key=lambda s: (view.pos[s.offload_op], s.after, s.tensor))
        self._queue_keys = [(view.pos[s.offload_op], s.after, s.tensor) for s in queue]
        self._queue_ends = [s.copy_done_us for s in queue]
        self._queue_swaps = queue
        self._queue_enc = [self._encode(k) for k in self._queue_keys]
        self._queue_cost = [self._copy_cost(s) for s in queue]
        self._queue_np = None
        self._stale = False
        for s in self.swaps.values():
            size = self.view.tensor[s.tensor].size_bytes
            u.remove(size, self.gone_from(s), self.view.start(s.need_op))
            if s.prefetch_op is not None:
                u.add(size, self.view.start(s.prefetch_op), self.view.start(s.need_op))
        for t, (after, _chain) in self.drops.items():
            u.remove(self.view.tensor[t].size_bytes, self.view.end(after),
                     self.view.before(self.need(t)))
        return u

    def place_prefetches(self, desired: Callable[[Swap], int]) -> None:
        """In order of need, issue each prefetch at the op-start slot `desired(swap)` or, when
        that would break the budget, the earliest later slot that does not (at the latest at
        the reader itself). Never before an earlier-needed prefetch: one H2D engine serves
        them in issue order, and a later need issued first would delay an earlier one."""
        view = self.view
        if not self._slots_fresh:  # after in-place additions (else as profile() left them)
            self.timeline.release_slots(list(self.swaps.values()))
            self._slots_fresh = True
        order = sorted(self.swaps.values(), key=lambda s: (view.pos[s.need_op], s.tensor))
        floor = 0
        for s in order:
            need = view.start(s.need_op)
            lo = max(desired(s), s.release_slot + 1, floor)
            slot = place_prefetch(self.usage, view.tensor[s.tensor].size_bytes, lo, need,
                                  self.budget)
            floor = slot
            s.prefetch_op = view.ops[slot // 2].id
            self.usage.add(view.tensor[s.tensor].size_bytes, slot, need)

    def actions(self) -> list[Action]:
        acts: list[Action] = []
        pos = self.view.pos
        swaps = list(self.swaps.values())
        # (each swap's offload and prefetch built once: actions() built both for each)
        for s in sorted(swaps, key=lambda s: (pos[s.offload_op], s.tensor)):
            acts.append(s.offload())
        # Prefetches issued at one op go to the H2D engine in this order: the first needed first.
        for s in sorted(swaps, key=lambda s: (pos[s.prefetch_op if s.prefetch_op is not None
                                                  else s.need_op], pos[s.need_op], s.tensor)):
            acts.append(s.prefetch())
        for t, (after, chain) in sorted(self.drops.items()):
            acts += [Drop(t, after), Recompute(chain, self.need(t), (t,))]
        return acts


def free_time_us(ev: Evictions, t: int) -> float:
    """What a swap of `t` leaves free: from its last forward use to the op that needs it back,
    less its copy out and its copy back (negative: the round trip does not hide)."""
    view, tl = ev.view, ev.timeline
    size = view.tensor[t].size_bytes
    return (view.time_at(ev.need(t)) - view.end_time(ev.last_fwd_use(t))
            - tl.d2h_us(size) - tl.h2d_us(size))


def jit_prefetch_slots(view: TraceView, timeline: Timeline, swaps: Iterable[Swap]
                       ) -> dict[int, int]:
    """Just-in-time issue slots: going back from the last need, each prefetch starts so that it
    ends by its reader's recorded start and before the next prefetch (one H2D engine, in need
    order) starts. tensor -> op-start slot."""
    out: dict[int, int] = {}
    next_start = float("inf")
    for s in sorted(swaps, key=lambda s: (view.pos[s.need_op], s.tensor), reverse=True):
        end = min(view.time_at(s.need_op), next_start)
        start = end - timeline.h2d_us(view.tensor[s.tensor].size_bytes)
        next_start = start
        out[s.tensor] = 2 * timeline.op_at(start)
    return out
