"""A compute-time model per op: a roofline per op class with efficiencies fitted to recordings.

An op's busy time (its kernels, without the idle gaps between them) on a GPU is

    t = overhead + flops / (peak[precision] x compute x ramp) + bytes / (dram_bandwidth x dram)

with `compute`, `dram` (fractions) and `overhead` (us) per op class, fitted across recorded traces
(`vsim.compute_fit.fit`, stored by `save_efficiencies` as hardware/efficiency/NAME.yaml with its
provenance and errors). `flops` and `bytes` are the op's own (`Op.flops`:
torch.utils.flop_counter's formulas; `Op.dram_bytes`: the bytes of the tensor arguments and results
of its aten calls, which counts in-place and read-modify-write operands twice, so `dram` can exceed
100%). The compute and memory terms add rather than overlap (an "additive roofline"): cuDNN's
fastest kernels on an NCHW fp32 model are a layout transform, an implicit GEMM and a transform
back, in sequence, and the sum fits the H100 recordings better than the max
(hardware/efficiency/h100-sxm.yaml). `ramp` = min(1, channels / ramp_channels) ** ramp_power is a
convolution's loss of efficiency with few output channels (the GEMM's N dimension: tiles left
idle); on the H100 a 64-channel convolution reaches a third of the rate of a 256-channel one. A
trace without flops or bytes falls back to the bytes of the tensors the op reads and writes; a
convolution or GEMM without flops is taken as compute-bound (its time scales with the peak rate).

Classes: conv_fwd, conv_bwd (the algorithm the recording used: cuDNN's pick with its workspace,
vDNN's (p)), gemm, attention, elementwise, pool, norm, optimizer. vDNN's memory-optimal (m)
variant of a convolution (cuDNN's IMPLICIT_GEMM, no workspace) runs at the hardware's
`implicit_gemm` fraction of the fp32 peak (FP32 FMA kernels, no tensor cores; an assumption, see
IMPLICIT_GEMM_ASSUMED), with the same channel ramp; never faster than the (p) time.

The precision of an op follows the trace's meta: convolutions use TF32 when `meta.tf32.cudnn`
(PyTorch's default) and the GPU has a tf32 peak, GEMMs when `meta.tf32.matmul`; fp16/bf16 dtypes
use the fp16 peak, as do convolutions, GEMMs and attention under bf16/fp16 autocast
(`meta.precision`, issue 17; the other ops keep their fp32 rate); otherwise fp32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .errors import HardwareError
from .hardware import Hardware, hardware_dirs, parse_percent
from .trace.schema import Op, Trace
from .units import load_yaml, parse_time

COMPUTE_CLASSES = ("conv_fwd", "conv_bwd", "gemm", "attention")
MEMORY_CLASSES = ("elementwise", "pool", "norm", "optimizer")
CLASSES = COMPUTE_CLASSES + MEMORY_CLASSES
DEFAULT_EFFICIENCY = "h100-sxm"  # the fit used for a profile that has none of its own
# vDNN's memory-optimal algorithm is cuDNN's IMPLICIT_GEMM (algo 0, no workspace), run by FP32
# FMA kernels (implicit_convolve_sgemm: no tensor cores, im2col indices recomputed per tile).
# None of the recordings times it; half of the fp32 peak is an assumption (cuBLAS SGEMM reaches
# 73% on the H100, hardware/efficiency/h100-sxm.yaml's gemm class), stated in each fit's file.
IMPLICIT_GEMM_ASSUMED = 0.5

_GEMM_NAMES = re.compile(r"(^|::)(linear|addmm|mm|bmm|matmul|baddbmm)$|^(Addmm|Mm|Bmm|Linear|"
                         r"Matmul|Baddbmm)Backward")
_NORM_TYPES = ("bn", "layernorm", "lrn")


@dataclass(frozen=True)
class ClassEfficiency:
    """Fractions of the peak rate and of the DRAM bandwidth an op class reaches, its fixed cost
    per op in us (launch tails, small-kernel ramp), and the output-channel ramp of the compute
    fraction (ramp_channels 0: none)."""

    compute: float
    dram: float
    overhead_us: float
    ramp_channels: float = 0.0
    ramp_power: float = 1.0

    def compute_at(self, channels: float) -> float:
        if self.ramp_channels <= 0 or channels <= 0:
            return self.compute
        return self.compute * min(1.0, channels / self.ramp_channels) ** self.ramp_power


@dataclass(frozen=True)
class Efficiencies:
    """Per-class efficiencies of one GPU (and library), with where they come from."""

    name: str
    classes: dict[str, ClassEfficiency]
    implicit_gemm: float
    provenance: dict[str, Any] = field(default_factory=dict)
    source_path: str = ""

    def of(self, cls: str) -> ClassEfficiency:
        return self.classes.get(cls) or self.classes["elementwise"]


@dataclass(frozen=True)
class OpCost:
    """What the model needs of an op: its class, work and precision."""

    cls: str
    flops: float
    bytes: float
    precision: str
    channels: float = 0.0    # a convolution's output channels (0: unknown)


# ---------------------------------------------------------------- classifying ops

def op_class(op: Op) -> str:
    """The model's class of an op (see the module docstring)."""
    name = op.name.split("::")[-1]
    if op.phase == "opt" or op.layer_type == "optimizer":
        return "optimizer"
    if "AccumulateGrad" in op.name:
        return "elementwise"
    if op.layer_type == "conv" or name in ("conv2d", "convolution", "conv1d", "conv3d") \
            or name.startswith("ConvolutionBackward"):
        if op.phase == "bwd" or "Backward" in name:
            return "conv_bwd"
        return "conv_fwd"
    if op.layer_type == "attention" or "scaled_dot_product" in name or "Attention" in name:
        return "attention"
    if op.layer_type == "fc" or _GEMM_NAMES.search(name):
        return "gemm"
    if op.layer_type == "pool":
        return "pool"
    if op.layer_type in _NORM_TYPES:
        return "norm"
    return "elementwise"


def _dtype_precision(meta: dict[str, Any]) -> str | None:
    dtype = str(meta.get("dtype") or "float32")
    if dtype in ("float16", "bfloat16", "half"):
        return "fp16"
    return None


def op_precision(op: Op, meta: dict[str, Any], cls: str | None = None) -> str:
    """fp32, tf32 or fp16: the peak an op's flops are held against (see the module docstring)."""
    half = _dtype_precision(meta)
    if half:
        return half
    tf32 = meta.get("tf32") or {}
    cls = cls or op_class(op)
    if meta.get("precision") in ("bf16", "fp16") and cls in COMPUTE_CLASSES:
        return "fp16"  # autocast: the tensor-core rate (bf16's equals fp16's on Ampere+)
    if cls in ("conv_fwd", "conv_bwd") and tf32.get("cudnn"):
        return "tf32"
    if cls in ("gemm", "attention") and tf32.get("matmul"):
        return "tf32"
    return "fp32"


def op_costs(trace: Trace) -> dict[int, OpCost]:
    """Class, flops, bytes, precision and (convolutions) output channels of every op, by id.
    Bytes are estimated from the tensors an op reads and writes when the trace does not record
    them; channels come from the op's `out_channels` attr (synthesized traces) or from the sizes
    of a forward convolution's weight W and output Y: K = 2 x elements(W) x elements(Y) / flops
    (flops = 2 N K C R S P Q), and a backward convolution takes its layer's forward K."""
    tensors = trace.tensor_by_id()
    out: dict[int, OpCost] = {}
    channels: dict[str, float] = {}
    elem = _element_bytes(trace.meta)
    for op in trace.ops:
        cls = op_class(op)
        nbytes = float(op.dram_bytes)
        if nbytes <= 0:
            nbytes = float(sum(tensors[t].size_bytes for t in (*op.reads, *op.writes)
                               if t in tensors and tensors[t].kind != "workspace"))
        k = float(op.attr("out_channels", 0) or 0)
        if cls == "conv_fwd" and not k and op.flops > 0:
            w = max((tensors[t].size_bytes for t in op.reads
                     if t in tensors and tensors[t].kind == "weight"), default=0) / elem
            y = sum(tensors[t].size_bytes for t in op.writes
                    if t in tensors and tensors[t].kind != "workspace") / elem
            k = round(2 * w * y / op.flops) if w and y else 0.0
        if cls == "conv_fwd" and k:
            channels.setdefault(op.layer, k)
        elif cls == "conv_bwd" and not k:
            k = channels.get(op.layer, 0.0)
        out[op.id] = OpCost(cls, float(op.flops), nbytes, op_precision(op, trace.meta, cls), k)
    return out


def _element_bytes(meta: dict[str, Any]) -> int:
    return 2 if _dtype_precision(meta) else 4


# ---------------------------------------------------------------- the model

def peak_for(hw: Hardware, precision: str) -> float:
    """Peak flops per us at `precision`, falling back to fp32 where the GPU has no such rate
    (a Maxwell GPU runs a TF32-allowed convolution in fp32)."""
    return hw.peak_flops_per_us.get(precision) or hw.peak_flops_per_us["fp32"]


def busy_time_us(cost: OpCost, hw: Hardware, eff: Efficiencies) -> float:
    """Model busy time of an op (us); 0 for an op with neither flops nor bytes."""
    if cost.flops <= 0 and cost.bytes <= 0:
        return 0.0
    e = eff.of(cost.cls)
    t_compute = (cost.flops / (peak_for(hw, cost.precision) * e.compute_at(cost.channels))
                 if cost.flops else 0.0)
    t_memory = cost.bytes / (hw.dram_bytes_per_us * e.dram) if cost.bytes else 0.0
    return e.overhead_us + t_compute + t_memory


def memory_algo_time_us(cost: OpCost, hw: Hardware, eff: Efficiencies,
                        performance_us: float) -> float:
    """A convolution's time with vDNN's memory-optimal algorithm (implicit GEMM, no workspace,
    fp32): at the `implicit_gemm` efficiency of the fp32 peak, never below the time of the
    performance-optimal algorithm it replaces (`performance_us`)."""
    e = eff.of(cost.cls)
    ramp = e.compute_at(cost.channels) / e.compute
    t_compute = cost.flops / (hw.peak_flops_per_us["fp32"] * eff.implicit_gemm * ramp)
    t_memory = cost.bytes / (hw.dram_bytes_per_us * e.dram) if cost.bytes else 0.0
    return max(performance_us, e.overhead_us + t_compute + t_memory)


def time_ratio(cost: OpCost, old_hw: Hardware, old_eff: Efficiencies, new_hw: Hardware,
               new_eff: Efficiencies) -> float:
    """Model time on the new GPU over model time on the old one (1 when the model knows no
    work). A convolution, GEMM or attention without flops is taken as compute-bound: the ratio
    of the rates it would reach."""
    if cost.cls in COMPUTE_CLASSES and cost.flops <= 0:
        old_rate = peak_for(old_hw, cost.precision) * old_eff.of(cost.cls).compute_at(
            cost.channels)
        new_rate = peak_for(new_hw, cost.precision) * new_eff.of(cost.cls).compute_at(
            cost.channels)
        return old_rate / new_rate
    old = busy_time_us(cost, old_hw, old_eff)
    return busy_time_us(cost, new_hw, new_eff) / old if old > 0 else 1.0


def memory_algo_ratio(cost: OpCost, hw: Hardware, eff: Efficiencies) -> float:
    """A convolution's (m) time over its (p) time on `hw` (at least 1). Without flops: the ratio
    of the rates, taken as compute-bound."""
    if cost.flops <= 0:
        e = eff.of(cost.cls)
        ramp = e.compute_at(cost.channels) / e.compute
        p_rate = peak_for(hw, cost.precision) * e.compute_at(cost.channels)
        m_rate = hw.peak_flops_per_us["fp32"] * eff.implicit_gemm * ramp
        return max(1.0, p_rate / m_rate)
    p = busy_time_us(cost, hw, eff)
    return memory_algo_time_us(cost, hw, eff, p) / p if p > 0 else 1.0


def compute_signature(hw: Hardware, eff: Efficiencies) -> tuple[Any, ...]:
    """What the model reads of a GPU: equal signatures give equal op times."""
    return (tuple(sorted(hw.peak_flops_per_us.items())), hw.dram_bytes_per_us, eff.implicit_gemm,
            tuple(sorted((k, (v.compute, v.dram, v.overhead_us, v.ramp_channels, v.ramp_power))
                         for k, v in eff.classes.items())))


# ---------------------------------------------------------------- efficiency files

def efficiency_dirs() -> list[Path]:
    return [d / "efficiency" for d in hardware_dirs()]


def profile_stem(hw: Hardware) -> str:
    """The profile's own name (its file name), also for a profile with overrides."""
    if hw.source_path and hw.source_path.endswith((".yaml", ".yml")):
        return Path(hw.source_path).stem
    return hw.name.split("+")[0].split(":")[0]


def load_efficiencies(hw: Hardware) -> Efficiencies:
    """hardware/efficiency/NAME.yaml for profile NAME, else the default fit (h100-sxm's), with
    the profile's own compute.efficiency entries on top (CLASS: compute fraction, CLASS_dram:
    DRAM fraction, implicit_gemm). HardwareError when no efficiency file can be found."""
    stem = profile_stem(hw)
    path = _find_efficiency_file(stem) or _find_efficiency_file(DEFAULT_EFFICIENCY)
    if path is None:
        raise HardwareError(f"no efficiency file for {stem!r} nor the default "
                            f"{DEFAULT_EFFICIENCY!r} in {', '.join(map(str, efficiency_dirs()))}")
    eff = read_efficiencies(path)
    if path.stem != stem:
        eff = replace(eff, provenance={**eff.provenance,
                                       "used_for": f"{stem} (no fit of its own)"})
    return with_profile_overrides(eff, hw)


def _find_efficiency_file(stem: str) -> Path | None:
    for d in efficiency_dirs():
        p = d / f"{stem}.yaml"
        if p.is_file():
            return p
    return None


def with_profile_overrides(eff: Efficiencies, hw: Hardware) -> Efficiencies:
    if not hw.op_efficiency:
        return eff
    classes = dict(eff.classes)
    implicit = eff.implicit_gemm
    for key, value in hw.op_efficiency.items():
        if key == "implicit_gemm":
            implicit = value
            continue
        base = key[:-len("_dram")] if key.endswith("_dram") else key
        if base not in CLASSES:
            raise HardwareError(f"compute.efficiency.{key}: unknown op class; valid: "
                                f"{', '.join(CLASSES)}, CLASS_dram, implicit_gemm",
                                hw.source_path or hw.name)
        old = classes.get(base) or eff.of(base)
        classes[base] = (replace(old, dram=value) if key.endswith("_dram")
                         else replace(old, compute=value))
    return replace(eff, classes=classes, implicit_gemm=implicit)


def read_efficiencies(path: str | Path) -> Efficiencies:
    """Parse an efficiency file; HardwareError naming the key on bad input. Fractions are
    percentages, overheads times. `dram` may exceed 100% (bytes as the recorder counts them,
    see the module docstring) and so may a convolution's `compute` (of the direct
    convolution's flops: FFT and Winograd algorithms do fewer), up to 400%."""
    where = str(path)
    try:
        doc = load_yaml(Path(path).read_text(), where)  # bounded; ConfigError names the file
    except OSError as exc:
        raise HardwareError(f"cannot read: {exc.strerror or exc}", where) from None
    except yaml.YAMLError:
        raise HardwareError("invalid YAML", where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("classes"), dict):
        raise HardwareError("expected a mapping with 'classes'", where)
    prov = doc.get("provenance")
    if not isinstance(prov, dict) or not all(prov.get(k) for k in ("source", "date", "method")):
        raise HardwareError("provenance: needs source, date and method", where)
    classes: dict[str, ClassEfficiency] = {}
    for cls, entry in doc["classes"].items():
        at = f"{where}: classes.{cls}"
        if cls not in CLASSES:
            raise HardwareError(f"classes.{cls}: unknown op class; valid: {', '.join(CLASSES)}",
                                where)
        if not isinstance(entry, dict):
            raise HardwareError(f"classes.{cls}: expected a mapping", where)
        classes[cls] = ClassEfficiency(
            compute=_fraction(entry.get("compute", "100%"), f"{at}.compute", 4.0),
            dram=_fraction(entry.get("dram"), f"{at}.dram", 10.0),
            overhead_us=_time(entry.get("overhead", "0us"), f"{at}.overhead"),
            ramp_channels=_number(entry.get("ramp_channels", 0), f"{at}.ramp_channels"),
            ramp_power=_number(entry.get("ramp_power", 1), f"{at}.ramp_power"))
    for cls in ("elementwise",):
        if cls not in classes:
            raise HardwareError(f"classes: missing {cls!r} (the fallback class)", where)
    return Efficiencies(name=str(doc.get("name") or Path(path).stem), classes=classes,
                        implicit_gemm=_fraction(doc.get("implicit_gemm"),
                                                f"{where}: implicit_gemm", 1.0),
                        provenance=dict(prov), source_path=where)


def _fraction(value: Any, where: str, most: float) -> float:
    if most <= 1.0:
        from .errors import UnitError
        try:
            return parse_percent(value, where)
        except UnitError as exc:
            raise HardwareError(exc.message, exc.where) from None
    if not isinstance(value, str) or not value.strip().endswith("%"):
        raise HardwareError(f"expected a percentage like '80%', got {value!r}", where)
    try:
        f = float(value.strip()[:-1]) / 100
    except ValueError:
        raise HardwareError(f"cannot read {value!r} as a percentage", where) from None
    if not 0 < f <= most:
        raise HardwareError(f"{value!r} must be above 0% and at most {most * 100:.0f}%", where)
    return f


def _number(value: Any, where: str) -> float:
    """A plain count (channels, an exponent): a number, not below zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise HardwareError(f"expected a number not below zero, got {value!r}", where)
    return float(value)


def _time(value: Any, where: str) -> float:
    from .errors import UnitError
    try:
        return parse_time(value, where)
    except UnitError as exc:
        raise HardwareError(exc.message, exc.where) from None


def efficiencies_to_yaml(eff: Efficiencies, report: dict[str, Any] | None = None) -> str:
    doc: dict[str, Any] = {
        "name": eff.name,
        "provenance": eff.provenance,
        "model": "busy time = overhead + flops / (peak[precision] x compute x "
                 "min(1, out_channels / ramp_channels) ^ ramp_power) + dram_bytes / "
                 "(dram_bandwidth x dram)",
        "implicit_gemm": _pct(eff.implicit_gemm),
        "classes": {c: {"compute": _pct(e.compute), "dram": _pct(e.dram),
                        "overhead": f"{e.overhead_us:.2f}us",
                        **({"ramp_channels": e.ramp_channels, "ramp_power": e.ramp_power}
                           if e.ramp_channels else {})}
                    for c, e in eff.classes.items()},
    }
    if report:
        doc["fit"] = report
    return yaml.safe_dump(doc, sort_keys=False, width=100)


def _pct(f: float) -> str:
    return f"{f * 100:.3g}%"


def with_model_times(trace: Trace, hw: Hardware, eff: Efficiencies | None = None) -> Trace:
    """The trace with every op timed by the model on `hw`, back to back on its stream (a
    synthesized trace: no recorded times to keep). An op whose `launches` attr is 0 (it only
    allocates) takes no time. Convolutions get `dur_us_memory_algo` (memory_algo: model)."""
    eff = eff or load_efficiencies(hw)
    costs = op_costs(trace)
    clock: dict[int, float] = {}
    ops = []
    for op in trace.ops:
        cost = costs[op.id]
        launches = op.attr("launches")
        busy = busy_time_us(cost, hw, eff) if launches is None or launches > 0 else 0.0
        attrs = dict(op.attrs)
        if cost.cls in ("conv_fwd", "conv_bwd") and busy > 0:
            attrs["dur_us_memory_algo"] = round(busy * memory_algo_ratio(cost, hw, eff), 3)
            attrs["memory_algo"] = "model"
        start = clock.get(op.stream, 0.0)
        clock[op.stream] = start + busy
        ops.append(replace(op, start_us=round(start, 3), dur_us=round(busy, 3), kernels=(),
                           attrs=tuple(sorted(attrs.items()))))
    return replace(trace, ops=tuple(ops), meta={**trace.meta, "hardware": hw.name})


# ---------------------------------------------------------------- fitting to network timings
