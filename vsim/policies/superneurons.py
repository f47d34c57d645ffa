"""`superneurons`: SuperNeurons (Wang et al., PPoPP'18), its three techniques in its order.

1. Liveness analysis: every activation, gradient, workspace and temporary is released right after
   its last reader (Release), where the trace kept it longer.
2. Cost-aware recomputation: the saved outputs of cheap layers (POOL, ACT, BN, LRN: their forward
   costs little next to a CONV) are dropped after their last forward reader and recomputed in
   backward. The network is cut into segments of consecutive cheap layers; each segment is
   recomputed speed-centric (once, at its first backward need, keeping all its outputs until their
   backward readers free them) or memory-centric (each output recomputed from what is still on the
   device right before its own backward reader, the intermediates given back at once).
   recompute=auto chooses per segment as the paper does: speed-centric unless that raises the
   network's peak, memory-centric otherwise.
3. Offload of CONV outputs through an LRU tensor cache, only under memory pressure: walking the
   static profile, wherever it exceeds the capacity the least recently used CONV output that is
   not needed again before that point is evicted (copied out after its last forward reader; other
   saved maps only when CONV outputs are not enough, as the cache holds every tensor), and
   prefetched at the start of the backward CONV layer before the one that needs it (or later
   where memory does not allow). Offloaded tensors live in a reused pinned pool; an allocation
   that does not fit waits for offloads in flight (Plan.wait_for_memory).

The plan is checked with one simulated iteration and re-planned against a tighter budget when the
check runs out of memory (planning.fit_by_profiling): SuperNeurons' runtime decides evictions as
allocations fail, which a static plan can only approximate.

Convolution algorithms (`algo`: auto, performance, memory): see vsim.workspace_free.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ..plan import Action, Drop, Plan, Recompute
from ..spec import choice
from ..units import format_size
from .base import register
from .fitted import Attempt, FittedPolicy
from .layers import TraceView
from .planning import (
    Swap,
    Usage,
    alive_in_trace,
    chain_inputs,
    host_pool_bytes,
    liveness_releases,
    rebuild_chain,
    stale_inputs,
)

CHEAP = ("relu", "gelu", "pool", "bn", "lrn")
"""Layer types SuperNeurons recomputes (POOL, ACT, BN, LRN)."""


@dataclass(frozen=True)
class Segment:
    ops: tuple[int, ...]          # the segment's forward ops, in trace order
    dropped: tuple[int, ...]      # its saved outputs, dropped after their last forward reader


def segments(view: TraceView) -> list[Segment]:
    """Runs of consecutive cheap forward layers and the saved outputs they produce."""
    out: list[Segment] = []
    run: list[int] = []
    for lay in [*view.fwd, None]:
        if lay is not None and lay.layer_type in CHEAP:
            run.extend(lay.ops)
            continue
        if run:
            # A map that a later layer updates in place (ResNet's `out += identity` and ReLU on
            # a batch norm's output) is not dropped: rebuilding it would mean re-running that
            # update too, whose other inputs may be gone by then (found by vsim measure).
            inside = set(run)
            dropped = [t for o in run for t in view.op[o].writes
                       if view.is_saved(t) and view.tensor[t].kind == "activation"
                       and inside.issuperset(view.inplace_ops(t))]
            if dropped:
                out.append(Segment(tuple(run), tuple(dropped)))
            run = []
    return out


def recompute_actions(view: TraceView, seg: Segment, speed: bool,
                      from_checkpoint: bool = False) -> list[Action]:
    need = {t: view.first_bwd_reader(t) for t in seg.dropped}
    acts: list[Action] = []
    for t in seg.dropped:
        last = view.last_fwd_reader(t)
        acts.append(Drop(t, last if last is not None else view.tensor[t].producer or 0))
    if speed:
        first = min(seg.dropped, key=lambda t: view.pos[need[t]])  # type: ignore[index]
        before = need[first] or 0
        chain = rebuild_chain(view, seg.ops, seg.dropped, view.before(before))
        acts.append(Recompute(chain, before, seg.dropped))
    else:
        for t in sorted(seg.dropped, key=lambda t: view.pos[need[t]]):  # type: ignore[index]
            before = need[t] or 0
            # from_checkpoint: an output the segment drops is recomputed too, not read
            gone = seg.dropped if from_checkpoint else ()
            chain = rebuild_chain(view, seg.ops, (t,), view.before(before), gone)
            acts.append(Recompute(chain, before, (t,)))
    return acts


def feasible(view: TraceView, acts: list[Action], dropped: set[int]) -> bool:
    """Every recomputation reads only tensors that the trace still holds at that point, in the
    state it read (planning.stale_inputs), and that no segment drops."""
    chains = [a for a in acts if isinstance(a, Recompute)]
    return not any(stale_inputs(view, a.ops) for a in chains) and all(
        alive_in_trace(view, t, view.before(a.before_op)) and t not in dropped
        for a in chains for t in chain_inputs(view, a.ops))


@dataclass(frozen=True)
class _Rebuild:
    """One way of recomputing a segment: its actions, the spans its drops take off the profile
    (size, first slot, end slot: each dropped tensor is off the device from its drop until the
    recomputation that brings it back) and what each recomputation reads (its op, its chain's
    inputs)."""

    actions: list[Action]
    drops: tuple[tuple[int, int, int], ...]
    reads: tuple[tuple[int, frozenset[int]], ...]


def _segment_plans(view: TraceView, from_checkpoint: bool
                   ) -> list[tuple[_Rebuild, _Rebuild, bool]]:
    """Per segment: its memory-centric and speed-centric rebuilds and whether both are
    feasible. Independent of the budget and the workspaces: memoised on the view (the
    profiling loop plans for up to 23 budgets; ResNet-1001 has 1,500 segments)."""
    key = ("superneurons segments", from_checkpoint)
    got: list[tuple[_Rebuild, _Rebuild, bool]] | None = view.memo.get(key)
    if got is None:
        segs = segments(view)
        all_dropped = {t for seg in segs for t in seg.dropped}
        got = []
        for seg in segs:
            mem = recompute_actions(view, seg, speed=False, from_checkpoint=from_checkpoint)
            fast = recompute_actions(view, seg, speed=True)
            ok = feasible(view, fast, all_dropped) and feasible(view, mem, all_dropped)
            got.append((_rebuild(view, mem), _rebuild(view, fast), ok))
        view.memo[key] = got
    return got


def _rebuild(view: TraceView, acts: list[Action]) -> _Rebuild:
    back: dict[int, int] = {}
    for a in acts:
        if isinstance(a, Recompute):
            for t in a.tensors:
                back[t] = view.before(a.before_op)
    drops = tuple((view.tensor[a.tensor].size_bytes, view.end(a.after_op), back[a.tensor])
                  for a in acts if isinstance(a, Drop))
    reads = tuple((a.before_op, frozenset(chain_inputs(view, a.ops)))
                  for a in acts if isinstance(a, Recompute))
    return _Rebuild(acts, drops, reads)


def _peak_with(usage: Usage, drops: tuple[tuple[int, int, int], ...]) -> int:
    """The peak of `usage` with these spans taken off, as a copy with them removed would
    have it: only the slots the spans cover are copied (two full copies per segment were a
    fifth of the planning on ResNet-1001)."""
    spans = [(size, lo, hi) for size, lo, hi in drops if hi > lo]
    if not spans:
        return usage.peak
    first, last = min(lo for _, lo, _ in spans), max(hi for _, _, hi in spans)
    inside = usage.bytes[first:last].copy()
    for size, lo, hi in spans:
        inside[lo - first:hi - first] -= size
    peak = int(inside.max())
    for rest in (usage.bytes[:first], usage.bytes[last:]):
        if len(rest):
            peak = max(peak, int(rest.max()))
    return peak


@register
@dataclass(frozen=True)
class SuperNeurons(FittedPolicy):
    name = "superneurons"
    description = ("SuperNeurons: liveness release, cost-aware recomputation of cheap layers, LRU "
                   "offload of CONV outputs under memory pressure with prefetch at backward CONVs")
    recompute: str = choice("auto", "speed", "memory", "off")
    algo: str = choice("auto", "performance", "memory", "microbatch")
    # memory-centric rebuilds: `reads` (default, the plans the validation corpus was measured
    # with) read what the trace still holds, so a segment whose rebuild would read an output it
    # drops is kept; `checkpoint` recomputes such outputs from the segment's checkpoint, as
    # SuperNeurons' paper does (validation/paper/superneurons-k40.yaml)
    rebuild: str = choice("reads", "checkpoint")
    examples = ("superneurons:recompute=off", "superneurons:recompute=memory",
                "superneurons:rebuild=checkpoint")

    def plan_for(self, at: Attempt) -> Plan:
        view, budget = at.view, at.budget
        actions: list[Action] = []
        # 1. liveness
        releases = liveness_releases(view)
        actions += releases
        actions += at.retimes
        usage = at.usage(releases)
        # 2. cost-aware recomputation, per segment
        needs: dict[int, int] = {}
        n_speed = n_memory = n_skipped = 0
        if self.recompute != "off":
            for mem, fast, ok in _segment_plans(view, self.rebuild == "checkpoint"):
                if not ok:
                    n_skipped += 1
                    continue
                chosen = mem
                if self.recompute in ("speed", "auto"):
                    if self.recompute == "speed":
                        chosen = fast
                    elif _peak_with(usage, fast.drops) <= _peak_with(usage, mem.drops):
                        chosen = fast
                if chosen is mem:
                    n_memory += 1
                else:
                    n_speed += 1
                for size, first, end in chosen.drops:
                    usage.remove(size, first, end)
                actions += chosen.actions
                for before_op, inputs in chosen.reads:
                    for t in inputs:
                        if t not in needs or view.pos[before_op] < view.pos[needs[t]]:
                            needs[t] = before_op
        # 3. LRU offload of CONV outputs, only where the profile exceeds the budget
        ev = at.evictions(usage, blocking=True)
        ev.needs.update(needs)
        dropped = {a.tensor for a in actions if isinstance(a, Drop)}
        conv_out = [t for t in view.saved if _conv_output(view, t) and t not in dropped]
        # The tensor cache holds every tensor: when CONV outputs are not enough (a map whose
        # recomputation was not possible, the network input), the others are evicted too.
        in_conv_out = set(conv_out)
        others = [t for t in view.saved if t not in in_conv_out and t not in dropped]
        n_others = 0
        start = 0  # swaps only take bytes off (in place, blocking): the first slot over the
        for pool in (conv_out, others):  # budget never moves back, the search resumes there
            # Least recently used first. Blocking, a swap's window does not depend on the
            # swaps chosen before it: the candidates are sorted once (planning time, issue 14).
            lru = sorted((view.end(ev.last_fwd_use(t)), t, *ev.swap_window(t)) for t in pool)
            # the first in LRU order whose window covers the slot over the budget, not yet
            # swapped (only this loop swaps): as arrays, a scan in C per eviction
            ids = [t for _, t, _, _ in lru]
            lo = np.array([w for _, _, w, _ in lru], dtype=np.int64)
            hi = np.array([w for _, _, _, w in lru], dtype=np.int64)
            open_ = np.array([t not in ev.swaps for t in ids], dtype=bool)
            while (x := ev.usage.over(budget, start)) is not None:
                start = x
                covers = (open_ & (lo <= x) & (x < hi)).nonzero()[0]
                if not len(covers):
                    break
                j = int(covers[0])
                open_[j] = False
                ev.add_swap(ids[j])
                n_others += pool is others
        ev.place_prefetches(lambda s: _previous_bwd_conv(view, s))
        notes = list(at.retime_notes)
        if n_speed or n_memory or n_skipped:
            notes.append(f"superneurons: {n_speed} segment(s) recomputed speed-centric, "
                         f"{n_memory} memory-centric, {n_skipped} kept (their recomputation "
                         f"would read a tensor the trace has freed by then)")
        if n_others:
            notes.append(f"superneurons: {n_others} feature map(s) other than CONV outputs "
                         f"evicted as well")
        if (x := ev.usage.over(budget)) is not None:
            notes.append(f"superneurons: the static profile still exceeds "
                         f"{format_size(budget)} at op "
                         f"{view.ops[x // 2].id}: no feature map left to evict there")
        return Plan(actions=(*actions, *ev.actions()), notes=tuple(notes),
                    pinned_pool_bytes=host_pool_bytes(view, ev.swaps.values()),
                    wait_for_memory=True)


def _conv_output(view: TraceView, t: int) -> bool:
    producer = view.tensor[t].producer
    return (view.tensor[t].kind == "activation" and producer is not None
            and view.layer_of[producer].layer_type == "conv")


def _previous_bwd_conv(view: TraceView, s: Swap) -> int:
    """Start slot of the last backward CONV layer that starts before the layer that needs the
    tensor: SuperNeurons prefetches one CONV ahead."""
    if "bwd convs" not in view.memo:  # backward layers' first positions; last CONV before each
        firsts: list[int] = []
        convs: list[int | None] = []
        last: int | None = None
        for lay in view.bwd:
            firsts.append(view.pos[lay.first])
            convs.append(last)
            if lay.layer_type == "conv":
                last = view.start(lay.first)
        view.memo["bwd convs"] = (firsts, [*convs, last])
    firsts, convs = view.memo["bwd convs"]
    need_layer = view.layer_of[s.need_op]
    best = convs[bisect.bisect_left(firsts, view.pos[need_layer.first])]
    return view.start(need_layer.first) if best is None else int(best)
