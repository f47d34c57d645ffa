"""Hold a synthesized trace's memory side against a recording of the same model (no torch here).

The figures: bytes and counts of tensors by kind, the liveness peak (the no-policy replay's peak,
vsim.metrics.liveness_peak_bytes) with and without workspaces (cuDNN's workspaces are modelled in
synthesis, everything else follows from shapes), and the sequence of ops.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from .metrics import liveness_peak_bytes
from .trace.schema import TENSOR_KINDS, Trace


def memory_profile(trace: Trace) -> dict[str, Any]:
    """Bytes and counts by tensor kind, peaks with and without workspaces, op count."""
    by_kind: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for t in trace.tensors:
        by_kind[t.kind] += t.size_bytes
        count[t.kind] += 1
    no_ws = dataclasses.replace(trace, tensors=tuple(
        dataclasses.replace(t, size_bytes=0) if t.kind == "workspace" else t
        for t in trace.tensors))
    return {"bytes_by_kind": {k: by_kind.get(k, 0) for k in TENSOR_KINDS},
            "count_by_kind": {k: count.get(k, 0) for k in TENSOR_KINDS},
            "peak_bytes": liveness_peak_bytes(trace),
            "peak_without_workspace_bytes": liveness_peak_bytes(no_ws),
            "ops": len(trace.ops)}


def compare(recorded: Trace, synthesized: Trace) -> dict[str, Any]:
    """Both profiles and the relative error of the synthesized one per figure (None where the
    recording has 0)."""
    a, b = memory_profile(recorded), memory_profile(synthesized)

    def rel(x: float, y: float) -> float | None:
        return None if not x else (y - x) / x

    err = {f"bytes.{k}": rel(a["bytes_by_kind"][k], b["bytes_by_kind"][k]) for k in TENSOR_KINDS}
    err["peak"] = rel(a["peak_bytes"], b["peak_bytes"])
    err["peak_without_workspace"] = rel(a["peak_without_workspace_bytes"],
                                        b["peak_without_workspace_bytes"])
    names_a = [o.name for o in recorded.ops]
    names_b = [o.name for o in synthesized.ops]
    return {"recorded": a, "synthesized": b, "error": err,
            "same_op_sequence": names_a == names_b,
            "op_names_only_recorded": sorted((Counter(names_a) - Counter(names_b)).elements()),
            "op_names_only_synthesized": sorted((Counter(names_b) - Counter(names_a)).elements())}
