"""Metrics as pure functions of a trace (predicted or measured): times in us, sizes in bytes.

The same functions score a simulation's predicted trace and a measured run, so that validation
compares like with like.
"""

from __future__ import annotations

from typing import Any

from .trace.schema import Trace


def iteration_time_us(trace: Trace) -> float:
    """From time 0 to the end of the last op or copy, plus the recorded idle tail
    (meta.iteration_tail_us: host work after the last kernel before the next iteration)."""
    ends = [op.start_us + op.dur_us for op in trace.ops]
    ends += [c.start_us + c.dur_us for c in trace.copies]
    return max(ends, default=0.0) + float(trace.meta.get("iteration_tail_us", 0.0))


def compute_time_us(trace: Trace) -> float:
    return sum(op.dur_us for op in trace.ops)


def stall_time_us(trace: Trace) -> float:
    """Time ops waited for copies, synchronisations or other streams beyond their launch gap."""
    return sum(float(op.attr("stall_us", 0.0)) for op in trace.ops)


def recompute_time_us(trace: Trace) -> float:
    return sum(op.dur_us for op in trace.ops if op.attr("recompute_of") is not None)


def bytes_moved(trace: Trace, direction: str) -> int:
    return sum(c.size_bytes for c in trace.copies if c.direction == direction)


def memory_curve(trace: Trace) -> list[tuple[float, int, int]]:
    """(time_us, allocated_bytes, reserved_bytes) after each allocator event, in time order.
    Allocated drops at free_requested (PyTorch's memory_allocated), or at free_completed for a
    block with no free_requested. Reserved follows segment events; a trace without them
    reserves what it holds."""
    allocated = reserved = 0
    has_segments = any(e.action in ("segment_alloc", "segment_free") for e in trace.mem_events)
    curve = []
    events = trace.mem_events
    if any(a.time_us > b.time_us for a, b in zip(events, events[1:], strict=False)):
        events = tuple(sorted(events, key=lambda e: e.time_us))
    requested: dict[tuple[int | None, int], int] = {}  # freed by the program, still held
    pending = 0  # their bytes
    for e in events:
        if e.action == "alloc":
            allocated += e.size_bytes
        elif e.action == "free_requested":
            # Allocated bytes follow PyTorch's memory_allocated: down when the program frees a
            # block, even if a stream still uses it (the block returns at free_completed).
            allocated -= e.size_bytes
            requested[(e.tensor, e.addr)] = e.size_bytes
            pending += e.size_bytes
        elif e.action == "free_completed":
            held_back = requested.pop((e.tensor, e.addr), None)
            if held_back is None:
                allocated -= e.size_bytes
            else:
                pending -= held_back
        elif e.action == "segment_alloc":
            reserved += e.size_bytes
        elif e.action == "segment_free":
            reserved -= e.size_bytes
        else:
            continue
        # Without segments, reserved is what is held: allocated plus blocks awaiting a stream.
        curve.append((e.time_us, allocated, reserved if has_segments else allocated + pending))
    return curve


Curve = list[tuple[float, int, int]]


def peak_allocated_bytes(trace: Trace, curve: Curve | None = None) -> int:
    return max((a for _, a, _ in curve or memory_curve(trace)), default=0)


def peak_reserved_bytes(trace: Trace, curve: Curve | None = None) -> int:
    return max((r for _, _, r in curve or memory_curve(trace)), default=0)


def avg_allocated_bytes(trace: Trace, curve: Curve | None = None) -> float:
    """Time-weighted mean of allocated bytes over [0, iteration end]."""
    end = iteration_time_us(trace)
    if end <= 0:
        return 0.0
    total, last_t, last_a = 0.0, 0.0, 0
    for t, a, _ in curve or memory_curve(trace):
        total += last_a * (min(t, end) - last_t)
        last_t, last_a = min(t, end), a
    total += last_a * (end - last_t)
    return total / end


def summary(trace: Trace, curve: Curve | None = None) -> dict[str, Any]:
    """The metric part of a `vsim run --json` report (`curve`: memory_curve(trace), if the
    caller has it already)."""
    curve = curve if curve is not None else memory_curve(trace)  # once: the costly part
    return {
        "iteration_time_us": iteration_time_us(trace),
        "compute_time_us": compute_time_us(trace),
        "stall_time_us": stall_time_us(trace),
        "recompute_time_us": recompute_time_us(trace),
        "peak_allocated_bytes": peak_allocated_bytes(trace, curve),
        "peak_reserved_bytes": peak_reserved_bytes(trace, curve),
        "avg_allocated_bytes": avg_allocated_bytes(trace, curve),
        "h2d_bytes": bytes_moved(trace, "h2d"),
        "d2h_bytes": bytes_moved(trace, "d2h"),
    }


def resident_bytes(trace: Trace) -> int:
    """Bytes on the GPU before the first op: tensors no op produces (weights, optimizer state,
    inputs). A capacity below this cannot run the iteration under any policy."""
    return sum(t.size_bytes for t in trace.tensors if t.producer is None)


def liveness_peak_bytes(trace: Trace) -> int:
    """Peak of live tensor bytes over the op sequence with the trace's own lifetimes (no policy,
    no fragmentation): resident tensors from the start, outputs from their producer's start,
    frees at the freeing op's end. What `vsim run --policy none --allocator exact` reports."""
    live = resident_bytes(trace)
    size = {t.id: t.size_bytes for t in trace.tensors}
    peak = live
    for op in trace.ops:
        live += sum(size[t] for t in op.writes)
        peak = max(peak, live)
        live -= sum(size[t] for t in op.frees)
    return peak
