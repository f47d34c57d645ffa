"""Where a training process creates, in its first iteration, the blocks that then live across
iterations.

A trace lists them as resident (no producer), but PyTorch allocates two kinds at first use:
SGD's momentum buffers at the first optimizer step, and cuBLAS's workspaces (the unidentified
resident blocks no op reads) at the first GEMM. Placed there they split whatever block is free
at that moment, which sets the reserved memory of the whole run; PyTorch's whole-run allocator
histories show both (validation/allocator/README.md).
"""

from __future__ import annotations

from ..compute import op_class
from ..trace.schema import Trace


def first_use_residents(trace: Trace) -> dict[int, list[int]]:
    """op id -> the resident tensors created just before that op's own allocations."""
    resident = [t for t in trace.tensors if t.producer is None]
    momentum = [t.id for t in resident if t.kind == "optimizer_state"]
    cublas = [t.id for t in resident if t.kind == "temporary" and not t.consumers]
    placed: dict[int, list[int]] = {}
    first_opt = next((op.id for op in trace.ops if op.phase == "opt"), None)
    first_gemm = next((op.id for op in trace.ops if op_class(op) == "gemm"), None)
    if momentum and first_opt is not None:
        placed.setdefault(first_opt, []).extend(momentum)
    if cublas and first_gemm is not None:
        placed.setdefault(first_gemm, []).extend(cublas)
    return placed
