"""A measuring session: one model, batch and trace on one device, measured under several plans
in turn (`Session.run`) or under PyTorch's built-ins (`Session.builtin`); see
vsim.runtime.measure for what a case measures."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..allocator import make_allocator
from ..engine import TIMING_DRAWS, simulate
from ..errors import ConfigError
from ..hardware import load_hardware
from ..plan import Plan, Retime
from ..policies import make_policy
from ..record.hostprobe import probe_host
from ..record.step import StepConfig, TrainingStep, set_tf32, step_config
from ..trace.schema import Trace
from .executor import Executor, ExecutorError, IterationStats, PinnedPool, core_available
from .hostmem import process_pool
from .hostuse import HostUse
from .nativerun import NativeDivergence, native_gate, native_saved
from .opmap import OpMap, map_ops
from .results import (
    FORMAT,
    VERSION,
    allocator_counters,
    case_notes,
    compare_gradients,
    executed_summary,
    kernel_profiler,
    kernel_summary,
    measure_command,
    plan_summary,
    provenance,
)

Progress = Callable[[str], None]


def quiet(_msg: str) -> None:
    pass


@contextmanager
def deterministic() -> Iterator[None]:
    """cuDNN's deterministic algorithms and PyTorch's deterministic mode (warn-only: kernels
    without a deterministic version still run, and their noise is measured separately)."""
    cudnn = torch.backends.cudnn
    prev = (cudnn.deterministic, torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        cudnn.deterministic = prev[0]
        torch.use_deterministic_algorithms(prev[1], warn_only=prev[2])


# A case whose plan ran convolutions squeezed changed the cuDNN engines PyTorch caches for the
# rest of the process (vsim.runtime.executor): later cases would run with them.
_ENGINES_SQUEEZED = False


def squeezes(plan: Plan) -> bool:
    """Whether the plan runs a convolution without workspace (executed by squeezing it)."""
    return any(isinstance(a, Retime) and a.workspace_bytes == 0 for a in plan.actions)


NOISE_REPEATS = 5
"""Repeats of the reference's gradients where the first repeat already differs."""


class CollectorClock:
    """A gc callback: the host time Python's cyclic collector takes (`us`, summed). The
    collector runs on whichever thread allocates when a generation fills, the autograd
    engine's included, and stops every thread while it runs."""

    def __init__(self) -> None:
        self.us = 0.0
        self._t0: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.us += (time.perf_counter() - self._t0) * 1e6
            self._t0 = None


# The op tracker plans are made for: the native one, its saved-tensor hooks where a save is
# armed (vsim.engine's trackers; plans measured before 2026-11-27T08:30 were made for
# "native-always", and their runs' provenance has no plan_tracker); with those saves taken
# from their frames under VSIM_NATIVE_SAVED=frames, "native-frames"; "-gated": backward's nodes
# without an action untracked (VSIM_NATIVE_GATE=nodes). Both are the defaults from 2026-11-27
# ("native-frames-gated")
PLAN_TRACKER = "native"


def plan_tracker() -> str:
    """The tracker this process's plans are made for (PLAN_TRACKER, or its frames variant;
    gated unless VSIM_NATIVE_GATE=off; "-core" where the executor's core will carry the plan
    out, from 2026-11-27T19:30)."""
    name = "native-frames" if native_saved() == "frames" else PLAN_TRACKER
    return name + ("-gated" if native_gate() == "nodes" else "") + \
        ("-core" if core_available() else "")


class Session:
    """One model, batch and trace on one device, measured under several policies in turn.

    Built: the step the trace recorded (vsim.record.step.training_step with the trace meta's
    model, batch, precision, optimizer and sequence length; weights from seed 0, synthetic
    batch), `warmup` plain iterations; a snapshot of weights, optimizer and grad-scaler state
    (every check starts from it); the op map (one iteration under the recorder's structure
    pass); the reference loss and gradients (deterministic kernels, twice). `model`, `batch`,
    `precision`, `optimizer`, `seq`: None takes the trace's; one that differs from the trace's
    is a ConfigError (vsim.record.step.step_config)."""

    def __init__(self, model: str | None, batch: int | None, trace: Trace, *,
                 device: str = "cuda", hardware: str = "h100-sxm",
                 trace_path: str | None = None, warmup: int = 3, check: bool = True,
                 progress: Progress | None = None, opmap: OpMap | None = None,
                 precision: str | None = None, optimizer: str | None = None,
                 seq: int | None = None) -> None:
        self.say = progress or quiet
        self.config: StepConfig = step_config(
            trace.meta, model, batch, precision, optimizer, seq,
            what=f"the trace {trace_path}" if trace_path else "the trace")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("CUDA is not available here; measure with --device cpu")
        self.gpu = self.device.type == "cuda"
        if self.gpu and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_name, self.batch = self.config.model, self.config.batch
        self.trace, self.trace_path = trace, trace_path
        self.hw_name = hardware
        self.hw = load_hardware(hardware)
        self.warmup = warmup
        self.check = check
        self._uncap()
        self.train: TrainingStep = self.config.build(self.device)
        self.net, self.opt, self.loss_fn = self.train.net, self.train.opt, self.train.loss_fn
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.args = self.train.args
        self.target = self.train.target
        self.inputs = (self.train.inputs, self.train.target)
        self.flat_inputs = [t for t in tree_flatten(self.inputs)[0]
                            if isinstance(t, torch.Tensor)]
        for _ in range(warmup):
            self.step()
        self._sync()
        self.host_probe = probe_host(self.device)
        self.snapshot = [t.detach().to("cpu", copy=True) for t in self._state()]
        self.rng = (torch.get_rng_state(),
                    torch.cuda.get_rng_state(self.device) if self.gpu else None)
        if opmap is None:
            self.say(f"{self.model_name} (batch {self.batch}): mapping the trace's ops")
            opmap = map_ops(self.step, self.net, self.opt, self.inputs, self.loss_fn,
                            self.device, trace)
            self.restore()
        self.opmap: OpMap = opmap
        self._plans: dict[tuple[str, int | None], tuple[Any, Plan]] = {}  # see _plan
        self.say(f"  {opmap.n_calls} aten calls, {len(trace.ops)} ops, "
                 f"{opmap.diagnostics['tensors_located']} tensors located")
        self.reference: dict[str, Any] | None = None
        self.noise: dict[str, Any] | None = None
        if check:
            self.reference = self.gradients(None)
            self.noise = self._repeat_noise()

    def _repeat_noise(self) -> dict[str, Any]:
        """The reference's own spread: its gradients again, against it. Where one repeat is not
        bitwise equal (nondeterministic kernels: atomics in bf16 matmul and attention
        backward), one repeat understates the spread, so NOISE_REPEATS of them are run and the
        largest differences kept (`repeats` says how many)."""
        assert self.reference is not None
        noise = compare_gradients(self.reference, self.gradients(None))
        noise["repeats"] = 1
        if noise["bitwise_equal"]:
            return noise
        for _ in range(NOISE_REPEATS - 1):
            other = compare_gradients(self.reference, self.gradients(None))
            for key in ("max_abs_grad_diff", "max_rel_grad_diff"):
                noise[key] = max(noise[key], other[key])
        noise["repeats"] = NOISE_REPEATS
        return noise

    # ------------------------------------------------------------ training

    def step(self, capture: Callable[[torch.Tensor | None], None] | None = None) -> None:
        """The recorder's training step (vsim.record.step.TrainingStep: autocast, grad scaler
        and optimizer as the trace recorded them). `capture` is called with the loss after the
        forward pass (a plan may free the loss in backward) and with None after the backward
        pass."""
        self.train(capture)

    def _sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def _state(self) -> list[torch.Tensor]:
        out = list(self.params) + [b for b in self.net.buffers()]
        for p in self.params:
            st = self.opt.state.get(p, {})
            out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        scaler = self.train.scaler
        if scaler is not None:  # fp16: the loss scale and its growth count
            out += [t for t in (getattr(scaler, "_scale", None),
                                getattr(scaler, "_growth_tracker", None))
                    if isinstance(t, torch.Tensor)]
        return out

    def restore(self) -> None:
        """Weights, buffers, optimizer state and random generators back to the snapshot; no
        gradients (an iteration stopped by an exception may have left some)."""
        self.opt.zero_grad(set_to_none=True)
        set_tf32(self.config.precision)
        with torch.no_grad():
            for t, s in zip(self._state(), self.snapshot, strict=True):
                t.copy_(s)
        torch.set_rng_state(self.rng[0])
        if self.gpu:
            assert self.rng[1] is not None
            torch.cuda.set_rng_state(self.rng[1], self.device)
        self._sync()

    def gradients(self, ex: Executor | None) -> dict[str, Any]:
        """Loss and parameter gradients of one iteration from the snapshot, deterministic
        kernels on, with the plan carried out by `ex` (None: no policy)."""
        self.restore()
        got: dict[str, Any] = {}

        def capture(loss: torch.Tensor | None) -> None:
            with ex.untracked() if ex is not None else nullcontext():
                if loss is not None:
                    got["loss"] = loss.detach().to("cpu", copy=True)
                    return
                got["grads"] = [None if p.grad is None else p.grad.detach().to("cpu", copy=True)
                                for p in self.params]

        try:
            with deterministic():
                if ex is not None and ex.needs_calibration():
                    self._iteration(ex)  # the checked iteration then runs as measured ones do
                    self.restore()
                if ex is not None:
                    try:
                        ex.run(lambda: self.step(capture))
                    except NativeDivergence:  # checked under the Python tracker instead
                        self.restore()
                        got.clear()
                        ex.run(lambda: self.step(capture))
                else:
                    self.step(capture)
                self._sync()
        finally:
            self.restore()
        return got

    def _iteration(self, ex: Executor, notes: list[str] | None = None) -> IterationStats:
        """One iteration with `ex`; one whose native tracker diverged from its calibration runs
        again under the Python tracker (its time then includes both: a note says so). So does
        the first native iteration (tracker "auto") when it runs out of memory after the
        calibrating iteration fit under the Python tracker: a safety net, so that a plan that fits
        is not reported out of memory because of the tracker (on VGG-16(256) at 12 GiB a
        recompute plan's native iterations held 2.3 GiB more while a chain was replayed, until
        native.targets stopped acting inside the previous counted call's callback)."""
        try:
            return ex.run(self.step)
        except NativeDivergence as exc:
            if notes is not None:
                notes.append(f"the native tracker diverged ({exc}): that iteration ran again "
                             "under the Python tracker, as every later one did")
            # the step clears gradients only at its end: a stopped one leaves some, and the
            # run again would accumulate into them (aten.add_ where the trace has none)
            self.opt.zero_grad(set_to_none=True)
            self._sync()
            return ex.run(self.step)
        except torch.OutOfMemoryError:
            # only before any native iteration has run to the end (a native one follows a
            # calibrating one that did): a later one that runs out is the plan's (or the
            # allocator's) doing, not the tracker's
            if ex.stats.tracker != "native" or ex.tracker_requested != "auto" or \
                    ex.native_iterations > 0:
                raise
        # out of the except block, so that its traceback (the stopped iteration's tensors) is
        # gone before the iteration runs again
        ex.give_up_native("out of memory in a native iteration after its calibrating "
                          "iteration fit under the Python tracker")
        if notes is not None:
            notes.append("a native iteration ran out of memory where the calibrating one (Python "
                         "tracker) fit: that iteration ran again under the Python tracker, as "
                         "every later one did")
        self._clean()
        ex.restore_inputs()
        return ex.run(self.step)

    # ------------------------------------------------------------ memory

    def _uncap(self) -> None:
        if self.gpu:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _cap(self, memory_bytes: int | None) -> float:
        """Cap the process at `memory_bytes`; the fraction of the device it set (1.0 without a
        GPU)."""
        if not self.gpu:
            return 1.0
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = 1.0 if memory_bytes is None else min(1.0, memory_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        return fraction

    def _clean(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.gpu:
            self._sync()
            torch.cuda.empty_cache()

    def recover(self) -> None:
        """After a case that raised: free what it left behind and lift the cap."""
        self._clean()
        self._uncap()
        self._check_intact()

    def _check_intact(self) -> None:
        """Every input, weight, buffer and optimizer state still holds all its bytes: a plan
        resizes storages to 0, and one left so by a stopped iteration would break every later
        case of the session (a convolution reading 0 bytes fails in cuDNN with BAD_PARAM)."""
        for what, tensors in (("input", self.flat_inputs), ("state", self._state())):
            for k, t in enumerate(tensors):
                if t.numel() and t.untyped_storage().nbytes() == 0:
                    raise ExecutorError(f"{self.model_name} (batch {self.batch}): {what} "
                                        f"tensor {k} {tuple(t.shape)} was left without its "
                                        "bytes by the last case; later cases of this session "
                                        "would read it")

    def _pool(self, plan: Plan) -> PinnedPool | None:
        """The process's pinned pool for the plan (vsim.runtime.hostmem.process_pool)."""
        return process_pool(plan.pinned_pool_bytes, self.gpu and plan.pinned)

    # ------------------------------------------------------------ one case

    def squeezes(self, policy: str, memory_bytes: int | None = None) -> bool:
        """Whether the policy's plan for this case runs convolutions squeezed (on a GPU), which
        changes the engines cuDNN caches for the rest of the process: such a case is measured
        in a process of its own (vsim.runtime.suite)."""
        return self.gpu and squeezes(self._plan(policy, memory_bytes)[1])

    def _plan(self, policy: str, memory_bytes: int | None) -> tuple[Any, Plan]:
        """(policy, its plan for this case), planned once per case: the suite asks `squeezes`
        before `run`, and a capacity-aware policy's planning runs the engine many times."""
        key = (policy, memory_bytes)
        if key not in self._plans:
            pol = make_policy(policy)
            capacity = self.hw.capacity_bytes if memory_bytes is None else memory_bytes
            # as `vsim run` and `vsim validate` plan it: under the native tracker, and, where
            # the plan fits a capacity that binds by a margin too thin for most timing draws,
            # the policy's plan for a budget a little lower (engine.simulate's `draws`)
            plan = simulate(self.trace, self.hw, pol, make_allocator(_allocator_spec()),
                            capacity, plan_tracker=plan_tracker(), draws=TIMING_DRAWS).plan
            self._plans[key] = (pol, plan)
        return self._plans[key]

    def run(self, policy: str, memory_bytes: int | None = None, iters: int = 10,
            warmup: int | None = None, instrument: bool = False, strict: bool = True,
            command: str | None = None, profile_last: bool = False,
            tracker: str = "auto") -> dict[str, Any]:
        """Measure one case: the plan of `policy` for this trace at `memory_bytes` (None: the
        profile's capacity, no cap) carried out for `warmup` + `iters` iterations.
        `instrument`: run the op tracker even for a plan without actions (to see its cost).
        `strict`: see Executor (a recomputation that cannot rebuild a tensor's final value
        raises ExecutorError; otherwise it runs as planned and the check shows the damage).
        `profile_last`: profile the last iteration's kernels (CUPTI; that iteration's time and
        peaks are left out of the medians) into the result's `profile_last`. `tracker`: the
        executor's op tracker (vsim.runtime.nativerun: auto, native or python)."""
        warmup = self.warmup if warmup is None else warmup
        if iters < 1:
            raise ConfigError(f"--iters must be at least 1, got {iters}")
        capacity = self.hw.capacity_bytes if memory_bytes is None else memory_bytes
        pol, plan = self._plan(policy, memory_bytes)
        global _ENGINES_SQUEEZED
        if _ENGINES_SQUEEZED:
            raise ConfigError(f"{policy}: an earlier case in this process ran convolutions "
                              "squeezed to workspace-free engines, which PyTorch keeps using; "
                              "run each such case alone (--only ID)")
        if squeezes(plan) and self.gpu:
            _ENGINES_SQUEEZED = True
        notes = list(plan.notes)
        self._clean()
        fraction = self._cap(memory_bytes)
        held = torch.cuda.memory_allocated(self.device) if self.gpu else None
        ex = None
        if plan.actions or instrument:
            ex = Executor(plan, self.opmap, self.trace, self.device, self.flat_inputs,
                          self._pool(plan), strict=strict, memory_fraction=fraction,
                          tracker=tracker)
        times: list[float] = []
        issued: list[float] = []  # host time until the step returned, before the final sync
        peaks_a: list[int] = []
        peaks_r: list[int] = []
        stats: IterationStats | None = None
        measured_stats: list[IterationStats] = []  # the executor's, per measured iteration
        oom = None
        i = 0
        profiled: dict[str, Any] | None = None
        last = warmup + iters if profile_last and self.gpu else None
        counters: dict[str, int] = {}  # the allocator's, after the warm-up
        churn: dict[str, int] = {}     # their growth over the measured iterations
        gc_clock = CollectorClock()
        gc_per_iteration: list[float] = []  # the collector's host time in each measured one
        host_use = HostUse()  # the process's CPU time while each measured one was issued
        gc.callbacks.append(gc_clock)
        try:
            for i in range(warmup + iters + (1 if last is not None else 0)):
                self._sync()
                gc_before = gc_clock.us
                if self.gpu:
                    torch.cuda.reset_peak_memory_stats(self.device)
                if i == warmup and self.gpu:
                    counters = allocator_counters(self.device)
                prof = kernel_profiler() if i == last else None
                host_use.start()
                t0 = time.perf_counter()
                if ex is not None:
                    stats = self._iteration(ex, notes)
                else:
                    self.step()
                t_issued = time.perf_counter()
                host_use.issued()
                self._sync()
                dt = (time.perf_counter() - t0) * 1e6
                if prof is not None:
                    prof.stop()
                    profiled = kernel_summary(prof, dt)
                    continue
                if i >= warmup:
                    times.append(dt)
                    issued.append((t_issued - t0) * 1e6)
                    gc_per_iteration.append(gc_clock.us - gc_before)
                    host_use.keep()
                    if stats is not None:
                        measured_stats.append(stats)
                    if self.gpu:
                        peaks_a.append(torch.cuda.max_memory_allocated(self.device))
                        peaks_r.append(torch.cuda.max_memory_reserved(self.device))
                        churn = {k: v - counters.get(k, 0)
                                 for k, v in allocator_counters(self.device).items()}
        except torch.OutOfMemoryError as exc:
            oom = {"iteration": i, "in_warmup": i < warmup,
                   "message": str(exc).strip().splitlines()[0][:1000]}
            oom.update(ex.where() if ex is not None else {})
            del exc
        finally:
            gc.callbacks.remove(gc_clock)
        self._clean()
        if ex is not None and ex.inputs_pending:
            self._uncap()
            ex.restore_inputs()
            notes.append("the batch's inputs were brought back after the out-of-memory stop "
                         "(they did not fit under the cap while the stopped iteration held "
                         "its tensors)")
        self._check_intact()
        if oom is not None and ex is None:
            oom.update(self._locate_oom(plan))
        check: dict[str, Any] | None = None
        if oom is None and self.check and ex is not None and plan.actions:
            self._uncap()
            assert self.reference is not None
            check = compare_gradients(self.reference, self.gradients(ex))
            self._clean()
        elif oom is None and self.check:
            check = {"skipped": "no plan actions: the run is the reference itself"}
        if check is not None and self.noise is not None:
            check["reference_repeat"] = {k: self.noise[k] for k in
                                         ("bitwise_equal", "max_abs_grad_diff",
                                          "max_rel_grad_diff", "repeats")}
        self._uncap()
        fits = oom is None
        notes += case_notes(plan, ex, stats, self.trace)
        if ex is not None:
            ex.close()  # the forward gate's module hooks off the model
        if command is None:
            command = measure_command(self.model_name, self.batch, policy, memory_bytes,
                                      self.hw_name, self.trace_path, None,
                                      "" if self.trace_path else self.config.flags())
        host_peak = stats.host_peak_bytes if stats is not None else 0
        if plan.pinned_pool_bytes and ex is not None and ex.pool is not None:
            host_peak = max(host_peak, plan.pinned_pool_bytes)
        result: dict[str, Any] = {
            "format": FORMAT, "version": VERSION,
            "model": self.model_name, "batch_size": self.batch, "policy": pol.spec(),
            "step": dataclasses.asdict(self.config),
            "hardware": self.hw_name, "trace": self.trace_path,
            "memory_bytes": memory_bytes, "capacity_bytes": capacity,
            "fits": fits, "oom": oom,
            "iteration_time_us": round(statistics.median(times), 3) if fits else None,
            "iteration_times_us": [round(t, 3) for t in times],
            # the host's time to issue the iteration (the step returned; the GPU may still
            # run): close to the iteration time when the host bounds it
            "host_issue_us": round(statistics.median(issued), 1) if fits and issued else None,
            # Python's cyclic collector inside each measured iteration (host time): 0.1-3 ms
            # on the H100 and not what makes host-bound runs vary (validation/README.md)
            "collector_us": [round(t, 1) for t in gc_per_iteration],
            # the process's CPU time while each was issued, its involuntary context switches,
            # the machine's steal time (vsim.runtime.hostuse): a slow host-bound iteration
            # whose CPU time stayed was off the CPU, one whose CPU time grew ran on a slower one
            "host_use": host_use.summary(),
            "peak_allocated_bytes": (int(statistics.median_low(peaks_a))
                                     if fits and peaks_a else None),
            "peak_reserved_bytes": (int(statistics.median_low(peaks_r))
                                    if fits and peaks_r else None),
            "peaks_allocated_bytes": peaks_a, "peaks_reserved_bytes": peaks_r,
            "pinned_host_peak_bytes": host_peak if fits else None,
            "h2d_bytes": stats.h2d_bytes if stats is not None else 0,
            "d2h_bytes": stats.d2h_bytes if stats is not None else 0,
            "iterations": {"warmup": warmup, "measured": len(times)},
            "allocator_churn": churn or None,
            "allocated_at_start_bytes": held,
            "plan": plan_summary(plan),
            "executed": executed_summary(stats, ex, measured_stats),
            "op_map": dict(self.opmap.diagnostics),
            "check": check,
            "notes": notes,
            # the tracker the plan was made for (vsim validate plans it so again)
            "provenance": {**provenance(self.device, command, self.host_probe),
                           "plan_tracker": plan_tracker()},
        }
        if profiled is not None:
            result["profile_last"] = profiled
        return result

    def _locate_oom(self, plan: Plan) -> dict[str, Any]:
        """A run without an executor ran out of memory: run one iteration with the op tracker
        alone to say at which op."""
        ex = Executor(Plan(), self.opmap, self.trace, self.device, self.flat_inputs)
        try:
            ex.run(self.step)
        except torch.OutOfMemoryError:
            return ex.where()
        finally:
            self._clean()
        return {"op": None, "note": "a second, tracked iteration did not run out of memory"}

    # ------------------------------------------------------------ PyTorch's built-ins

    def builtin(self, kind: str, memory_bytes: int | None = None, iters: int = 10,
                warmup: int | None = None, segments: int = 6) -> dict[str, Any]:
        """PyTorch's own alternatives, timed like a case: `save_on_cpu` (saved tensors to
        pinned host memory) or `checkpoint_sequential` (`segments` segments over the model's
        modules flattened, which needs an nn.Sequential model)."""
        warmup = self.warmup if warmup is None else warmup
        if kind == "save_on_cpu":
            def step() -> None:
                with torch.autograd.graph.save_on_cpu(pin_memory=self.gpu):
                    self.train()
        elif kind == "checkpoint_sequential":
            segmented = dataclasses.replace(
                self.train, net=_Checkpointed(_segments(_flat_sequential(self.net), segments)),
                inputs=self.args[0])
            step = segmented.step
        else:
            raise ConfigError(f"unknown built-in {kind!r}: save_on_cpu or checkpoint_sequential")
        self._clean()
        self._cap(memory_bytes)
        times: list[float] = []
        peaks_a: list[int] = []
        oom = None
        i = 0
        try:
            for i in range(warmup + iters):
                self._sync()
                if self.gpu:
                    torch.cuda.reset_peak_memory_stats(self.device)
                t0 = time.perf_counter()
                step()
                self._sync()
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e6)
                    if self.gpu:
                        peaks_a.append(torch.cuda.max_memory_allocated(self.device))
        except torch.OutOfMemoryError as exc:
            oom = {"iteration": i, "in_warmup": i < warmup,
                   "message": str(exc).strip().splitlines()[0][:1000]}
            del exc
        self._clean()
        self._check_intact()
        self._uncap()
        label = f"pytorch:{kind}" + (f":segments={segments}" if kind != "save_on_cpu" else "")
        note = ("PyTorch's built-in, not a vsim policy: no trace plan, no check"
                + ("; checkpoint_sequential's split with each boundary moved past in-place "
                   "ReLUs (their in-place update of a checkpointed segment's input fails "
                   "otherwise), use_reentrant=False" if kind != "save_on_cpu" else
                   "; save_on_cpu(pin_memory=True) around the forward pass"))
        return {"format": FORMAT, "version": VERSION, "model": self.model_name,
                "batch_size": self.batch, "policy": label, "memory_bytes": memory_bytes,
                "fits": oom is None, "oom": oom,
                "iteration_time_us": round(statistics.median(times), 3) if oom is None else None,
                "iteration_times_us": [round(t, 3) for t in times],
                "peak_allocated_bytes": (int(statistics.median_low(peaks_a))
                                         if oom is None and peaks_a else None),
                "notes": [note],
                "provenance": provenance(self.device, f"python -m vsim.runtime.measure "
                                                      f"(builtin {label})", self.host_probe)}



class _Checkpointed(torch.nn.Module):
    """The segments in turn, each but the last under torch.utils.checkpoint (non-reentrant)."""

    def __init__(self, segs: list[torch.nn.Sequential]) -> None:
        super().__init__()
        self.segs = segs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for seg in self.segs[:-1]:
            x = checkpoint(seg, x, use_reentrant=False)
        return self.segs[-1](x)  # type: ignore[no-any-return]


def _segments(mods: list[torch.nn.Module], n: int) -> list[torch.nn.Sequential]:
    """checkpoint_sequential's even split into `n` segments (the last one runs without
    checkpointing, as there), each boundary moved forward past in-place modules (ReLU(inplace)):
    a segment may not start by overwriting the input its predecessor's checkpoint keeps."""
    size = max(1, len(mods) // n)
    bounds: list[int] = []
    for k in range(1, n):
        b = k * size
        while b < len(mods) and getattr(mods[b], "inplace", False):
            b += 1
        if b < len(mods) and (not bounds or b > bounds[-1]):
            bounds.append(b)
    edges = [0, *bounds, len(mods)]
    return [torch.nn.Sequential(*mods[a:b]) for a, b in zip(edges, edges[1:], strict=False)
            if b > a]


def _flat_sequential(module: torch.nn.Module) -> list[torch.nn.Module]:
    if not isinstance(module, torch.nn.Sequential):
        raise ConfigError(f"checkpoint_sequential needs an nn.Sequential model, not "
                          f"{type(module).__name__}")
    out: list[torch.nn.Module] = []
    for child in module:
        out += _flat_sequential(child) if isinstance(child, torch.nn.Sequential) else [child]
    return out


def _allocator_spec() -> str:
    """The allocator model of this process's PyTorch allocator (PYTORCH_CUDA_ALLOC_CONF)."""
    import os
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return "expandable" if "expandable_segments:true" in conf.replace(" ", "").lower() \
        else "caching"
