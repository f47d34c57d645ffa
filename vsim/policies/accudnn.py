"""`accudnn`: AccUDNN (Zhou et al., 2019): a performance model picks which feature maps to swap
so that their transfers hide under compute, given the capacity.

Performance model, on the trace's own timeline: a saved feature map t swapped out after its last
forward reader and back before its first backward reader has a free time
    FT(t) = start(first backward reader) - end(last forward reader) - d2h(t) - h2d(t)
(copy times from the hardware profile's pinned link). FT >= 0: the round trip can hide entirely
under the compute in between; FT < 0: about -FT would be exposed. Where the memory is needed
before the copy out can end (the D2H engine works through earlier swaps first), the op that needs
it waits (Plan.wait_for_memory), and that wait counts as exposed too.

Selection, against the static profile (planning.py): while some slot exceeds the capacity, among
the feature maps whose time off the device would cover that slot, swap one whose transfers hide
(FT >= 0), the largest first (fewest transfers for the bytes); if none hides, the one with the
least exposed time. Prefetches are issued just in time by the model (each ends at its reader's
start, one H2D engine in need order), or later where the capacity does not allow. The plan is
checked by one simulated iteration and re-planned with a tighter budget if that runs out of
memory.

Convolution algorithms (`algo`: auto, performance, memory): see vsim.workspace_free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import Plan
from ..spec import choice
from ..units import format_size
from .base import register
from .fitted import Attempt, FittedPolicy
from .planning import free_time_us, jit_prefetch_slots


@register
@dataclass(frozen=True)
class AccUDNN(FittedPolicy):
    name = "accudnn"
    description = ("AccUDNN: a performance model swaps the feature maps whose transfers hide "
                   "under compute, until the capacity is met")
    algo: str = choice("auto", "performance", "memory", "microbatch")
    examples = ("accudnn:algo=memory",)

    def plan_for(self, a: Attempt) -> Plan:
        view, budget = a.view, a.budget
        ev = a.evictions(blocking=True)
        # Per candidate, as arrays (each swap weighs every candidate: a loop over them in
        # Python was most of the planning): its exposed time, its window (blocking swaps wait
        # for no queue, and no need changes here) and where its copy joins the D2H queue.
        # None of it depends on the budget or on the swaps chosen: built once per view and
        # profile (the profiling loop plans for up to 23 budgets).
        key = ("accudnn candidates", repr(a.hw))
        if key not in view.memo:
            cands = [t for t in view.saved if view.tensor[t].kind in ("activation", "input")]
            windows = np.array([ev.swap_window(t) for t in cands], dtype=np.int64)
            view.memo[key] = (
                cands, np.array(cands, dtype=np.int64),
                np.array([view.tensor[t].size_bytes for t in cands], dtype=np.int64),
                np.array([max(0.0, -free_time_us(ev, t)) for t in cands]),
                *windows.reshape(-1, 2).T, ev.issue_table(cands))
        candidates, ids, size, exposed, lo, hi, issues = view.memo[key]
        open_ = np.ones(len(candidates), dtype=bool)
        hidden, best_cost = 0, 0.0
        # Each swap only takes bytes off the profile (in place: blocking), so the first slot
        # over the budget never moves back: the search resumes from it, and the candidates
        # covering it, while it stays, are those before less the ones swapped (their columns
        # taken once per slot; a swapped one is masked, its cost infinite).
        start, covered_at, left = 0, -1, 0
        while (x := ev.usage.over(budget, start)) is not None:
            start = x
            if x != covered_at:
                # (nonzero()[0]: np.flatnonzero of a 1-D mask without its extra calls)
                covers, covered_at = (open_ & (lo <= x) & (x < hi)).nonzero()[0], x
                # (a copy: a swapped candidate's exposed time becomes infinite, its mask)
                c_exposed, c_ids, c_size = exposed[covers], ids[covers], size[covers]
                c_issues = (issues[0][covers], issues[1][covers], issues[2][covers])
                left = len(covers)
            if not left:
                break
            cost = c_exposed + ev.blocking_us_many(c_issues, x)
            hides = (cost == 0).nonzero()[0]
            # (the orders lexsort gave, by one pass each: ids are distinct)
            if len(hides):  # one that hides, the largest first, then the lowest id
                largest = hides[c_size[hides] == c_size[hides].max()]
                j = int(largest[np.argmin(c_ids[largest])])
            else:  # the least exposed, then the lowest id
                least = (cost == cost.min()).nonzero()[0]
                j = int(least[np.argmin(c_ids[least])])
            i = int(covers[j])
            best_cost = float(cost[j])
            open_[i] = False
            c_exposed[j] = np.inf
            left -= 1
            ev.add_swap(candidates[i])
            hidden += best_cost == 0
        jit = jit_prefetch_slots(view, ev.timeline, ev.swaps.values())
        ev.place_prefetches(lambda s: jit[s.tensor])
        notes = [f"accudnn: {len(ev.swaps)} feature map(s) swapped, {hidden} of them expected "
                 f"to hide under compute entirely"]
        if (x := ev.usage.over(budget)) is not None:
            notes.append(f"accudnn: the static profile still exceeds {format_size(budget)} at op "
                         f"{view.ops[x // 2].id}: nothing left to swap there")
        return Plan(actions=(*ev.actions(), *a.retimes), notes=(*notes, *a.retime_notes),
                    wait_for_memory=True)
