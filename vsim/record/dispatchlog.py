"""The recorder's dispatch-level log: for each aten call below autograd, the storages it reads, its
flops and the bytes of its operands, with a profiler marker inside the call (vsim::d#N) that ties
the call to the kernels it launches. Used by the recorder's structure pass and by synth (which
runs the same mode on meta tensors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .assemble import DISPATCH, StructureLog

try:  # a profiler range without a dispatcher op of its own (torch >= 2.2)
    from torch._C._profiler import _RecordFunctionFast as ProfilerRange
except ImportError:  # pragma: no cover
    from torch.autograd.profiler import record_function as ProfilerRange  # type: ignore[assignment]

try:
    from torch.utils.flop_counter import flop_registry as FLOPS
except ImportError:  # pragma: no cover
    FLOPS = {}

def marker(name: str) -> None:
    """An empty profiler range named `name` (the structure pass's markers)."""
    with ProfilerRange(name):
        pass


def tensor_addr(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr()) or None
    except (RuntimeError, NotImplementedError):
        return None


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return 0


def call_profile(func: Any, args: Any, kwargs: Any, out: Any, flat_in: list[Any],
                 flat_out: list[Any], device_type: str,
                 addr: Callable[[torch.Tensor], int | None]) -> tuple[list[int], float, float]:
    """One aten call's (storages read, flops, bytes of its tensor arguments and results) on
    `device_type`, `addr` naming a tensor's storage: the recorder's log entry, also synth's."""
    reads: list[int] = []
    nbytes = 0.0
    for x in flat_in:
        if isinstance(x, torch.Tensor) and x.device.type == device_type:
            a = addr(x)
            if a is not None:
                reads.append(a)
            nbytes += x.numel() * x.element_size()
    for x in flat_out:
        if isinstance(x, torch.Tensor) and x.device.type == device_type:
            nbytes += x.numel() * x.element_size()
    flops = 0.0
    formula = FLOPS.get(getattr(func, "overloadpacket", None))
    if formula is not None:
        try:
            flops = float(formula(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a formula that does not fit this call: unknown
            flops = 0.0
    return reads, flops, nbytes


def mutated_storages(func: Any, args: Any, kwargs: Any, device_type: str,
                     addr: Callable[[torch.Tensor], int | None]) -> list[int]:
    """The storages an aten call writes in place (its schema's written arguments: `self` of
    relu_ and add_, out= arguments) on `device_type`: the trace lists them among the reads and
    marks them in the op's `mutates` attribute (which of an `add_`'s reads it updated)."""
    schema = getattr(func, "_schema", None)
    out: list[int] = []
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        x = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        for t in x if isinstance(x, (list, tuple)) else (x,):
            if isinstance(t, torch.Tensor) and t.device.type == device_type:
                got = addr(t)
                if got is not None:
                    out.append(got)
    return out


class DispatchLog(TorchDispatchMode):
    """Logs, for each aten op below autograd, the storages it reads on the recorded device, its
    flops (torch.utils.flop_counter's formulas) and the bytes of its tensor arguments and results,
    and leaves a marker 'vsim::d#N' inside the op in the profiler capture."""

    def __init__(self, log: StructureLog, device_type: str) -> None:
        super().__init__()
        self.log = log
        self.device_type = device_type

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "namespace", "") == "profiler":
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        reads, flops, nbytes = call_profile(func, args, kwargs, out, flat_in, flat_out,
                                            self.device_type, tensor_addr)
        n = len(self.log.dispatch)
        self.log.dispatch.append((reads, flops, nbytes))
        mutated = mutated_storages(func, args, kwargs, self.device_type, tensor_addr)
        if mutated:
            self.log.mutated[n] = mutated
        marker(f"{DISPATCH}{n}")
        return out
