"""The recorder's timing pass (see vsim.record.assemble): the median timed iteration's ops or
kernels, with the profiler's idle gaps fitted to the measured iteration time (`fit_idle`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import TraceError
from ..trace.importers import Capture, phases_of, stream_map
from ..trace.schema import Kernel
from .markers import ITERATION


def fit_idle(intervals: list[tuple[float, float]], target_us: float | None,
             scale_busy: bool = False) -> tuple[Callable[[float], float], dict[str, Any]]:
    """A monotone time map that keeps busy time (the union of `intervals`, us from the iteration
    start) and rescales the idle time before and between them so the last busy moment falls at
    `target_us`. Idle gaps are shrunk by subtracting one constant from each (floored at zero) --
    the profiler and hooks add a roughly constant CPU cost per op, which only shows where the GPU
    was waiting for the CPU -- or grown in proportion when the measured run idled more. Without a
    target, the identity. With `scale_busy` (CPU recordings, whose op spans include the
    profiler's own cost), a busy time above the target is scaled down with everything else.
    Returns (map, summary for meta.timing)."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    busy = sum(e - s for s, e in merged)
    gaps = []
    prev = 0.0
    for s, e in merged:
        gaps.append(max(0.0, s - prev))
        prev = e
    idle = sum(gaps)
    span = merged[-1][1] if merged else 0.0
    info: dict[str, Any] = {"profiled_span_us": round(span, 3), "busy_us": round(busy, 3),
                            "idle_profiled_us": round(idle, 3)}
    if target_us is None or not merged:
        info["fit"] = "none"
        return (lambda t: t), info
    want = target_us - busy
    if want <= 0 and scale_busy and span > 0:
        factor = target_us / span
        info.update(fit="scale-all", scale=round(factor, 6), idle_fitted_us=round(idle * factor, 3))
        return (lambda t: t * factor), info
    if want >= idle:
        if idle > 0:
            factor = want / idle
            new = [g * factor for g in gaps]
            info.update(fit="scale", scale=round(factor, 6))
        else:
            new = [want] + gaps[1:]
            info.update(fit="first-gap")
    elif want <= 0:
        new = [0.0] * len(gaps)
        info.update(fit="clamp", note="busy time exceeds the measured iteration time")
    else:
        order = sorted(gaps, reverse=True)
        total = 0.0
        c = 0.0
        for k, g in enumerate(order, 1):
            total += g
            c = (total - want) / k
            nxt = order[k] if k < len(order) else 0.0
            if nxt <= c <= g:
                break
        new = [max(0.0, g - c) for g in gaps]
        info.update(fit="subtract", subtract_us=round(c, 3))
    info["idle_fitted_us"] = round(sum(new), 3)
    old_pts, new_pts = [0.0], [0.0]
    clock = 0.0
    for (s, e), g_new in zip(merged, new, strict=False):
        clock += g_new
        old_pts.append(s)
        new_pts.append(clock)
        clock += e - s
        old_pts.append(e)
        new_pts.append(clock)

    def warp(t: float) -> float:
        if t <= 0:
            return t
        i = bisect.bisect_right(old_pts, t) - 1
        if i >= len(old_pts) - 1:
            return new_pts[-1] + (t - old_pts[-1])
        o0, o1, n0, n1 = old_pts[i], old_pts[i + 1], new_pts[i], new_pts[i + 1]
        if o1 == o0:
            return n1
        return n0 + (t - o0) * (n1 - n0) / (o1 - o0)

    return warp, info


# ---------------------------------------------------------------- timing pass

@dataclass
class TimedOp:
    name: str
    phase: str
    start_us: float          # warped, from the iteration start
    dur_us: float
    stream: int
    kernels: list[Kernel]
    timed: bool              # has kernels (GPU) or a CPU span (CPU recording)


def timing_ops(capture: Capture, gpu: bool, target_us: float | None,
               skip: int = 1) -> tuple[list[TimedOp], dict[str, Any]]:
    """The median iteration of the timing pass (by span, after skipping the first `skip`), its
    ops timed by kernels (GPU) or CPU spans, with idle gaps fitted to `target_us`."""
    iterations = capture.annotations_named(ITERATION)
    if len(iterations) <= skip:
        raise TraceError(f"the timing pass has {len(iterations)} iterations; need more than "
                         f"{skip}")
    candidates = []
    for ann in iterations[skip:]:
        ops = capture.ops_between(ann.start_ns, ann.end_ns)
        if gpu:
            ends = [k.end_ns for op in ops for k in op.kernels]
        else:
            ends = [op.end_ns for op in ops]
        if not ends:
            raise TraceError("an iteration of the timing pass has no "
                             + ("GPU kernels" if gpu else "ops"))
        candidates.append((max(ends) - ann.start_ns, ann, ops))
    candidates.sort(key=lambda c: c[0])
    span_ns, window, ops = candidates[len(candidates) // 2]
    origin = window.start_ns
    phases = phases_of(ops, capture, [])
    if gpu:
        intervals = [((k.start_ns - origin) / 1e3, (k.end_ns - origin) / 1e3)
                     for op in ops for k in op.kernels]
    else:
        intervals = [((op.start_ns - origin) / 1e3, (op.end_ns - origin) / 1e3) for op in ops]
    warp, info = fit_idle(intervals, target_us, scale_busy=not gpu)
    info["timing_iterations_us"] = [round(c[0] / 1e3, 3) for c in
                                    sorted(candidates, key=lambda c: c[1].start_ns)]
    smap = stream_map(k.stream for op in ops for k in op.kernels)
    out = []
    for op, phase in zip(ops, phases, strict=False):
        if gpu:
            kernels = [Kernel(k.name, k.stream, round(warp((k.start_ns - origin) / 1e3), 3),
                              round((k.end_ns - k.start_ns) / 1e3, 3)) for k in op.kernels]
            if kernels:
                start = kernels[0].start_us
                end = max(k.start_us + k.dur_us for k in kernels)
                out.append(TimedOp(op.name, phase, start, end - start,
                                   smap[op.kernels[0].stream], kernels, True))
            else:
                out.append(TimedOp(op.name, phase, 0.0, 0.0, 0, [], False))
        else:
            start = warp((op.start_ns - origin) / 1e3)
            end = warp((op.end_ns - origin) / 1e3)
            out.append(TimedOp(op.name, phase, start, end - start, 0, [], True))
    info["stream_map"] = {str(k): v for k, v in smap.items()}
    return out, info


DELIMITER = "spin_kernel"  # torch.cuda._sleep's kernel, launched before each timed iteration


def timing_kernels(capture: Capture, target_us: float | None,
                   skip: int = 1) -> tuple[list[Kernel], dict[str, Any]]:
    """The kernels of the median iteration of a CUDA-only timing pass (by span from the
    delimiter kernel that starts each iteration, after skipping the first `skip`), in start
    order, with idle gaps fitted to `target_us`. Times are us from the delimiter's end."""
    marks = [i for i, k in enumerate(capture.kernels) if DELIMITER in k.name]
    if len(marks) <= skip:
        raise TraceError(f"the timing pass has {len(marks)} iterations (delimiter kernels); need "
                         f"more than {skip}")
    candidates = []
    bounds = marks + [len(capture.kernels)]
    for n in range(skip, len(marks)):
        origin = capture.kernels[bounds[n]].end_ns
        ks = capture.kernels[bounds[n] + 1:bounds[n + 1]]
        if not ks:
            raise TraceError("an iteration of the timing pass launched no kernels")
        span = max(k.end_ns for k in ks) - origin
        candidates.append((span, n, origin, ks))
    ordered = sorted(candidates, key=lambda c: (c[0], c[1]))
    _, _, origin, ks = ordered[len(ordered) // 2]
    intervals = [((k.start_ns - origin) / 1e3, (k.end_ns - origin) / 1e3) for k in ks]
    warp, info = fit_idle(intervals, target_us)
    info["timing_iterations_us"] = [round(c[0] / 1e3, 3) for c in candidates]
    info["kernels_per_iteration"] = [len(c[3]) for c in candidates]
    kernels = [Kernel(k.name, k.stream, round(warp((k.start_ns - origin) / 1e3), 3),
                      round((k.end_ns - k.start_ns) / 1e3, 3)) for k in ks]
    return kernels, info
