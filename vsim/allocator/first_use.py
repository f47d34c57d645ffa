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
    """op id -> the resident tensors created as that op launches: the first
    optimizer op or the first GEMM, or the first op that reads the tensor if that comes earlier."""
    pos = {op.id: i for i, op in enumerate(trace.ops)}
    firsts: dict[str, int | None] = {}  # found on first need: a trace may have neither
    placed: dict[int, list[int]] = {}
    for t in trace.tensors:
        if t.producer is not None:
            continue
        if t.kind == "optimizer_state":
            if "opt" not in firsts:
                firsts["opt"] = next((op.id for op in trace.ops if op.phase == "opt"), None)
            at = firsts["opt"]
        elif t.kind == "temporary" and not t.consumers:
            if "gemm" not in firsts:
                firsts["gemm"] = next((op.id for op in trace.ops if op_class(op) == "gemm"),
                                      None)
            at = firsts["gemm"]
        else:
            continue
        readers = [c for c in t.consumers if c in pos]
        if readers and (at is None or min(pos[c] for c in readers) < pos[at]):
            at = min(readers, key=pos.__getitem__)
        if at is not None:
            placed.setdefault(at, []).append(t.id)
    return placed
