"""`hybrid`: per tensor, swap or recompute, whichever costs less (Capuchin, Peng et al., ASPLOS'20).

Capuchin measures tensor accesses in a first iteration and then, for the tensors it must evict,
weighs the two ways back. Here the trace is that measured iteration. For each saved feature map t:
- swap: out after its last forward reader, back before its first backward reader. Its free time
  FT = start(back-access) - end(last forward access) - d2h(t) - h2d(t); the overhead is
  max(0, -FT): what the transfers cannot hide, plus what the op that needs the memory would wait
  for the copy out to end (Plan.wait_for_memory) when the D2H engine is still busy.
- recompute: re-run the op that produced t (and any op that modified it in place) right before the
  back-access; the overhead is those ops' recorded time. Possible only if everything they read is
  still held then (by the trace) and not dropped itself; an input that is swapped comes back for
  the recomputation, and inputs of planned recomputations are never dropped.

Selection, against the static profile (planning.py): while some slot exceeds the capacity, among
the tensors whose eviction would cover that slot, evict the one with the least overhead per byte
saved (Capuchin's memory saving per second), by its cheaper way. Swapped tensors come back just in
time by the same timing model, or later where the capacity does not allow. The plan is checked by
one simulated iteration and planned again with a tighter budget when that runs out of memory.

Convolution algorithms (`algo`: auto, performance, memory): see vsim.workspace_free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..plan import Plan
from ..spec import choice
from ..units import format_size
from .base import register
from .fitted import Attempt, FittedPolicy
from .planning import (
    alive_in_trace,
    chain_inputs,
    free_time_us,
    jit_prefetch_slots,
    recompute_chain,
    stale_inputs,
)


@register
@dataclass(frozen=True)
class Hybrid(FittedPolicy):
    name = "hybrid"
    description = ("Capuchin-style: evict feature maps under memory pressure by swap or "
                   "recomputation, whichever costs less for that tensor")
    algo: str = choice("auto", "performance", "memory", "microbatch")
    examples = ("hybrid:algo=memory",)

    def plan_for(self, a: Attempt) -> Plan:
        view, budget = a.view, a.budget
        ev = a.evictions(blocking=True)
        cands = [t for t in view.saved if view.tensor[t].kind in ("activation", "input")]
        tl = ev.timeline

        def swap_cost(t: int) -> float:
            return max(0.0, -free_time_us(ev, t))

        spent = {"swap": 0.0, "recompute": 0.0}  # swap: how many hide; recompute: us
        # Per candidate, as arrays (each eviction weighs every candidate: a loop over them in
        # Python was most of the planning), what depends only on its need (ev.need: changed
        # below only for the inputs of a planned recomputation, refreshed then): its swap window
        # (blocking: behind no queue), swap cost, drop window, and whether its recomputation
        # reads only what the trace holds then, in the state it read (planning.stale_inputs).
        # Their first values depend on neither the budget nor the plan: built once per view and
        # profile (the profiling loop plans for up to 23 budgets), copied per plan.

        def refresh(i: int) -> None:
            t = cands[i]
            lo[i], hi[i] = ev.swap_window(t)
            dlo[i], dhi[i] = ev.drop_window(t)
            swap_us[i] = swap_cost(t)
            chain = chains[t]
            held[i] = bool(chain) and not stale_inputs(view, chain) \
                and all(alive_in_trace(view, u, int(dhi[i])) for u in ins[i])
            chain_us[i] = math.fsum(view.op[o].dur_us for o in chain)

        key = ("hybrid candidates", repr(a.hw))
        if key not in view.memo:
            chains = {t: recompute_chain(view, t) for t in cands}
            n = len(cands)
            lo, hi, dlo, dhi = (np.zeros(n, dtype=np.int64) for _ in range(4))
            swap_us, chain_us = np.zeros(n), np.zeros(n)
            held = np.zeros(n, dtype=bool)
            ins = [chain_inputs(view, chains[t]) for t in cands]
            read_by: dict[int, list[int]] = {}  # tensor -> candidates whose recomputation
            for i, got in enumerate(ins):       # reads it
                for u in got:
                    read_by.setdefault(u, []).append(i)
            for i in range(n):
                refresh(i)
            view.memo[key] = (chains, ins, read_by, (lo, hi, dlo, dhi, swap_us, chain_us, held),
                              ev.issue_table(cands))
        chains, ins, read_by, first, issues = view.memo[key]
        lo, hi, dlo, dhi, swap_us, chain_us, held = (arr.copy() for arr in first)
        n = len(cands)
        where = {t: i for i, t in enumerate(cands)}
        ids = np.array(cands, dtype=np.int64)
        size = np.array([view.tensor[t].size_bytes for t in cands], dtype=np.int64)
        per_byte = np.maximum(size, 1)
        # dynamic: not yet evicted; not read by a planned recomputation (may be swapped, not
        # dropped); reads nothing dropped (swapped inputs come back for a recomputation)
        open_, free_of_plans, reads_no_drop = (np.ones(n, dtype=bool) for _ in range(3))
        # The candidates covering slot x as last found, while only `open_` has changed since
        # (a swap closes one candidate and changes nothing else they are chosen by): the same
        # indices less those closed, without the masks over every candidate again (the slot
        # over the budget often stays the same for many evictions)
        covered: tuple[int, np.ndarray, np.ndarray] | None = None
        while (x := ev.usage.over(budget)) is not None:
            if covered is not None and covered[0] == x:
                sw, rc = covered[1], covered[2]
            else:
                # (a 1-D mask's nonzero()[0] is np.flatnonzero's result without its ravel and
                # dispatch)
                sw = (open_ & (lo <= x) & (x < hi)).nonzero()[0]
                rc = (open_ & (dlo <= x) & (x < dhi) & free_of_plans & held
                      & reads_no_drop).nonzero()[0]
            if not len(sw) and not len(rc):
                break
            table = (issues[0][sw], issues[1][sw], issues[2][sw])
            cost = np.concatenate([swap_us[sw] + ev.blocking_us_many(table, x), chain_us[rc]])
            which = np.concatenate([sw, rc])
            ratio = cost / per_byte[which]
            recompute = np.concatenate([np.zeros(len(sw), dtype=bool),
                                        np.ones(len(rc), dtype=bool)])
            # the least cost per byte saved; then the largest, the lowest id, recompute first
            # (lexsort's first, by a pass per key over the ties left: (id, how) is unique)
            tie = (ratio == ratio.min()).nonzero()[0]
            if len(tie) > 1:
                tie = tie[size[which[tie]] == size[which[tie]].max()]
            if len(tie) > 1:
                tie = tie[ids[which[tie]] == ids[which[tie]].min()]
            if len(tie) > 1 and recompute[tie].any():
                tie = tie[recompute[tie]]
            j = int(tie[0])
            i, cost_per_byte = int(which[j]), float(ratio[j])
            t = cands[i]
            how = "recompute" if recompute[j] else "swap"
            spent[how] += (cost_per_byte == 0) if how == "swap" \
                else cost_per_byte * view.tensor[t].size_bytes
            open_[i] = False
            if how == "swap":
                ev.add_swap(t)
                covered = (x, sw[sw != i], rc[rc != i])
                continue
            covered = None  # (a recomputation changes needs, windows and masks)
            # What the recomputation reads must be back by then: a swapped input's next need
            # becomes the recomputation (Capuchin's recompute-after-swap).
            before = ev.need(t)
            for u in chain_inputs(view, chains[t]):
                if u in where:
                    free_of_plans[where[u]] = False
                if view.tensor[u].kind not in ("activation", "input"):
                    continue
                if u not in ev.needs or view.pos[before] < view.pos[ev.needs[u]]:
                    ev.move_need(u, before)  # a swapped input comes back by then
                    if u in where:
                        refresh(where[u])
            ev.add_drop(t, chains[t])
            reads_no_drop[read_by.get(t, [])] = False
        jit = jit_prefetch_slots(view, tl, ev.swaps.values())
        ev.place_prefetches(lambda s: jit[s.tensor])
        notes = [f"hybrid: {len(ev.swaps)} swapped ({spent['swap']:.0f} expected to hide "
                 f"entirely), {len(ev.drops)} recomputed ({spent['recompute']:.0f} us)"]
        if (x := ev.usage.over(budget)) is not None:
            notes.append(f"hybrid: the static profile still exceeds {format_size(budget)} at op "
                         f"{view.ops[x // 2].id}: nothing left to evict there")
        return Plan(actions=(*ev.actions(), *a.retimes), notes=(*notes, *a.retime_notes),
                    wait_for_memory=True)
