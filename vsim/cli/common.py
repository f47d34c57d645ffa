"""What the verb modules share: the parser that ends usage errors like bad input, progress and
JSON printing, and the checks of outputs and capacities made before any work."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..units import format_size, parse_size

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """Usage errors end like every other bad input: one line, exit code 2."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_BAD_INPUT, f"vsim: error: {message} (see `{self.prog} --help`)\n")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def parse_capacity(text: str | None) -> int | None:
    if text is None:
        return None
    size = parse_size(text, "--memory")
    if size <= 0:
        raise ConfigError(f"--memory: capacity must be above zero, got {text!r}")
    return size


def check_output(path: str, flag: str) -> None:
    parent = Path(path).parent
    if str(parent) and not parent.exists():
        raise ConfigError(f"{flag}: folder {str(parent)!r} does not exist")
    if Path(path).is_dir():
        raise ConfigError(f"{flag}: {path!r} is a folder; give a file name")


def check_capacity(trace_path: str, trace: Any, hw: Any, capacity: int | None) -> None:
    """A capacity below what is resident before the first op (weights, optimizer state,
    inputs) is impossible input, not an out-of-memory result: no policy can even start."""
    from ..metrics import resident_bytes

    resident = resident_bytes(trace)
    usable = hw.capacity_bytes if capacity is None else capacity
    if usable >= resident:
        return
    given = (f"--memory {format_size(usable)}" if capacity is not None else
             f"{hw.name}'s capacity {format_size(usable)} (give --memory or another --hw)")
    raise ConfigError(f"{given} is below the {format_size(resident)} ({resident} B) that must "
                      "be on the GPU before the first op (weights, optimizer state, inputs)",
                      trace_path)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"

