"""Run a simulation: trace + hardware + policy + allocator + capacity -> report and predicted trace.

The public API: `run_plan(trace, hw, plan, allocator, capacity_bytes)` runs a ready plan;
`simulate(trace, hw, policy, ...)` is the policy's plan (made with `run_plan` at hand for its
profiling runs: `policy.plan_with`) then `run_plan`. The engine knows plans (vsim.plan), not
policies: a policy is anything with `plan_with()` and `spec()` (vsim.plan.Planner).

A simulation is a pure function of its inputs: the same inputs give byte-identical reports and
predicted traces.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .. import metrics
from ..allocator import make_allocator
from ..allocator.base import Allocator, AllocatorSpec
from ..errors import ConfigError
from ..hardware import Hardware
from ..host import HostModel, load_host_model
from ..plan import Plan, PlanIndex, Planner, Retime, RunPlan
from ..trace.schema import MemEvent, Op, Tensor, Trace
from ..units import format_size
from ..workspace_free import memory_optimal_retimes
from . import floor
from .draws import TIMING_DRAWS, TimingDraw, drawn, timing_draws, with_margin
from .hostclock import HostClock
from .prep import trace_prep
from .simulator import D2H_STREAM, H2D_STREAM, Engine, EngineOutput, ExecutedOp, PlanError
from .warm import supports_warm_start, warm_layout

__all__ = ["TIMING_DRAWS", "PlanError", "SimResult", "TimingDraw", "planning_runner", "run_plan",
           "simulate", "timing_draws"]


class SimResult:
    """A simulation's report, and its predicted trace, built on first use: sweeps need only the
    report, the search only the engine's `output`, and building the trace (an Op and a MemEvent
    per event) costs about as much as the run itself. `simpy_events`: the SimPy events the
    reported iteration scheduled (vsim bench's measure of the engine's overhead)."""

    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, policy: str,
                 allocator: AllocatorSpec, capacity: int, out: EngineOutput,
                 simpy_events: int, logged: bool = True) -> None:
        self.output = out  # the engine's raw outcome: executed ops, copies, memory log, oom
        self.simpy_events = simpy_events
        # A run cut short (run_plan's `iterations`) that can go on: the whole run's result,
        # without simulating its first iterations again; None when the run is whole
        self.resume: Callable[[], SimResult] | None = None
        # CPU seconds the policy took to plan (set by simulate; not part of the report, which
        # is a pure function of the inputs)
        self.plan_seconds = 0.0
        self.plan = plan  # what was simulated (a measured run of the same plan has its digest)
        self._plan = plan
        self._inputs = (trace, hw, policy, allocator, capacity, out)
        self.logged = logged  # (False: run_plan's `logged`; a verdict, no report)

    def _needs_log(self) -> None:
        if not self.logged:
            raise RuntimeError("a run without its memory log (run_plan's logged=False) has no "
                               "report or predicted trace, only its verdict")

    @functools.cached_property
    def report(self) -> dict[str, Any]:
        """The `vsim run --json` report (one dict: changes to it stay)."""
        self._needs_log()
        trace, hw, policy, allocator, capacity, out = self._inputs
        report = run_metrics(trace, out)
        report.update({
            "pinned_host_peak_bytes": max(out.memory.host_peak_bytes,
                                          self._plan.pinned_pool_bytes),
            "fits": out.oom is None,
            "oom": None if out.oom is None else out.oom.to_json(),
            "policy": policy,
            "allocator": allocator_spec_string(allocator),
            "hardware": hw.name,
            "capacity_bytes": capacity,
            # the median of the iterations a measurement times (4 to 13) where the run simulated
            # them; iteration_time_us is the last one's (what the predicted trace shows)
            "timed_iteration_time_us": (
                statistics.median(out.timed_ends_us)
                + float(trace.meta.get("iteration_tail_us", 0.0))) if out.timed_ends_us
            else report["iteration_time_us"],
            "retargeted_from": trace.meta.get("retargeted_from"),
            # the allocator's driver calls per iteration, as a measured run's allocator_churn
            # counts them (EngineOutput.churn: the timed iterations' mean, from a first one)
            "allocator_churn": out.churn,
            "notes": out.notes,
            "trace": {k: trace.meta.get(k) for k in ("model", "batch_size", "device", "source")},
            "measured": None if trace.measured is None else {
                "iteration_time_us": trace.measured.iteration_time_us,
                "peak_allocated_bytes": trace.measured.peak_allocated_bytes,
                "peak_reserved_bytes": trace.measured.peak_reserved_bytes},
        })
        return report

    @functools.cached_property
    def verdict(self) -> dict[str, Any]:
        """The report's `fits`, `oom` and `iteration_time_us` alone, the same values without
        the report's metrics (a pass over the run's memory log): all that the judge of a
        profiling run reads (vsim.policies.fitted.Judge)."""
        if "report" in self.__dict__:
            return {k: self.report[k] for k in ("fits", "oom", "iteration_time_us")}
        trace, out = self._inputs[0], self._inputs[-1]
        assert isinstance(trace, Trace) and isinstance(out, EngineOutput)
        return {"fits": out.oom is None, "oom": None if out.oom is None else out.oom.to_json(),
                "iteration_time_us": out.end_us  # (run_metrics' `end`)
                + float(trace.meta.get("iteration_tail_us", 0.0))}

    @property
    def capacity_bound(self) -> bool:
        """Whether the capacity decided anything in this run of its plan (first iteration
        included): out of memory, a request the allocator refused or freed its cache for, a plan
        that waits for memory, or an allocator whose state the capacity shapes (a pool
        pre-sized to it). False: run_plan of the same plan on any larger capacity runs the
        same (vsim run takes such a run of `none` as its ample-memory baseline)."""
        out = self.output
        allocator = out.memory.allocator
        return (out.oom is not None or self._plan.wait_for_memory
                or not allocator.capacity_only_at_limit or allocator.capacity_hits > 0)

    @functools.cached_property
    def predicted(self) -> Trace:
        self._needs_log()
        return _predicted_trace(*self._inputs)


def simulate(trace: Trace, hw: Hardware, policy: Planner, allocator: AllocatorSpec,
             capacity_bytes: int | None = None, first_iteration: bool | None = None,
             workspace_fallback: bool | None = None, host_time: bool | None = None,
             runtime_cost: bool | None = None, tracker: str | None = None,
             plan_tracker: str | None = None, draws: int = 0, warm_start: bool = False,
             plan_warm_start: bool | None = None) -> SimResult:
    """Simulate one iteration of `policy`'s plan (see run_plan). The policy plans with run_plan
    at hand for its profiling runs. `runtime_cost` False: the plan is carried out by an ideal
    runtime that pays none of vsim's runtime's own host costs (run_plan's `tracked` False);
    default: vsim's runtime, as measured. `tracker`: see run_plan. `plan_tracker`: the tracker
    the profiling runs assume where it is not the run's (vsim's runtime plans for its native
    tracker, also when the run then falls back to the Python one); None: the run's.

    `draws`: where the plan fits a capacity that binds, run it under that many timing draws
    (timing_draws; the report's `timing_draws`: how many fit, of how many); when most run out of
    memory, the policy's plan for a lower budget that most draws fit, if one of a few does
    (draws.with_margin), is the result.

    `warm_start`: run_plan's. `plan_warm_start`: the one the profiling runs assume where it is
    not the run's (vsim validate: vsim's runtime plans from a cold start the runs it starts
    warm); None: the run's. Where the
    plan was judged with another start than the run's, the run's verdict under draws is drawn
    again under the run's own options (a real run is one draw of the run)."""
    if plan_warm_start is None:
        plan_warm_start = warm_start
    capacity = _capacity(hw, capacity_bytes)
    tracked = False if runtime_cost is False else None
    started = time.process_time()
    runner = planning_runner(allocator, first_iteration=first_iteration,
                             workspace_fallback=workspace_fallback, host_time=host_time,
                             tracked=tracked,
                             tracker=tracker if plan_tracker is None else plan_tracker,
                             warm_start=plan_warm_start)
    options: dict[str, Any] = {"first_iteration": first_iteration,
                               "workspace_fallback": workspace_fallback,
                               "host_time": host_time, "tracked": tracked, "tracker": tracker,
                               "warm_start": warm_start}
    plan = policy.plan_with(trace, hw, capacity, runner)
    result = run_plan(trace, hw, plan, allocator, capacity, label=policy.spec(), **options)
    if draws and plan.actions:
        # The margin is the planner's choice, made under the costs it plans with: where those
        # are not the run's (a plan made for one runtime, run by another), judged there and
        # the chosen plan then run under the run's
        planned = options if plan_tracker in (None, tracker) \
            and plan_warm_start == warm_start else \
            {**options, "tracker": tracker if plan_tracker is None else plan_tracker,
             "warm_start": plan_warm_start}
        judged = result if planned is options else \
            run_plan(trace, hw, plan, allocator, capacity, label=policy.spec(), **planned)
        if judged.report["fits"] and judged.capacity_bound:
            chosen = with_margin(trace, hw, policy, allocator, capacity, draws, runner, judged,
                                 planned)
            if planned is options:
                result = chosen
            else:
                if chosen.plan is not plan:
                    result = run_plan(trace, hw, chosen.plan, allocator, capacity,
                                      label=policy.spec(), **options)
                # the margin's and the draws' notes, as where the plan was judged (with
                # another start, the margin's alone: the run draws its own below)
                result.report["notes"] += [
                    n for n in chosen.report["notes"] if n not in result.report["notes"]
                    and (plan_warm_start == warm_start or n.startswith("planned for"))]
                if "timing_draws" in chosen.report and plan_warm_start == warm_start:
                    result.report["timing_draws"] = {
                        **chosen.report["timing_draws"], "under_tracker": plan_tracker}
        if plan_warm_start != warm_start and result.report["fits"] and result.capacity_bound:
            # the verdict: the run's own draws (it does not start as its plan was judged)
            runs = timing_draws(trace, hw, result.plan, allocator, capacity, draws, **options)
            if runs is not None:
                drawn(result, [d for d in runs if d.report["fits"]], draws)
    result.plan_seconds = time.process_time() - started
    return result


def planning_runner(run_allocator: AllocatorSpec | None, *, first_iteration: bool | None = None,
                    workspace_fallback: bool | None = None, host_time: bool | None = None,
                    tracked: bool | None = None, tracker: str | None = None,
                    warm_start: bool = False) -> RunPlan:
    """The run_plan a policy plans with for a run on `run_allocator` (with these options): called
    with allocator None, as the policies' profiling runs call it, it runs the plan as the run
    itself will, so that a plan judged to fit fits the run (issue 14: the caching allocator's
    rounding, the first iteration and the workspace fallback decide what fits); called with an
    allocator, it is run_plan. `run_allocator` None: PyTorch's caching allocator (a plan made
    outside a simulation). `tracker`: the op tracker the run's executor uses (run_plan's), so
    that a plan is judged under the host costs it will run with. Its
    `iteration_floor(trace, hw, plan)` is a lower bound on the iteration time such a profiling
    run reports (plan.iteration_floor)."""
    return _PlanningRunner(run_allocator, first_iteration, workspace_fallback, host_time,
                           tracked, tracker, warm_start)


class _PlanningRunner:
    def __init__(self, run_allocator: AllocatorSpec | None, first_iteration: bool | None,
                 workspace_fallback: bool | None, host_time: bool | None, tracked: bool | None,
                 tracker: str | None = None, warm_start: bool = False) -> None:
        self.run_allocator = run_allocator
        self.tracker = tracker
        self.warm_start = warm_start
        self.first_iteration, self.workspace_fallback = first_iteration, workspace_fallback
        self.host_time, self.tracked = host_time, tracked
        self._free_us: dict[tuple[int, str], tuple[Trace, dict[int, float]]] = {}

    def __call__(self, trace: Trace, hw: Hardware, plan: Plan, allocator: AllocatorSpec | None,
                 capacity_bytes: int | None = None) -> SimResult:
        if allocator is not None:
            return run_plan(trace, hw, plan, allocator, capacity_bytes)
        return self.screen(trace, hw, plan, capacity_bytes, None)

    def screen(self, trace: Trace, hw: Hardware, plan: Plan, capacity_bytes: int | None,
               iterations: int | None) -> SimResult:
        """A profiling run cut short after `iterations` (run_plan's; None: the whole run): out
        of memory there is out of memory in the run; fitting there says only that its first
        iterations fit."""
        return run_plan(trace, hw, plan, self.run_allocator, capacity_bytes,
                        first_iteration=self.first_iteration,
                        workspace_fallback=self.workspace_fallback, host_time=self.host_time,
                        tracked=self.tracked, tracker=self.tracker, iterations=iterations,
                        warm_start=self.warm_start)

    def unlogged(self, trace: Trace, hw: Hardware, plan: Plan, capacity_bytes: int | None,
                 iterations: int | None) -> SimResult:
        """`screen` without the memory log (run_plan's `logged` False): a profiling run whose
        verdict alone is read (SimResult.verdict; vsim.policies.fitted.Judge)."""
        return run_plan(trace, hw, plan, self.run_allocator, capacity_bytes,
                        first_iteration=self.first_iteration,
                        workspace_fallback=self.workspace_fallback, host_time=self.host_time,
                        tracked=self.tracked, tracker=self.tracker, iterations=iterations,
                        logged=False, warm_start=self.warm_start)

    def iteration_floor(self, trace: Trace, hw: Hardware, plan: Plan) -> float:
        """A lower bound on the iteration time this runner's profiling run reports for `plan`
        (vsim.engine.floor), with the host model and tracking its runs use."""
        host = _host_model(trace, hw, self.host_time, self.tracker)
        tracked = bool(plan.actions) if self.tracked is None else self.tracked
        clock = None if host is None else HostClock(trace, host, tracked, PlanIndex(plan))
        key = (id(trace), hw.name)
        if key not in self._free_us or self._free_us[key][0] is not trace:
            self._free_us[key] = (trace, {r.op: r.dur_us
                                          for r in memory_optimal_retimes(trace, hw)[0]})
        return floor.iteration_floor(trace, hw, plan, clock, self._free_us[key][1])


# The op tracker and runtime a run is simulated under by default: the runtime's default, native
# where built, the saves a plan acts on taken from their calls' frames, backward gated, the
# plan carried out by the executor's core in C++ (_host_model says what each part means)
DEFAULT_TRACKER = "native-frames-gated-core"


def _host_model(trace: Trace, hw: Hardware, host_time: bool | None,
                tracker: str | None = None) -> HostModel | None:
    """The host model a run uses (run_plan's `host_time`), or None; with the costs of the op
    tracker the run's executor uses (run_plan's `tracker`): the Python one's per op, or the
    native one's hook and call back."""
    if not (host_time or (host_time is None and trace.meta.get("torch"))):
        return None
    host = load_host_model(hw.name)
    if host is None:
        return None
    if tracker == "python":  # its cost per op includes the hook's, the recording's calls and
        # what the native tracker costs per call
        return dataclasses.replace(host, pack_us=0.0, save_us=0.0, record_callback_us=0.0,
                                   frame_callback_us=0.0,
                                   native_us_per_call=0.0)
    # None: the runtime's default (DEFAULT_TRACKER); "native": the saved-tensor
    # hooks on only where a save is armed; "native-always": the native tracker before
    # 2026-11-27T08:30, the hooks on for every forward op; "native-frames": those saves taken
    # from their calls' frames (VSIM_NATIVE_SAVED=frames); a "-gated" suffix: backward's nodes
    # without an action untracked (VSIM_NATIVE_GATE=nodes); then "-modules": forward's module
    # calls without an action untracked (VSIM_NATIVE_FWD_GATE=modules); last "-core": the plan
    # carried out by the executor's core in C++ (native/core.cpp), at HostModel.core's costs
    name = tracker or DEFAULT_TRACKER
    core = name.endswith("-core")  # the plan carried out by the executor's core (C++)
    name = name.removesuffix("-core")
    if core:
        host = host.with_core()
    modules = name.endswith("-modules")
    name = name.removesuffix("-modules")
    gated = name.endswith("-gated")
    name = name.removesuffix("-gated")
    hooks = {"native-always": "always", "native-frames": "frames"}.get(name, "armed")
    return dataclasses.replace(host, tracker_us_per_op=0.0, hooks=hooks, gated=gated,
                               forward_gated=modules)


def run_plan(trace: Trace, hw: Hardware, plan: Plan, allocator: AllocatorSpec | None,
             capacity_bytes: int | None = None, *, first_iteration: bool | None = None,
             workspace_fallback: bool | None = None, host_time: bool | None = None,
             tracked: bool | None = None, label: str = "plan",
             tracker: str | None = None, iterations: int | None = None,
             dgrad_workspace: bool | None = None, draw: TimingDraw | None = None,
             logged: bool = True, warm_start: bool = False) -> SimResult:
    """Simulate one iteration of a ready plan. `capacity_bytes` defaults to what the GPU leaves
    a process. ConfigError when the capacity is impossible; out of memory is a result (fits
    false). `label` is the report's (and the predicted trace's) `policy`.

    `first_iteration`: a training process's first iteration runs first, on the same allocator:
    momentum and cuBLAS workspaces are created at first use there (vsim.allocator.first_use),
    and the segments and fragmentation it leaves are what the reported, steady iteration starts
    from, as in a real run. Out of memory in the first iteration is the run's result.

    `workspace_fallback`: a convolution whose workspace cannot be allocated runs without one, at
    its workspace-free algorithm's time on `hw` (vsim.workspace_free), instead of ending the run
    out of memory, as PyTorch falls back to another cuDNN engine; after a first iteration the
    convolutions that fell back there keep that algorithm, as PyTorch caches the engine.

    Both default to on with an allocator that models PyTorch's (`caching`), off otherwise (the
    vDNN paper's framework on cnmem has neither). On the validation suite they take fits right
    from 68 to 69 of 70 and the time MAPE from 10.3% to 9.3% (docs/design.md, allocators).

    `host_time`: the host's own time to issue ops, recomputations and the allocator's driver
    calls (vsim.engine.hostclock), from the host model probed on `hw`'s machine
    (hardware/host/NAME.yaml). Default: on for a PyTorch trace (meta.torch) when `hw` has a
    host model; off otherwise (the recorded launch gaps alone).

    `tracked`: with host time, the run is vsim's executor (vsim measure), whose op tracker costs
    host time per op (HostModel.tracker_us_per_op). Default: when the plan has actions, as the
    executor runs the tracker only then. `tracker`: which op tracker that executor runs
    (vsim.runtime.nativerun): "python" pays tracker_us_per_op per op; "native" (a C++ counter)
    pays native_us_per_call per counted call and its saved-tensor hooks (pack_us) on the
    forward ops with a save the plan acts on; "native-always" (the native tracker before
    2026-11-27T08:30) the hooks on every forward op; a "-gated" suffix ("native-gated") counts
    only the backward ops the plan acts at, one call each (hostclock.gated_calls;
    VSIM_NATIVE_GATE=nodes, counter.cpp's Gate), and a further "-modules" none in forward's
    module calls without an action (hostclock.forward_gated; VSIM_NATIVE_FWD_GATE=modules);
    None: DEFAULT_TRACKER ("native-frames-gated-core", the plan carried out in C++ by the
    executor's core at HostModel.core's costs), as the
    runtime's default ("auto") runs every plan where the native tracker builds. Planning
    profiling runs use the same tracker (planning_runner), so that a plan is judged under the
    host costs it runs with.

    `dgrad_workspace`: a backward convolution allocates and frees its data-gradient kernel's
    workspace, about its forward convolution's (TracePrep.dgrad_workspaces), after its
    gradients and before its recorded workspace, as PyTorch asks for them (Engine._transient_of),
    which the trace merged into its one workspace: the block it leaves cached is the
    fragmentation PyTorch's allocator shows. Default: on with an allocator that models PyTorch's, as
    `first_iteration`.

    `iterations`: at most this many iterations, the first one included (default: as many as a
    measured run has, RUN_ITERATIONS, stopping earlier once the allocator's layout repeats). A
    run cut short this way that did not run out of memory says only that its first
    `iterations` fit: a screening run (vsim.policies.fitted.Judge.screen).

    `draw`: the run's iterations under one draw of the timing variation measured between real
    iterations (TimingDraw; all of them run, none alike); None: the recorded timing.

    `warm_start` (with `first_iteration`, on PyTorch's caching allocator): the process ran its
    plain step with the whole GPU before the plan and the cap, as `vsim measure`'s sessions
    do, then freed the gradients and emptied the cache: the first iteration starts with every
    resident tensor where that step placed it (vsim.engine.warm), none created at first use.
    False: a fresh training process, which creates momentum and cuBLAS workspaces at first use
    under the cap.

    `logged` False: the engine keeps no memory log and no per-op or per-copy records (its
    output's `executed` and `copies` are empty), from which the report and the predicted
    trace are built (asking for either raises): a profiling run whose verdict alone is read
    (SimResult.verdict), which runs the same without them.
    """
    capacity = _capacity(hw, capacity_bytes)
    if iterations is not None and iterations < 2:
        raise ValueError(f"a run simulates at least 2 iterations, got {iterations}")
    if allocator is None:  # a profiling run outside a simulation: PyTorch's (vsim run's default)
        allocator = make_allocator("caching")
    memory = allocator.build(capacity)
    if first_iteration is None:
        first_iteration = allocator.pytorch_runtime
    if workspace_fallback is None:
        workspace_fallback = allocator.pytorch_runtime
    fallback = _WorkspaceFree(trace, hw, plan) if workspace_fallback else None
    host = _host_model(trace, hw, host_time, tracker)
    if tracked is None:
        tracked = bool(plan.actions)
    if dgrad_workspace is None:
        dgrad_workspace = allocator.pytorch_runtime
    transients = trace_prep(trace).dgrad_workspaces() if dgrad_workspace else None
    run = _Run(trace, hw, plan, memory, first_iteration, fallback, host, tracked, transients,
               draw, logged)
    if warm_start and first_iteration and supports_warm_start(memory):
        run.memory, run.resident = warm_layout(trace, hw, allocator, capacity, transients)
        run.warm = True
    return _advance(run, RUN_ITERATIONS if iterations is None else iterations, label, allocator,
                    capacity)


def _advance(run: _Run, iterations: int, label: str, allocator: AllocatorSpec, capacity: int
             ) -> SimResult:
    """run.advance(iterations) as a SimResult; one cut short can go on (SimResult.resume)."""
    # The cyclic garbage collector finds little to free in a run (SimPy's events and the
    # engine's records go by reference counting) but its passes over every young record and
    # then the whole heap were 40% of a run's time on a 200k-op trace: paused while it runs.
    enabled = gc.isenabled()
    gc.disable()
    try:
        out, engine = run.advance(iterations)
    finally:
        if enabled:
            gc.enable()
    simpy_events = next(engine.env._eid)  # noqa: SLF001  (SimPy numbers every event it schedules)
    result = SimResult(run.trace, run.hw, run.plan_given, label, allocator, capacity, out,
                       simpy_events, run.logged)
    if not run.done and run.ran < RUN_ITERATIONS:
        result.resume = lambda: _advance(run, RUN_ITERATIONS, label, allocator, capacity)
    return result


def _capacity(hw: Hardware, capacity_bytes: int | None) -> int:
    capacity = hw.capacity_bytes if capacity_bytes is None else capacity_bytes
    if capacity <= 0:
        raise ConfigError(f"capacity must be above zero, got {format_size(capacity)}")
    return capacity


FALLBACK = "workspace fallback"


class _WorkspaceFree(Mapping[int, Retime]):
    """Per convolution the plan does not retime, its workspace-free algorithm (the fallback).
    Computed on first lookup: most runs never fall back, and the table costs a pass of the
    compute model over the trace (about a tenth of a run)."""

    def __init__(self, trace: Trace, hw: Hardware, plan: Plan) -> None:
        self._trace, self._hw, self._plan = trace, hw, plan

    @functools.cached_property
    def _table(self) -> dict[int, Retime]:
        # (a micro-batched convolution falls back too: each part is a call of its own)
        planned = {a.op for a in self._plan.actions if isinstance(a, Retime) and a.parts == 1}
        retimes, _ = memory_optimal_retimes(self._trace, self._hw)
        return {r.op: dataclasses.replace(r, note=FALLBACK) for r in retimes
                if r.op not in planned}

    def __getitem__(self, op: int) -> Retime:
        return self._table[op]

    def __iter__(self) -> Iterator[int]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


class _Run:
    """A run's iterations (see run_plan), simulated on demand: the first one when
    `first_iteration`, then steady ones until the allocator starts one as it started the one
    before, with the same plan (the two are then equal, and so would every later one be; an
    iteration that fell back to workspace-free convolutions changes the next one's plan), at
    most as many as a measured run has: fragmentation that builds up over iterations ends a run
    in a later iteration. `advance(n)` simulates up to n iterations in all and returns the
    reported (last) iteration's output and engine; called again with a larger n it goes on
    from there (a screening run run whole, vsim.policies.fitted.Judge)."""

    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, memory: Allocator,
                 first_iteration: bool, fallback: Mapping[int, Retime] | None,
                 host: HostModel | None, tracked: bool,
                 transients: Mapping[int, int] | None = None,
                 draw: TimingDraw | None = None, logged: bool = True) -> None:
        self.trace, self.hw, self.plan, self.memory = trace, hw, plan, memory
        self.logged = logged
        self.draw = draw
        self.rng = random.Random(draw.seed) if draw is not None else None
        self.transients = transients
        self.plan_given = plan  # (self.plan gains the workspace fallbacks of each iteration)
        self.first_iteration, self.fallback = first_iteration, fallback
        if fallback is not None:  # PyTorch's engine cache: one engine per shape
            self.plan = _with_fallbacks(plan, [a.op for a in plan.actions if isinstance(a, Retime)
                                               and a.workspace_bytes == 0 and a.parts == 1],
                                        fallback, trace)
        self.host, self.tracked = host, tracked
        self.resident: dict[int, object] | None = None
        self.warm = False  # the first iteration adopts `resident` (run_plan's warm_start)
        # The host clock's issue times, computed once per run: its later iterations' plans
        # differ only by workspace fallbacks (retimes), which cost the host nothing (hostclock).
        self.clock: HostClock | None = None
        self.layout: object = None
        self.ran = 0
        self.ends: list[float] = []  # each steady iteration's end (iteration 2 first)
        self.churns: list[dict[str, float]] = []  # and its allocator churn (EngineOutput.churn)
        self.converged = False
        self.done = False  # out of memory, settled, or one steady iteration is all there is
        self.out: EngineOutput | None = None
        self.engine: Engine | None = None
        self._steady: Engine | None = None  # the last steady iteration, its state not carried
        self._engine_notes: list[str] = []
        self._plan_index: tuple[Plan, PlanIndex] | None = None  # (_index)

    def advance(self, iterations: int) -> tuple[EngineOutput, Engine]:
        if self.done and self.ran == 1:  # out of memory in the first iteration
            assert self.out is not None and self.engine is not None
            return self.out, self.engine
        if self.ran == 0 and self.first_iteration:
            first = Engine(self.trace, self.hw, self.plan, self.memory,
                           first_use=None if self.warm else trace_prep(self.trace).first_use(),
                           resident_blocks=self.resident if self.warm else None,
                           fallback=self.fallback, host=self.host, tracked=self.tracked,
                           transients=self.transients, logged=self.logged,
                           index=self._index(), **self._drawn())
            out = first.run()
            self.ran = 1
            if out.oom is not None:
                out.notes.append("out of memory in the first iteration (the steady iteration "
                                 "not run), which started warm: its resident tensors where a "
                                 "plain step with the whole GPU left them, the cache emptied"
                                 if self.warm else
                                 "out of memory in the first iteration, which creates momentum "
                                 "and cuBLAS workspaces at first use (the steady iteration not "
                                 "run)")
                self.out, self.engine, self.done = out, first, True
                return out, first
            self.resident = first.resident_left()
            self.clock = first.clock
            self.plan = _with_fallbacks(self.plan, first.fell_back, self.fallback, self.trace)
            self.transients = _without(self.transients, first.transient_fell_back)
            # Not reported: its log goes before the next iteration builds its own (discard, and
            # no reference cycle holds an engine after its run: no collection needed, which
            # cost a pass over every record made since run_plan paused the collector)
            first.discard()
            del first, out
            self.layout = (self.memory.layout(), len(self.plan.actions),
                           len(self.transients or ()))
        elif self.ran == 0:
            self.ran = 1
        while not self.done and self.ran < iterations:
            if self._steady is not None:  # carry the last iteration's state into the next
                engine = self._steady
                resident_next = engine.resident_left()
                self.plan = _with_fallbacks(self.plan, engine.fell_back, self.fallback,
                                            self.trace)
                self.transients = _without(self.transients, engine.transient_fell_back)
                now = (self.memory.layout(), len(self.plan.actions), len(self.transients or ()))
                if now == self.layout and self.draw is None:  # (drawn: no two alike)
                    self.converged = self.done = True
                    break
                self.layout, self.resident = now, resident_next
                engine.discard()  # likewise
                self._steady = None
                del engine
            engine = Engine(self.trace, self.hw, self.plan, self.memory,
                            resident_blocks=self.resident, fallback=self.fallback,
                            host=self.host, tracked=self.tracked, clock=self.clock,
                            transients=self.transients, logged=self.logged,
                            index=self._index(), **self._drawn())
            self.clock = engine.clock
            out = engine.run()
            self.ran += 1
            self.ends.append(out.end_us)
            self.churns.append(out.churn)
            self.out, self.engine, self._steady = out, engine, engine
            self._engine_notes = list(out.notes)
            if out.oom is not None or not self.first_iteration:
                self.done = True
        assert self.out is not None and self.engine is not None
        return self._reported(), self.engine

    def _index(self) -> PlanIndex:
        """The PlanIndex of the plan the next iteration runs: the last one's while the plan is
        the same (one per plan, not per iteration; engines only read it)."""
        if self._plan_index is None or self._plan_index[0] is not self.plan:
            self._plan_index = (self.plan, PlanIndex(self.plan))
        return self._plan_index[1]

    def _drawn(self) -> dict[str, Any]:
        """The next iteration's Engine arguments of the timing draw (none without one)."""
        if self.draw is None or self.rng is None:
            return {}
        gauss, k = self.rng.gauss, self.draw.kernel_sigma
        return {"scale": {op.id: math.exp(gauss(0.0, k)) for op in self.trace.ops},
                "host_scale": math.exp(gauss(0.0, self.draw.host_sigma))}

    def _reported(self) -> EngineOutput:
        """The last iteration's output with the run's notes and timed iterations (rebuilt on
        each advance: a run gone on from a screening reports its own)."""
        out, engine, plan, ran = self.out, self.engine, self.plan, self.ran
        assert out is not None and engine is not None
        out.notes = list(self._engine_notes)
        out.iterations = ran
        if self.first_iteration and out.oom is None:
            # A measurement times iterations 4 to 13; a run that converged would repeat its
            # last iteration until then (same layout, same plan: the same iteration)
            ends = self.ends + ([self.ends[-1]] * (RUN_ITERATIONS - ran) if self.converged
                                else [])
            out.timed_ends_us = ends[TIMED_FROM - 2:] or [ends[-1]]
            # the churn likewise, the mean over the timed iterations (as a measurement counts
            # it over them): a run that never settles cycles through layouts of its own, and
            # its last iteration is one of them (VGG-16(256)'s micro-batched search plan at
            # 12 GiB: 9.4 to 17.1 GiB mapped, one iteration to the next)
            churns = self.churns + ([self.churns[-1]] * (RUN_ITERATIONS - ran)
                                    if self.converged else [])
            timed = churns[TIMED_FROM - 2:] or [churns[-1]]
            out.churn = {k: sum(c[k] for c in timed) / len(timed) for k in timed[-1]}
        if self.first_iteration:
            out.notes.append("a first iteration ran before this one on the same allocator "
                             "(its segments and fragmentation carry over)")
            if self.warm:
                out.notes.append("warm start: the first iteration found every resident tensor "
                                 "where a plain step with the whole GPU placed it, the cache "
                                 "emptied (vsim measure's sessions)")
            if ran > 2:
                out.notes.append(f"iteration {ran} of the run reported: the allocator's "
                                 f"segments (or the convolutions that fell back) changed from "
                                 f"one iteration to the next until then"
                                 + (" (out of memory there)" if out.oom is not None else ""))
        fell = sorted(set(engine.fell_back) | {a.op for a in plan.actions
                                               if isinstance(a, Retime) and a.note == FALLBACK})
        if fell:
            out.notes.append(f"workspace fallback: {len(fell)} convolution(s) ran without "
                             f"their workspace (PyTorch fell back, or cached a workspace-free "
                             f"engine for their shape), at that algorithm's time (ops "
                             f"{', '.join(map(str, fell[:12]))}"
                             f"{'...' if len(fell) > 12 else ''})")
        return out


RUN_ITERATIONS = 13  # a measured run's iterations: 3 warm-up, 10 timed (vsim.runtime.measure)
TIMED_FROM = 4  # the first of them that a measurement times


def _without(transients: Mapping[int, int] | None, fell_back: list[int]
             ) -> Mapping[int, int] | None:
    """The transients of the next iteration: none for the ops whose transient could not be
    had (Engine.transient_fell_back), as PyTorch's cached engine for the shape asks none."""
    if not fell_back or transients is None:
        return transients
    return {o: s for o, s in transients.items() if o not in fell_back}


def _with_fallbacks(plan: Plan, fell_back: list[int], fallback: Mapping[int, Retime] | None,
                    trace: Trace) -> Plan:
    """The plan with the workspace-free algorithms PyTorch fell back to (cached for good), and
    the same for every convolution of the shape of one of `fell_back`: PyTorch caches one
    engine per shape (TracePrep.same_shape). _Run passes the ops the plan runs workspace-free
    (squeezed) first, then each iteration's fallbacks."""
    if not fell_back or fallback is None:
        return plan
    done = {a.op for a in plan.actions if isinstance(a, Retime)}
    same = trace_prep(trace).same_shape()
    more: list[Retime] = []
    for o in [*fell_back, *(x for f in fell_back for x in same.get(f, ()))]:
        if o not in done and o in fallback:
            done.add(o)
            more.append(fallback[o])
    return dataclasses.replace(plan, actions=plan.actions + tuple(more)) if more else plan


def run_metrics(trace: Trace, out: EngineOutput) -> dict[str, Any]:
    """metrics.summary of the predicted trace, computed from the engine's output without
    building that trace (tests/test_engine_metrics.py holds the two equal). Sums run in the
    predicted trace's op order so that they agree to the last bit."""
    executed = _in_start_order(out)
    end = out.end_us + float(trace.meta.get("iteration_tail_us", 0.0))
    peak_allocated, peak_reserved, avg_allocated = metrics.curve_figures(
        out.memory.log, out.memory.allocator.has_segments, end)
    return {
        "iteration_time_us": end,
        "compute_time_us": math.fsum(e.dur_us for e in executed),
        "stall_time_us": math.fsum(e.stall_us for e in executed),
        "recompute_time_us": math.fsum(e.dur_us for e in executed if e.recompute_of is not None),
        "peak_allocated_bytes": peak_allocated,
        "peak_reserved_bytes": peak_reserved,
        "avg_allocated_bytes": avg_allocated,
        "h2d_bytes": sum(c.size_bytes for c in out.copies if c.direction == "h2d"),
        "d2h_bytes": sum(c.size_bytes for c in out.copies if c.direction == "d2h"),
    }


def engine_curve(out: EngineOutput) -> metrics.Curve:
    """The memory curve of the engine's allocator log (logged in time order, with segment
    events exactly when the allocator model has segments)."""
    return metrics.curve_of_events(out.memory.events, in_time_order=True,
                                   has_segments=out.memory.allocator.has_segments)


def _in_start_order(out: EngineOutput) -> list[ExecutedOp]:
    """By start time, ties in the order the ops ended (a stable sort of `executed`, which is
    appended as ops end): an op that waited on a zero-length op starting at the same instant
    on another stream comes after it, so deps and uses still point backwards."""
    return sorted(out.executed, key=lambda e: e.start_us)


def allocator_spec_string(spec: AllocatorSpec) -> str:
    """'caching', or 'caching:events=gpu': the fields that differ from their defaults (an
    allocator's field added later leaves the names of the runs before it as they were; a
    default changed, as events' on 2026-11-26, changes what an old name meant)."""
    params = ",".join(f"{f.name}={getattr(spec, f.name)}" for f in dataclasses.fields(spec)
                      if getattr(spec, f.name) != f.default)
    return f"{spec.name}:{params}" if params else spec.name


def _predicted_trace(trace: Trace, hw: Hardware, policy: str, allocator: AllocatorSpec,
                     capacity: int, out: EngineOutput) -> Trace:
    """Ops renumbered in execution order (recomputations get their own ids), original tensors
    with producers and consumers mapped to the new ids, copies and allocator events as run."""
    new_id: dict[int, int] = {}
    ops: list[Op] = []
    kind = {t.id: t.kind for t in trace.tensors}
    for i, ex in enumerate(_in_start_order(out)):
        op = ex.op
        attrs = dict(op.attrs)
        attrs["stall_us"] = ex.stall_us
        attrs["trace_op"] = op.id
        if ex.recompute_of is not None:
            attrs["recompute_of"] = ex.recompute_of
            ops.append(Op(id=i, name=f"recompute {op.name}", layer=op.layer,
                          layer_type=op.layer_type, phase=op.phase, start_us=ex.start_us,
                          dur_us=ex.dur_us, stream=op.stream, reads=(), kernels=(),
                          attrs=tuple(sorted(attrs.items()))))
            continue
        new_id[op.id] = i
        reads = op.reads
        if ex.without_workspace:  # its workspace was never allocated: not read either
            reads = tuple(t for t in reads if kind[t] != "workspace")
        ops.append(Op(id=i, name=op.name, layer=op.layer, layer_type=op.layer_type,
                      phase=op.phase, start_us=ex.start_us, dur_us=ex.dur_us, stream=op.stream,
                      reads=reads, writes=op.writes, frees=op.frees,
                      deps=tuple(new_id[d] for d in op.deps if d in new_id), kernels=(),
                      flops=op.flops, dram_bytes=op.dram_bytes,
                      attrs=tuple(sorted(attrs.items()))))
    # An out-of-memory run stops part-way: keep only the tensors of ops that ran, so the
    # predicted trace stays valid (every op in `ops` ran, so their writes are all kept).
    ran = set(new_id)
    tensors = tuple(
        Tensor(t.id, t.size_bytes, t.kind, t.name,
               None if t.producer is None else new_id.get(t.producer),
               tuple(new_id[c] for c in t.consumers if c in new_id))
        for t in trace.tensors if t.producer is None or t.producer in ran)
    meta = dict(trace.meta)
    meta.update({"source": "predicted", "predicted_from": trace.meta.get("source"),
                 "policy": policy, "allocator": allocator_spec_string(allocator),
                 "hardware": hw.name, "capacity_bytes": capacity,
                 "stream_names": {**trace.meta.get("stream_names", {}),
                                  "0": "compute", str(H2D_STREAM): "H2D copies",
                                  str(D2H_STREAM): "D2H copies"}})
    predicted = Trace(meta=meta, tensors=tensors, ops=tuple(ops), measured=trace.measured,
                      copies=tuple(sorted(out.copies, key=lambda c: (c.start_us, c.stream))),
                      mem_events=tuple(MemEvent(*e) for e in out.memory.events))
    # Memory counters for viewing in Perfetto: the last state at each distinct time.
    curve = engine_curve(out)
    points = {t: (a, r) for t, a, r in curve}
    counters = tuple({"name": "device memory", "ph": "C", "ts": t, "pid": 1,
                      "args": {"allocated_MiB": round(a / 2**20, 3),
                               "reserved_MiB": round(r / 2**20, 3)}}
                     for t, (a, r) in sorted(points.items()))
    return dataclasses.replace(predicted, counters=counters)
