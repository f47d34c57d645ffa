"""The vsim-trace format: data model, reading and writing, version upgrades."""

from .io import load_trace, save_trace, trace_from_json, trace_to_json
from .schema import (
    SCHEMA_VERSION,
    Copy,
    Kernel,
    Measured,
    MemEvent,
    Op,
    Tensor,
    Trace,
)

__all__ = [
    "SCHEMA_VERSION", "Copy", "Kernel", "Measured", "MemEvent", "Op", "Tensor", "Trace",
    "load_trace", "save_trace", "trace_from_json", "trace_to_json",
]
