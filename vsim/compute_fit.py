"""Fitting vsim.compute's efficiencies: per op class, the compute and DRAM fractions, overhead and
channel ramp that best explain recorded kernel times (`fit`, for `vsim fit-compute`), and a
refit of the convolution classes to whole-network timings (`fit_to_timings`, for networks known
only by their published iteration times). The model itself is vsim.compute's."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .compute import (
    CLASSES,
    IMPLICIT_GEMM_ASSUMED,
    ClassEfficiency,
    Efficiencies,
    OpCost,
    busy_time_us,
    op_costs,
    peak_for,
)
from .hardware import Hardware
from .trace.schema import Trace


@dataclass(frozen=True)
class Sample:
    """One op of a recording: its cost and the busy time of its kernels."""

    trace: str
    cost: OpCost
    busy_us: float


def samples(trace: Trace, label: str) -> list[Sample]:
    """Ops with kernels, each with the sum of its kernels' durations (its busy time)."""
    costs = op_costs(trace)
    out = []
    for op in trace.ops:
        busy = sum(k.dur_us for k in op.kernels)
        if busy > 0:
            out.append(Sample(label, costs[op.id], busy))
    return out


_COMPUTE_GRID = [10 ** (k / 30) for k in range(-75, 1)]      # 0.3% .. 100%
_DRAM_GRID = [10 ** (k / 30) for k in range(-60, 31)]        # 1% .. 1000%
_OVERHEAD_GRID = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0]
_RAMP_GRID = [(0.0, 1.0)] + [(k0, a) for k0 in (64.0, 128.0, 256.0, 512.0)
                             for a in (0.5, 1.0, 1.5, 2.0)]


def fit_class(group: Sequence[Sample], hw: Hardware, ramp: bool = True
              ) -> tuple[ClassEfficiency, dict[str, Any]]:
    """Grid search for (compute, dram, overhead, ramp) minimising the time-weighted squared
    relative error, sum of busy x (model / busy - 1)^2: the ops that take the time decide, and
    a microsecond missed on a small op costs what it costs in the iteration."""
    import numpy as np

    busy = np.array([s.busy_us for s in group])
    flops = np.array([s.cost.flops for s in group])
    nbytes = np.array([s.cost.bytes for s in group])
    chans = np.array([s.cost.channels for s in group])
    peak = np.array([peak_for(hw, s.cost.precision) for s in group])
    has_flops = bool((flops > 0).any())
    comp = np.array(_COMPUTE_GRID if has_flops else [1.0])
    dram = np.array(_DRAM_GRID)
    tm = nbytes[None, :] / (hw.dram_bytes_per_us * dram[:, None])     # (D, n)
    ramps = _RAMP_GRID if (ramp and has_flops and (chans > 0).any()) else [(0.0, 1.0)]
    best: tuple[float, ...] | None = None
    for k0, a in ramps:
        r = (np.minimum(1.0, np.where(chans > 0, chans, k0) / k0) ** a) if k0 > 0 else 1.0
        tc = flops[None, :] / (peak[None, :] * comp[:, None] * r)     # (C, n)
        roof = tc[:, None, :] + tm[None, :, :]                        # (C, D, n)
        for o in _OVERHEAD_GRID:
            err = (((o + roof) - busy) ** 2 / busy).sum(axis=-1)
            i, j = np.unravel_index(int(np.argmin(err)), err.shape)
            cand = (float(err[i, j]), float(comp[i]), float(dram[j]), o, k0, a)
            if best is None or cand[0] < best[0]:
                best = cand
    assert best is not None
    # Refine (compute, dram, overhead) around the grid's best with shrinking local grids.
    _, c0, d0, o0, k0, a = best
    r = (np.minimum(1.0, np.where(chans > 0, chans, k0) / k0) ** a) if k0 > 0 else 1.0
    step, ostep = 10 ** (2 / 30), 4.0
    for _ in range(10):
        cs = (np.clip(c0 * step ** np.linspace(-1, 1, 9), 1e-4, 1.0) if has_flops
              else np.array([1.0]))
        ds = d0 * step ** np.linspace(-1, 1, 9)
        os_ = np.maximum(0.0, o0 + ostep * np.linspace(-1, 1, 9))
        tc = flops[None, :] / (peak[None, :] * cs[:, None] * r)
        tmm = nbytes[None, :] / (hw.dram_bytes_per_us * ds[:, None])
        pred = os_[:, None, None, None] + tc[None, :, None, :] + tmm[None, None, :, :]
        err = ((pred - busy) ** 2 / busy).sum(axis=-1)
        i, j, k = np.unravel_index(int(np.argmin(err)), err.shape)
        o0, c0, d0 = float(os_[i]), float(cs[j]), float(ds[k])
        step, ostep = step ** 0.5, ostep * 0.5
    e = ClassEfficiency(compute=c0, dram=d0, overhead_us=round(o0, 2), ramp_channels=k0,
                        ramp_power=a)
    # The squared relative error leans low on totals (Jensen); scale the rate terms so that the
    # class's summed model time equals its summed busy time over all the recordings.
    single = Efficiencies(name="", classes={"elementwise": e}, implicit_gemm=1.0)
    rate_part = sum(busy_time_us(replace(s.cost, cls="elementwise"), hw, single) - e.overhead_us
                    for s in group)
    if rate_part > 0:
        scale = rate_part / max(1e-9, float(busy.sum()) - e.overhead_us * len(group))
        if scale > 0:
            e = replace(e, compute=min(1.0, e.compute * scale) if has_flops else 1.0,
                        dram=e.dram * scale)
    single = Efficiencies(name="", classes={"elementwise": e}, implicit_gemm=1.0)
    pred = np.array([busy_time_us(replace(s.cost, cls="elementwise"), hw, single)
                     for s in group])
    return e, {"ops": len(group), "busy_ms": round(float(busy.sum()) / 1e3, 3),
               "model_ms": round(float(pred.sum()) / 1e3, 3),
               "median_abs_op_error": f"{float(np.median(np.abs(pred / busy - 1))) * 100:.1f}%",
               "flops_known": int((flops > 0).sum())}


def fit(traces: Iterable[tuple[str, Trace]], hw: Hardware, implicit_gemm: float | None = None,
        provenance: dict[str, Any] | None = None) -> tuple[Efficiencies, dict[str, Any]]:
    """Fit every class across all `traces` (label, trace) recorded on `hw`; the report has each
    class's errors and, per trace, the summed model busy time against the measured one.
    `implicit_gemm` defaults to IMPLICIT_GEMM_ASSUMED (no recording times the (m) algorithm)."""
    traces = list(traces)
    all_samples = [s for label, t in traces for s in samples(t, label)]
    classes: dict[str, ClassEfficiency] = {}
    per_class: dict[str, Any] = {}
    for cls in CLASSES:
        group = [s for s in all_samples if s.cost.cls == cls]
        if group:
            classes[cls], per_class[cls] = fit_class(group, hw)
    if "elementwise" not in classes:
        classes["elementwise"] = ClassEfficiency(1.0, 1.0, 0.0)
    implicit = implicit_gemm if implicit_gemm is not None else IMPLICIT_GEMM_ASSUMED
    eff = Efficiencies(name=hw.name, classes=classes, implicit_gemm=implicit,
                       provenance=dict(provenance or {}))
    per_trace = {}
    for label, _ in traces:
        ss = [s for s in all_samples if s.trace == label]
        measured = sum(s.busy_us for s in ss)
        model = sum(busy_time_us(s.cost, hw, eff) for s in ss)
        per_trace[label] = {"busy_ms": round(measured / 1e3, 3), "model_ms": round(model / 1e3, 3),
                            "error": f"{(model / measured - 1) * 100:+.1f}%"}
    return eff, {"classes": per_class, "traces": per_trace}


def fit_to_timings(networks: Sequence[tuple[str, Trace, float, float]], hw: Hardware,
                   base: Efficiencies, provenance: dict[str, Any] | None = None
                   ) -> tuple[Efficiencies, dict[str, Any]]:
    """Fit the conv_fwd and conv_bwd compute fractions of `base` (no channel ramp) so that the
    model's forward and backward times of whole networks match published ones: `networks` are
    (label, trace, forward us, backward us), timed without loss, optimizer and dropout (as
    convnet-benchmarks times them). Every other class keeps `base`'s values. The fit minimises
    the squared log errors of the 2 x len(networks) times; the report has each one."""
    import numpy as np

    def parts(trace: Trace) -> dict[str, Any]:
        costs = op_costs(trace)
        out: dict[str, Any] = {"fwd": [0.0, 0.0], "bwd": [0.0, 0.0]}   # conv flops, rest us
        for op in trace.ops:
            cost = costs[op.id]
            if op.phase not in ("fwd", "bwd") or op.layer_type in ("loss", "dropout") \
                    or op.attr("launches") == 0 or cost.cls not in CLASSES:
                continue
            if op.layer == "" and op.layer_type == "other":  # the loss gradient's ones_like
                continue
            if cost.cls in ("conv_fwd", "conv_bwd"):
                e = base.of(cost.cls)
                out[op.phase][0] += cost.flops / peak_for(hw, cost.precision)
                out[op.phase][1] += e.overhead_us + cost.bytes / (hw.dram_bytes_per_us * e.dram)
            else:
                out[op.phase][1] += busy_time_us(cost, hw, base)
        return out

    split = [(label, parts(t), f, b) for label, t, f, b in networks]
    grid = np.array([10 ** (k / 200) for k in range(-400, 121)])   # 1% .. 400%
    fitted = {}
    for phase, cls, col in (("fwd", "conv_fwd", 2), ("bwd", "conv_bwd", 3)):
        conv = np.array([p[phase][0] for _, p, *_ in split])
        rest = np.array([p[phase][1] for _, p, *_ in split])
        meas = np.array([row[col] for row in split])
        pred = conv[None, :] / grid[:, None] + rest[None, :]
        err = ((np.log(pred) - np.log(meas)) ** 2).sum(axis=1)
        fitted[cls] = float(grid[int(np.argmin(err))])
    classes = dict(base.classes)
    for cls, value in fitted.items():
        classes[cls] = replace(base.of(cls), compute=value, ramp_channels=0.0, ramp_power=1.0)
    eff = Efficiencies(name=hw.name, classes=classes, implicit_gemm=base.implicit_gemm,
                       provenance=dict(provenance or {}))
    report: dict[str, Any] = {"networks": {}}
    for label, p, f, b in split:
        row = {}
        for phase, cls, published in (("fwd", "conv_fwd", f), ("bwd", "conv_bwd", b)):
            model_us = float(p[phase][0] / fitted[cls] + p[phase][1])
            row[phase] = {"published_ms": round(published / 1e3, 2),
                          "model_ms": round(model_us / 1e3, 2),
                          "error": f"{(model_us / published - 1) * 100:+.1f}%"}
        report["networks"][label] = row
    return eff, report
