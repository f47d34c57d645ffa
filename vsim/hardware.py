"""GPU hardware profiles: YAML files with a unit on every quantity and a provenance block.

`load_hardware("h100-sxm")` reads hardware/h100-sxm.yaml; a path loads that file. Inside, sizes
are int bytes, times float microseconds, bandwidths bytes per microsecond and compute rates flops
per microsecond. Fractions (efficiencies) are written as percentages, e.g. "45%".
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import HardwareError, UnitError
from .safeload import read_yaml
from .units import parse_flops, parse_rate, parse_size, parse_time

HARDWARE_DIR_ENV = "VSIM_HARDWARE_DIR"


def hardware_dirs() -> list[Path]:
    """Where profile names are looked up: $VSIM_HARDWARE_DIR, ./hardware, the checkout's."""
    dirs = []
    if os.environ.get(HARDWARE_DIR_ENV):
        dirs.append(Path(os.environ[HARDWARE_DIR_ENV]))
    dirs.append(Path.cwd() / "hardware")
    dirs.append(Path(__file__).resolve().parent.parent / "hardware")
    return dirs


@dataclass(frozen=True)
class CopyPath:
    """One host-memory kind over one direction of the link.

    A copy of n bytes takes latency_us + n / (bandwidth * efficiency(n)). `efficiency` is a table
    of (size_bytes, fraction) points, interpolated in log(size) and flat beyond its ends; it holds
    what latency alone does not explain of the measured small-transfer slowdown.
    """

    bandwidth_bytes_per_us: float
    latency_us: float
    efficiency: tuple[tuple[int, float], ...] = ()

    def efficiency_at(self, size_bytes: int) -> float:
        if not self.efficiency:
            return 1.0
        sizes = [s for s, _ in self.efficiency]
        if size_bytes <= sizes[0]:
            return self.efficiency[0][1]
        if size_bytes >= sizes[-1]:
            return self.efficiency[-1][1]
        i = bisect.bisect_right(sizes, size_bytes)
        (s0, e0), (s1, e1) = self.efficiency[i - 1], self.efficiency[i]
        w = (math.log(size_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return e0 + w * (e1 - e0)

    def copy_time_us(self, size_bytes: int) -> float:
        if size_bytes <= 0:
            return 0.0
        return self.latency_us + size_bytes / (self.bandwidth_bytes_per_us *
                                               self.efficiency_at(size_bytes))


@dataclass(frozen=True)
class LinkDirection:
    pinned: CopyPath
    pageable: CopyPath

    def copy_time_us(self, size_bytes: int, pinned: bool = True) -> float:
        return (self.pinned if pinned else self.pageable).copy_time_us(size_bytes)


@dataclass(frozen=True)
class Hardware:
    """A GPU, its memory, its compute rates and its host link. A profile's
    compute.launch_latency and gpu.cuda_malloc are informational: checked, not kept (the
    recorded launch gaps already hold launch latency, and the allocator models reserve segments
    without a time cost); modelling either would change every prediction."""

    name: str
    description: str
    memory_bytes: int
    context_bytes: int
    peak_flops_per_us: dict[str, float]
    dram_bytes_per_us: float
    op_efficiency: dict[str, float]
    copy_interference: float
    h2d: LinkDirection
    d2h: LinkDirection
    duplex_bytes_per_us: float
    pinned_limit_bytes: int  # pinned host memory a run may hold; more does not fit
    pinned_alloc_us_per_gib: float
    provenance: dict[str, Any] = field(default_factory=dict)
    source_path: str = ""

    @property
    def capacity_bytes(self) -> int:
        """Device memory a process can allocate: the card's memory less the CUDA context."""
        return self.memory_bytes - self.context_bytes

    def with_overrides(self, **changes: Any) -> Hardware:
        return replace(self, **changes)


def load_hardware(name_or_path: str) -> Hardware:
    """Load a profile by name (hardware/NAME.yaml) or path. HardwareError if absent or invalid."""
    path = Path(name_or_path)
    if not (name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path):
        for directory in hardware_dirs():
            candidate = directory / f"{name_or_path}.yaml"
            if candidate.is_file():
                path = candidate
                break
        else:
            known = ", ".join(sorted(list_hardware())) or "none found"
            raise HardwareError(f"unknown hardware {name_or_path!r}; known: {known}")
    where = str(path)
    doc = read_yaml(path, HardwareError, "profile")
    return parse_hardware(doc, where)


def list_hardware() -> dict[str, Path]:
    """Profile names found in the lookup directories, first one wins."""
    found: dict[str, Path] = {}
    for directory in hardware_dirs():
        if directory.is_dir():
            for p in sorted(directory.glob("*.yaml")):
                found.setdefault(p.stem, p)
    return found


def parse_percent(value: Any, where: str) -> float:
    """'45%' -> 0.45. Must be in (0%, 100%]."""
    if not isinstance(value, str) or not value.strip().endswith("%"):
        raise UnitError(f"expected a percentage like '45%', got {value!r}", where)
    try:
        fraction = float(value.strip()[:-1]) / 100
    except ValueError:
        raise UnitError(f"cannot read {value!r} as a percentage", where) from None
    if not 0 < fraction <= 1:
        raise UnitError(f"percentage {value!r} must be above 0% and at most 100%", where)
    return fraction


# Physical sanity bounds on every quantity of a profile, in vsim's internal units, so that no
# sum, product or quotient the engine forms can overflow or divide by a denormal (a profile with
# 1e-320 GB/s or 1e308 us once gave Infinity/NaN results with `fits: true`). Each is a factor of
# 1,000 or more beyond any device of today, so a real profile never meets them; a value outside
# is a unit mistake. (low, high, why)
BOUNDS: dict[str, tuple[float, float, str]] = {
    # 1 MB/s .. 100 TB/s: below a USB 1 link, above 30x an H200's HBM (4.8 TB/s)
    "bandwidth": (1.0, 1e8, "between 1MB/s and 100TB/s"),
    # 1 GFLOP/s .. 10 EFLOP/s: below one CPU core, 5,000x an H100's dense fp8 (2 PFLOP/s)
    "flops": (1e3, 1e13, "between 1GFLOP/s and 10000000TFLOP/s (10 EFLOP/s)"),
    # 0 .. 100 s per latency or per-call cost: above that it is a unit mistake (ms for us)
    "time": (0.0, 1e8, "between 0us and 100s"),
    # 0 .. 1 PiB of memory: 2^50 keeps every sum of sizes below 2^53, exact in a float
    "size": (0.0, float(2**50), "at most 1PiB"),
}


def check_bound(value: float, kind: str, where: str) -> float:
    """`value` (internal units of `kind`: bandwidth, flops, time, size) within BOUNDS[kind];
    HardwareError naming `where` otherwise."""
    low, high, why = BOUNDS[kind]
    if not (math.isfinite(value) and low <= value <= high):
        raise HardwareError(f"{value:g} {_UNIT[kind]} is out of range: must be {why}", where)
    return value


_UNIT = {"bandwidth": "bytes/us", "flops": "flop/us", "time": "us", "size": "bytes"}
_KIND: dict[Any, str] = {parse_rate: "bandwidth", parse_flops: "flops", parse_time: "time",
                         parse_size: "size"}  # the parser of a field -> its kind of quantity


class _ProfileReader:
    def __init__(self, where: str) -> None:
        self.where = where

    def at(self, path: str) -> str:
        return f"{self.where}: {path}"

    def section(self, doc: Any, path: str) -> dict[str, Any]:
        if not isinstance(doc, dict):
            raise HardwareError(f"{path or 'top level'}: expected a mapping", self.where)
        return doc

    def get(self, doc: dict[str, Any], key: str, path: str) -> Any:
        if key not in doc:
            raise HardwareError(f"{path}: missing required field {key!r}", self.where)
        return doc[key]

    def quantity(self, doc: dict[str, Any], key: str, path: str, parse: Any,
                 positive: bool = True, default: Any = None) -> Any:
        raw = doc.get(key, default) if default is not None else self.get(doc, key, path)
        try:
            value = parse(raw, self.at(f"{path}.{key}"))
        except UnitError as exc:
            raise HardwareError(exc.message, exc.where) from None
        if positive and value <= 0:
            raise HardwareError(f"{path}.{key}: must be above zero, got {raw!r}", self.where)
        kind = _KIND[parse]
        low, high, why = BOUNDS[kind]
        if not low <= value <= high:
            raise HardwareError(f"{path}.{key}: {raw!r} is out of range: must be {why}",
                                self.where)
        return value

    def copy_path(self, doc: Any, path: str) -> CopyPath:
        doc = self.section(doc, path)
        table = []
        points = doc.get("efficiency", []) or []
        if not isinstance(points, list):
            raise HardwareError(f"{path}.efficiency: expected a list of {{size: ..., "
                                f"fraction: ...%}}", self.where)
        for i, point in enumerate(points):
            pp = f"{path}.efficiency[{i}]"
            if not isinstance(point, dict) or set(point) != {"size", "fraction"}:
                raise HardwareError(f"{pp}: expected {{size: ..., fraction: ...%}}", self.where)
            try:
                size = parse_size(point["size"], self.at(f"{pp}.size"))
                table.append((size,
                              parse_percent(point["fraction"], self.at(f"{pp}.fraction"))))
            except UnitError as exc:
                raise HardwareError(exc.message, exc.where) from None
            if not 0 < size <= BOUNDS["size"][1]:
                # interpolation is in log(size): 0 B has no logarithm
                raise HardwareError(f"{pp}.size: must be above 0 B and {BOUNDS['size'][2]}, "
                                    f"got {point['size']!r}", self.where)
        if [s for s, _ in table] != sorted({s for s, _ in table}):
            raise HardwareError(f"{path}.efficiency: sizes must strictly increase", self.where)
        return CopyPath(
            bandwidth_bytes_per_us=self.quantity(doc, "bandwidth", path, parse_rate),
            latency_us=self.quantity(doc, "latency", path, parse_time, positive=False),
            efficiency=tuple(table))

    def direction(self, doc: Any, path: str) -> LinkDirection:
        doc = self.section(doc, path)
        return LinkDirection(pinned=self.copy_path(self.get(doc, "pinned", path), f"{path}.pinned"),
                             pageable=self.copy_path(self.get(doc, "pageable", path),
                                                     f"{path}.pageable"))


def parse_hardware(doc: Any, where: str) -> Hardware:
    """Build a Hardware from a parsed YAML document; HardwareError naming the key on bad input."""
    r = _ProfileReader(where)
    doc = r.section(doc, "")
    provenance = r.section(r.get(doc, "provenance", "top level"), "provenance")
    for key in ("source", "date", "method"):
        if not provenance.get(key):
            raise HardwareError(f"provenance: missing {key!r}", where)
    gpu = r.section(r.get(doc, "gpu", "top level"), "gpu")
    compute = r.section(r.get(doc, "compute", "top level"), "compute")
    link = r.section(r.get(doc, "link", "top level"), "link")
    host = r.section(r.get(doc, "host", "top level"), "host")
    peaks = r.section(r.get(compute, "peak", "compute"), "compute.peak")
    if "fp32" not in peaks:
        raise HardwareError("compute.peak: missing required field 'fp32'", where)
    peak = {k: r.quantity(peaks, k, "compute.peak", parse_flops) for k in peaks}
    eff = r.section(compute.get("efficiency", {}) or {}, "compute.efficiency")
    try:
        op_eff = {k: parse_percent(v, r.at(f"compute.efficiency.{k}")) for k, v in eff.items()}
        interference = (parse_percent(compute["copy_interference"],
                                      r.at("compute.copy_interference"))
                        if compute.get("copy_interference") not in (None, "0%") else 0.0)
    except UnitError as exc:
        raise HardwareError(exc.message, exc.where) from None
    memory = r.quantity(gpu, "memory", "gpu", parse_size)
    context = r.quantity(gpu, "context", "gpu", parse_size, positive=False)
    if context >= memory:
        raise HardwareError(f"gpu.context ({context} B) must be below gpu.memory ({memory} B)",
                            where)
    for section, key, path in ((compute, "launch_latency", "compute"),
                               (gpu, "cuda_malloc", "gpu")):
        if key in section:  # informational (see Hardware): optional, but a bad value is bad
            r.quantity(section, key, path, parse_time, positive=False)
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise HardwareError("name: missing or not a string", where)
    return Hardware(
        name=name,
        description=str(doc.get("description", "")),
        memory_bytes=memory,
        context_bytes=context,
        peak_flops_per_us=peak,
        dram_bytes_per_us=r.quantity(compute, "dram_bandwidth", "compute", parse_rate),
        op_efficiency=op_eff,
        copy_interference=interference,
        h2d=r.direction(r.get(link, "h2d", "link"), "link.h2d"),
        d2h=r.direction(r.get(link, "d2h", "link"), "link.d2h"),
        duplex_bytes_per_us=r.quantity(link, "duplex", "link", parse_rate),
        pinned_limit_bytes=r.quantity(host, "pinned_limit", "host", parse_size),
        pinned_alloc_us_per_gib=r.quantity(host, "pinned_alloc_per_GiB", "host", parse_time,
                                           positive=False),
        provenance=dict(provenance),
        source_path=where,
    )
