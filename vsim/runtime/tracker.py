"""The executor's dispatch mode: counts the iteration's aten calls, checks each against the OpMap
and lets the executor act at op boundaries (see vsim.runtime.executor)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .microbatch import split_call, splits
from .opmap import is_profiler_op
from .recompute import written_args

if TYPE_CHECKING:
    from .executor import Executor


_RNG: dict[Any, bool] = {}


def _uses_rng(func: Any) -> bool:
    """Whether a call draws from the RNG, so that a recomputation must replay it from the
    state it ran at: aten's `nondeterministic_seeded` tag, which also marks the fused attention
    kernels that draw their dropout mask inside (`_scaled_dot_product_efficient_attention`,
    `_flash_attention_forward`, ...; by name alone they looked deterministic, and recomputed
    GPT-2 and BERT attention on the GPU drew new masks: gradients 3x the reference's noise);
    names as a fallback for a function without tags."""
    got = _RNG.get(func)
    if got is None:
        name = str(func)
        got = _RNG[func] = (torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
                            or any(w in name for w in (
                                "dropout", "bernoulli", "rand", "normal", "uniform",
                                "exponential", "multinomial", "geometric", "cauchy")))
    return got


class Tracker(TorchDispatchMode):
    """Counts aten calls, checks each against the OpMap and lets the executor act at op
    boundaries: before the first call of an op (its kernels are not launched yet) the ops before
    it have ended in launch order."""

    def __init__(self, ex: Executor) -> None:
        super().__init__()
        self.ex = ex

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ex = self.ex
        if ex.paused or is_profiler_op(func):
            return func(*args, **kwargs)
        native = ex.calibrating  # the native counter beside this mode (vsim.runtime.native)
        if native is not None:
            ex.cal_before.append(native.count())
            ex.cal_inside.append(native.depth() > 0)
            ex.cal_frames.append(native.frame())
            native.pause(True)  # what this handler dispatches itself is not the step's
        k = ex.calls
        ex.calls = k + 1
        m = ex.map
        if k >= m.n_calls or func is not m.funcs[k]:
            ex.diverged(k, func)
        op = m.call_op[k]
        if op > ex.cur:
            ex.advance(op)
        rec = ex.recording.get(op)
        track = rec is not None or op <= ex.track_until
        rng = ex.rng_state() if track and _uses_rng(func) else None
        parts = ex.split_parts.get(op) if ex.split_parts else None
        if parts is not None and splits(func, kwargs):
            out = split_call(func, args, kwargs, parts)  # below this mode: not counted
            ex.stats.split_calls += 1
        else:
            out = func(*args, **kwargs)  # inside a counted call: the counter does not count it
        watch = ex.watch.get(k)
        if watch:
            ex.register(watch, out)
            if native is not None:
                ex.note_registered(watch)
        if rec is not None or k in ex.constant_calls or (
                track and written_args(func)):
            # a native iteration calls back here (its frame) where this call kept, recorded or
            # noted something: an in-place update of a storage no recorded call touched is not
            # called back (a call back costs 20-100 us of host time)
            if ex.on_call(func, args, kwargs, out, rng, k) and native is not None:
                ex.cal_flagged[k] = (func, rng is not None)
        if native is not None:
            native.pause(False)
        return out
