"""Pictures of runs: the only module that imports matplotlib (with the Agg backend, no screen)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from .fileio import replace_atomically  # noqa: E402
from .trace.schema import TENSOR_KINDS, Trace

KIND_COLORS = {
    "weight": "#4c72b0", "optimizer_state": "#8172b2", "gradient": "#dd8452",
    "activation": "#55a868", "input": "#937860", "workspace": "#c44e52", "temporary": "#da8bc3",
}
PHASE_COLORS = {"fwd": "#55a868", "bwd": "#4c72b0", "opt": "#8172b2", "other": "#999999"}
GIB = 2**30
BATCH = "trace.batch_size"  # sweep row columns of the swept trace's shape
SEQ = "trace.seq_len"


def memory_by_kind(trace: Trace) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Times (ms) and, per tensor kind, allocated GiB after each allocator event."""
    kind_of = {t.id: t.kind for t in trace.tensors}
    events = sorted((e for e in trace.mem_events if e.action in ("alloc", "free_completed")),
                    key=lambda e: e.time_us)
    times = np.zeros(len(events) + 1)
    levels = {k: np.zeros(len(events) + 1) for k in TENSOR_KINDS}
    current = dict.fromkeys(TENSOR_KINDS, 0)
    for i, e in enumerate(events, start=1):
        kind = kind_of.get(e.tensor if e.tensor is not None else -1, "temporary")
        current[kind] += e.size_bytes if e.action == "alloc" else -e.size_bytes
        times[i] = e.time_us / 1e3
        for k in TENSOR_KINDS:
            levels[k][i] = current[k] / GIB
    return times, levels


def plot_run(trace: Trace, report: dict[str, Any], path: str) -> None:
    """Memory over time stacked by tensor kind with the capacity line, above the streams'
    activity (compute by phase, stalls, H2D and D2H copies). Written atomically."""
    fig, (ax_mem, ax_streams) = plt.subplots(
        2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    end_ms = report["iteration_time_us"] / 1e3
    times, levels = memory_by_kind(trace)
    times = np.append(times, end_ms)
    kinds = [k for k in TENSOR_KINDS if levels[k].any()]
    stacks = [np.append(levels[k], levels[k][-1]) for k in kinds]
    if kinds:
        ax_mem.stackplot(times, *stacks, labels=kinds, step="post",
                         colors=[KIND_COLORS[k] for k in kinds], alpha=0.85)
    cap = report["capacity_bytes"] / GIB
    peak = report["peak_allocated_bytes"] / GIB
    ax_mem.axhline(cap, color="black", linestyle="--", linewidth=1.2,
                   label=f"capacity {cap:.1f} GiB")
    ax_mem.set_ylim(0, max(cap, peak) * 1.08 if cap < 4 * max(peak, 1e-9) else peak * 1.25)
    if cap >= 4 * max(peak, 1e-9):
        ax_mem.text(0.99, 0.97, f"capacity {cap:.1f} GiB (off the scale)", ha="right", va="top",
                    transform=ax_mem.transAxes, fontsize=9)
    ax_mem.set_ylabel("device memory (GiB)")
    status = "fits" if report["fits"] else "OUT OF MEMORY"
    meta = trace.meta
    ax_mem.set_title(f"{meta.get('model', '?')} batch {meta.get('batch_size', '?')} on "
                     f"{report['hardware']}, policy {report['policy']}: {status}; "
                     f"iteration {end_ms:.1f} ms, peak {peak:.2f} GiB", fontsize=10)
    ax_mem.legend(loc="upper left", fontsize=8, ncol=4)
    ax_mem.grid(alpha=0.3)

    rows = {"compute": 2, "H2D": 1, "D2H": 0}
    for phase, color in PHASE_COLORS.items():
        spans = [(op.start_us / 1e3, op.dur_us / 1e3) for op in trace.ops
                 if op.phase == phase and op.stream == 0]
        if spans:
            ax_streams.broken_barh(spans, (rows["compute"] - 0.4, 0.8), color=color,
                                   label=f"compute {phase}")
    stalls = [((op.start_us - float(op.attr("stall_us", 0.0))) / 1e3,
               float(op.attr("stall_us", 0.0)) / 1e3) for op in trace.ops
              if float(op.attr("stall_us", 0.0)) > 0]
    if stalls:
        ax_streams.broken_barh(stalls, (rows["compute"] - 0.4, 0.8), color="#d62728",
                               label="stall")
    for direction, row, color in (("h2d", "H2D", "#17becf"), ("d2h", "D2H", "#ff7f0e")):
        spans = [(c.start_us / 1e3, c.dur_us / 1e3) for c in trace.copies
                 if c.direction == direction]
        if spans:
            ax_streams.broken_barh(spans, (rows[row] - 0.4, 0.8), color=color, label=row)
    ax_streams.set_yticks(list(rows.values()), list(rows.keys()))
    ax_streams.set_xlabel("time (ms)")
    ax_streams.set_xlim(0, max(end_ms, 1e-6))
    ax_streams.legend(loc="upper right", fontsize=7, ncol=6)
    ax_streams.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def plot_validation(rows: list[dict[str, Any]], path: str) -> None:
    """Predicted against measured iteration time and peak allocated, one point per case, on
    log axes (the cases span two orders of magnitude; equal relative errors lie equally far
    from the identity), with the identity line and the cases' usual tolerance as a band; in
    each panel the cases outside that panel's own tolerance in red (a time miss does not colour
    the peak panel); a third panel, the fit verdicts against the real runs (_plot_verdicts)."""
    from .validate import metric_ok

    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    _plot_verdicts(axes[2], rows)
    for ax, key, metric, scale, unit, label in (
            (axes[0], "iteration_time_us", "iteration_time", 1e3, "ms", "iteration time"),
            (axes[1], "peak_allocated_bytes", "peak_allocated", GIB, "GiB", "peak allocated")):
        pts = [(r["measured"][key] / scale, r["predicted"][key] / scale, metric_ok(r, metric),
                r["id"])
               for r in rows if r["measured"].get(key) and r["predicted"].get(key)
               and r["measured"]["fits"] and r["predicted"]["fits"]]
        if pts:
            lo = min(min(m, p) for m, p, _, _ in pts) / 1.25
            hi = max(max(m, p) for m, p, _, _ in pts) * 1.25
            tols = sorted(r["tolerance"][metric] for r in rows
                          if metric in (r.get("tolerance") or {}))
            ax.plot([lo, hi], [lo, hi], color="gray", linewidth=1, label="predicted = measured")
            if tols:
                tol = tols[len(tols) // 2]
                for f in (1 - tol, 1 + tol):
                    ax.plot([lo, hi], [lo * f, hi * f], color="gray", linewidth=0.8,
                            linestyle="--", label=f"±{tol:.0%}" if f > 1 else None)
            for ok in (True, False):
                sel = [(m, p) for m, p, o, _ in pts if o is ok]
                if sel:
                    ax.scatter(*zip(*sel, strict=True), color="#4c72b0" if ok else "#d62728",
                               s=14, label="within tolerance" if ok else "outside tolerance",
                               zorder=3)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured {label} ({unit})")
        ax.set_ylabel(f"predicted {label} ({unit})")
        misses = sum(not o for _, _, o, _ in pts)
        ax.set_title(f"{label}: {len(pts)} cases, {misses} outside tolerance")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _plot_verdicts(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Whether each case fits, predicted against measured: the cases grouped by how many of
    their timing draws fit (vsim.engine.timing_draws; those out of memory in the recorded
    timing, and those run without draws, apart), each bar the share of its real runs that fit:
    a verdict is trustworthy where that share is near 0 or 1."""
    groups = ["out of memory\nas recorded", "0 of 3\ndraws fit", "1 of 3", "2 of 3",
              "3 of 3", "fits, no\ndraws"]
    fit = [0] * len(groups)
    runs = [0] * len(groups)
    for r in rows:
        if r["predicted"].get("fits") is None:
            continue
        drawn = r["predicted"].get("timing_draws")
        if drawn is not None and drawn.get("draws") == 3:
            g = 1 + int(drawn["fit"])
        else:
            g = 5 if r["predicted"]["fits"] else 0
        runs[g] += 1
        fit[g] += bool(r["measured"]["fits"])
    shown = [i for i in range(len(groups)) if runs[i]]
    share = [fit[i] / runs[i] for i in shown]
    # coloured by the verdict: most draws out of memory (or the recorded timing) is a
    # prediction of out of memory, whose bar should be near 0; the others near 1
    predicted_fit = [i >= 3 for i in shown]
    bars = ax.bar(range(len(shown)), share,
                  color=["#4c72b0" if f else "#d62728" for f in predicted_fit])
    ax.legend([bars[predicted_fit.index(v)] for v in (True, False) if v in predicted_fit],
              [label for v, label in ((True, "predicted: fits"),
                                      (False, "predicted: out of memory"))
               if v in predicted_fit], fontsize=8, loc="upper left")
    for j, i in enumerate(shown):
        ax.text(j, share[j] + 0.02, f"{fit[i]}/{runs[i]}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)), [groups[i] for i in shown], fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.axhline(0.5, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel("predicted")
    ax.set_ylabel("share of the real runs that fit")
    right = sum(r["predicted"]["fits"] == bool(r["measured"]["fits"]) for r in rows
                if r["predicted"].get("fits") is not None)
    ax.set_title(f"fits: {right} of {sum(runs)} verdicts right")
    ax.grid(alpha=0.3, axis="y")


# ------------------------------------------------------------------ sweeps

_MARKERS = "osD^v<>pPX*h"
_LINES = ("-", "--", "-.", ":")


def plot_sweep(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    """The pictures of a sweep (rows as vsim.sweep.read_rows gives them), written into
    `out_dir`: per model and hardware, the slowdown against capacity per policy
    (slowdown-MODEL-HW.png) and, when the sweep has several batch sizes of the model, the
    largest batch that fits against capacity per policy (max-batch-MODEL-HW.png), or for
    several sequence lengths (traces with meta.seq_len) the longest sequence that fits
    (max-seq-MODEL-HW.png). Returns the paths written."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("capacity_bytes") is None or r.get("fits") is None:
            continue
        groups.setdefault((_model(r), str(r.get("hardware"))), []).append(r)
    written = []
    for (model, hw), group in sorted(groups.items()):
        stem = f"{_slug(model)}-{_slug(hw)}"
        path = str(Path(out_dir) / f"slowdown-{stem}.png")
        plot_slowdown(group, path)
        written.append(path)
        if len({r.get("trace.batch_size") for r in group}) >= 2:
            path = str(Path(out_dir) / f"max-batch-{stem}.png")
            plot_max_batch(group, path)
            written.append(path)
        if len({r.get("trace.seq_len") for r in group if r.get("trace.seq_len")}) >= 2:
            path = str(Path(out_dir) / f"max-seq-{stem}.png")
            plot_max_batch(group, path, axis=SEQ)
            written.append(path)
    return written


def _model(row: dict[str, Any]) -> str:
    return str(row.get("trace.model") or Path(str(row.get("trace_path", "?"))).name)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _series(rows: list[dict[str, Any]], several_allocators: bool | None = None
            ) -> dict[str, list[dict[str, Any]]]:
    """Rows by policy (and allocator, when the rows have several), ordered by name with `none`
    first: the same order (and so the same colour) whatever order the rows came in."""
    if several_allocators is None:
        several_allocators = len({r.get("allocator") for r in rows}) > 1
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        name = str(r.get("policy")) + (f" / {r.get('allocator')}" if several_allocators else "")
        out.setdefault(name, []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("none"), kv[0])))


def _style(name: str, i: int) -> dict[str, Any]:
    """The i-th series' look; no policy is black and drawn above the others (it is the
    reference, and the policies that leave everything on the GPU sit on top of it)."""
    if name.startswith("none"):
        return {"color": "black", "marker": "o", "markersize": 4, "linestyle": "-",
                "linewidth": 1.6, "zorder": 4}
    return {"color": f"C{i % 10}", "marker": _MARKERS[i % len(_MARKERS)], "markersize": 3.5,
            "linestyle": _LINES[i % len(_LINES)], "linewidth": 1.3, "zorder": 2}


def slowdown_panels(rows: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """The panels of plot_slowdown, in order: one per (batch size, sequence length) of the
    rows' traces (sequence None for traces without one), so that each panel's lines compare
    policies on one trace."""
    return sorted({(r.get(BATCH), r.get(SEQ)) for r in rows},
                  key=lambda b: tuple((v is None, v or 0) for v in b))


def plot_slowdown(rows: list[dict[str, Any]], path: str) -> None:
    """Iteration time over the no-policy time at ample capacity, against capacity, one line per
    policy, one panel per batch size (per batch size and sequence length when the traces have
    several: the lines of one panel belong to one trace); a policy has no point where it runs
    out of memory."""
    batches = slowdown_panels(rows)
    ncols = min(3, len(batches))
    nrows = -(-len(batches) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(7.0, 5.2 * ncols), 3.8 * nrows + 1.2),
                             squeeze=False, sharey=True, sharex=True)
    handles: dict[str, Any] = {}
    several = len({r.get("allocator") for r in rows}) > 1
    index = {name: i for i, name in enumerate(_series(rows, several))}  # one style per series
    for ax, batch in zip(axes.flat, batches, strict=False):
        sel = [r for r in rows if (r.get(BATCH), r.get(SEQ)) == batch]
        ax.axhline(1.0, color="gray", linewidth=1)
        for name, rs in _series(sel, several).items():
            i = index[name]
            pts = sorted((r["capacity_bytes"] / GIB, r["slowdown"]) for r in rs
                         if r.get("fits") and r.get("slowdown") is not None)
            if not pts:
                continue
            (line,) = ax.plot(*zip(*pts, strict=True), label=name, **_style(name, i))
            handles.setdefault(name, line)
        seq = f" seq {batch[1]}" if batch[1] is not None else ""
        ax.set_title(f"{_model(sel[0])} batch {batch[0]}{seq} on {sel[0].get('hardware')}",
                     fontsize=10)
        ax.set_xlabel("capacity (GiB)")
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("slowdown (x no policy, ample memory)")
    for ax in list(axes.flat)[len(batches):]:
        ax.set_visible(False)
    handles = {name: handles[name] for name in index if name in handles}
    ncol = 2 if ncols == 1 else 3
    legend_rows = -(-len(handles) // ncol) + 1
    bottom = min(0.5, 0.22 * legend_rows / fig.get_figheight())
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="lower center",
                   ncol=ncol, fontsize=8, title="policy (no point: out of memory there)",
                   title_fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    _save(fig, path)


def largest_batch(rows: list[dict[str, Any]], axis: str = BATCH) -> dict[str, dict[int, int]]:
    """Per policy (series as in the plots), per capacity in bytes: the largest batch size (or
    with axis=SEQ, sequence length) among the rows that fits there, 0 when none does. Rows of
    one model and hardware."""
    caps = sorted({int(r["capacity_bytes"]) for r in rows})
    table: dict[str, dict[int, int]] = {}
    for name, rs in _series(rows).items():
        best = dict.fromkeys(caps, 0)
        for r in rs:
            if r.get("fits") and r.get(axis) is not None:
                cap = int(r["capacity_bytes"])
                best[cap] = max(best[cap], int(r[axis]))
        table[name] = best
    return table


def slowdown_at_largest(rows: list[dict[str, Any]], axis: str = BATCH
                        ) -> dict[str, dict[int, float | None]]:
    """Per policy and capacity (as largest_batch), the slowdown of the run at the largest batch
    (sequence) that fits there; None where none fits or the row has no slowdown."""
    table = largest_batch(rows, axis)
    out: dict[str, dict[int, float | None]] = {}
    for name, rs in _series(rows).items():
        out[name] = {}
        for cap, best in table[name].items():
            hit = [r.get("slowdown") for r in rs if r.get("fits") and best
                   and int(r["capacity_bytes"]) == cap and r.get(axis) is not None
                   and int(r[axis]) == best]
            out[name][cap] = float(hit[0]) if hit and hit[0] is not None else None
    return out


def _values_text(values: list[int]) -> str:
    """Swept sizes for a title: all of them when few, else the range and the count."""
    if len(values) <= 6:
        return ", ".join(map(str, values))
    return f"{values[0]}..{values[-1]} ({len(values)} sizes)"


# At most this many capacities: the largest batch (sequence) as grouped bars per policy, with
# its value and slowdown written on each bar; more capacities: one step line per policy.
BAR_CAPACITIES = 4


def plot_max_batch(rows: list[dict[str, Any]], path: str, axis: str = BATCH) -> None:
    """The largest batch size (axis=SEQ: sequence length) of those swept that fits, per policy
    and capacity; none where none fits. For up to BAR_CAPACITIES capacities (cards) grouped
    horizontal bars, one group per policy, each bar labelled with the size and the slowdown
    there; for more, lines against capacity, nudged apart a little where policies agree."""
    batches = sorted({int(r[axis]) for r in rows if r.get(axis) is not None})
    table = largest_batch(rows, axis)
    word = "batch" if axis == BATCH else "sequence"
    most = "largest" if axis == BATCH else "longest"
    sample = rows[0]
    other = (f" at sequence {sample[SEQ]}" if axis == BATCH and sample.get(SEQ) else
             f" at batch {sample.get(BATCH)}" if axis == SEQ else "")
    title = (f"{_model(sample)}{other} on {sample.get('hardware')}: {most} trainable {word} "
             f"of {_values_text(batches)}")
    caps = sorted({int(r["capacity_bytes"]) for r in rows})
    if len(caps) <= BAR_CAPACITIES:
        gaps = {name: {cap: any(not r.get("fits") and int(r["capacity_bytes"]) == cap
                                and r.get(axis) is not None and int(r[axis]) < best
                                for r in rs)
                       for cap, best in table[name].items()}
                for name, rs in _series(rows).items()}
        _max_bars(table, slowdown_at_largest(rows, axis), gaps, caps, batches, path,
                  f"{most} {word} that fits (slowdown against no policy with ample memory)",
                  title)
        return
    fig, ax = plt.subplots(figsize=(10, 6.2))
    n = len(table)
    for i, (name, best) in enumerate(table.items()):
        x = [c / GIB for c in caps]
        nudge = 1 + 0.012 * (i - (n - 1) / 2)  # on a log axis: the same gap at every batch
        y = [best[c] * nudge if best[c] else np.nan for c in caps]
        ax.step(x, y, where="post", label=name, **_style(name, i))
    ax.set_yscale("log", base=2)
    ax.set_yticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_ylim(batches[0] / 1.4, batches[-1] * 1.4)
    ax.set_xlabel("capacity (GiB)")
    ax.set_ylabel(f"{most} {word} that fits")
    ax.set_title(title + " (no line: none fits)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              title="policy", title_fontsize=8, frameon=False)
    fig.tight_layout()
    _save(fig, path)


def _max_bars(table: dict[str, dict[int, int]], slow: dict[str, dict[int, float | None]],
              gaps: dict[str, dict[int, bool]], caps: list[int], sizes: list[int], path: str,
              xlabel: str, title: str) -> None:
    """Grouped horizontal bars: a group per policy (top to bottom in series order), a bar per
    capacity, its length the largest size that fits on a log2 axis, labelled 'SIZE (SLOWx)' or
    'none fits', with a '*' where a smaller swept size ran out of memory there."""
    names = list(table)
    height = 0.8 / len(caps)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.32 * len(names) * len(caps) + 0.9))
    base = sizes[0] / 2  # bars start left of the smallest size, so that one shows
    for j, cap in enumerate(caps):
        ys = [len(names) - 1 - k + (len(caps) - 1 - j - (len(caps) - 1) / 2) * height
              for k in range(len(names))]
        widths = [table[n][cap] - base if table[n][cap] else 0 for n in names]
        ax.barh(ys, widths, left=base, height=height * 0.9, color=f"C{j}",
                label=f"{cap / GIB:g} GiB")
        for y, n in zip(ys, names, strict=True):
            best, sd = table[n][cap], slow[n][cap]
            text = "none fits" if not best else f"{best} ({sd:.2f}x)" if sd else str(best)
            text += " *" if gaps[n][cap] else ""
            ax.text(best * 1.04 if best else base * 1.04, y, text, va="center", fontsize=7.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes], fontsize=8)
    ax.minorticks_off()
    ax.set_xlim(base, sizes[-1] * 2.2)
    ax.set_yticks(range(len(names)), [n.replace(":", "\n", 1) for n in reversed(names)],
                  fontsize=7.5)
    ax.set_xlabel(xlabel)
    if any(g for per in gaps.values() for g in per.values()):
        title += "\n* a smaller size of those swept ran out of memory at that capacity"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", title="capacity", title_fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig: Any, path: str) -> None:
    try:
        replace_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=".png")
    finally:
        plt.close(fig)
