"""Two runs side by side: metric deltas, and one Chrome-trace file holding both for Perfetto.

The metrics are vsim.metrics' functions of each trace, so a measured and a predicted run are
scored alike. A measured trace (meta.source "measured") with a `measured` block uses that block's
iteration time and peaks instead: they were timed without the profiler, whose overhead stretches
the traced ops. A predicted trace carries its input's measured block too, but its own figures are
the prediction, so the block is ignored there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import metrics
from .fileio import write_atomic
from .trace import trace_to_json
from .trace.schema import Trace

METRICS = ("iteration_time_us", "compute_time_us", "stall_time_us", "recompute_time_us",
           "peak_allocated_bytes", "peak_reserved_bytes", "avg_allocated_bytes", "h2d_bytes",
           "d2h_bytes")
_MEASURED_BLOCK = ("iteration_time_us", "peak_allocated_bytes", "peak_reserved_bytes")


def trace_metrics(trace: Trace) -> tuple[dict[str, float | None], list[str]]:
    """The metrics of one run (us and bytes) and the keys taken from its measured block.
    Memory figures are None for a trace without allocator events (nothing to measure them
    from), unless its measured block has them."""
    values: dict[str, float | None] = {
        k: v for k, v in metrics.summary(trace).items() if k in METRICS}
    if not trace.mem_events:
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "avg_allocated_bytes"):
            values[key] = None
    from_block: list[str] = []
    if trace.source == "measured" and trace.measured is not None:
        for key in _MEASURED_BLOCK:
            values[key] = getattr(trace.measured, key)
            from_block.append(key)
    return values, from_block


def label(trace: Trace) -> str:
    """'measured vgg16 batch 64 on NVIDIA H100' / 'predicted ... policy vdnn:... on h100-sxm'."""
    m = trace.meta
    text = f"{m.get('source', '?')} {m.get('model', '?')} batch {m.get('batch_size', '?')}"
    if m.get("policy"):
        text += f", policy {m['policy']}"
    where = m.get("hardware") if m.get("source") == "predicted" else m.get("device")
    if m.get("capacity_bytes"):
        text += f", capacity {m['capacity_bytes'] / 2**30:.2f} GiB"
    return text + (f" on {where}" if where else "")


def compare(a: Trace, b: Trace, path_a: str = "A", path_b: str = "B") -> dict[str, Any]:
    """{a: {path, label, metrics, from_measured_block}, b: {...}, delta: {metric: {a, b, diff,
    rel}}}; diff is b - a in the metric's unit, rel is diff / a (None when a is 0 or a figure
    is missing)."""
    ma, block_a = trace_metrics(a)
    mb, block_b = trace_metrics(b)
    delta = {}
    for key in METRICS:
        va, vb = ma[key], mb[key]
        diff = None if va is None or vb is None else vb - va
        delta[key] = {"a": va, "b": vb, "diff": diff,
                      "rel": diff / va if diff is not None and va else None}
    return {"a": {"path": path_a, "label": label(a), "metrics": ma,
                  "from_measured_block": block_a},
            "b": {"path": path_b, "label": label(b), "metrics": mb,
                  "from_measured_block": block_b},
            "delta": delta}


def merged_chrome_trace(a: Trace, b: Trace, name_a: str = "A", name_b: str = "B"
                        ) -> dict[str, Any]:
    """One Chrome trace JSON document with run `a` as process 1 and `b` as process 2, each
    named after its file and what it is; both start at time 0. For viewing only: it has no
    vsim sidecar and does not load back as a vsim trace."""
    events: list[dict[str, Any]] = []
    for pid, trace, name in ((1, a, name_a), (2, b, name_b)):
        for ev in trace_to_json(trace)["traceEvents"]:
            ev = {**ev, "pid": pid}
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                ev["args"] = {"name": f"{'AB'[pid - 1]}: {label(trace)} ({name})"}
            events.append(ev)
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"vsim_compare": {"1": name_a, "2": name_b}}}


def save_merged(a: Trace, b: Trace, path: str, name_a: str = "A", name_b: str = "B") -> None:
    """Write the merged document atomically; gzip when the name ends in .gz."""
    data = json.dumps(merged_chrome_trace(a, b, name_a, name_b), separators=(",", ":"),
                      allow_nan=False).encode()
    write_atomic(path, data, gzip_level=6 if Path(path).suffix == ".gz" else None)
