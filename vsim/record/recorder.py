"""Record one steady-state training iteration of a PyTorch model into a vsim trace.

    with Recorder(model, optimizer, inputs=(x, y)) as rec:
        while not rec.done:
            train_step()          # the user's own forward, backward, optimizer step
            rec.step()
    trace = rec.trace

Like torch.profiler's schedule, the recorder decides what each iteration is for: `warmup`
iterations untouched; `iters` iterations MEASURED without any profiler or hook (median time;
peak allocated and reserved memory, each iteration after reset_peak_memory_stats); one STRUCTURE
iteration under the profiler with hooks; `timing_iters` + 1 TIMING iterations under the profiler
alone, the first discarded. vsim.record.assemble joins them (see its docstring for why the passes
are separate). `record_model` does all this for a model of the zoo.

Needs eager mode: the structure and timing passes must issue the same sequence of top-level ops
(torch.compile'd or CUDA-graph'd steps are not supported; the join reports how many ops did not
match in meta.join).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError, TraceError
from ..trace.importers import parse_chrome, snapshot_blocks
from ..trace.schema import Measured, Trace
from . import RECORDER_VERSION, selfcheck
from .assemble import (
    BACKWARD,
    GRAD,
    ITERATION,
    MODULE,
    SAVE,
    UNPACK,
    Storage,
    StructureLog,
    assemble,
)
from .dispatchlog import DispatchLog, ProfilerRange, marker, storage_bytes, tensor_addr
from .hf import default_seq, is_hf
from .hostprobe import probe_host, speed_probe_us
from .module_types import module_type
from .step import TrainingStep, check_choice, training_step

Progress = Callable[[str], None]

def _device_of(model: nn.Module, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def hardware_guess(device_name: str) -> str | None:
    """The hardware/ profile a device name suggests: 'h100-sxm' for an H100, 'h200' for an H200."""
    name = device_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name and "PCIE" not in name:
        return "h100-sxm"
    return None


def optimizer_name(optimizer: torch.optim.Optimizer | None) -> str | None:
    """meta.optimizer: sgd, adam, adamw (vsim.record.step's names), else the class name."""
    if optimizer is None:
        return None
    name = type(optimizer).__name__
    return {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}.get(name, name)


def optimizer_label(optimizer: torch.optim.Optimizer | None) -> str | None:
    """meta.optimizer_config: the class and its non-default hyperparameters."""
    if optimizer is None:
        return None
    keys = ("lr", "momentum", "weight_decay", "betas", "eps", "foreach", "fused")
    args = ", ".join(f"{k}={optimizer.defaults[k]}" for k in keys
                     if k in optimizer.defaults and optimizer.defaults[k] not in (None, 0, False))
    return f"{type(optimizer).__name__}({args})"


class Recorder:
    """Context manager that records the user's own training step (see the module docstring).

    `inputs`: tensors resident across iterations (the batch), named as inputs in the trace.
    `loss_fn`: an nn.Module computing the loss, to name its ops 'loss'. `fit_gaps`: reconcile the
    timing pass's idle time with the measured iteration time (vsim.record.assemble.fit_idle).
    `trace` is available once `done`; leaving the block early raises ConfigError.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 inputs: Any = (), loss_fn: Any = None, device: Any = None, warmup: int = 3,
                 iters: int = 10, timing_iters: int = 3, fit_gaps: bool = True,
                 meta: dict[str, Any] | None = None, progress: Progress | None = None) -> None:
        if warmup < 1 or iters < 1 or timing_iters < 1:
            raise ConfigError("warmup, iters and timing_iters must each be at least 1 "
                              "(a first iteration allocates lazily and is never typical)")
        self.model = model
        self.optimizer = optimizer
        self.inputs = inputs
        self.loss_fn = loss_fn
        self.device = _device_of(model, device)
        if self.device.type not in ("cuda", "cpu"):
            raise ConfigError(f"recording on {self.device.type!r} is not supported (cuda or cpu)")
        self.gpu = self.device.type == "cuda"
        self.fit_gaps = fit_gaps
        self.extra_meta = dict(meta or {})
        self.progress: Progress = progress or (lambda _msg: None)
        self.schedule = (["warmup"] * warmup + ["measure"] * iters + ["structure"]
                         + ["timing"] * (timing_iters + 1))
        self.pos = -1
        self.times_us: list[float] = []
        self.speed_us: list[float] = []  # the core's speed of the moment, before each
        self.peaks_allocated: list[int] = []
        self.peaks_reserved: list[int] = []
        self.log = StructureLog(device_type=1 if self.gpu else 0)
        self.structure_capture: Any = None
        self.timing_capture: Any = None
        self._trace: Trace | None = None
        self._t0 = 0.0
        self._profiler: Any = None
        self._range: Any = None
        self._undo: list[Callable[[], None]] = []
        self._history_on = False
        self.host_probe: dict[str, Any] | None = None

    # -- public

    @property
    def done(self) -> bool:
        return self._trace is not None

    @property
    def remaining(self) -> int:
        return max(0, len(self.schedule) - self.pos)

    @property
    def trace(self) -> Trace:
        if self._trace is None:
            raise ConfigError(f"the recording is not finished: {self.remaining} more step() calls")
        return self._trace

    def __enter__(self) -> Recorder:
        # before any profiling: a process that has profiled launches more slowly (CUPTI)
        self.host_probe = probe_host(self.device)
        self.pos = 0
        self.progress(f"warm-up: {self.schedule.count('warmup')} iterations")
        self._begin(self.schedule[0])
        return self

    def step(self) -> None:
        """Call once after each training iteration."""
        if self.done or self.pos < 0:
            return
        self._end(self.schedule[self.pos])
        self.pos += 1
        if self.pos < len(self.schedule):
            self._begin(self.schedule[self.pos])
        else:
            self._finish()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.done:
            self.cleanup()
            if exc_type is None:
                raise ConfigError(f"the recorder block ended {self.remaining} step() calls "
                                  "early: loop `while not rec.done`")

    # -- phases

    def _sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def _begin(self, phase: str) -> None:
        prev = self.schedule[self.pos - 1] if self.pos > 0 else None
        if phase == "measure":
            self._sync()
            if self.gpu:
                torch.cuda.reset_peak_memory_stats(self.device)
            self.speed_us.append(speed_probe_us())
            self._t0 = time.perf_counter()
        elif phase == "structure":
            self.begin_structure()
        elif phase == "timing":
            if prev != "timing":
                self._sync()
                gc.collect()
                # GPU: kernels only (CUPTI activity), no CPU op recording, whose cost per op
                # would show as GPU idle time; CPU: the ops are what is timed
                activity = torch.profiler.ProfilerActivity
                self._profiler = torch.profiler.profile(
                    activities=[activity.CUDA] if self.gpu else [activity.CPU])
                self._profiler.start()
            self._sync()
            if self.gpu:
                torch.cuda._sleep(1)  # the delimiter kernel: this iteration starts at its end
            else:
                self._range = ProfilerRange(ITERATION)
                self._range.__enter__()

    def _end(self, phase: str) -> None:
        nxt = self.schedule[self.pos + 1] if self.pos + 1 < len(self.schedule) else None
        if phase == "measure":
            self._sync()
            self.times_us.append((time.perf_counter() - self._t0) * 1e6)
            if self.gpu:
                self.peaks_allocated.append(torch.cuda.max_memory_allocated(self.device))
                self.peaks_reserved.append(torch.cuda.max_memory_reserved(self.device))
            if nxt != "measure":
                t = sorted(self.times_us)
                self.progress(f"measured: median {statistics.median(t) / 1e3:.3f} ms over "
                              f"{len(t)} iterations (min {t[0] / 1e3:.3f}, max {t[-1] / 1e3:.3f})"
                              + (f", peak allocated {self._peak(self.peaks_allocated) / 2**20:.1f}"
                                 f" MiB (max {max(self.peaks_allocated) / 2**20:.1f}), reserved "
                                 f"{self._peak(self.peaks_reserved) / 2**20:.1f} MiB"
                                 if self.gpu else ""))
        elif phase == "structure":
            self.end_structure()
        elif phase == "timing":
            if self._range is not None:
                self._range.__exit__(None, None, None)
                self._range = None
            self._sync()
            if nxt != "timing":
                self._profiler.stop()
                self.timing_capture = self._export(self._profiler, "timing")
                self._profiler = None
                cap = self.timing_capture
                self.progress(f"timing pass: {self.schedule.count('timing')} iterations "
                              "profiled, " + (f"{len(cap.kernels)} kernels" if self.gpu else
                                              f"{len(cap.ops)} top-level ops"))

    @staticmethod
    def _peak(values: list[int]) -> int:
        """The median of per-iteration peaks (steady state; the max is kept in meta)."""
        return int(statistics.median_low(values)) if values else 0

    # -- structure pass

    def _known_storages(self) -> list[Storage]:
        found: list[Storage] = []
        names = {}
        for name, p in self.model.named_parameters():
            names[id(p)] = name
            a = tensor_addr(p)
            if a is not None:
                found.append(Storage(a, storage_bytes(p), "weight", name))
            if p.grad is not None and tensor_addr(p.grad) is not None:
                found.append(Storage(tensor_addr(p.grad), storage_bytes(p.grad), "gradient",  # type: ignore[arg-type]
                                     f"grad {name}"))
        for name, b in self.model.named_buffers():
            a = tensor_addr(b)
            if a is not None:
                found.append(Storage(a, storage_bytes(b), "weight", f"buffer {name}"))
        found.extend(self._optimizer_storages(names))
        flat, _ = tree_flatten(self.inputs)
        for i, x in enumerate(t for t in flat if isinstance(t, torch.Tensor)):
            a = tensor_addr(x)
            if a is not None:
                found.append(Storage(a, storage_bytes(x), "input", f"input {i}"))
        return [s for s in found if s.size > 0]

    def _optimizer_storages(self, names: dict[int, str] | None = None) -> list[Storage]:
        if self.optimizer is None:
            return []
        if names is None:
            names = {id(p): n for n, p in self.model.named_parameters()}
        found = []
        for p, state in self.optimizer.state.items():
            if not isinstance(state, dict):
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type == self.device.type:
                    a = tensor_addr(value)
                    if a is not None:
                        found.append(Storage(a, storage_bytes(value), "optimizer_state",
                                             f"{names.get(id(p), 'param')}.{key}"))
        return found

    def begin_structure(self) -> None:
        """Start the structure pass's instrumentation (profiler, hooks, dispatch log); the
        runtime's op map (vsim.record.opmap) drives it around one step of its own."""
        self._sync()
        gc.collect()
        log = self.log
        log.known_start = self._known_storages()
        if self.gpu:
            snapshot = torch.cuda.memory_snapshot()
            dev = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            log.resident_blocks = [(addr, size) for addr, size, state
                                   in snapshot_blocks(snapshot, dev)
                                   if state == "active_allocated"]
            log.allocated_at_start = torch.cuda.memory_allocated(self.device)
            try:
                torch.cuda.memory._record_memory_history("all", context=None, stacks="python",
                                                         max_entries=2_000_000)
                self._history_on = True
            except Exception as exc:  # noqa: BLE001 - optional: the trace is valid without it
                self.progress(f"allocator history unavailable ({exc}); mem_events left empty")
        activity = torch.profiler.ProfilerActivity
        self._profiler = torch.profiler.profile(
            activities=[activity.CPU, activity.CUDA] if self.gpu else [activity.CPU],
            profile_memory=True)
        self._profiler.start()
        # module ranges
        modules = [(q, m) for q, m in self.model.named_modules() if q]
        if isinstance(self.loss_fn, nn.Module):
            modules += [("loss" + (f".{q}" if q else ""), m)
                        for q, m in self.loss_fn.named_modules()]
        stack: list[Any] = []

        def pre(qual: str, _m: nn.Module, _args: Any) -> None:
            r = ProfilerRange(f"{MODULE}{qual}")
            r.__enter__()
            stack.append(r)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        for qual, m in modules:
            log.modules[qual] = (module_type(m), not any(True for _ in m.children()))
            h1 = m.register_forward_pre_hook(partial(pre, qual))
            h2 = m.register_forward_hook(post, always_call=True)
            self._undo += [h1.remove, h2.remove]
        # gradients: which AccumulateGrad wrote which parameter's grad
        owner = {}
        for name, p in self.model.named_parameters():
            owner[id(p)] = (name, name.rsplit(".", 1)[0] if "." in name else "")
        for p in self.model.parameters():
            if p.requires_grad:
                def on_grad(param: torch.Tensor) -> None:
                    if param.grad is None:
                        return
                    a = tensor_addr(param.grad)
                    if a is None:
                        return
                    name, module = owner.get(id(param), ("param", ""))
                    log.grads.append((name, module, a))
                    marker(f"{GRAD}{len(log.grads) - 1}")
                h = p.register_post_accumulate_grad_hook(on_grad)
                self._undo.append(h.remove)
        # which backward call: a range around torch.autograd.backward
        original = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            with ProfilerRange(BACKWARD):
                return original(*args, **kwargs)

        torch.autograd.backward = backward  # type: ignore[assignment]
        self._undo.append(lambda: setattr(torch.autograd, "backward", original))

        # saved tensors
        def pack(t: torch.Tensor) -> Any:
            k = len(log.saved)
            a = tensor_addr(t) if t.device.type == self.device.type else None
            log.saved.append(a or 0)
            marker(f"{SAVE}{k}")
            return (k, t)

        def unpack(packed: Any) -> torch.Tensor:
            k, t = packed
            marker(f"{UNPACK}{k}")
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))
        mode = DispatchLog(log, self.device.type)
        mode.__enter__()
        self._undo.append(lambda: mode.__exit__(None, None, None))
        rng = ProfilerRange(ITERATION)
        rng.__enter__()
        self._undo.append(lambda: rng.__exit__(None, None, None))

    def _teardown(self, collect: bool) -> Any:
        """Undo the structure pass's instrumentation, innermost first; returns the profiler."""
        profiler, self._profiler = self._profiler, None
        history = self._history_on
        self._history_on = False
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:  # noqa: BLE001 - must not leave hooks behind
                if collect:
                    raise
        self._undo = []
        if self._range is not None:  # a timing iteration's range, when aborting
            try:
                self._range.__exit__(None, None, None)
            except Exception:  # noqa: BLE001
                pass
            self._range = None
        self._sync()
        if profiler is not None:
            profiler.stop()
        if history:
            if collect:
                self._collect_history()
            torch.cuda.memory._record_memory_history(None)
        return profiler

    def cleanup(self) -> None:
        if self._profiler is not None or self._undo or self._history_on:
            self._teardown(collect=False)

    def end_structure(self) -> None:
        """Stop the structure pass and keep its capture in `structure_capture`."""
        profiler = self._teardown(collect=True)
        self.log.known_end = self._optimizer_storages()
        self.structure_capture = self._export(profiler, "structure")
        self.progress(f"structure pass: {len(self.structure_capture.ops)} top-level ops, "
                      f"{len(self.log.dispatch)} aten calls, {len(self.log.saved)} saved tensors")

    def _collect_history(self) -> None:
        try:
            snap = torch.cuda.memory._snapshot()
            dev = self.device.index if self.device.index is not None else \
                torch.cuda.current_device()
            entries = snap.get("device_traces", [[]])[dev]
            self.log.history = [{k: v for k, v in e.items() if k != "frames"} for e in entries]
        except Exception as exc:  # noqa: BLE001 - optional: the trace is valid without it
            self.progress(f"allocator history unreadable ({exc}); mem_events left empty")

    def _export(self, profiler: Any, label: str) -> Any:
        fd, path = tempfile.mkstemp(prefix=f"vsim-{label}-", suffix=".json")
        os.close(fd)
        try:
            profiler.export_chrome_trace(path)
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
        finally:
            os.unlink(path)
        return parse_chrome(doc, f"<{label} pass>")

    # -- result

    def _finish(self) -> None:
        measured = None
        if self.times_us:
            measured = Measured(iteration_time_us=round(statistics.median(self.times_us), 3),
                                peak_allocated_bytes=self._peak(self.peaks_allocated),
                                peak_reserved_bytes=self._peak(self.peaks_reserved))
        meta = self._meta()
        try:
            trace = assemble(self.structure_capture, self.log, self.timing_capture,
                             gpu=self.gpu, measured=measured, meta=meta, fit_gaps=self.fit_gaps)
        except TraceError as exc:
            raise TraceError(f"cannot assemble the recording: {exc.message}") from None
        if not self.gpu and measured is not None:
            # CPU: no allocator statistics; the peak comes from the profiler's allocation events
            peak = int(trace.meta["structure_check"]["peak_from_events"])
            measured = Measured(measured.iteration_time_us, peak, peak)
            trace = Trace(meta={**trace.meta, "measured_peak": "profiler allocation events "
                                "(CPU has no allocator statistics)"},
                          tensors=trace.tensors, ops=trace.ops, measured=measured,
                          copies=trace.copies, mem_events=trace.mem_events)
        self._trace = trace
        kernels = sum(len(op.kernels) for op in trace.ops)
        timing = trace.meta["timing"]
        self.progress(f"trace: {len(trace.ops)} ops, {len(trace.tensors)} tensors, {kernels} "
                      f"kernels, {len(trace.mem_events)} allocator events; join "
                      f"{trace.meta['join']}")
        self.progress(f"timing: profiled span {timing['profiled_span_us'] / 1e3:.3f} ms (busy "
                      f"{timing['busy_us'] / 1e3:.3f} ms), idle fit {timing.get('fit')} "
                      + ", ".join(f"{k}={timing[k]}" for k in ("subtract_us", "scale")
                                  if k in timing))
        check = trace.meta["structure_check"]
        self.progress("structure check: " + ", ".join(f"{k}={v}" for k, v in check.items()))
        self.progress("self-check: " + selfcheck.describe(trace))

    def _meta(self) -> dict[str, Any]:
        gpu = self.gpu
        name = torch.cuda.get_device_name(self.device) if gpu else "cpu"
        smap = {"0": "compute"}  # the GPU assembly names the other streams it finds
        params = list(self.model.parameters())
        meta: dict[str, Any] = {
            "source": "measured",
            "model": type(self.model).__name__,
            "batch_size": None,
            "device": name,
            "device_type": self.device.type,
            "torch": torch.__version__,
            "cuda": torch.version.cuda if gpu else None,
            "cudnn": torch.backends.cudnn.version() if gpu else None,
            "driver": driver_version() if gpu else None,
            "recorder": RECORDER_VERSION,
            "hardware": hardware_guess(name) if gpu else None,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(sys.argv),
            "dtype": str(params[0].dtype).replace("torch.", "") if params else None,
            "tf32": {"cudnn": bool(torch.backends.cudnn.allow_tf32),
                     "matmul": bool(torch.backends.cuda.matmul.allow_tf32)},
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "host_probe": self.host_probe,  # this machine's host speed (vsim.record.hostprobe)
            "precision": None,  # what the step ran under autocast: the caller says
            "optimizer": optimizer_name(self.optimizer),
            "optimizer_config": optimizer_label(self.optimizer),
            "stream_names": smap,
            "iterations": {"warmup": self.schedule.count("warmup"),
                           "measured": self.schedule.count("measure"),
                           "timing": self.schedule.count("timing") - 1},
            "measured_iteration_times_us": [round(t, 3) for t in self.times_us],
            # vsim.record.hostprobe.speed_probe_us before each: host-bound iterations follow it
            # (validation/host/noise/host-use/)
            "measured_speed_probe_us": self.speed_us,
            "measured_peaks_allocated_bytes": list(self.peaks_allocated),
            "measured_peaks_reserved_bytes": list(self.peaks_reserved),
            "timing_pass": ("CUDA activity only, iterations delimited by a spin kernel, kernels "
                            "joined to the structure pass's ops by aligning kernel names"
                            if gpu else "CPU op spans, joined by aligning op names"),
        }
        meta.update(self.extra_meta)
        return meta


def record_step(step: Callable[[], Any], model: nn.Module,
                optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> Trace:
    """Record `step()` (one training iteration) with a Recorder; kwargs go to Recorder."""
    with Recorder(model, optimizer, **kwargs) as rec:
        while not rec.done:
            step()
            rec.step()
    return rec.trace


def sgd_training(model: str, batch: int, dev: torch.device) -> TrainingStep:
    """Zoo model `model` at `batch` on `dev`, fp32 with SGD (momentum 0.9): the step every
    recording before issue 17 ran (vsim.record.step.training_step with its defaults)."""
    return training_step(model, batch, dev)


def record_model(model: str, batch: int, device: str = "cuda", warmup: int = 3, iters: int = 10,
                 progress: Progress | None = None, timing_iters: int = 3,
                 fit_gaps: bool = True, precision: str = "fp32", optimizer: str = "sgd",
                 seq: int | None = None) -> Trace:
    """Record a zoo model (vsim.record.zoo; `seq` for Hugging Face models) training on
    synthetic data with vsim.record.step.training_step: forward and loss (under autocast for
    bf16/fp16), backward, optimizer step, zero_grad(set_to_none=True). ConfigError for an
    unknown model, precision or optimizer, or an unavailable device."""
    check_choice(precision, optimizer)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA is not available here; record with --device cpu")
    say = progress or (lambda _m: None)
    say(f"building {model} (batch {batch}{'' if seq is None else f', seq {seq}'}) on {dev}, "
        f"{precision}, {optimizer}")
    t = training_step(model, batch, dev, precision=precision, optimizer=optimizer, seq=seq)
    command = (f"vsim record {model} --batch {batch}"
               + ("" if seq is None else f" --seq {seq}")
               + f" --precision {precision} --optimizer {optimizer} --device {device} "
               f"--warmup {warmup} --iters {iters}")
    meta: dict[str, Any] = {"model": model, "batch_size": batch, "command": command,
                            **t.meta()}
    if seq is not None or is_hf(model):
        meta["seq_len"] = seq if seq is not None else default_seq(model)
    return record_step(t.step, t.net, t.opt, inputs=(t.inputs, t.target), loss_fn=t.loss_fn,
                       device=dev,
                       warmup=warmup, iters=iters, timing_iters=timing_iters, fit_gaps=fit_gaps,
                       progress=progress, meta=meta)
