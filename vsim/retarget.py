"""Retarget a trace to another GPU: op times through the compute model, as a pure trace -> trace
transform done before `simulate` (the engine never sees the difference).

Each op's busy time (its kernels; the whole op for a trace without kernels) is scaled by the
model's ratio new GPU / recording GPU (vsim.compute), so what the model does not capture of an
op (cuDNN's algorithm choice, an inefficient shape) carries over from the recording and only the
change between GPUs comes from the model. Idle time inside an op (between its kernels) and the
launch gaps between ops are host-side and kept. A convolution also gets `dur_us_memory_algo`,
its time with vDNN's memory-optimal algorithm on the new GPU (scaled from a recorded one, else
modelled), so `algo=memory` policies use the new GPU's time.

The recording's `measured` block belongs to the recording GPU: it moves to
`meta.measured_on_recording` and the retargeted trace has none. `meta.retargeted_from` names the
recording's device and profile (the report's `retargeted_from`); `meta.hardware` becomes the new
profile.

Hypothetical GPUs: `hardware_with_overrides("h100-sxm", ["gpu.memory=24GiB", ...])` applies
unit-checked `KEY=VALUE` settings (keys in OVERRIDE_KEYS) to the profile's YAML and parses it
again with the profile's own checks.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compute import (
    Efficiencies,
    compute_signature,
    load_efficiencies,
    memory_algo_ratio,
    op_costs,
    time_ratio,
)
from .errors import ConfigError, HardwareError
from .hardware import Hardware, list_hardware, load_hardware, parse_hardware
from .safeload import read_yaml
from .trace.schema import Kernel, MemEvent, Op, Trace

# --set keys: dotted paths into a profile. PRECISION and CLASS stand for any name.
OVERRIDE_KEYS = (
    "name", "description",
    "gpu.memory", "gpu.context", "gpu.cuda_malloc",
    "compute.peak.PRECISION", "compute.dram_bandwidth", "compute.launch_latency",
    "compute.copy_interference", "compute.efficiency.CLASS",
    "link.h2d.pinned.bandwidth", "link.h2d.pinned.latency",
    "link.h2d.pageable.bandwidth", "link.h2d.pageable.latency",
    "link.d2h.pinned.bandwidth", "link.d2h.pinned.latency",
    "link.d2h.pageable.bandwidth", "link.d2h.pageable.latency",
    "link.duplex", "link.bandwidth",
    "host.pinned_limit", "host.pinned_alloc_per_GiB",
)


# ---------------------------------------------------------------- hypothetical GPUs

def _profile_path(name_or_path: str) -> Path:
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        return Path(name_or_path)
    found = list_hardware().get(name_or_path)
    if found is None:
        load_hardware(name_or_path)  # raises the usual "unknown hardware" error
        raise AssertionError("unreachable")
    return found


def _key_allowed(key: str) -> bool:
    parts = key.split(".")
    for pattern in OVERRIDE_KEYS:
        pp = pattern.split(".")
        if len(pp) == len(parts) and all(p == q or p in ("PRECISION", "CLASS")
                                          for p, q in zip(pp, parts, strict=True)):
            return True
    return False


def hardware_with_overrides(name_or_path: str, sets: Sequence[str]) -> Hardware:
    """The profile with each `KEY=VALUE` of `sets` applied (values carry their units, as in the
    profile: 24GiB, 32GB/s, 20TFLOP/s, 9us, 45%). `link.bandwidth` sets the pinned bandwidth of
    both directions and scales their pageable bandwidths and the duplex limit in proportion.
    ConfigError for an unknown key or a malformed setting; HardwareError (naming the key) for a
    bad value."""
    if not sets:
        return load_hardware(name_or_path)
    path = _profile_path(name_or_path)
    doc = read_yaml(path, HardwareError, "profile")  # bounded (safeload)
    if not isinstance(doc, dict):
        raise HardwareError("top level: expected a mapping", str(path))
    doc = copy.deepcopy(doc)
    applied = []
    for item in sets:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. gpu.memory=24GiB")
        if not _key_allowed(key):
            raise ConfigError(f"--set {key}: unknown key; valid: {', '.join(OVERRIDE_KEYS)}")
        if key == "link.bandwidth":
            _set_link_bandwidth(doc, value, str(path))
        else:
            node = doc
            parts = key.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[parts[-1]] = value
        applied.append(f"{key}={value}")
    base = str(doc.get("name") or path.stem)
    if not any(a.startswith("name=") for a in applied):
        doc["name"] = f"{base}+{','.join(applied)}"
    hw = parse_hardware(doc, f"{path} with --set {' '.join(applied)}")
    return dataclasses.replace(hw, source_path=str(path))


def _set_link_bandwidth(doc: dict[str, Any], value: str, where: str) -> None:
    from .units import parse_rate
    try:
        new = parse_rate(value, "--set link.bandwidth")
        link = doc["link"]
        old = {d: parse_rate(link[d]["pinned"]["bandwidth"], where) for d in ("h2d", "d2h")}
        duplex = parse_rate(link["duplex"], where)
    except (KeyError, TypeError):
        raise HardwareError("link: the profile lacks link.h2d/d2h.pinned.bandwidth or "
                            "link.duplex", where) from None
    except Exception as exc:  # noqa: BLE001 - a unit error, reported with its place
        raise HardwareError(str(exc), where) from None
    if new <= 0:
        raise ConfigError("--set link.bandwidth: must be above zero")
    for d in ("h2d", "d2h"):
        ratio = new / old[d]
        for kind in ("pinned", "pageable"):
            path = link[d][kind]
            path["bandwidth"] = f"{parse_rate(path['bandwidth'], where) * ratio / 1e3:.6g}GB/s"
    link["duplex"] = f"{duplex * 2 * new / (old['h2d'] + old['d2h']) / 1e3:.6g}GB/s"


# ---------------------------------------------------------------- when to retarget

def recording_hardware(trace: Trace) -> Hardware | None:
    """The profile a trace's op times belong to (meta.hardware), None when it names none or
    none that can be found. A name with overrides ('h100-sxm+gpu.memory=24GiB', from a
    predicted trace) falls back to its base profile."""
    name = trace.meta.get("hardware")
    if not name:
        return None
    for candidate in dict.fromkeys((str(name), str(name).split("+")[0].split(":")[0])):
        try:
            return load_hardware(candidate)
        except HardwareError:
            continue
    return None


def needs_retarget(trace: Trace, hw: Hardware) -> tuple[bool, str]:
    """(True, why) when the trace's op times belong to another GPU than `hw` as the compute
    model sees it; (False, why not) otherwise."""
    src_name = trace.meta.get("hardware")
    if not src_name:
        return False, ("the trace does not name the GPU profile it was recorded on "
                       "(meta.hardware): op times kept as recorded")
    src = recording_hardware(trace)
    if src is None:
        return False, f"no profile {src_name!r} (meta.hardware) is known: op times kept"
    same = compute_signature(src, load_efficiencies(src)) == \
        compute_signature(hw, load_efficiencies(hw))
    if same:
        return False, f"same compute model as {src_name}"
    return True, f"recorded on {src_name}, simulated on {hw.name}"


# ---------------------------------------------------------------- the transform

def retarget(trace: Trace, hw: Hardware, source: Hardware | None = None,
             eff: Efficiencies | None = None, source_eff: Efficiencies | None = None) -> Trace:
    """The trace with op times for `hw` (see the module docstring). `source` defaults to the
    profile in meta.hardware; ConfigError when there is none."""
    if source is None:
        source = recording_hardware(trace)
        if source is None:
            raise ConfigError("cannot retarget: the trace does not name the GPU profile its op "
                              "times belong to (meta.hardware)")
    eff = eff or load_efficiencies(hw)
    source_eff = source_eff or load_efficiencies(source)
    costs = op_costs(trace)
    new_ops: list[Op] = []
    ends_old: dict[int, float] = {}
    ends_new: dict[int, float] = {}
    stream_end_old: dict[int, float] = {}
    stream_end_new: dict[int, float] = {}
    bounds: list[tuple[float, float]] = [(0.0, 0.0)]  # (old time, new time) at op boundaries
    for op in trace.ops:
        cost = costs[op.id]
        busy = sum(k.dur_us for k in op.kernels) if op.kernels else op.dur_us
        factor = time_ratio(cost, source, source_eff, hw, eff) if busy > 0 else 1.0
        dur = max(0.0, op.dur_us - busy + busy * factor)
        gap = op.start_us - stream_end_old.get(op.stream, 0.0)
        start = stream_end_new.get(op.stream, 0.0) + max(0.0, gap)
        for d in op.deps:
            if d in ends_new:
                start = max(start, ends_new[d] + max(0.0, op.start_us - ends_old[d]))
        attrs = dict(op.attrs)
        if cost.cls in ("conv_fwd", "conv_bwd") and busy > 0:
            attrs.update(_memory_algo(op, cost, busy, factor, source, source_eff, hw, eff))
        kernels = tuple(Kernel(k.name, k.stream,
                               round(start + (k.start_us - op.start_us) * factor, 3),
                               round(k.dur_us * factor, 3)) for k in op.kernels)
        new_ops.append(dataclasses.replace(op, start_us=round(start, 3), dur_us=round(dur, 3),
                                           kernels=kernels, attrs=tuple(sorted(attrs.items()))))
        ends_old[op.id] = op.start_us + op.dur_us
        ends_new[op.id] = start + dur
        stream_end_old[op.stream] = max(stream_end_old.get(op.stream, 0.0), ends_old[op.id])
        stream_end_new[op.stream] = max(stream_end_new.get(op.stream, 0.0), ends_new[op.id])
        bounds += [(op.start_us, start), (op.start_us + op.dur_us, start + dur)]
    by_id = {old.id: (old, new) for old, new in zip(trace.ops, new_ops, strict=True)}
    bounds.sort()
    mem = tuple(_move_event(e, by_id, bounds) for e in trace.mem_events)
    meta = dict(trace.meta)
    src_label = f"{trace.meta.get('device') or '?'} ({source.name})"
    meta.update({
        "hardware": hw.name,
        "retargeted_from": trace.meta.get("retargeted_from") or src_label,
        "retargeted_to": hw.name,
        "retarget": {"model": "vsim.compute: op busy time x model(new) / model(recording)",
                     "efficiencies": {"recording": source_eff.source_path or source_eff.name,
                                      "target": eff.source_path or eff.name}},
    })
    if trace.measured is not None:
        meta["measured_on_recording"] = {
            "device": trace.meta.get("device"), "hardware": source.name,
            "iteration_time_us": trace.measured.iteration_time_us,
            "peak_allocated_bytes": trace.measured.peak_allocated_bytes,
            "peak_reserved_bytes": trace.measured.peak_reserved_bytes}
    return dataclasses.replace(trace, meta=meta, ops=tuple(new_ops), measured=None,
                               mem_events=mem, copies=(), counters=())


def _memory_algo(op: Op, cost: Any, busy: float, factor: float, source: Hardware,
                 source_eff: Efficiencies, hw: Hardware, eff: Efficiencies) -> dict[str, Any]:
    """The op's memory-optimal time on the new GPU: a recorded one scaled by the model's (m)
    ratio, else the new busy time times the model's (m)/(p) ratio on the new GPU."""
    new_ratio = memory_algo_ratio(cost, hw, eff)
    recorded = op.attr("dur_us_memory_algo")
    if recorded is not None and op.attr("memory_algo") != "model":
        # recorded (m) time x (m time on the new GPU / m time on the old one)
        ratio = factor * new_ratio / memory_algo_ratio(cost, source, source_eff)
        return {"dur_us_memory_algo": round(float(recorded) * ratio, 3),
                "memory_algo": "recorded, retargeted"}
    m_busy = busy * factor * new_ratio
    return {"dur_us_memory_algo": round(op.dur_us - busy + m_busy, 3), "memory_algo": "model"}


def _move_event(e: MemEvent, by_id: dict[int, tuple[Op, Op]],
                bounds: list[tuple[float, float]]) -> MemEvent:
    """An allocator event at its op's new start (or end, where it sat at the op's end), else
    warped between the nearest op boundaries."""
    if e.op is not None and e.op in by_id:
        old, new = by_id[e.op]
        at_end = abs(e.time_us - (old.start_us + old.dur_us)) < abs(e.time_us - old.start_us)
        return dataclasses.replace(e, time_us=round(new.start_us + (new.dur_us if at_end
                                                                    else 0.0), 3))
    i = bisect.bisect_right(bounds, (e.time_us, float("inf"))) - 1
    before = bounds[max(0, i)]
    return dataclasses.replace(e, time_us=round(before[1] + (e.time_us - before[0]), 3))


def for_hardware(trace: Trace, hw: Hardware, enabled: bool = True) -> tuple[Trace, str | None]:
    """The trace `vsim run` simulates on `hw`: retargeted when its op times belong to another
    GPU (and `enabled`), with a note saying what was done (None: nothing to say)."""
    needed, why = needs_retarget(trace, hw)
    if not needed:
        return trace, None
    if not enabled:
        return trace, f"op times kept as recorded ({why}; --no-retarget)"
    out = retarget(trace, hw)
    eff = out.meta["retarget"]["efficiencies"]["target"]
    return out, (f"op times retargeted from {out.meta['retargeted_from']} to {hw.name} through "
                 f"the compute model ({Path(eff).name if eff else 'default efficiencies'})")
