"""Summaries of a trace for `vsim inspect`: counts, bytes by tensor kind, span, peaks."""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import metrics
from .trace.schema import SCHEMA_VERSION, TENSOR_KINDS, Trace


def summarize(trace: Trace) -> dict[str, Any]:
    """A JSON-ready summary; includes meta and measured (contract of `vsim inspect --json`)."""
    by_kind: Counter[str] = Counter()
    for t in trace.tensors:
        by_kind[t.kind] += t.size_bytes
    phases = Counter(op.phase for op in trace.ops)
    layers = {(op.layer, op.layer_type) for op in trace.ops}
    layer_types = Counter(lt for _, lt in layers)
    return {
        "version": SCHEMA_VERSION,
        "meta": trace.meta,
        "measured": None if trace.measured is None else {
            "iteration_time_us": trace.measured.iteration_time_us,
            "peak_allocated_bytes": trace.measured.peak_allocated_bytes,
            "peak_reserved_bytes": trace.measured.peak_reserved_bytes},
        "ops": len(trace.ops),
        "ops_by_phase": dict(sorted(phases.items())),
        "layers": len(layers),
        "layers_by_type": dict(sorted(layer_types.items())),
        "kernels": sum(len(op.kernels) for op in trace.ops),
        "tensors": len(trace.tensors),
        "bytes_by_kind": {k: by_kind[k] for k in TENSOR_KINDS if by_kind[k]},
        "copies": len(trace.copies),
        "mem_events": len(trace.mem_events),
        "span_us": metrics.iteration_time_us(trace),
        "op_time_us": metrics.compute_time_us(trace),
        "replay_peak_bytes": metrics.liveness_peak_bytes(trace),
    }
