"""Train with a policy's plan in one's own loop: `PlannedStep` wraps the user's own training
step (their model, optimizer, loss, autocast) and runs it with the plan carried out.

    step = PlannedStep(train_step, model, opt, (x, y), policy="vdnn:mode=all")
    for xb, yb in loader:
        x.copy_(xb); y.copy_(yb)      # static input buffers, as with CUDA graphs
        stats = step()                # one iteration, the plan's actions carried out

The step is recorded (vsim.record.recorder.record_step), its aten calls mapped to the trace's
ops (vsim.runtime.opmap.map_ops), the policy plans for the trace at the capacity asked, and an
Executor (vsim.runtime.executor) carries the plan out in every call. What `vsim measure` does
for a zoo model's step (vsim.runtime.session), here for any step that runs the same aten calls
every iteration; nothing here caps memory or times anything.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError
from ..hardware import load_hardware
from ..plan import Drop, Offload, Plan, Prefetch, Recompute
from ..policies import make_policy
from ..record.recorder import record_step
from ..trace import load_trace
from ..trace.schema import Trace
from ..units import format_size, parse_size
from .executor import Executor, IterationStats
from .hostmem import process_pool
from .opmap import OpMap, map_ops

RECORD_DEFAULTS: dict[str, int] = {"warmup": 1, "iters": 2, "timing_iters": 1}

__all__ = ["RECORD_DEFAULTS", "PlannedStep"]


def _device(model: torch.nn.Module, device: Any) -> torch.device:
    if device is not None:
        dev = torch.device(device)
    else:
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _capacity(memory: int | str | None, default: int) -> int:
    if memory is None:
        return default
    if isinstance(memory, bool) or not isinstance(memory, (int, str)):
        raise ConfigError(f"memory {memory!r}: bytes (int) or a size such as '12GiB'")
    size = parse_size(memory, "memory") if isinstance(memory, str) else memory
    if size <= 0:
        raise ConfigError(f"memory {memory!r}: must be more than 0 bytes")
    return size


class PlannedStep:
    """The user's training step run with a memory policy's plan carried out.

    `step`: a zero-argument callable doing one whole training iteration -- forward (under the
    user's own autocast, if any), loss, backward, the optimizer's step and zero_grad -- on the
    tensors in `inputs` (static input buffers: copy each new batch into them, do not rebind
    them). It must run the same aten calls every iteration (no data-dependent branches), as
    the plan's op ids point at the recorded ones. `model`, `optimizer`: the step's; `loss_fn`:
    an nn.Module computing the loss, only to name its ops in the trace.

    Construction RUNS THE STEP: unless `trace` (a Trace or a path) is given, the step is
    recorded with `record` (vsim.record.recorder.Recorder's warmup, iters and timing_iters;
    default RECORD_DEFAULTS: 1 + 2 + 1 + 2 = 6 calls), and mapping its aten calls to the trace's
    ops runs it once more. These are real training iterations on what `inputs` holds: the
    weights, optimizer state and random generators move on. Then `policy` (a spec string, as
    for `vsim run`; PolicyError when it is not one) plans for the trace on `hardware` (a
    profile name or path) at `memory` (bytes or a size such as "12GiB"; default the profile's
    capacity). `memory` is what the plan is made for: nothing here caps the process (cap it
    with torch.cuda.set_per_process_memory_fraction to hold the run to it).

    Each call runs one iteration with the plan carried out and returns its IterationStats (an
    empty one, with the step run as is, when the plan has no actions). A step whose aten calls
    differ from the recorded ones raises OpSequenceError (vsim.runtime.opmap); a recomputation
    that cannot rebuild a tensor exactly raises ExecutorError (`strict`). After an out-of-memory
    stop the inputs an offload had taken to the host are brought back before the error is
    raised again (or, where they still do not fit, left to `executor.restore_inputs()`).
    `tracker`: the executor's op tracker ("auto", "native" or "python";
    vsim.runtime.nativerun). `.trace`, `.opmap`, `.plan`, `.policy`, `.capacity_bytes`,
    `.executor` (None for a plan without actions), `.last` (the last call's statistics) are
    public; `summary()` says what the plan is and what the last call did.

    On a GPU the copies run on side streams beside the compute stream; on the CPU they are
    synchronous copies (the plan is carried out, nothing is saved)."""

    def __init__(self, step: Callable[[], Any], model: torch.nn.Module, optimizer: Any,
                 inputs: Any, *, policy: str, hardware: str = "h100-sxm",
                 memory: int | str | None = None, device: Any = None, loss_fn: Any = None,
                 tracker: str = "auto", record: Mapping[str, Any] | None = None,
                 trace: Trace | str | Path | None = None, strict: bool = True) -> None:
        self.step = step
        self.device = _device(model, device)
        self.inputs = inputs
        self.flat_inputs = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        self.policy = make_policy(policy)  # a bad spec fails before anything runs
        self.hardware = load_hardware(hardware)
        self.capacity_bytes = _capacity(memory, self.hardware.capacity_bytes)
        if trace is None:
            unknown = set(record or {}) - {"warmup", "iters", "timing_iters", "fit_gaps",
                                           "meta", "progress"}
            if unknown:
                raise ConfigError(f"record: unknown key(s) {', '.join(sorted(unknown))} "
                                  f"(warmup, iters, timing_iters, fit_gaps, meta, progress)")
            trace = record_step(step, model, optimizer, inputs=inputs, loss_fn=loss_fn,
                                device=self.device, **{**RECORD_DEFAULTS, **(record or {})})
        elif not isinstance(trace, Trace):
            trace = load_trace(str(trace))
        self.trace: Trace = trace
        self.opmap: OpMap = map_ops(step, model, optimizer, inputs, loss_fn, self.device, trace)
        self.plan: Plan = self.policy.plan(trace, self.hardware, self.capacity_bytes)
        gpu = self.device.type == "cuda"
        self.executor: Executor | None = None
        if self.plan.actions:
            self.executor = Executor(
                self.plan, self.opmap, trace, self.device, self.flat_inputs,
                process_pool(self.plan.pinned_pool_bytes, gpu and self.plan.pinned),
                strict=strict, memory_fraction=self._memory_fraction(), tracker=tracker)
        self.iterations = 0
        self.last: IterationStats | None = None

    def _memory_fraction(self) -> float:
        """The process's cap, which the executor restores after squeezing a convolution."""
        if self.device.type != "cuda":
            return 1.0
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return float(get(self.device)) if get is not None else 1.0

    def __call__(self) -> IterationStats:
        """One iteration of the step with the plan carried out; its statistics."""
        ex = self.executor
        if ex is None:
            self.step()
            stats = IterationStats()
        else:
            stopped = None
            try:
                stats = ex.run(self.step)
            except torch.OutOfMemoryError as exc:
                stopped = str(exc)
                del exc  # its frames hold the stopped iteration's tensors
            if stopped is not None:
                if ex.inputs_pending:
                    gc.collect()
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                    try:
                        ex.restore_inputs()
                    except torch.OutOfMemoryError:
                        pass  # still pending: ex.restore_inputs() once memory is free
                raise torch.OutOfMemoryError(stopped)
        self.iterations += 1
        self.last = stats
        return stats

    def summary(self) -> str:
        """The policy, the plan's actions, the tracker and what the last call did."""
        acts = self.plan.actions
        n = {k.__name__: sum(isinstance(a, k) for a in acts)
             for k in (Offload, Prefetch, Drop, Recompute)}
        lines = [f"{self.policy.spec()} on {self.hardware.name} at "
                 f"{format_size(self.capacity_bytes)}: {len(self.trace.ops)} ops, "
                 f"{self.opmap.n_calls} aten calls"]
        if not acts:
            lines.append("plan: no actions (the step runs as is)")
        else:
            lines.append(f"plan: {n['Offload']} offloads, {n['Prefetch']} prefetches, "
                         f"{n['Drop']} drops, {n['Recompute']} recomputations")
        ex, s = self.executor, self.last
        if ex is None or s is None:
            lines.append(f"iterations run: {self.iterations}")
            return "\n".join(lines)
        used = ex.tracker_used
        note = ("calibrating the native one" if used == "calibrate" else ex.tracker_note)
        used = "python" if used == "calibrate" else used
        note = f" ({note})" if note else ""
        lines.append(f"last iteration (of {self.iterations}), {used} tracker{note}: "
                     f"{s.offloads} offloads, {s.prefetches} prefetches, {s.drops} drops, "
                     f"{s.recomputed_calls} recomputed calls; "
                     f"{format_size(s.d2h_bytes)} to host, {format_size(s.h2d_bytes)} back")
        return "\n".join(lines)
