"""Host (CPU) time of issuing a training step: how long PyTorch's Python, dispatcher and
autograd engine take to launch each op, from a probe of the machine (hardware/host/NAME.yaml,
made by validation/host/fit_host.py from validation/host/probe_host.py's measurements).

A GPU waits for a slow host: an op cannot start before the host has issued it. Recorded traces
carry that wait in their launch gaps, but ops a plan adds (recomputations) or a model never
recorded (synthesized traces) have none; this model gives their host time. Costs are per op
name (an aten op in forward and the optimizer, an autograd node in backward), else the median
of the op's phase; `per_weight_us` is the gradient accumulation autograd runs once per weight
in backward (AccumulateGrad nodes, which traces fold into the op that produces the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import HardwareError
from .trace.schema import Op, Trace

HOST_DIR = Path(__file__).resolve().parents[1] / "hardware" / "host"


@dataclass(frozen=True)
class HostModel:
    """Host microseconds per op: `by_name[phase][name]`, else `by_phase[phase]`."""

    name: str
    by_name: dict[str, dict[str, float]]
    by_phase: dict[str, float]
    per_weight_us: float
    provenance: dict[str, Any] = field(default_factory=dict)

    def op_us(self, op: Op) -> float:
        phase = op.phase if op.phase in self.by_phase else "fwd"
        return self.by_name.get(phase, {}).get(op.name, self.by_phase[phase])

    def iteration_us(self, trace: Trace) -> float:
        """Host time to issue the whole iteration (no waits for the GPU)."""
        weights = sum(1 for t in trace.tensors if t.kind == "weight")
        return sum(self.op_us(o) for o in trace.ops) + weights * self.per_weight_us


def load_host_model(hw_name: str, directory: Path | None = None) -> HostModel | None:
    """hardware/host/NAME.yaml for a hardware profile's name; None when no probe exists."""
    path = (directory or HOST_DIR) / f"{hw_name}.yaml"
    if not path.is_file():
        return None
    return read_host_model(path)


def read_host_model(path: Path) -> HostModel:
    """HardwareError naming the file and key on a malformed file."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise HardwareError(f"{path}: cannot read host model: {exc}") from None
    if not isinstance(doc, dict):
        raise HardwareError(f"{path}: a host model is a mapping")

    def us(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 <= float(value) < 1e6:
            raise HardwareError(f"{path}: {where} must be microseconds in [0, 1e6), "
                                f"got {value!r}")
        return float(value)

    by_phase_raw = doc.get("by_phase")
    if not isinstance(by_phase_raw, dict) or "fwd" not in by_phase_raw:
        raise HardwareError(f"{path}: by_phase must map phases (fwd, bwd, opt) to us")
    by_phase = {str(k): us(v, f"by_phase.{k}") for k, v in by_phase_raw.items()}
    by_name: dict[str, dict[str, float]] = {}
    for phase, table in (doc.get("by_name") or {}).items():
        if not isinstance(table, dict):
            raise HardwareError(f"{path}: by_name.{phase} must map op names to us")
        by_name[str(phase)] = {str(k): us(v, f"by_name.{phase}.{k}") for k, v in table.items()}
    return HostModel(name=str(doc.get("name", path.stem)), by_name=by_name, by_phase=by_phase,
                     per_weight_us=us(doc.get("per_weight_us", 0.0), "per_weight_us"),
                     provenance=dict(doc.get("provenance") or {}))
