"""Greedy construction and local search over genomes (see vsim/search/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..allocator.base import AllocatorSpec
from ..hardware import Hardware
from ..plan import Plan
from ..trace.schema import Trace
from ..workspace_free import MICROBATCH_PARTS
from .bound import forced_workspace_free
from .problem import LEAD_SHIFTS, MAX_TOGGLE_CANDIDATES, Genome, Outcome, Problem

EXCHANGES = 4
"""Evictions tried in place of a map brought back to the device that no longer fits."""

# ---------------------------------------------------------------- greedy

def repair(p: Problem, g: Genome, log: Callable[[str], None] | None = None,
           deadline: float = math.inf, keep_leads: bool = False, max_steps: int | None = None
           ) -> tuple[Genome, Outcome]:
    """Make the plan fit: where it runs out of memory, first issue later the prefetches that
    hold memory there for a later reader, then evict maps that would be away there (best
    bytes per microsecond of expected cost first) until the shortfall is covered, else run the
    op's convolution without workspace. Prefetches of newly swapped maps (all of them unless
    `keep_leads`) go as early as the static profile allows. Returns the last genome tried and
    its outcome."""
    floor: dict[int, int] = {}
    fixed = set(g.lead) if keep_leads else set()
    pos = p.view.pos

    def place(g: Genome) -> Genome:
        asap = p.asap_leads(g)
        return g.with_leads({t: max(cur if t in fixed else asap.get(t, cur), floor.get(t, 0))
                             for t, cur in g.lead.items()})

    steps = 4 * len(p.cands) + 2 * len(p.memory_retime) + 8 if max_steps is None else max_steps
    g = place(g)
    r = p.evaluate(g)
    for _ in range(steps):
        if r.fits or r.oom is None or r.oom["op"] is None or time.monotonic() > deadline:
            break
        op, failed = int(r.oom["op"]), int(r.oom["tensor"])
        x = pos[op]
        short = max(1, int(r.oom["need_bytes"]) - int(r.oom["free_bytes"]))
        need = p.needs(g)
        chosen: list[str] = []
        freed = 0
        # prefetches issued by then for a later reader (the one that failed included)
        early = [(-pos[need[t]], t) for t, at in g.lead.items()
                 if p.clamp(t, at, need[t]) <= x < pos[need[t]]]
        for _, t in sorted(early):
            if freed >= short:
                break
            floor[t] = x + 1
            freed += 0 if t == failed else p.cands[t].size
            chosen.append(f"prefetch {t} later")
        if failed in g.lead and chosen:
            freed = short  # the failed request itself moves
        ranked = []
        for t in p.by_size if freed < short else ():
            if g.how(t) != "keep":
                continue
            options = []
            if p.covers(t, "swap", op):
                options.append((p.swap_cost_us(t), "swap"))
            cost = p.drop_cost_us(t, g)
            if cost is not None and p.covers(t, "drop", op):
                options.append((cost, "drop"))
            for cost, how in options:
                ranked.append((-p.cands[t].size / (cost + 1.0), t, how))
        for _, t, how in sorted(ranked):
            if freed >= short or g.how(t) != "keep":
                continue
            if how == "drop" and p.drop_cost_us(t, g) is None:
                continue
            g = g.set(t, how, 0)
            freed += p.cands[t].size
            chosen.append(f"{how} {t}")
        if not chosen:
            if op in p.memory_retime and op not in g.slow:
                g = g.toggle_slow(op)
                chosen.append(f"op {op} without workspace")
            else:
                break
        g = place(g)
        r = p.evaluate(g)
        if log:
            log(f"greedy: out of memory at op {op} short {short} B -> {', '.join(chosen)}: "
                f"{'fits' if r.fits else 'no'} {r.time_us / 1e3:.2f} ms")
    return g, r


def greedy(p: Problem, log: Callable[[str], None] | None = None,
           deadline: float = math.inf) -> tuple[Genome, Outcome]:
    forced = forced_workspace_free(p.trace, p.hw, p.view, p.capacity)
    start = Genome(slow=tuple(sorted(o for o in forced if o in p.memory_retime)))
    return repair(p, start, log, deadline)


# ---------------------------------------------------------------- local search

def moves(p: Problem, g: Genome, r: Outcome, rng: random.Random
          ) -> Iterator[tuple[Genome, bool]]:
    """Neighbours of g, the most promising first (see the module docstring), each with whether
    to repair it (greedy evictions) when it does not fit: keeping a map, or fetching one
    earlier, may pay for the evictions it needs elsewhere."""
    pos, view = p.view.pos, p.view
    lead, need = g.lead, p.needs(g)
    # 1. earlier prefetches for maps whose reader (or an op between) waited
    stalled = []
    for t, at in lead.items():
        hi = pos[need[t]]
        wait = sum(r.stalls.get(view.ops[i].id, 0.0) for i in range(p.clamp(t, at, need[t]),
                                                                     hi + 1))
        if wait > 0:
            stalled.append((-wait, t))
    for k, (_, t) in enumerate(sorted(stalled)):
        for d in LEAD_SHIFTS:
            yield g.set(t, "swap", p.clamp(t, lead[t] - d, need[t])), k == 0
    # 2. decisions of the maps moved: the other way; back on the device, and if that no
    #    longer fits, exchanged for maps that would be away where it runs out (cheapest first)
    moved = [t for t in p.by_size if g.how(t) != "keep"]
    rng.shuffle(moved)
    for u in moved:
        now = g.how(u)
        other = "drop" if now == "swap" else "swap"
        if other == "swap":
            ng = g.set(u, "swap", 0)
            yield ng.set(u, "swap", p.asap_leads(ng).get(u, 0)), False
        elif p.drop_cost_us(u, g.set(u, "keep")) is not None:
            yield g.set(u, "drop"), False
        kg = g.set(u, "keep")
        yield kg, False
        kr = p.evaluate(kg)
        if kr.fits or kr.oom is None or kr.oom["op"] is None:
            continue
        for t, how in exchanges(p, kg, kr, exclude=u):
            ng = kg.set(t, how, 0)
            if how == "swap":
                ng = ng.set(t, "swap", p.asap_leads(ng).get(t, 0))
            yield ng, True
    # the maps one recomputation rebuilds, all back on the device (repaired)
    for _, (_, tensors) in sorted(p.groups(g).items()):
        if len(tensors) > 1:
            ng = g
            for t in tensors:
                ng = ng.set(t, "keep")
            yield ng, True
    # 3. later, just-in-time, as-early-as-possible prefetches
    asap, jit = p.asap_leads(g), p.jit_leads(g)
    swapped = sorted(lead)
    rng.shuffle(swapped)
    for t in swapped:
        for later in (lead[t] + 1, lead[t] + 2, lead[t] + 4, jit.get(t), asap.get(t)):
            if later is not None and \
                    p.clamp(t, later, need[t]) != p.clamp(t, lead[t], need[t]):
                yield g.set(t, "swap", later), False
    # 4. convolution algorithms: back to the recorded one (repaired); to the workspace-free one
    #    only while something stalls (its workspace may make room for an earlier prefetch)
    stalls = any(v > 0 for v in r.stalls.values())
    ops = [o for o in sorted(p.memory_retime) if o in g.slow or stalls]
    rng.shuffle(ops)
    for op in ops:
        yield g.toggle_slow(op), op in g.slow
        if op in g.slow:  # as micro-batches instead, or fewer or more of them
            have = dict(g.split).get(op, 1)
            for k in (1, *MICROBATCH_PARTS):
                if k != have:
                    yield g.split_into(op, k), False
    yield dataclasses.replace(g, wait=not g.wait), False
    # 5. last: one more of the largest maps away (it may let another prefetch go earlier)
    kept = [t for t in p.by_size[:MAX_TOGGLE_CANDIDATES] if g.how(t) == "keep"]
    rng.shuffle(kept)
    for t in kept:
        ng = g.set(t, "swap", 0)
        yield ng.set(t, "swap", p.asap_leads(ng).get(t, 0)), False
        if p.drop_cost_us(t, g) is not None:
            yield g.set(t, "drop"), False


def exchanges(p: Problem, g: Genome, r: Outcome, exclude: int) -> list[tuple[int, str]]:
    """Up to EXCHANGES (map, how) evictions that would be away where g runs out of memory:
    first those that alone cover the shortfall, cheapest first, then the best bytes per
    microsecond."""
    assert r.oom is not None
    op = int(r.oom["op"])
    short = int(r.oom["need_bytes"]) - int(r.oom["free_bytes"])
    whole, part = [], []
    for t in p.by_size:
        if t == exclude or g.how(t) != "keep":
            continue
        options = []
        if p.covers(t, "swap", op):
            options.append((p.swap_cost_us(t), "swap"))
        cost = p.drop_cost_us(t, g)
        if cost is not None and p.covers(t, "drop", op):
            options.append((cost, "drop"))
        for cost, how in options:
            size = p.cands[t].size
            if size >= short:
                whole.append((cost, -size, t, how))
            else:
                part.append((-size / (cost + 1.0), t, how))
    out = [(t, how) for _, _, t, how in sorted(whole)]
    out += [(t, how) for _, t, how in sorted(part)]
    return out[:EXCHANGES]


def kick(p: Problem, g: Genome, rng: random.Random, n: int = 3) -> Genome:
    """n random decision changes (the perturbation of an iterated local search)."""
    for _ in range(n):
        t = rng.choice(p.by_size[:MAX_TOGGLE_CANDIDATES]) if p.by_size else None
        if t is None:
            break
        how = rng.choice([h for h in ("swap", "drop", "keep") if h != g.how(t)])
        if how == "drop" and p.drop_cost_us(t, g.set(t, "keep")) is None:
            how = "swap"
        g = g.set(t, how, 0)
    return g.with_leads(p.asap_leads(g))


@dataclass
class SearchResult:
    genome: Genome
    outcome: Outcome
    plan: Plan
    greedy_genome: Genome
    greedy_outcome: Outcome
    evaluations: int
    seconds: float
    sim_seconds: float
    converged: bool
    history: list[tuple[int, float]]   # (evaluation, best iteration time so far)
    counts: dict[str, Any]             # what the plan does: maps swapped, dropped, bytes, ...
    origin: str = "greedy"             # where the best plan's local search started
    from_greedy: Outcome | None = None  # the best plan of the search from the greedy start

    def summary_counts(self) -> dict[str, Any]:
        return dict(self.counts)


def search(trace: Trace, hw: Hardware, capacity_bytes: int,
           allocator: AllocatorSpec | None = None, *, seed: int = 0, budget_s: float = 60.0,
           kicks: int = 4, log: Callable[[str], None] | None = None,
           starts: Callable[[], list[tuple[str, Plan]]] | None = None,
           warm_start: bool = False) -> SearchResult:
    """Greedy start, then local search with `kicks` perturbations (module docstring); then, when
    `starts` is given, local search again from each plan it returns (name, plan: the built-in
    policies' plans, as genomes, repaired when they do not fit). Stops early, at the best plan
    so far, after `budget_s` seconds. `warm_start`: plans judged for a process that starts warm
    (engine.run_plan's)."""
    t0 = time.monotonic()
    deadline = t0 + budget_s
    p = Problem(trace, hw, capacity_bytes, allocator, warm_start=warm_start)
    rng = random.Random(seed)
    g0, r0 = greedy(p, log, deadline)
    best_g, best = g0, r0
    history = [(p.evaluations, r0.time_us)] if r0.fits else []
    converged = True
    if r0.fits:
        best_g, best, converged = climb(p, g0, r0, rng, deadline, log)
        history.append((p.evaluations, best.time_us))
        for _ in range(kicks if converged else 0):
            kg, kr = repair(p, kick(p, best_g, rng), None, deadline)
            if not kr.fits:
                continue
            kg, kr, done = climb(p, kg, kr, rng, deadline, log)
            if kr.time_us < best.time_us - 1e-6:
                best_g, best = kg, kr
                history.append((p.evaluations, best.time_us))
            if not done:
                converged = False
                break
    from_greedy, origin = best, "greedy"
    for name, plan in starts() if starts is not None else ():
        if not converged:
            break
        sg = p.genome_of(plan)
        sr = p.evaluate(sg)
        if not sr.fits:
            sg, sr = repair(p, sg, None, deadline, keep_leads=True)
        if not sr.fits:
            continue
        if log:
            log(f"start from {name}: {sr.time_us / 1e3:.3f} ms")
        sg, sr, converged = climb(p, sg, sr, rng, deadline, log)
        if not best.fits or sr.time_us < best.time_us - 1e-6:
            best_g, best, origin = sg, sr, name
            history.append((p.evaluations, best.time_us))
    plan = p.plan(best_g)
    began = "the greedy plan" if origin == "greedy" else f"{origin}'s plan"
    n_split = len(best_g.split)
    notes = [f"search: {len(best_g.swaps)} map(s) swapped, {len(best_g.drops)} recomputed, "
             f"{len(best_g.slow) - n_split} convolution(s) without workspace"
             + (f", {n_split} as micro-batches" if n_split else "")
             + f"; {p.evaluations} simulations, seed {seed}, local search from {began}"]
    if n_split:
        notes.append("micro-batched convolutions: vsim measure carries them out under its "
                     "Python op tracker (vsim.runtime.microbatch)")
    slow_notes = [n for n in p.retime_notes if len(best_g.slow) > n_split]
    plan = dataclasses.replace(plan, notes=(*notes, *slow_notes))
    counts = {"swapped": len(best_g.swaps), "dropped": len(best_g.drops),
              "swapped_bytes": sum(p.cands[t].size for t, _ in best_g.swaps),
              "dropped_bytes": sum(p.cands[t].size for t in best_g.drops),
              "workspace_free_convolutions": len(best_g.slow) - n_split,
              "micro_batched_convolutions": n_split, "wait_for_memory": best_g.wait,
              "candidates": len(p.cands)}
    return SearchResult(best_g, best, plan, g0, r0, p.evaluations, time.monotonic() - t0,
                        p.sim_seconds, converged, history, counts, origin, from_greedy)


def climb(p: Problem, g: Genome, r: Outcome, rng: random.Random, deadline: float,
          log: Callable[[str], None] | None = None) -> tuple[Genome, Outcome, bool]:
    """First-improvement local search from a fitting genome; the third value is False when the
    deadline stopped it before a local optimum."""
    while True:
        for ng, fix in moves(p, g, r, rng):
            if time.monotonic() > deadline:
                return g, r, False
            nr = p.evaluate(ng)
            if fix and not nr.fits and nr.oom is not None:
                ng, nr = repair(p, ng, None, deadline, keep_leads=True, max_steps=3)
            if nr.fits and nr.time_us < r.time_us - 1e-6:
                g, r = ng, nr
                if log:
                    log(f"local search: {r.time_us / 1e3:.3f} ms after {p.evaluations} "
                        f"simulations")
                break
        else:
            return g, r, True
