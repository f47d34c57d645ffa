"""The search's terms: a Genome (one decision per saved feature map, per convolution's algorithm,
and wait_for_memory), the Problem that turns a genome into a Plan and simulates it (the cost
model), and the cost estimates the greedy ranks evictions by. See vsim/search/__init__.py."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..allocator import make_allocator
from ..allocator.base import AllocatorSpec
from ..engine import PlanError, run_plan
from ..hardware import Hardware
from ..plan import Action, Drop, Offload, Plan, Prefetch, Recompute, Retime
from ..policies.layers import TraceView
from ..policies.planning import (
    Evictions,
    Swap,
    Usage,
    alive_in_trace,
    anchor_prefetches,
    apply_releases,
    chain_inputs,
    host_pool_bytes,
    jit_prefetch_slots,
    liveness_releases,
    recompute_chain,
    stale_inputs,
)
from ..trace.schema import Trace
from ..workspace_free import memory_optimal_retimes, microbatch_retime

MIN_CANDIDATE_BYTES = 2**20
"""Smaller saved maps stay: moving them frees next to nothing and costs a copy's latency."""
MAX_TOGGLE_CANDIDATES = 48
"""Decision toggles try the largest maps (and every map already moved) first; this many."""
LEAD_SHIFTS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Genome:
    """One plan in the search's terms. `swaps`: (tensor, position in trace order of the op that
    issues its prefetch), sorted; `drops`: tensors; `slow`: convolution op ids run without
    workspace; `wait`: Plan.wait_for_memory; `split`: (op, parts) for the ops of `slow` run
    instead as micro-batches with their recorded algorithm (workspace_free.microbatch_retime)."""

    swaps: tuple[tuple[int, int], ...] = ()
    drops: tuple[int, ...] = ()
    slow: tuple[int, ...] = ()
    wait: bool = True
    split: tuple[tuple[int, int], ...] = ()

    @property
    def lead(self) -> dict[int, int]:
        return dict(self.swaps)

    def how(self, t: int) -> str:
        if t in self.lead:
            return "swap"
        return "drop" if t in self.drops else "keep"

    def set(self, t: int, how: str, lead: int = 0) -> Genome:
        swaps = {k: v for k, v in self.swaps if k != t}
        drops = set(self.drops) - {t}
        if how == "swap":
            swaps[t] = lead
        elif how == "drop":
            drops.add(t)
        return dataclasses.replace(self, swaps=tuple(sorted(swaps.items())),
                                   drops=tuple(sorted(drops)))

    def with_leads(self, leads: dict[int, int]) -> Genome:
        return dataclasses.replace(self, swaps=tuple(sorted(
            (t, leads.get(t, p)) for t, p in self.swaps)))

    def toggle_slow(self, op: int) -> Genome:
        return dataclasses.replace(self, slow=tuple(sorted(set(self.slow) ^ {op})),
                                   split=tuple(s for s in self.split if s[0] != op))

    def split_into(self, op: int, parts: int) -> Genome:
        """`op` (in `slow`) as `parts` micro-batches (1: without workspace again)."""
        rest = [s for s in self.split if s[0] != op]
        return dataclasses.replace(self, split=tuple(sorted(
            rest + ([(op, parts)] if parts > 1 else []))))


@dataclass(frozen=True)
class Outcome:
    """One simulated iteration: fits, iteration time (us), where it ran out of memory, stall
    per trace op (us); `error` when the plan was invalid."""

    fits: bool
    time_us: float
    oom: dict[str, Any] | None = None
    stalls: dict[int, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class Candidate:
    tensor: int
    size: int
    offload_op: int
    offload_after: bool
    last_fwd: int       # release after it (swap), drop after it
    first_bwd: int
    chain: tuple[int, ...]
    inputs: frozenset[int]


class Problem:
    """A trace, hardware, capacity and allocator; builds and simulates plans for genomes."""

    def __init__(self, trace: Trace, hw: Hardware, capacity_bytes: int,
                 allocator: AllocatorSpec | None = None, as_run: bool = True,
                 warm_start: bool = False) -> None:
        self.trace, self.hw, self.capacity = trace, hw, capacity_bytes
        self.warm_start = warm_start  # judged as a process that starts warm (engine.warm)
        self.allocator = allocator or make_allocator("exact")
        # Judged as `vsim run` judges (issue 14): the allocator's first iteration and workspace
        # fallback where it models PyTorch's (None: run_plan's default for the allocator).
        self.first_iteration: bool | None = None if as_run else False
        self.view = view = TraceView(trace)
        self.tail_us = float(trace.meta.get("iteration_tail_us", 0.0))
        retimes, self.retime_notes = memory_optimal_retimes(trace, hw)
        ws_ops = {view.tensor[t].producer for t in view.tensor
                  if view.tensor[t].kind == "workspace" and view.tensor[t].size_bytes > 0}
        self.memory_retime = {r.op: r for r in retimes if r.op in ws_ops}
        self.releases = liveness_releases(view)
        self.cands: dict[int, Candidate] = {}
        for t in view.saved:
            c = self._candidate(t)
            if c is not None:
                self.cands[t] = c
        self.by_size = sorted(self.cands, key=lambda t: (-self.cands[t].size, t))
        self.cache: dict[Genome, Outcome] = {}
        self.evaluations = 0
        self.sim_seconds = 0.0
        self._usage: dict[object, Usage] = {}
        self._inputs: dict[tuple[int, ...], frozenset[int]] = {}
        self._groups: dict[tuple[int, ...], dict[tuple[int, ...], tuple[int, tuple[int, ...]]]] = {}

    def _candidate(self, t: int) -> Candidate | None:
        view = self.view
        ten = view.tensor[t]
        first_bwd = view.first_bwd_reader(t)
        if ten.size_bytes < MIN_CANDIDATE_BYTES or first_bwd is None:
            return None
        readers = view.fwd_readers(t)
        last_fwd = readers[-1] if readers else ten.producer
        if last_fwd is None:
            return None
        inplace = view.inplace_ops(t)
        if inplace:
            offload_op, after = inplace[-1], True
        elif ten.producer is not None:
            offload_op, after = ten.producer, True
        else:  # the network input: final from the start, copied while its first reader runs
            offload_op, after = readers[0], False
        if view.pos[last_fwd] < view.pos[offload_op]:
            last_fwd = offload_op
        chain = recompute_chain(view, t)
        if stale_inputs(view, chain):  # it cannot read what it read: not droppable
            chain = ()
        return Candidate(t, ten.size_bytes, offload_op, after, last_fwd, first_bwd, chain,
                         frozenset(chain_inputs(view, chain)))

    # ------------------------------------------------------------ genome -> plan

    def groups(self, g: Genome) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
        """Recomputations: chain -> (the op it runs before, the dropped maps it brings back).
        Dropped maps whose chains share an op, or one of which the other's chain reads, are
        rebuilt by one recomputation (the union of their chains, in trace order) before the
        first of them is needed."""
        if g.drops in self._groups:
            return self._groups[g.drops]
        pos = self.view.pos
        parent = {t: t for t in g.drops}

        def find(t: int) -> int:
            while parent[t] != t:
                parent[t] = parent[parent[t]]
                t = parent[t]
            return t

        by_op: dict[int, int] = {}
        for t in g.drops:
            c = self.cands[t]
            for other in [*(by_op[o] for o in c.chain if o in by_op),
                          *(i for i in c.inputs if i in parent)]:
                parent[find(other)] = find(t)
            for o in c.chain:
                by_op.setdefault(o, t)
        comps: dict[int, list[int]] = {}
        for t in g.drops:
            comps.setdefault(find(t), []).append(t)
        out = {}
        for ts in comps.values():
            ops = tuple(sorted({o for t in ts for o in self.cands[t].chain},
                               key=pos.__getitem__))
            before = min((self.cands[t].first_bwd for t in ts), key=pos.__getitem__)
            out[ops] = (before, tuple(ts))
        self._groups[g.drops] = out
        return out

    def needs(self, g: Genome) -> dict[int, int]:
        """Op that must find each swapped map back: its first backward reader, or a
        recomputation that reads it, whichever comes first."""
        pos = self.view.pos
        need = {t: self.cands[t].first_bwd for t, _ in g.swaps}
        for chain, (before, _) in self.groups(g).items():
            for i in self.inputs(chain):
                if i in need and pos[before] < pos[need[i]]:
                    need[i] = before
        return need

    def inputs(self, chain: tuple[int, ...]) -> frozenset[int]:
        if chain not in self._inputs:
            self._inputs[chain] = frozenset(chain_inputs(self.view, chain))
        return self._inputs[chain]

    def invalid(self, g: Genome) -> str:
        """Why the genome cannot be a plan ('' when it can)."""
        view, dropped = self.view, set(g.drops)
        if dropped & set(g.lead):
            return "a map both swapped and dropped"
        for chain, (before, _) in self.groups(g).items():
            if not chain:
                return "a dropped map without a producer"
            slot = view.before(before)
            for i in self.inputs(chain):
                if i in dropped:
                    return f"recomputation reads dropped tensor {i}"
                if view.tensor[i].producer is not None and not alive_in_trace(view, i, slot):
                    return f"recomputation reads tensor {i}, freed by then"
        return ""

    def clamp(self, t: int, lead: int, need: int) -> int:
        lo = self.view.pos[self.cands[t].last_fwd] + 1
        return max(lo, min(lead, self.view.pos[need]))

    def plan(self, g: Genome) -> Plan:
        view, pos = self.view, self.view.pos
        acts: list[Action] = list(self.releases)
        acts += self.retimes(g.slow, g.split)
        need = self.needs(g)
        swaps = sorted(g.swaps, key=lambda s: (pos[self.cands[s[0]].offload_op], s[0]))
        for t, _ in swaps:
            c = self.cands[t]
            acts.append(Offload(t, c.offload_op, c.offload_after, c.last_fwd))
        issue = {t: self.clamp(t, p, need[t]) for t, p in g.swaps}
        for t in sorted(issue, key=lambda t: (issue[t], pos[need[t]], t)):
            acts.append(Prefetch(t, view.ops[issue[t]].id, need[t]))
        for chain, (before, tensors) in sorted(self.groups(g).items(),
                                               key=lambda kv: (pos[kv[1][0]], kv[0])):
            acts += [Drop(t, self.cands[t].last_fwd) for t in tensors]
            acts.append(Recompute(chain, before, tensors))
        pool = host_pool_bytes(view, [Swap(t, self.cands[t].offload_op, self.cands[t].offload_after,
                                           self.cands[t].last_fwd, 0, need[t],
                                           view.ops[issue[t]].id) for t in issue])
        return anchor_prefetches(view, Plan(actions=tuple(acts), pinned_pool_bytes=pool,
                                            wait_for_memory=g.wait))

    def evaluate(self, g: Genome) -> Outcome:
        hit = self.cache.get(g)
        if hit is not None:
            return hit
        why = self.invalid(g)
        if why:
            out = Outcome(False, math.inf, error=why)
        else:
            start = time.perf_counter()
            self.evaluations += 1
            try:
                run = run_plan(self.trace, self.hw, self.plan(g), self.allocator, self.capacity,
                               first_iteration=self.first_iteration,
                               workspace_fallback=self.first_iteration,
                               warm_start=self.warm_start).output
            except PlanError as exc:
                out = Outcome(False, math.inf, error=str(exc))
            else:
                stalls: dict[int, float] = {}
                for ex in run.executed:
                    if ex.recompute_of is None:
                        stalls[ex.op.id] = ex.stall_us
                # what a measurement reports: the median of the iterations it times (a plan
                # whose allocator layout never settles has its own fast last iteration:
                # VGG-16(256)'s sixth search plan at 12 GiB, 348.5 ms last, 417.8 median)
                end = statistics.median(run.timed_ends_us) if run.timed_ends_us else run.end_us
                out = Outcome(run.oom is None, end + self.tail_us,
                              None if run.oom is None else run.oom.to_json(), stalls)
            self.sim_seconds += time.perf_counter() - start
        self.cache[g] = out
        return out

    def genome_of(self, plan: Plan) -> Genome:
        """Another policy's plan in the search's terms: its offloaded candidates swapped (with
        their prefetch op), its dropped ones dropped, its workspace-free convolutions,
        wait_for_memory. Syncs, releases and maps too small to be candidates are left out."""
        pos = self.view.pos
        fetch = {a.tensor: a.at_op for a in plan.actions if isinstance(a, Prefetch)}
        swaps: dict[int, int] = {}
        drops, slow = set(), set()
        split: dict[int, int] = {}
        for a in plan.actions:
            if isinstance(a, Offload) and a.tensor in self.cands and a.tensor in fetch:
                swaps[a.tensor] = pos[fetch[a.tensor]]
            elif isinstance(a, Drop) and a.tensor in self.cands:
                drops.add(a.tensor)
            elif isinstance(a, Retime) and a.op in self.memory_retime and (
                    a.workspace_bytes == 0 or a.parts > 1):
                slow.add(a.op)
                if a.parts > 1:
                    split[a.op] = a.parts
        return Genome(tuple(sorted(swaps.items())), tuple(sorted(drops - set(swaps))),
                      tuple(sorted(slow)), plan.wait_for_memory, tuple(sorted(split.items())))

    # ------------------------------------------------------------ prefetch placement

    def retimes(self, slow: tuple[int, ...], split: tuple[tuple[int, int], ...] = ()
                ) -> list[Retime]:
        parts = dict(split)
        out = []
        for o in slow:
            r = microbatch_retime(self.view.op[o], self.view.tensor, self.hw, parts[o]) \
                if o in parts else None
            out.append(r or self.memory_retime[o])
        return out

    def base_usage(self, slow: tuple[int, ...], split: tuple[tuple[int, int], ...] = ()
                   ) -> Usage:
        key = (slow, split)
        if key not in self._usage:
            u = Usage(self.view, self.retimes(slow, split))
            apply_releases(u, self.view, self.releases)
            self._usage[key] = u
        return self._usage[key].copy()

    def evictions(self, g: Genome) -> Evictions:
        view = self.view
        ev = Evictions(view, self.hw, self.base_usage(g.slow, g.split), self.capacity,
                       blocking=g.wait)
        need = self.needs(g)
        ev.needs.update(need)
        for t, _ in g.swaps:
            c = self.cands[t]
            ev.add_swap(t, Swap(t, c.offload_op, c.offload_after, c.last_fwd,
                                view.end(c.last_fwd), need[t]), update=False)
        for chain, (_, tensors) in self.groups(g).items():
            for t in tensors:
                ev.drops[t] = (self.cands[t].last_fwd, chain)
        ev.refresh()
        return ev

    def asap_leads(self, g: Genome, late: Iterable[int] = ()) -> dict[int, int]:
        """Every prefetch as early as the static profile leaves room for it, in need order
        (planning.Evictions.place_prefetches); the maps in `late` at their reader."""
        ev = self.evictions(g)
        late = set(late)
        pos = self.view.pos
        ev.place_prefetches(lambda s: self.view.start(s.need_op) if s.tensor in late else 0)
        return {t: pos[s.prefetch_op] for t, s in ev.swaps.items() if s.prefetch_op is not None}

    def jit_leads(self, g: Genome) -> dict[int, int]:
        """Just in time by the trace's clock (planning.jit_prefetch_slots)."""
        ev = self.evictions(g)
        slots = jit_prefetch_slots(self.view, ev.timeline, ev.swaps.values())
        return {t: s // 2 for t, s in slots.items()}

    # ------------------------------------------------------------ cost estimates (greedy)

    def op_us(self, op: int, slow: tuple[int, ...]) -> float:
        r = self.memory_retime.get(op)
        return r.dur_us if r is not None and op in slow else self.view.op[op].dur_us

    def swap_cost_us(self, t: int) -> float:
        view, c = self.view, self.cands[t]
        d2h = self.hw.d2h.pinned.copy_time_us(c.size)
        h2d = self.hw.h2d.pinned.copy_time_us(c.size)
        window = view.time_at(c.first_bwd) - view.end_time(c.last_fwd)
        return max(0.0, d2h + h2d - window) + self.hw.copy_interference * (d2h + h2d)

    def drop_cost_us(self, t: int, g: Genome) -> float | None:
        """Recomputation time it adds (its chain's ops not already re-run); None when it
        cannot be dropped (no producer, or its chain reads a map the trace has freed by
        then)."""
        c, view = self.cands[t], self.view
        if not c.chain:
            return None
        slot = view.before(c.first_bwd)
        for i in c.inputs:
            if i not in g.drops and view.tensor[i].producer is not None \
                    and not alive_in_trace(view, i, slot):
                return None
        running = {o for ch in self.groups(g) for o in ch}
        return sum(self.op_us(o, g.slow) for o in c.chain if o not in running)

    def covers(self, t: int, how: str, op: int) -> bool:
        """Would `t` be off the device when `op` starts, if evicted that way?"""
        view, c = self.view, self.cands[t]
        x = view.start(op)
        if t in view.op[op].reads or t in view.op[op].writes:
            return False
        hi = view.start(c.first_bwd) if how == "swap" else view.before(c.first_bwd)
        return view.end(c.last_fwd) <= x < hi


