"""The replay a simulation with no policy makes of a trace, in a few lines and without simpy, so the
recorder can show on the GPU machine whether a trace will meet issue 3's acceptance (iteration
time within 3% of measured, peak allocated within 1%).

Semantics (the engine's, DESIGN.md): ops run in trace order, each on its stream after the previous
op there plus the recorded gap between them (this op's recorded start minus the previous op's
recorded end on that stream, never negative; the first op of a stream keeps its recorded start),
and not before its dependencies end. Tensors without a producer are live from the start; a tensor
is allocated when its producer starts and released when the op that frees it ends.
"""

from __future__ import annotations

from typing import Any

from ..trace.schema import Trace


def replay_estimate(trace: Trace) -> tuple[float, int]:
    """(iteration time in us, peak allocated bytes) of replaying `trace` with no policy."""
    size = {t.id: t.size_bytes for t in trace.tensors}
    produced: dict[int, list[int]] = {}
    for t in trace.tensors:
        if t.producer is not None:
            produced.setdefault(t.producer, []).append(t.id)
    live = sum(t.size_bytes for t in trace.tensors if t.producer is None)
    peak = live
    end: dict[int, float] = {}
    last: dict[int, tuple[float, float]] = {}  # stream -> (recorded end, replayed end)
    finish = 0.0
    for op in trace.ops:
        prev = last.get(op.stream)
        if prev is None:
            start = op.start_us
        else:
            start = prev[1] + max(0.0, op.start_us - prev[0])
        for dep in op.deps:
            start = max(start, end[dep])
        stop = start + op.dur_us
        end[op.id] = stop
        last[op.stream] = (op.start_us + op.dur_us, stop)
        finish = max(finish, stop)
        live += sum(size[t] for t in produced.get(op.id, ()))
        peak = max(peak, live)
        live -= sum(size[t] for t in op.frees)
    return finish, peak


def compare(trace: Trace) -> dict[str, Any]:
    """Replay estimate against the trace's measured block: values and relative errors, and whether
    they fall within issue 3's tolerances (3% time, 1% peak)."""
    time_us, peak = replay_estimate(trace)
    out: dict[str, Any] = {"replay_time_us": time_us, "replay_peak_bytes": peak}
    m = trace.measured
    if m is not None:
        time_err = (time_us - m.iteration_time_us) / m.iteration_time_us \
            if m.iteration_time_us else float("nan")
        peak_err = (peak - m.peak_allocated_bytes) / m.peak_allocated_bytes \
            if m.peak_allocated_bytes else float("nan")
        out.update(measured_time_us=m.iteration_time_us,
                   measured_peak_bytes=m.peak_allocated_bytes,
                   time_error=time_err, peak_error=peak_err,
                   time_ok=abs(time_err) <= 0.03, peak_ok=abs(peak_err) <= 0.01)
    return out


def describe(trace: Trace) -> str:
    """One line: replay vs measured, for the recorder's progress output."""
    c = compare(trace)
    line = (f"replay {c['replay_time_us'] / 1e3:.2f} ms, peak {c['replay_peak_bytes'] / 2**20:.1f}"
            " MiB")
    if "measured_time_us" in c:
        line += (f" | measured {c['measured_time_us'] / 1e3:.2f} ms, peak "
                 f"{c['measured_peak_bytes'] / 2**20:.1f} MiB | error time "
                 f"{c['time_error'] * 100:+.2f}% ({'ok' if c['time_ok'] else 'OUT'} of 3%), "
                 f"peak {c['peak_error'] * 100:+.2f}% ({'ok' if c['peak_ok'] else 'OUT'} of 1%)")
    return line


def index_table(paths: list[str]) -> str:
    """A markdown table of trace files (traces/README.md): provenance, size on disk, measured
    iteration time and peak against the replay estimate, and how much the recorder's idle-gap
    fit changed the profiled timeline."""
    from pathlib import Path

    from ..trace import load_trace

    rows = ["| trace | model | batch | device | date | torch | size | measured ms | replay ms "
            "(error) | measured peak MiB | replay peak MiB (error) | profiled span / busy ms | "
            "idle fit |", "|" + "---|" * 13]
    for path in paths:
        t = load_trace(path)
        c = compare(t)
        m = t.meta
        timing = m.get("timing", {})
        fit = timing.get("fit", "?")
        if "subtract_us" in timing:
            fit += f" {timing['subtract_us']:.1f} us/gap"
        elif "scale" in timing:
            fit += f" x{timing['scale']:.3f}"
        size = Path(path).stat().st_size
        measured = t.measured
        rows.append(
            f"| {Path(path).name} | {m.get('model')} | {m.get('batch_size')} | {m.get('device')} | "
            f"{str(m.get('date', ''))[:10]} | {m.get('torch')} | {size / 1e3:.0f} kB | "
            + (f"{measured.iteration_time_us / 1e3:.2f} | {c['replay_time_us'] / 1e3:.2f} "
               f"({c['time_error'] * 100:+.2f}%) | {measured.peak_allocated_bytes / 2**20:.1f} | "
               f"{c['replay_peak_bytes'] / 2**20:.1f} ({c['peak_error'] * 100:+.2f}%) | "
               if measured is not None else "- | - | - | - | ")
            + f"{timing.get('profiled_span_us', 0) / 1e3:.2f} / "
              f"{timing.get('busy_us', 0) / 1e3:.2f} | {fit} |")
    return "\n".join(rows) + "\n"
