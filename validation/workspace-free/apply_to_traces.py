"""Write the measured workspace-free convolution times into the H100 traces.

Each convolution op of `traces/RUN-h100.vsim.json.gz` gets `dur_us_memory_algo`: its recorded
time scaled by its layer's measured slowdown without room for a workspace (probe_convs.py:
`short` over `room`, forward ops by the forward ratio, backward ops by the backward one), and
`memory_algo: measured`. A ratio rather than the probe's own time, because the probe times one
layer alone (its launch overheads and clocks are not the training step's); the ratio carries
only the change of engine. The trace's meta says where the times come from.

Usage: python validation/workspace-free/apply_to_traces.py  (from the repository root)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from vsim.compute import op_class
from vsim.trace import load_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "validation" / "workspace-free" / "h100"


def ratios(run: str) -> dict[tuple[str, str], float]:
    room = json.loads((PROBES / f"{run}-room.convs.json").read_text())
    short = json.loads((PROBES / f"{run}-short.convs.json").read_text())
    out = {}
    for r, s in zip(room["layers"], short["layers"], strict=True):
        assert r["layer"] == s["layer"], (r["layer"], s["layer"])
        if "error" in r or "error" in s:
            continue
        out[(r["layer"], "conv_fwd")] = s["fwd_us"] / r["fwd_us"]
        out[(r["layer"], "conv_bwd")] = s["bwd_us"] / r["bwd_us"]
    return out


def apply(run: str) -> int:
    path = ROOT / "traces" / f"{run}-h100.vsim.json.gz"
    trace = load_trace(path)
    scale = ratios(run)
    ops, changed = [], 0
    for op in trace.ops:
        key = (op.layer, op_class(op))
        if key in scale and op.layer_type == "conv":
            attrs = dict(op.attrs)
            attrs["dur_us_memory_algo"] = round(op.dur_us * scale[key], 3)
            attrs["memory_algo"] = "measured"
            op = dataclasses.replace(op, attrs=tuple(sorted(attrs.items())))
            changed += 1
        ops.append(op)
    meta = dict(trace.meta)
    probe = json.loads((PROBES / f"{run}-short.convs.json").read_text())["meta"]
    meta["memory_algo_times"] = {
        "what": "dur_us_memory_algo of convolutions: recorded time x the layer's measured "
                "slowdown with no room for a cuDNN workspace (validation/workspace-free)",
        "probes": f"validation/workspace-free/h100/{run}-{{room,short}}.convs.json",
        "device": probe["device"], "driver": probe["driver"], "torch": probe["torch"],
        "cudnn": probe["cudnn"], "date": probe["date"][:10],
        "command": "python validation/workspace-free/apply_to_traces.py"}
    save_trace(dataclasses.replace(trace, ops=tuple(ops), meta=meta), path)
    return changed


def main() -> None:
    for probe in sorted(PROBES.glob("*-room.convs.json")):
        run = probe.name[: -len("-room.convs.json")]
        print(f"{run}: {apply(run)} convolution ops timed")


if __name__ == "__main__":
    main()
