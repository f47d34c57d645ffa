"""Planning time (issue 14 item 1), by behaviour rather than seconds: the lower bound planners
prune candidates with never exceeds a judged run's time, and pruning with it leaves the plan as
it was while running fewer profiling runs; the planners' shortcuts (candidates weighed as
arrays, the profile kept in place, the host clock reused) give what the long way gives."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vsim.allocator import make_allocator
from vsim.engine import planning_runner, run_plan
from vsim.engine.hostclock import HostClock
from vsim.hardware import load_hardware
from vsim.host import load_host_model
from vsim.plan import Plan, iteration_floor
from vsim.policies import make_policy
from vsim.policies.fitted import Attempt
from vsim.policies.layers import TraceView
from vsim.policies.planning import recompute_chain
from vsim.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
HW = load_hardware("h100-sxm")
CACHING = make_allocator("caching")


class Counting:
    """A planning runner that counts profiling runs and checks the floor against each; with
    `floor` False it offers none (as a runner that knows no bound)."""

    def __init__(self, floor: bool) -> None:
        self.inner = planning_runner(CACHING)
        self.runs: list[tuple[float, bool, float]] = []
        if floor:
            self.iteration_floor = self.inner.iteration_floor  # type: ignore[attr-defined]

    def __call__(self, trace: Any, hw: Any, plan: Plan, allocator: Any,
                 capacity: int | None = None) -> Any:
        result = self.inner(trace, hw, plan, allocator, capacity)
        if allocator is None:
            low = iteration_floor(self.inner, trace, hw, plan)
            self.runs.append((low, bool(result.report["fits"]),
                              float(result.report["iteration_time_us"])))
        return result


@pytest.fixture(scope="module")
def resnet50() -> tuple[Any, int]:
    trace = load_trace(TRACES / "resnet50-b64-h100.vsim.json.gz")
    peak = run_plan(trace, HW, Plan(), CACHING, HW.capacity_bytes).report["peak_reserved_bytes"]
    return trace, int(peak)


@pytest.mark.parametrize("spec", ["recompute", "superneurons", "vdnn:mode=dyn", "hybrid"])
def test_the_floor_never_exceeds_a_fitting_runs_time(resnet50: tuple[Any, int],
                                                     spec: str) -> None:
    trace, peak = resnet50
    runner = Counting(floor=True)
    make_policy(spec).plan_with(trace, HW, int(peak * 0.6), runner)
    assert runner.runs and any(low > 0 for low, _, _ in runner.runs)  # a host model applies
    for low, fits, us in runner.runs:
        assert not fits or low <= us * (1 + 1e-12)


def test_recompute_optimal_prunes_by_the_floor_without_changing_its_plan(
        resnet50: tuple[Any, int]) -> None:
    trace, peak = resnet50
    plans, runs = [], []
    for floor in (False, True):
        runner = Counting(floor)
        plans.append(make_policy("recompute").plan_with(trace, HW, int(peak * 0.6), runner))
        runs.append(len(runner.runs))
    assert plans[0].actions == plans[1].actions
    assert runs[1] < runs[0]


def _evictions(trace: Any, budget: int) -> Any:
    view = TraceView(trace)
    return view, Attempt(trace, HW, view, budget, frozenset(), "auto").evictions(blocking=True)


def test_blocking_us_for_many_candidates_is_blocking_us_for_each(
        resnet50: tuple[Any, int]) -> None:
    """The vectorised weighing of hybrid and accudnn: the same wait, candidate by candidate,
    with swaps already queued on the D2H engine before and after them."""
    trace, peak = resnet50
    view, ev = _evictions(trace, int(peak * 0.6))
    saved = list(view.saved)
    table = ev.issue_table(saved)
    waits = 0.0
    for n, t in enumerate(saved[::3]):  # the queue's arrays kept up as swaps join it
        ev.add_swap(t)
        slot = (0, view.n_slots // 3, view.n_slots // 2, view.n_slots - 2)[n % 4]
        many = ev.blocking_us_many(table, slot)
        each = np.array([ev.blocking_us(t, slot) for t in saved])
        assert np.array_equal(many, each)
        waits += many.sum()
    assert waits > 0  # some wait


def test_in_place_drops_and_moved_needs_give_the_profile_a_rebuild_gives(
        resnet50: tuple[Any, int]) -> None:
    """Evictions.add_drop and move_need (blocking) update the profile in place; a rebuild from
    the base profile (profile()) gives the same bytes and the same D2H queue."""
    trace, peak = resnet50
    view, ev = _evictions(trace, int(peak * 0.6))
    saved = list(view.saved)
    swapped = saved[1::2]
    for t in swapped:
        ev.add_swap(t)
    moved = 0
    for t in saved[::2][:len(saved) // 4]:
        chain = recompute_chain(view, t)
        ev.add_drop(t, chain)
        for u in swapped:  # needed earlier, as by a planned recomputation that reads it
            if u not in ev.drops and view.pos[ev.need(u)] > view.pos[ev.need(t)] > \
                    view.pos[view.tensor[u].producer or 0] and moved < 5:
                before = ev.usage.bytes.copy()
                ev.move_need(u, ev.need(t))
                moved += not np.array_equal(before, ev.usage.bytes)
    assert moved and ev.drops
    in_place, ends = ev.usage.bytes.copy(), list(ev._queue_ends)
    rebuilt = ev.profile()
    assert np.array_equal(in_place, rebuilt.bytes)
    assert ends == ev._queue_ends


def test_a_fresh_host_clock_shares_issue_times_not_what_a_plan_added() -> None:
    trace = load_trace(TRACES / "resnet50-b64-h100.vsim.json.gz")
    model = load_host_model(HW.name)
    assert model is not None
    clock = HostClock(trace, model)
    clock.spend(5.0)
    again = clock.fresh()
    op = trace.ops[10].id
    assert again.ready_us(op) == clock.ready_us(op) - 5.0 == HostClock(trace, model).ready_us(op)
    again.spend(1.0)
    assert clock.extra_us == 5.0


def _issue_the_long_way(trace: Any, model: Any, index: Any) -> dict[int, float]:
    """HostClock's issue times of a tracked run as its loop once computed them: the model's
    time and executor_us for every op."""
    from vsim.engine.hostclock import executor_us, hooked_ops, noted_ops
    noted = noted_ops(trace, index)
    hooked = hooked_ops(trace, index) if model.hooks == "armed" else None
    bounded = trace.meta.get("source") == "measured"
    clock = runtime = 0.0
    out = {}
    for op in trace.ops:
        clock += model.op_us(op)
        if bounded and op.start_us < clock:
            clock = op.start_us
        before, after = executor_us(model, index, op, noted, hooked)
        runtime += model.tracker_us_per_op + before
        if model.native_us_per_call:
            runtime += model.native_us_per_call * model.counted(op)
        out[op.id] = clock + runtime
        runtime += after
    return out


@pytest.mark.parametrize("spec", ["recompute:strategy=sqrt", "vdnn:mode=all"])
@pytest.mark.parametrize("hooks", ["armed", "always"])
def test_the_host_clock_charges_what_executor_us_charges_per_op(
        resnet50: tuple[Any, int], spec: str, hooks: str) -> None:
    """The clock precomputes the model's per-op times and asks executor_us only for the ops
    it may charge: the same issue times as asking for every op."""
    import dataclasses

    from vsim.plan import PlanIndex
    trace, peak = resnet50
    model = load_host_model(HW.name)
    assert model is not None
    model = dataclasses.replace(model, hooks=hooks, tracker_us_per_op=0.5)
    plan = make_policy(spec).plan(trace, HW, peak // 2)
    assert plan.actions
    index = PlanIndex(plan)
    assert HostClock(trace, model, True, index).issue == _issue_the_long_way(trace, model, index)


def test_the_dps_rows_derived_for_more_workspaces_away_are_those_built_afresh(
        resnet50: tuple[Any, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """recompute optimal's workspace rounds and profiling loop cost again only the segments a
    changed algorithm reaches (Segmenter._rows_from): the rows are those a fresh view builds,
    as convolutions go without workspace round after round and come back."""
    from vsim.policies.recompute import Segmenter
    trace, _ = resnet50
    tensors = trace.tensor_by_id()
    convs = sorted({o.id for o in trace.ops for t in o.writes
                    if tensors[t].kind == "workspace"})
    costed: list[int] = []
    peaks = Segmenter._peaks
    monkeypatch.setattr(Segmenter, "_peaks", lambda self, entries, *a: costed.extend(
        [id(self.view)] * len(entries)) or peaks(self, entries, *a))
    view = TraceView(trace)
    for forced in [convs[:1], convs[:3], convs[:40:3], convs[:1], convs[5:60]]:
        retimes = Attempt(trace, HW, view, 1 << 40, frozenset(forced), "auto").retimes
        assert retimes
        seg = Segmenter.of(view, retimes)
        derived = seg._dp_rows(seg.base_without_saved())
        fresh = Segmenter.of(TraceView(trace), retimes)
        for mine, theirs in zip(derived, fresh._dp_rows(fresh.base_without_saved()),
                                strict=True):
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs)
    segments = len(derived[0])
    # each fresh view costs every segment; the one view, 5 builds, after its first only some
    assert costed.count(id(view)) < 3 * segments


def _reference_optimal(seg: Any, budget: int, base: np.ndarray) -> list[int] | None:
    """Segmenter.optimal as it was written before it ran on arrays (lists of tuples, one
    sort of every cut's options): the DP it must agree with, point for point."""
    import bisect
    import math

    from vsim.policies.recompute import FRONT_POINTS, thin
    own, kept, rcs = (x.tolist() for x in seg._dp_rows(base))
    fronts: list[list[tuple[int, float, int, int]]] = [[(0, 0.0, -1, -1)]] + \
        [[] for _ in range(seg.n)]
    front_bytes: list[list[int]] = [[0]] + [[] for _ in range(seg.n)]
    for b, among, _, lo, _ in seg._dp_layout():
        options: list[tuple[int, float, int, int]] = []
        for j, a in enumerate(among):
            k = bisect.bisect_right(front_bytes[a], budget - own[lo + j])
            options += [(before + kept[lo + j], t + rcs[lo + j], a, idx)
                        for idx, (before, t, _, _) in enumerate(fronts[a][:k])]
        options.sort()
        front: list[tuple[int, float, int, int]] = []
        fastest = math.inf
        for o in options:
            if o[1] < fastest:
                front.append(o)
                fastest = o[1]
        fronts[b] = thin(front, FRONT_POINTS)
        front_bytes[b] = [p[0] for p in fronts[b]]
    if not fronts[seg.n]:
        return None
    best = min(range(len(fronts[seg.n])), key=lambda i: (fronts[seg.n][i][1],
                                                          fronts[seg.n][i][0]))
    cuts, b, i = [], seg.n, best
    while b > 0:
        cuts.append(b)
        _, _, b, i = fronts[b][i]
    return sorted(cuts)


@pytest.mark.parametrize("name", ["resnet50-b64-h100", "densenet121-b64-h100"])
def test_the_dp_on_arrays_gives_the_cuts_of_the_dp_on_tuples(name: str) -> None:
    """Segmenter.optimal weighs each cut's options as arrays, and answers None without a DP
    for a budget at or below one that found none: the cuts (or None) of the DP on lists of
    tuples, for budgets from below the least that fits to ample, with and without
    workspaces."""
    from vsim.policies.recompute import Segmenter
    from vsim.workspace_free import memory_optimal_retimes
    trace = load_trace(TRACES / f"{name}.vsim.json.gz")
    view = TraceView(trace)
    found = {True: 0, False: 0}
    for retimes in ([], memory_optimal_retimes(trace, HW)[0]):
        seg = Segmenter.of(view, retimes)
        base = seg.base_without_saved()
        least = int(base.max())
        # descending, as the DP's escalation asks: the budgets below a None are answered
        # from the memo, and are checked against the reference all the same
        for k in range(40, -1, -1):
            budget = least + k * least // 10
            cuts = seg.optimal(budget, base)
            assert cuts == _reference_optimal(seg, budget, base), budget
            found[cuts is None] += 1
    assert found[True] and found[False]


@pytest.mark.parametrize("name", ["resnet50-b64-h100", "densenet121-b64-h100"])
def test_a_segments_chain_is_the_one_rebuild_chain_gives(name: str) -> None:
    """The DP's segment shapes walk their chains over per-view tables
    (Segmenter._rebuild_chain): every segment's chain is planning.rebuild_chain's over the
    segment's forward ops."""
    from vsim.policies.planning import rebuild_chain
    from vsim.policies.recompute import Segmenter
    view = TraceView(load_trace(TRACES / f"{name}.vsim.json.gz"))
    seg = Segmenter.of(view)
    fwd_ops, off = seg._fwd_ops()
    chains = 0
    for a, b in seg._entry_keys():
        shape = seg._shape(a, b)
        if shape.dropped:
            layers = seg.layers(a, b)
            assert shape.chain == rebuild_chain(view, fwd_ops[off[layers.start]:off[layers.stop]],
                                                shape.dropped, view.before(shape.before_op))
            chains += bool(shape.chain)
    assert chains > 100


@pytest.mark.parametrize("name", ["resnet50-b64-h100", "efficientnet_b0-b64-h100"])
def test_a_segments_validity_and_transient_bytes_are_the_planning_functions(name: str) -> None:
    """The DP's segment shapes take their chain's inputs and what it writes from per-op frozen
    sets and check staleness over the updated inputs' readers (Segmenter._stale): a segment
    is valid exactly when planning's chain_inputs are alive at the recomputation and
    stale_inputs finds none, and its transient bytes are what the chain writes that is neither
    dropped nor alive then (in-place ReLUs on resnet50, in-place SiLUs on efficientnet)."""
    from vsim.policies.planning import alive_in_trace, chain_inputs, stale_inputs
    from vsim.policies.recompute import Segmenter
    view = TraceView(load_trace(TRACES / f"{name}.vsim.json.gz"))
    seg = Segmenter.of(view)
    seen = {True: 0, False: 0}
    stale = 0
    for a, b in seg._entry_keys():
        sh = seg._shape(a, b)
        if not sh.dropped:
            continue
        slot = view.before(sh.before_op)
        inputs = chain_inputs(view, sh.chain)
        alive = not inputs & set(sh.dropped) and all(alive_in_trace(view, t, slot)
                                                     for t in inputs)
        stale += alive and bool(stale_inputs(view, sh.chain))
        assert sh.valid == (alive and not stale_inputs(view, sh.chain)), (a, b)
        seen[sh.valid] += 1
        written = {t for o in sh.chain for t in view.op[o].writes}
        transient = [view.tensor[t] for t in written
                     if t not in sh.dropped and not alive_in_trace(view, t, slot)]
        assert sh.transient_bytes == sum(t.size_bytes for t in transient)
        assert sorted(sh.transient_workspaces) == sorted(
            (t.producer, t.size_bytes) for t in transient if t.kind == "workspace")
    assert seen[True] > 100 and seen[False] > 0
    # (no DP segment's chain is stale, by its cuts: planning.inseparable) Over windows of the
    # forward ops, Segmenter._stale is stale_inputs as a truth value
    fwd_ops = seg._fwd_ops()[0]
    for width in (2, 5, 20):
        for i in range(0, len(fwd_ops) - width, 3):
            chain = fwd_ops[i:i + width]
            inputs = chain_inputs(view, chain)
            got = seg._stale(list(range(i + width - 1, i - 1, -1)), inputs)
            assert got == bool(stale_inputs(view, chain, inputs)), (i, width)
            stale += got
    assert stale > 0 or name.startswith("resnet")


def test_a_run_without_its_log_has_the_logged_runs_verdict(resnet50: tuple[Any, int]) -> None:
    """A profiling run without its memory log (run_plan's logged=False: no ExecutedOp or Copy
    records, only their latest end) gives the verdict of the same run logged: fits, where it
    ran out of memory and the iteration's end, with copies in flight at the end."""
    trace, peak = resnet50
    runner = planning_runner(make_allocator("caching"))
    checked = 0
    for spec, frac in [("vdnnpp", 0.5), ("vdnnpp", 0.3), ("superneurons", 0.5),
                       ("layrub", 0.4), ("hybrid", 0.5)]:
        plan = make_policy(spec).plan_with(trace, HW, int(peak * frac), runner)
        for iterations in (2, 3, None):
            cap = int(peak * frac)
            quiet = runner.unlogged(trace, HW, plan, cap, iterations)
            loud = runner.screen(trace, HW, plan, cap, iterations)
            assert not quiet.output.copies and not quiet.output.executed
            assert quiet.verdict == loud.verdict, (spec, frac, iterations)
            checked += bool(loud.output.copies)
    assert checked >= 6


@pytest.mark.parametrize("name", ["resnet50-b64-h100", "densenet121-b64-h100",
                                  "gpt2-b8-s1024-bf16-adamw-h100"])
def test_the_segments_own_profiles_at_once_are_each_segments(name: str) -> None:
    """Segmenter._own_profiles (every DP segment's own profile in one vectorised pass) is
    _new_own_profile of each segment, concatenated: the same slots, bytes and recomputation
    slot, as the same integers."""
    from vsim.policies.recompute import Segmenter
    view = TraceView(load_trace(TRACES / f"{name}.vsim.json.gz"))
    seg = Segmenter.of(view)
    slots, own, start, size, rc = seg._own_profiles()
    recomputed = 0
    for k, (a, b) in enumerate(seg._entry_keys()):
        idx, prof, at = seg._new_own_profile(a, b)
        lo, n = int(start[k]), int(size[k])
        assert n == len(idx)
        assert np.array_equal(slots[lo:lo + n], idx) and np.array_equal(own[lo:lo + n], prof)
        assert int(rc[k]) == (-1 if at is None else at)
        recomputed += at is not None
    assert recomputed > 100
    assert slots.dtype == own.dtype == start.dtype == size.dtype == rc.dtype == np.int64


def test_a_copied_evictions_plans_as_one_chosen_afresh(resnet50: tuple[Any, int]) -> None:
    """Evictions.copy (vDNN++ chooses its swaps once per base profile and copies them for each
    budget): the copy's prefetches, actions, profile and host pool are those of the same swaps
    chosen afresh for its budget, and placing them leaves the original as it was."""
    from vsim.policies.planning import Evictions, host_pool_bytes
    trace, peak = resnet50
    view = TraceView(trace)
    saved = list(view.saved)[::2]
    base = Attempt(trace, HW, view, int(peak * 0.6), frozenset(), "auto").usage()

    def chosen(budget: int) -> Any:  # (over one base profile: vdnnpp's memo is per base)
        ev = Evictions(view, HW, base, budget)
        for t in saved:
            ev.add_swap(t, update=False)
        ev.refresh()
        return ev
    template = chosen(peak)
    kept = (template.usage.bytes.copy(), [dataclasses.astuple(s) for s in template.swaps.values()])
    first_bwd = view.start(view.bwd[0].first)
    for frac in (0.0, 0.4, 0.6, 0.8):
        budget = int(peak * frac)
        fresh, copied, again = chosen(budget), template.copy(budget), chosen(budget)
        again._slots_fresh = False  # (its release slots estimated again, as before the flag)
        for ev in (fresh, copied, again):
            ev.place_prefetches(lambda s: first_bwd)
        assert copied.actions() == fresh.actions() == again.actions()
        assert np.array_equal(again.usage.bytes, fresh.usage.bytes)
        assert np.array_equal(copied.usage.bytes, fresh.usage.bytes)
        assert host_pool_bytes(view, copied.swaps.values()) == \
            host_pool_bytes(view, fresh.swaps.values())
        assert np.array_equal(template.usage.bytes, kept[0])
        assert [dataclasses.astuple(s) for s in template.swaps.values()] == kept[1]


@pytest.mark.parametrize("name", ["resnet50-b64-h100", "densenet121-b64-h100"])
def test_a_segmenters_usage_is_the_profile_changed_span_by_span(name: str) -> None:
    """Segmenter.usage (the spans of its recomputations and drops summed into the profile at
    once) is the profile Usage.add and Usage.remove give, one span at a time."""
    from vsim.plan import Drop
    from vsim.policies.planning import Usage
    from vsim.policies.recompute import RecomputeAction, Segmenter
    view = TraceView(load_trace(TRACES / f"{name}.vsim.json.gz"))
    seg = Segmenter.of(view)
    checked = 0
    for k in (1, 2, 3, 5, 8):
        acts, _, _ = seg.actions([*range(k, seg.n, k), seg.n])
        u = Usage(view, seg.retimes)
        back: dict[int, int] = {}
        for act in acts:
            if isinstance(act, RecomputeAction):
                slot = view.before(act.before_op)
                back.update(dict.fromkeys(act.tensors, slot))
                u.add(seg.transient_bytes(act.ops, set(act.tensors), slot), slot, slot + 1)
        for act in acts:
            if isinstance(act, Drop):
                u.remove(view.tensor[act.tensor].size_bytes, view.end(act.after_op),
                         back[act.tensor])
        got = seg.usage(acts).bytes
        assert got.dtype == u.bytes.dtype and np.array_equal(got, u.bytes)
        checked += bool(acts)
    assert checked >= 4
