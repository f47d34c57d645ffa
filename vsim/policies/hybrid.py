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

from dataclasses import dataclass

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
    algo: str = choice("auto", "performance", "memory")
    examples = ("hybrid:algo=memory",)

    def plan_for(self, a: Attempt) -> Plan:
        view, budget = a.view, a.budget
        ev = a.evictions(blocking=True)
        cands = [t for t in view.saved if view.tensor[t].kind in ("activation", "input")]
        tl = ev.timeline

        def swap_cost(t: int) -> float:
            return max(0.0, -free_time_us(ev, t))

        chains = {t: recompute_chain(view, t) for t in cands}
        inputs: set[int] = set()   # read by planned recomputations: may be swapped, not dropped
        spent = {"swap": 0.0, "recompute": 0.0}  # swap: how many hide; recompute: us
        # Per candidate, what depends only on its need (ev.need: changed below only for the
        # inputs of a planned recomputation, whose entries go then): its swap window (blocking:
        # behind no queue), swap cost, drop window and whether its recomputation reads only
        # what the trace holds then. Recomputed per eviction, these were most of the planning.
        known: dict[int, tuple[tuple[int, int], float, tuple[int, int], bool, float,
                               set[int]]] = {}

        def facts(t: int) -> tuple[tuple[int, int], float, tuple[int, int], bool, float,
                                   set[int]]:
            got = known.get(t)
            if got is None:
                dw = ev.drop_window(t)
                chain = chains[t]
                ins = chain_inputs(view, chain)
                held = bool(chain) and not stale_inputs(view, chain) \
                    and all(alive_in_trace(view, i, dw[1]) for i in ins)
                got = known[t] = (ev.swap_window(t), swap_cost(t), dw, held,
                                  sum(view.op[o].dur_us for o in chain), ins)
            return got

        while (x := ev.usage.over(budget)) is not None:
            best: tuple[float, int, int, str] | None = None
            for t in cands:
                if t in ev.swaps or t in ev.drops:
                    continue
                (lo, hi), sc, (dlo, dhi), held, chain_us, ins = facts(t)
                size = view.tensor[t].size_bytes
                options = []
                if lo <= x < hi:
                    options.append((sc + ev.blocking_us(t, x), "swap"))
                # recomputable: reads only what the trace still holds then, in the state it
                # read (planning.stale_inputs), and nothing dropped (swapped inputs come back)
                if dlo <= x < dhi and t not in inputs and held \
                        and ev.drops.keys().isdisjoint(ins):
                    options.append((chain_us, "recompute"))
                for cost, how in options:
                    key = (cost / max(size, 1), -size, t, how)
                    if best is None or key < best:
                        best = key
            if best is None:
                break
            cost_per_byte, _, t, how = best
            spent[how] += (cost_per_byte == 0) if how == "swap" \
                else cost_per_byte * view.tensor[t].size_bytes
            if how == "swap":
                ev.add_swap(t)
                continue
            # What the recomputation reads must be back by then: a swapped input's next need
            # becomes the recomputation (Capuchin's recompute-after-swap).
            before = ev.need(t)
            for i in chain_inputs(view, chains[t]):
                inputs.add(i)
                if view.tensor[i].kind not in ("activation", "input"):
                    continue
                if i not in ev.needs or view.pos[before] < view.pos[ev.needs[i]]:
                    ev.needs[i] = before
                    known.pop(i, None)
                if i in ev.swaps:
                    ev.add_swap(i, update=False)
            ev.add_drop(t, chains[t])
        jit = jit_prefetch_slots(view, tl, ev.swaps.values())
        ev.place_prefetches(lambda s: jit[s.tensor])
        notes = [f"hybrid: {len(ev.swaps)} swapped ({spent['swap']:.0f} expected to hide "
                 f"entirely), {len(ev.drops)} recomputed ({spent['recompute']:.0f} us)"]
        if (x := ev.usage.over(budget)) is not None:
            notes.append(f"hybrid: the static profile still exceeds {format_size(budget)} at op "
                         f"{view.ops[x // 2].id}: nothing left to evict there")
        return Plan(actions=(*ev.actions(), *a.retimes), notes=(*notes, *a.retime_notes),
                    wait_for_memory=True)
