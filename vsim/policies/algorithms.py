"""Convolution algorithm variants: vDNN's performance-optimal (p) and memory-optimal (m).

The policies' `algo` parameter: auto (default) runs a convolution without workspace only where
its working set cannot fit otherwise, as cuDNN frameworks do when the workspace allocation fails;
performance keeps the recorded algorithms; memory runs all of them without workspace
(planning.algorithm_retimes; times from here).

A recorded trace holds one algorithm per convolution: the one cuDNN picked (PyTorch's default, with
benchmark off, is the heuristic's fastest pick and may take a workspace). The (m) variant is
implicit GEMM with no workspace. Its time, in order of preference:
1. the op's `dur_us_memory_algo` attr: measured (the H100 traces: validation/workspace-free),
   or written by retargeting and synthesis (`memory_algo` says which: "model" when
   vsim.compute modelled it);
2. the compute model on the GPU the trace's times belong to (meta.hardware): the recorded time
   scaled by the model's (m)/(p) ratio for that op (vsim.compute.memory_algo_time_us: implicit
   GEMM at the profile's `implicit_gemm` fraction of the fp32 peak, no layout transform);
3. without a known GPU, MEMORY_ALGO_SLOWDOWN times the recorded time (SLOWDOWN_NOTE).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..errors import HardwareError
from ..trace.schema import Trace
from .base import Retime

# Implicit-GEMM (no workspace) against the fastest algorithm, for traces whose GPU is unknown:
# cuDNN's own benchmarks put IMPLICIT_GEMM at about 1.3-2x the fastest algorithm on large 3x3
# convolutions; 1.5x is that range's middle. An estimate, and the report says so.
MEMORY_ALGO_SLOWDOWN = 1.5
SLOWDOWN_NOTE = (f"algo=memory: convolution times without a recorded or modelled implicit-GEMM "
                 f"time are estimated as {MEMORY_ALGO_SLOWDOWN}x the recorded (fastest) time")


@lru_cache(maxsize=16)
def _model(hardware: str) -> Any:
    from ..compute import load_efficiencies
    from ..hardware import load_hardware
    try:
        hw = load_hardware(hardware)
        return hw, load_efficiencies(hw)
    except HardwareError:
        return None


def memory_optimal_retimes(trace: Trace) -> tuple[list[Retime], list[str]]:
    """Retime every convolution op to its workspace-free algorithm (see the module docstring
    for where each time comes from); notes say how many times were modelled or estimated."""
    from ..compute import memory_algo_ratio, op_class, op_costs

    model = _model(str(trace.meta["hardware"])) if trace.meta.get("hardware") else None
    costs = op_costs(trace) if model is not None else {}
    retimes: list[Retime] = []
    counts = {"measured": 0, "modelled": 0, "estimated": 0}
    for op in trace.ops:
        if op.layer_type != "conv" or op_class(op) not in ("conv_fwd", "conv_bwd"):
            continue
        attr = op.attr("dur_us_memory_algo")
        if attr is not None:
            how = "modelled" if op.attr("memory_algo") == "model" else "measured"
            dur = float(attr)
        elif model is not None and op.dur_us > 0:
            hw, eff = model
            busy = sum(k.dur_us for k in op.kernels) if op.kernels else op.dur_us
            ratio = memory_algo_ratio(costs[op.id], hw, eff)
            how, dur = "modelled", op.dur_us - busy + busy * ratio
        else:
            how, dur = "estimated", op.dur_us * MEMORY_ALGO_SLOWDOWN
        counts[how] += 1
        retimes.append(Retime(op=op.id, dur_us=dur, workspace_bytes=0, note=how))
    notes = []
    if counts["modelled"]:
        notes.append(f"algo=memory: {counts['modelled']} convolution time(s) modelled "
                     f"(implicit GEMM without workspace, by the compute model of "
                     f"{trace.meta.get('hardware')})")
    if counts["estimated"]:
        notes.append(SLOWDOWN_NOTE + f" ({counts['estimated']} ops)")
    return retimes, notes
