"""Metrics as pure functions of a trace (predicted or measured): times in us, sizes in bytes.

The same functions score a simulation's predicted trace and a measured run, so that validation
compares like with like.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .trace.schema import Trace


def iteration_time_us(trace: Trace) -> float:
    """From time 0 to the end of the last op or copy, plus the recorded idle tail
    (meta.iteration_tail_us: host work after the last kernel before the next iteration)."""
    ends = [op.start_us + op.dur_us for op in trace.ops]
    ends += [c.start_us + c.dur_us for c in trace.copies]
    return max(ends, default=0.0) + float(trace.meta.get("iteration_tail_us", 0.0))


# Float totals are math.fsum: correctly rounded on every Python version (3.12's sum() rounds
# differently from 3.11's), and equal to the engine's own report to the last bit.


def compute_time_us(trace: Trace) -> float:
    return math.fsum(op.dur_us for op in trace.ops)


def stall_time_us(trace: Trace) -> float:
    """Time ops waited for copies, synchronisations or other streams beyond their launch gap."""
    return math.fsum(float(op.attr("stall_us", 0.0)) for op in trace.ops)


def recompute_time_us(trace: Trace) -> float:
    return math.fsum(op.dur_us for op in trace.ops if op.attr("recompute_of") is not None)


def bytes_moved(trace: Trace, direction: str) -> int:
    return sum(c.size_bytes for c in trace.copies if c.direction == direction)


def memory_curve(trace: Trace) -> list[tuple[float, int, int]]:
    """(time_us, allocated_bytes, reserved_bytes) after each allocator event, in time order."""
    return curve_of_events([(e.action, e.time_us, e.addr, e.size_bytes, e.stream, e.tensor, e.op)
                            for e in trace.mem_events])


def curve_of_events(events: Sequence[tuple[Any, ...]], *, has_segments: bool | None = None,
                    in_time_order: bool = False) -> list[tuple[float, int, int]]:
    """The memory curve of allocator events given as tuples in MemEvent's field order (what the
    engine logs). Allocated drops at free_requested (PyTorch's memory_allocated), or at
    free_completed for a block with no free_requested. Reserved follows segment events; a log
    without them reserves what it holds. A caller that knows whether the log has segment events
    and is in time order (the engine logs as simulated time advances) says so: both checks cost
    a pass over the log."""
    allocated = reserved = 0
    if has_segments is None:
        has_segments = any(e[0] == "segment_alloc" or e[0] == "segment_free" for e in events)
    curve = []
    if not in_time_order and any(a[1] > b[1] for a, b in zip(events, events[1:], strict=False)):
        events = sorted(events, key=lambda e: e[1])
    requested: dict[tuple[int | None, int], int] = {}  # freed by the program, still held
    pending = 0  # their bytes
    for action, time_us, addr, size, _stream, tensor, _op in events:
        if action == "alloc":
            allocated += size
        elif action == "free_requested":
            # Allocated bytes follow PyTorch's memory_allocated: down when the program frees a
            # block, even if a stream still uses it (the block returns at free_completed).
            allocated -= size
            requested[(tensor, addr)] = size
            pending += size
        elif action == "free_completed":
            held_back = requested.pop((tensor, addr), None)
            if held_back is None:
                allocated -= size
            else:
                pending -= held_back
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        else:
            continue
        # Without segments, reserved is what is held: allocated plus blocks awaiting a stream.
        curve.append((time_us, allocated, reserved if has_segments else allocated + pending))
    return curve


Curve = list[tuple[float, int, int]]


def curve_figures(log: list[Any], has_segments: bool, end: float) -> tuple[int, int, float]:
    """(peak allocated bytes, peak reserved bytes, time-weighted mean allocated bytes over
    [0, end]) of the curve `curve_of_events(events, has_segments=has_segments,
    in_time_order=True)` would build, in one pass without building it (the report of a
    1M-op run: 4.5M events): the same values to the last bit, the same sums in the same
    order (tests/test_properties.py holds the report equal to metrics.summary). `log`: the
    events flat, seven items each in MemEvent's field order (the engine's DeviceMemory.log)."""
    it = iter(log)
    events = zip(it, it, it, it, it, it, it, strict=True)
    allocated = reserved = 0
    peak_a = peak_r = _BELOW  # max(..., default=0) of the curve: 0 only when it is empty
    requested: dict[tuple[int | None, int], int] = {}
    pending = 0
    total, last_t, last_a = 0.0, 0.0, 0
    for action, time_us, addr, size, _stream, tensor, _op in events:
        if action == "alloc":
            allocated += size
        elif action == "free_requested":
            allocated -= size
            requested[(tensor, addr)] = size
            pending += size
        elif action == "free_completed":
            held_back = requested.pop((tensor, addr), None)
            if held_back is None:
                allocated -= size
            else:
                pending -= held_back
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        else:
            continue
        r = reserved if has_segments else allocated + pending
        if allocated > peak_a:
            peak_a = allocated
        if r > peak_r:
            peak_r = r
        t = end if time_us > end else time_us
        total += last_a * (t - last_t)
        last_t, last_a = t, allocated
    if peak_a == _BELOW:
        peak_a = peak_r = 0
    if end <= 0:
        return peak_a, peak_r, 0.0
    total += last_a * (end - last_t)
    return peak_a, peak_r, total / end


_BELOW = -(2**63)  # below any byte count


def peak_allocated_bytes(trace: Trace, curve: Curve | None = None) -> int:
    return max((a for _, a, _ in curve or memory_curve(trace)), default=0)


def peak_reserved_bytes(trace: Trace, curve: Curve | None = None) -> int:
    return max((r for _, _, r in curve or memory_curve(trace)), default=0)


def avg_allocated_bytes(trace: Trace, curve: Curve | None = None) -> float:
    """Time-weighted mean of allocated bytes over [0, iteration end]."""
    return time_weighted_allocated(curve or memory_curve(trace), iteration_time_us(trace))


def time_weighted_allocated(curve: Curve, end: float) -> float:
    """Mean allocated bytes of a memory curve over [0, end]."""
    if end <= 0:
        return 0.0
    total, last_t, last_a = 0.0, 0.0, 0
    for t, a, _ in curve:
        if t > end:
            t = end
        total += last_a * (t - last_t)
        last_t, last_a = t, a
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
