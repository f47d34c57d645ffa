"""Convolution algorithm variants: vDNN's performance-optimal (p) and memory-optimal (m).

A recorded trace holds one algorithm per convolution: the one cuDNN picked (PyTorch's default, with
benchmark off, is the heuristic's fastest pick and may take a workspace). The (m) variant is
implicit GEMM with no workspace. When the recorder also timed the (m) algorithm it stores the time
in the op's attrs as `dur_us_memory_algo`; otherwise the time is estimated (see SLOWDOWN_NOTE).
"""

from __future__ import annotations

from ..trace.schema import Trace
from .base import Retime

# Implicit-GEMM (no workspace) against the fastest algorithm. The vDNN paper reports per-layer
# (m) vs (p) only through end-to-end throughput; cuDNN's own benchmarks put IMPLICIT_GEMM at
# about 1.3-2x the fastest algorithm on large 3x3 convolutions. 1.5x is that range's middle: an
# estimate, used only when the trace has no measured (m) time, and the report says so.
MEMORY_ALGO_SLOWDOWN = 1.5
SLOWDOWN_NOTE = (f"algo=memory: convolution times without a measured implicit-GEMM time are "
                 f"estimated as {MEMORY_ALGO_SLOWDOWN}x the recorded (fastest) time")


def memory_optimal_retimes(trace: Trace) -> tuple[list[Retime], list[str]]:
    """Retime every convolution op to its workspace-free algorithm."""
    retimes, estimated = [], 0
    for op in trace.ops:
        if op.layer_type != "conv":
            continue
        measured = op.attr("dur_us_memory_algo")
        if measured is None:
            estimated += 1
            dur = op.dur_us * MEMORY_ALGO_SLOWDOWN
        else:
            dur = float(measured)
        retimes.append(Retime(op=op.id, dur_us=dur, workspace_bytes=0,
                              note="measured" if measured is not None else "estimated"))
    notes = [SLOWDOWN_NOTE + f" ({estimated} ops)"] if estimated else []
    return retimes, notes
