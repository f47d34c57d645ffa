"""`vsim measure`: train with a policy's plan carried out for real, and record what it cost.

    result = measure("vgg16", 256, "vdnn:mode=all", memory_bytes=12 * 2**30,
                     trace_path="traces/vgg16-b256-h100.vsim.json.gz")

The trace (given, or recorded first by the recorder) is planned with
`make_policy(spec).plan(trace, load_hardware(hw), capacity)`, exactly as `vsim run` plans it,
and vsim.runtime.executor carries the plan out while the zoo model trains (SGD with momentum,
synthetic data, the recorder's own training step). A `Session` holds one model, batch and trace
on one device and measures several cases in one process (the suite runs so; `python -m
vsim.runtime.measure SUITE.yaml OUT_DIR`).

Per case: the process is capped with `torch.cuda.set_per_process_memory_fraction` (`--memory`),
the caches are emptied, `warmup` iterations run, then `iters` timed iterations, each
synchronised before and after, its peak memory read after `reset_peak_memory_stats` (as the
recorder measures). Out of memory is a result (fits false, with the op it happened at). Then,
unless told not to, one more iteration with deterministic kernels and no cap checks that the
loss and every parameter gradient equal those of the same iteration without a policy, from the
same weights (the reference is taken twice, to see how far the GPU's own nondeterministic
kernels move it).

The result is a JSON object (`validation/measured/*.json`): iteration_time_us (median),
iteration_times_us, peak_allocated_bytes and peak_reserved_bytes (medians of per-iteration
peaks), pinned_host_peak_bytes, h2d_bytes, d2h_bytes (per iteration), fits, oom, executed (what
the executor did), check, notes (what was approximated), provenance.
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import __version__
from ..errors import ConfigError
from ..hardware import load_hardware
from ..policies import make_policy
from ..policies.base import Offload, Plan, Retime
from ..record.zoo import build_model
from ..trace import load_trace
from ..trace.schema import Trace
from ..units import format_size
from .executor import Executor, IterationStats, PinnedPool
from .opmap import OpMap, map_ops

_POOLS: dict[bool, PinnedPool] = {}  # pinned -> the process's pool, reused across sessions
FORMAT = "vsim-measured"
VERSION = 1
Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
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


def compare_gradients(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Loss and gradients of a run against a reference: bitwise equality, the largest absolute
    difference, and the largest relative one per tensor (|a - b|_inf / |a|_inf)."""
    max_abs = max_rel = 0.0
    bitwise = bool(torch.equal(ref["loss"], got["loss"]))
    missing = 0
    for a, b in zip(ref["grads"], got["grads"], strict=True):
        if a is None or b is None:
            missing += (a is None) != (b is None)
            continue
        bitwise = bitwise and bool(torch.equal(a, b))
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        scale = float(a.double().abs().max()) if a.numel() else 0.0
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
    return {"bitwise_equal": bitwise and not missing,
            "loss": float(got["loss"]), "loss_reference": float(ref["loss"]),
            "max_abs_grad_diff": max_abs, "max_rel_grad_diff": max_rel,
            "gradients_missing": missing, "tensors": len(ref["grads"])}


def provenance(device: torch.device, command: str) -> dict[str, Any]:
    """Device, driver and library versions, date and command (no host name)."""
    from ..record.recorder import _driver_version

    gpu = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "driver": _driver_version() if gpu else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda if gpu else None,
            "cudnn": torch.backends.cudnn.version() if gpu else None,
            "python": platform.python_version(),
            "vsim": __version__,
            "tf32": {"cudnn": bool(torch.backends.cudnn.allow_tf32),
                     "matmul": bool(torch.backends.cuda.matmul.allow_tf32)},
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            or os.environ.get("PYTORCH_ALLOC_CONF"),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command}


def measure_command(model: str, batch: int, policy: str, memory_bytes: int | None,
                    hardware: str, trace_path: str | None, output: str | None) -> str:
    parts = ["vsim measure", model, "--batch", str(batch), "--policy", policy]
    if memory_bytes is not None:
        parts += ["--memory", format_size(memory_bytes).replace(" ", "")]
    parts += ["--hw", hardware]
    if trace_path:
        parts += ["--trace", trace_path]
    if output:
        parts += ["-o", output]
    return " ".join(parts)


class Session:
    """One model, batch and trace on one device, measured under several policies in turn.

    Built: the zoo model (weights from seed 0), SGD (lr 0.01, momentum 0.9), the synthetic
    batch; `warmup` plain iterations; a snapshot of weights and optimizer state (every check
    starts from it); the op map (one iteration under the recorder's structure pass); the
    reference loss and gradients (deterministic kernels, twice)."""

    def __init__(self, model: str, batch: int, trace: Trace, *, device: str = "cuda",
                 hardware: str = "h100-sxm", trace_path: str | None = None, warmup: int = 3,
                 check: bool = True, progress: Progress | None = None,
                 opmap: OpMap | None = None) -> None:
        self.say = progress or _quiet
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("CUDA is not available here; measure with --device cpu")
        self.gpu = self.device.type == "cuda"
        if self.gpu and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_name, self.batch = model, batch
        self.trace, self.trace_path = trace, trace_path
        self.hw_name = hardware
        self.hw = load_hardware(hardware)
        self.warmup = warmup
        self.check = check
        self._uncap()
        self.net, (inputs, target), self.loss_fn = build_model(model, batch, self.device)
        self.net.train()
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=0.01, momentum=0.9)
        self.args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        self.target = target
        self.inputs = (inputs, target)
        self.flat_inputs = [t for t in tree_flatten(self.inputs)[0]
                            if isinstance(t, torch.Tensor)]
        for _ in range(warmup):
            self.step()
        self._sync()
        self.snapshot = [t.detach().to("cpu", copy=True) for t in self._state()]
        self.rng = (torch.get_rng_state(),
                    torch.cuda.get_rng_state(self.device) if self.gpu else None)
        if opmap is None:
            self.say(f"{model} (batch {batch}): mapping the trace's ops")
            opmap = map_ops(self.step, self.net, self.opt, self.inputs, self.loss_fn,
                            self.device, trace)
            self.restore()
        self.opmap: OpMap = opmap
        self.say(f"  {opmap.n_calls} aten calls, {len(trace.ops)} ops, "
                 f"{opmap.diagnostics['tensors_located']} tensors located")
        self.reference: dict[str, Any] | None = None
        self.noise: dict[str, Any] | None = None
        if check:
            self.reference = self.gradients(None)
            again = self.gradients(None)
            self.noise = compare_gradients(self.reference, again)

    # ------------------------------------------------------------ training

    def step(self, capture: Callable[[torch.Tensor | None], None] | None = None) -> None:
        """The recorder's training step (vsim.record.recorder.record_model). `capture` is
        called with the loss after the forward pass (a plan may free the loss in backward)
        and with None after the backward pass."""
        loss = self.loss_fn(self.net(*self.args), self.target)
        if capture is not None:
            capture(loss)
        loss.backward()
        if capture is not None:
            capture(None)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def _state(self) -> list[torch.Tensor]:
        out = list(self.params) + [b for b in self.net.buffers()]
        for p in self.params:
            st = self.opt.state.get(p, {})
            out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        return out

    def restore(self) -> None:
        """Weights, buffers, optimizer state and random generators back to the snapshot; no
        gradients (an iteration stopped by an exception may have left some)."""
        self.opt.zero_grad(set_to_none=True)
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
                if ex is not None:
                    ex.run(lambda: self.step(capture))
                else:
                    self.step(capture)
                self._sync()
        finally:
            self.restore()
        return got

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

    def _pool(self, plan: Plan) -> PinnedPool | None:
        """The process's pinned pool, grown when a plan needs more (cudaHostAlloc costs about
        0.65 s per GiB on the H100 machine: paid once per process, outside the timing)."""
        if plan.pinned_pool_bytes <= 0:
            return None
        pin = self.gpu and plan.pinned
        pool = _POOLS.get(pin)
        if pool is None or pool.size < plan.pinned_pool_bytes:
            _POOLS.pop(pin, None)
            pool = None
            gc.collect()
            pool = _POOLS[pin] = PinnedPool(plan.pinned_pool_bytes, pin=pin)
        return pool

    # ------------------------------------------------------------ one case

    def run(self, policy: str, memory_bytes: int | None = None, iters: int = 10,
            warmup: int | None = None, instrument: bool = False, strict: bool = True,
            command: str | None = None, profile_last: bool = False) -> dict[str, Any]:
        """Measure one case: the plan of `policy` for this trace at `memory_bytes` (None: the
        profile's capacity, no cap) carried out for `warmup` + `iters` iterations.
        `instrument`: run the op tracker even for a plan without actions (to see its cost).
        `strict`: see Executor (a recomputation that cannot rebuild a tensor's final value
        raises ExecutorError; otherwise it runs as planned and the check shows the damage).
        `profile_last`: profile the last iteration's kernels (CUPTI; that iteration's time and
        peaks are left out of the medians) into the result's `profile_last`."""
        warmup = self.warmup if warmup is None else warmup
        if iters < 1:
            raise ConfigError(f"--iters must be at least 1, got {iters}")
        pol = make_policy(policy)
        capacity = self.hw.capacity_bytes if memory_bytes is None else memory_bytes
        plan = pol.plan(self.trace, self.hw, capacity)
        global _ENGINES_SQUEEZED
        if _ENGINES_SQUEEZED:
            raise ConfigError(f"{policy}: an earlier case in this process ran convolutions "
                              "squeezed to workspace-free engines, which PyTorch keeps using; "
                              "run each such case alone (--only ID)")
        if any(isinstance(a, Retime) and a.workspace_bytes == 0 for a in plan.actions) \
                and self.gpu:
            _ENGINES_SQUEEZED = True
        notes = list(plan.notes)
        self._clean()
        fraction = self._cap(memory_bytes)
        held = torch.cuda.memory_allocated(self.device) if self.gpu else None
        ex = None
        if plan.actions or instrument:
            ex = Executor(plan, self.opmap, self.trace, self.device, self.flat_inputs,
                          self._pool(plan), strict=strict, memory_fraction=fraction)
        times: list[float] = []
        peaks_a: list[int] = []
        peaks_r: list[int] = []
        stats: IterationStats | None = None
        oom = None
        i = 0
        profiled: dict[str, Any] | None = None
        last = warmup + iters if profile_last and self.gpu else None
        counters: dict[str, int] = {}  # the allocator's, after the warm-up
        churn: dict[str, int] = {}     # their growth over the measured iterations
        try:
            for i in range(warmup + iters + (1 if last is not None else 0)):
                self._sync()
                if self.gpu:
                    torch.cuda.reset_peak_memory_stats(self.device)
                if i == warmup and self.gpu:
                    counters = _allocator_counters(self.device)
                prof = _kernel_profiler() if i == last else None
                t0 = time.perf_counter()
                if ex is not None:
                    stats = ex.run(self.step)
                else:
                    self.step()
                self._sync()
                dt = (time.perf_counter() - t0) * 1e6
                if prof is not None:
                    prof.stop()
                    profiled = _kernel_summary(prof, dt)
                    continue
                if i >= warmup:
                    times.append(dt)
                    if self.gpu:
                        peaks_a.append(torch.cuda.max_memory_allocated(self.device))
                        peaks_r.append(torch.cuda.max_memory_reserved(self.device))
                        churn = {k: v - counters.get(k, 0)
                                 for k, v in _allocator_counters(self.device).items()}
        except torch.OutOfMemoryError as exc:
            oom = {"iteration": i, "in_warmup": i < warmup,
                   "message": str(exc).strip().splitlines()[0][:1000]}
            oom.update(ex.where() if ex is not None else {})
            del exc
        self._clean()
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
                                          "max_rel_grad_diff")}
        self._uncap()
        fits = oom is None
        notes += self._notes(plan, ex, stats)
        if command is None:
            command = measure_command(self.model_name, self.batch, policy, memory_bytes,
                                      self.hw_name, self.trace_path, None)
        host_peak = stats.host_peak_bytes if stats is not None else 0
        if plan.pinned_pool_bytes and ex is not None and ex.pool is not None:
            host_peak = max(host_peak, plan.pinned_pool_bytes)
        result: dict[str, Any] = {
            "format": FORMAT, "version": VERSION,
            "model": self.model_name, "batch_size": self.batch, "policy": pol.spec(),
            "hardware": self.hw_name, "trace": self.trace_path,
            "memory_bytes": memory_bytes, "capacity_bytes": capacity,
            "fits": fits, "oom": oom,
            "iteration_time_us": round(statistics.median(times), 3) if fits else None,
            "iteration_times_us": [round(t, 3) for t in times],
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
            "plan": _plan_summary(plan),
            "executed": _executed(stats, ex),
            "op_map": dict(self.opmap.diagnostics),
            "check": check,
            "notes": notes,
            "provenance": provenance(self.device, command),
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

    def _notes(self, plan: Plan, ex: Executor | None, stats: IterationStats | None) -> list[str]:
        notes: list[str] = []
        retimes = [a for a in plan.actions if isinstance(a, Retime)]
        free = [a.op for a in retimes if a.workspace_bytes == 0]
        other = [a.op for a in retimes if a.workspace_bytes != 0]
        if free and (ex is None or not ex.gpu):
            notes.append(f"not executed: {len(free)} workspace-free Retime action(s) (no cuDNN "
                         "engines to choose here)")
        elif free and ex is not None:
            notes.append(
                f"{len(free)} workspace-free convolution(s) run squeezed in the first "
                f"iteration (PyTorch then caches the engine that fits): {len(ex.squeezed)} "
                f"allocated no workspace, {len(ex.squeeze_missed)} still did (ops "
                f"{', '.join(map(str, ex.squeeze_missed[:8]))})")
        if other:
            notes.append(f"not executed: {len(other)} Retime action(s) that keep a workspace "
                         f"(ops {', '.join(map(str, other[:8]))}): PyTorch offers no per-call "
                         "choice of cuDNN engine")
        if ex is None:
            return notes
        if ex.unlocated:
            names = {t.id: t.name for t in self.trace.tensors}
            notes.append("not found at run time, their actions skipped: tensors "
                         + ", ".join(f"{t} ({names.get(t, '?')})" for t in ex.unlocated[:8]))
        if stats is not None and stats.inplace_rerun:
            notes.append(f"{stats.inplace_rerun} in-place call(s) outside the planned chains "
                         "re-run with the recomputation (ops that updated a dropped tensor "
                         "after its producer: the trace lists in-place updates as reads)")
        if stats is not None and stats.inplace_missed:
            notes.append(f"WRONG VALUES: {stats.inplace_missed} in-place call(s) that updated "
                         "dropped tensors after their producer could not be re-run (their "
                         "inputs were gone): the plan rebuilds those tensors as its producer's "
                         "output alone (run with strict off; see check)")
        if stats is not None and stats.skipped:
            notes.append("executor: " + ", ".join(f"{k} x{v}" for k, v in
                                                   sorted(stats.skipped.items())))
        offloads = any(isinstance(a, Offload) for a in plan.actions)
        if offloads:
            notes.append("an offloaded tensor's device memory is freed at its release op in "
                         "launch order (memory_allocated drops then); the caching allocator "
                         "hands the block out again only after the D2H copy (record_stream)")
            if plan.pinned_pool_bytes:
                notes.append(f"one pinned host pool of {format_size(plan.pinned_pool_bytes)} "
                             "allocated before the timed iterations, handed out in slots")
            elif plan.pinned:
                notes.append("per-copy pinned host buffers allocated at first use (warm-up) "
                             "and reused; pinned_host_peak_bytes is the most host copies held "
                             "at once")
            if not plan.pinned:
                notes.append("pageable host buffers: each copy blocks the host")
            if plan.pinned_lazy:
                notes.append("pinned_lazy not reproduced: PyTorch caches pinned buffers, so "
                             "cudaMallocHost is paid in warm-up only")
            if ex.pool_overflow:
                notes.append(f"pinned pool too small {ex.pool_overflow} time(s): a separate "
                             "pinned buffer was used")
        if plan.wait_for_memory:
            notes.append("wait_for_memory: PyTorch's allocator waits for copies in flight by "
                         "itself (a failed allocation synchronises the events of freed blocks "
                         "and retries)")
        notes.append("instrumented: a Python dispatch mode sees every aten call to find the "
                     "plan's op boundaries (a few microseconds of host time per call)")
        return notes

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
                    loss = self.loss_fn(self.net(*self.args), self.target)
                loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        elif kind == "checkpoint_sequential":
            from torch.utils.checkpoint import checkpoint

            segs = _segments(_flat_sequential(self.net), segments)

            def run_segment(seg: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
                return checkpoint(seg, x, use_reentrant=False)

            def step() -> None:
                x = self.args[0]
                for seg in segs[:-1]:
                    x = run_segment(seg, x)
                loss = self.loss_fn(segs[-1](x), self.target)
                loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
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
                                                      f"(builtin {label})")}


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


def _plan_summary(plan: Plan) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for a in plan.actions:
        counts[type(a).__name__] = counts.get(type(a).__name__, 0) + 1
    digest = hashlib.sha256(repr(plan.actions).encode()).hexdigest()[:16]
    return {"actions": counts, "digest": digest, "pinned_pool_bytes": plan.pinned_pool_bytes,
            "pinned": plan.pinned, "pinned_lazy": plan.pinned_lazy,
            "wait_for_memory": plan.wait_for_memory}


CHURN_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                  "num_sync_all_streams")


def _allocator_counters(device: torch.device) -> dict[str, int]:
    """The caching allocator's cumulative counters that show churn: allocation retries (a
    failed cudaMalloc that freed the cache and tried again), cudaMalloc and cudaFree calls (or
    page maps and unmaps with expandable segments), device-wide synchronisations."""
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in CHURN_COUNTERS}


def _kernel_profiler() -> Any:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    return prof


def _kernel_summary(prof: Any, wall_us: float) -> dict[str, Any]:
    """An extra, profiled iteration: its wall time, the GPU's busy time (the union of kernel and
    copy intervals on all streams) and the kernels by name (calls, summed time)."""
    spans: list[tuple[float, float]] = []
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, dur = e.time_range.start, e.time_range.end - e.time_range.start
        spans.append((start, start + dur))
        by_name[e.name][0] += 1
        by_name[e.name][1] += dur
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    return {"wall_us": round(wall_us, 3), "gpu_busy_us": round(busy, 3),
            "kernel_us": round(sum(v[1] for v in by_name.values()), 3),
            "kernels": [{"name": n[:200], "calls": c, "us": round(us, 3)} for n, (c, us) in top]}


# A case whose plan ran convolutions squeezed changed the cuDNN engines PyTorch caches for the
# rest of the process (vsim.runtime.executor): later cases would run with them.
_ENGINES_SQUEEZED = False


def _executed(stats: IterationStats | None, ex: Executor | None) -> dict[str, Any] | None:
    if stats is None or ex is None:
        return None
    return {"offloads": stats.offloads, "prefetches": stats.prefetches, "drops": stats.drops,
            "releases": stats.releases, "recomputed_calls": stats.recomputed_calls,
            "inplace_rerun": stats.inplace_rerun, "inplace_missed": stats.inplace_missed,
            "syncs": stats.syncs, "skipped": dict(stats.skipped),
            "executor_host_us": round(stats.host_us, 1),
            "unlocated_tensors": ex.unlocated, "host_buffers_allocated_bytes": ex.host_allocated,
            "iterations": ex.iterations, "workspace_free_squeezed": ex.squeezed,
            "workspace_free_missed": ex.squeeze_missed}


def measure(model: str, batch: int, policy: str, *, memory_bytes: int | None = None,
            hardware: str = "h100-sxm", trace_path: str | None = None, device: str = "cuda",
            warmup: int = 3, iters: int = 10, check: bool = True, strict: bool = True,
            progress: Progress | None = None, command: str | None = None) -> dict[str, Any]:
    """Measure one case (see the module docstring). Without `trace_path` the trace is recorded
    first with the recorder (vsim.record.recorder.record_model) on `device`."""
    say = progress or _quiet
    if trace_path is not None:
        trace = load_trace(trace_path)
    else:
        from ..record.recorder import record_model

        say(f"recording {model} (batch {batch}) on {device} first")
        trace = record_model(model, batch, device=device, progress=say)
    session = Session(model, batch, trace, device=device, hardware=hardware,
                      trace_path=trace_path, warmup=warmup, check=check, progress=say)
    result = session.run(policy, memory_bytes, iters=iters, strict=strict, command=command)
    if trace_path is None:
        result["notes"].append("trace recorded by this run (not saved)")
    return result


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Atomically (a temporary file renamed), with a trailing newline."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------- the suite

def map_in_subprocesses(groups: list[tuple[str, int, str]], out_dir: Path, device: str,
                        hardware: str, warmup: int, say: Progress) -> dict[tuple[str, int, str],
                                                                          Path]:
    """Make each group's op map in a process of its own, all at once: the map needs the
    profiler with CUDA activity, and a process that has used it may launch kernels more slowly
    afterwards (Kineto leaves CUPTI initialised unless TEARDOWN_CUPTI=1; pytorch#144455), which
    would slow every host-bound case measured after it."""
    import subprocess

    procs = []
    for model, batch, trace_path in groups:
        path = out_dir / f"map-{model}-b{batch}.json"
        cmd = [sys.executable, "-m", "vsim.runtime.measure", "--map", model, str(batch),
               trace_path, str(path), "--device", device, "--hw", hardware,
               "--warmup", str(warmup)]
        procs.append(((model, batch, trace_path), path,
                      subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True)))
    got = {}
    for key, path, proc in procs:
        _, err = proc.communicate()
        if proc.returncode == 0 and path.exists():
            got[key] = path
        else:
            say(f"{key[0]} (batch {key[1]}): mapping failed: {err.strip()[-400:]}")
    return got


def run_suite(cases: list[dict[str, Any]], out_dir: str | Path, *, device: str = "cuda",
              hardware: str = "h100-sxm", iters: int = 10, warmup: int = 3,
              progress: Progress | None = None, deadline_s: float | None = None,
              separate_maps: bool = False, profile_last: bool = False) -> list[str]:
    """Measure `cases` ({id, model, batch, trace, policy | builtin, memory, warmup}) in this
    process, one Session per (model, batch, trace), in the order first seen; write
    OUT_DIR/ID.json as each ends. A case that raises is reported (ID.error.txt) and the suite
    goes on. No case starts after `deadline_s` seconds. `separate_maps`: op maps made in
    subprocesses first (map_in_subprocesses). Returns the ids that failed or were not run."""
    from ..units import parse_size

    start = time.perf_counter()
    say = progress or _quiet
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, int, str | None], list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault((c["model"], int(c["batch"]), c.get("trace")), []).append(c)
    maps: dict[Any, Path] = {}
    if separate_maps:
        keys = [k for k in groups if k[2]]
        maps = map_in_subprocesses(keys, out, device, hardware, warmup, say)  # type: ignore[arg-type]
        say(f"op maps made in {time.perf_counter() - start:.1f} s")
    failed: list[str] = []
    for (model, batch, trace_path), group in groups.items():
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            failed += [c["id"] for c in group]
            say(f"{model} (batch {batch}): not run (deadline)")
            continue
        t0 = time.perf_counter()
        try:
            trace = load_trace(trace_path) if trace_path else None
            if trace is None:
                from ..record.recorder import record_model
                trace = record_model(model, batch, device=device, progress=say)
            key = (model, batch, trace_path)
            opmap = (OpMap.from_json(json.loads(maps[key].read_text())) if key in maps
                     else None)
            session = Session(model, batch, trace, device=device, hardware=hardware,
                              trace_path=trace_path, warmup=warmup, progress=say, opmap=opmap)
        except Exception as exc:  # noqa: BLE001 - a suite reports and goes on
            for c in group:
                failed.append(c["id"])
                (out / f"{c['id']}.error.txt").write_text(f"session: {exc!r}\n")
            say(f"{model} (batch {batch}): session failed: {exc!r}")
            continue
        say(f"{model} (batch {batch}): session ready in {time.perf_counter() - t0:.1f} s")
        for c in group:
            if deadline_s is not None and time.perf_counter() - start > deadline_s:
                failed.append(c["id"])
                say(f"  {c['id']}: not run (deadline)")
                continue
            t1 = time.perf_counter()
            memory = parse_size(c["memory"], c["id"]) if c.get("memory") else None
            case_warmup = int(c.get("warmup", warmup))
            try:
                if c.get("builtin"):
                    result = session.builtin(c["builtin"], memory, iters=iters,
                                             warmup=case_warmup)
                else:
                    output = f"validation/measured/{c['id']}.json"
                    result = session.run(c["policy"], memory, iters=iters, warmup=case_warmup,
                                         strict=c.get("strict", True),
                                         instrument=c.get("instrument", False),
                                         command=measure_command(model, batch, c["policy"],
                                                                 memory, hardware, trace_path,
                                                                 output),
                                         profile_last=profile_last)
                result["id"] = c["id"]
                if key in maps:
                    result["notes"].append("op map made in a separate process (no profiler "
                                           "in the measuring one)")
                write_json(result, out / f"{c['id']}.json")
            except Exception as exc:  # noqa: BLE001
                failed.append(c["id"])
                (out / f"{c['id']}.error.txt").write_text(f"{exc!r}\n")
                say(f"  {c['id']}: FAILED {exc!r}")
                session._clean()
                session._uncap()
                continue
            say(f"  {c['id']}: {summary_line(result)} [{time.perf_counter() - t1:.1f} s]")
        del session
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return failed


def summary_line(result: dict[str, Any]) -> str:
    """One line: time, peak, bytes moved, the check."""
    if not result["fits"]:
        oom = result.get("oom") or {}
        return f"out of memory at op {oom.get('op')} ({oom.get('name')})"
    out = f"{result['iteration_time_us'] / 1e3:.2f} ms"
    if result.get("peak_allocated_bytes"):
        out += f", peak {result['peak_allocated_bytes'] / 2**30:.3f} GiB"
    if result.get("d2h_bytes") or result.get("h2d_bytes"):
        out += (f", d2h {result['d2h_bytes'] / 2**30:.2f} GiB h2d "
                f"{result['h2d_bytes'] / 2**30:.2f} GiB")
    chk = result.get("check") or {}
    if "bitwise_equal" in chk:
        out += (", gradients bitwise equal" if chk["bitwise_equal"] else
                f", gradients differ (max rel {chk['max_rel_grad_diff']:.2e})")
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m vsim.runtime.measure SUITE.yaml OUT_DIR [--device cuda] [--only ID,...]
    [--skip ID,...] [--deadline S] [--separate-maps]; or --map MODEL BATCH TRACE OUT.json"""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(prog="python -m vsim.runtime.measure")
    parser.add_argument("suite", nargs="?")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hw", default="h100-sxm")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", help="comma-separated case ids or models")
    parser.add_argument("--skip", help="comma-separated case ids")
    parser.add_argument("--deadline", type=float, help="start no case after this many seconds")
    parser.add_argument("--separate-maps", action="store_true",
                        help="make the op maps in subprocesses first")
    parser.add_argument("--profile-last", action="store_true",
                        help="profile one extra iteration's kernels per case (profile_last)")
    parser.add_argument("--map", nargs=4, metavar=("MODEL", "BATCH", "TRACE", "OUT"),
                        help="only write the op map of MODEL at BATCH for TRACE")
    args = parser.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.map:
        model, batch, trace_path, path = args.map
        session = Session(model, int(batch), load_trace(trace_path), device=args.device,
                          hardware=args.hw, trace_path=trace_path, warmup=args.warmup,
                          check=False, progress=say)
        write_json(session.opmap.to_json(), path)
        return 0
    if not args.suite or not args.out_dir:
        parser.error("give SUITE and OUT_DIR, or --map")
    doc = yaml.safe_load(Path(args.suite).read_text())
    cases = doc["cases"] if isinstance(doc, dict) else doc
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c["id"] in keep or c["model"] in keep]
    if args.skip:
        drop = set(args.skip.split(","))
        cases = [c for c in cases if c["id"] not in drop]
    say(f"{len(cases)} cases on {args.device}; torch {torch.__version__}, pid {os.getpid()}")
    failed = run_suite(cases, args.out_dir, device=args.device, hardware=args.hw,
                       iters=args.iters, warmup=args.warmup, progress=say,
                       deadline_s=args.deadline, separate_maps=args.separate_maps,
                       profile_last=args.profile_last)
    say(f"done: {len(cases) - len(failed)} measured, {len(failed)} failed or not run {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
