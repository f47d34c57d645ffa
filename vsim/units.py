"""Quantities with units, parsed at the edges. Inside vsim: int bytes, float microseconds.

GB/MB/KB are decimal (10^9...), GiB/MiB/KiB binary (2^30...), as in the vDNN paper's tables and
the SI/IEC convention. A bare number is an error wherever a unit is expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from .errors import UnitError

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
MAX_SIZE_BYTES = 2**53
_TIME_UNITS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
_RATE_UNITS = {  # bytes per microsecond
    "B/s": 1e-6, "KB/s": 1e-3, "MB/s": 1.0, "GB/s": 1e3, "TB/s": 1e6,
    "KiB/s": 2**10 / 1e6, "MiB/s": 2**20 / 1e6, "GiB/s": 2**30 / 1e6,
}
_FLOPS_UNITS = {"FLOP/s": 1e-6, "GFLOP/s": 1e3, "TFLOP/s": 1e6}  # flops per microsecond

_NUMBER = re.compile(r"^\s*[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*$")
_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]+)\s*$")


def _parse(text: object, table: Mapping[str, float], what: str, where: str | None) -> float:
    if isinstance(text, bool) or not isinstance(text, str):
        raise UnitError(
            f"expected a {what} with a unit (one of {', '.join(table)}), got {text!r}", where
        )
    match = _QUANTITY.match(text)
    if not match and _NUMBER.match(text):
        raise UnitError(f"{text.strip()!r} is a {what} without a unit; write it with one "
                        f"(one of {', '.join(table)})", where)
    if not match:
        raise UnitError(f"cannot read {text!r} as a {what} (a number then a unit, one of "
                        f"{', '.join(table)})", where)
    number, unit = float(match.group(1)), match.group(2)
    if unit not in table:
        raise UnitError(f"unknown {what} unit {unit!r} in {text!r}; use one of "
                        f"{', '.join(table)}", where)
    value = number * table[unit]
    if not math.isfinite(value) or value < 0:
        raise UnitError(f"{what} {text!r} must be finite and not negative", where)
    return value


def parse_size(text: object, where: str | None = None) -> int:
    """'12GiB' -> 12884901888 bytes. Raises UnitError on a bare number or unknown unit, or
    above 2^53 bytes (8 PiB), beyond which sizes are not exact as floats or JSON numbers."""
    value = _parse(text, _SIZE_UNITS, "size", where)
    if value > MAX_SIZE_BYTES:
        raise UnitError(f"size {text!r} is more than 2^53 bytes (8 PiB)", where)
    return int(round(value))


def parse_time(text: object, where: str | None = None) -> float:
    """'9us' -> 9.0, '1.5ms' -> 1500.0 microseconds."""
    return _parse(text, _TIME_UNITS, "time", where)


def parse_rate(text: object, where: str | None = None) -> float:
    """'12.8GB/s' -> 12800.0 bytes per microsecond."""
    return _parse(text, _RATE_UNITS, "bandwidth", where)


def parse_flops(text: object, where: str | None = None) -> float:
    """'7TFLOP/s' -> 7e6 flops per microsecond."""
    return _parse(text, _FLOPS_UNITS, "compute rate", where)


def format_size(size_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_time(time_us: float) -> str:
    """Human-readable duration: 1500.0 -> '1.50 ms'."""
    if abs(time_us) >= 1e6:
        return f"{time_us / 1e6:.3f} s"
    if abs(time_us) >= 1e3:
        return f"{time_us / 1e3:.2f} ms"
    return f"{time_us:.1f} us"


def load_yaml(text: str, where: str = "<yaml>") -> object:
    """A YAML document through safeload's bounded safe loader (libyaml's when present);
    ConfigError naming `where` on invalid YAML or an alias bomb."""
    from .errors import ConfigError
    from .safeload import parse_yaml

    return parse_yaml(text, where, ConfigError)
