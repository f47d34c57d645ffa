"""Write the measured workspace-free convolution times into the traces of one GPU.

Each convolution op of `traces/RUN-GPU.vsim.json.gz` gets `dur_us_memory_algo`: its recorded
time scaled by its layer's measured slowdown without room for a workspace (probe_convs.py:
`short` over `room`, forward ops by the forward ratio, backward ops by the backward one), and
`memory_algo: measured`. A ratio rather than the probe's own time, because the probe times one
layer alone (its launch overheads and clocks are not the training step's); the ratio carries
only the change of engine. The trace's meta says where the times come from.

Usage: python validation/workspace-free/apply_to_traces.py [h100|h200]  (default h100; the
probes are read from validation/workspace-free/GPU/)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from vsim.compute import op_class
from vsim.trace import load_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]


def ratios(probes: Path, run: str) -> dict[tuple[str, str], float]:
    room = json.loads((probes / f"{run}-room.convs.json").read_text())
    short = json.loads((probes / f"{run}-short.convs.json").read_text())
    out = {}
    for r, s in zip(room["layers"], short["layers"], strict=True):
        assert r["layer"] == s["layer"], (r["layer"], s["layer"])
        if "error" in r or "error" in s:
            continue
        out[(r["layer"], "conv_fwd")] = s["fwd_us"] / r["fwd_us"]
        out[(r["layer"], "conv_bwd")] = s["bwd_us"] / r["bwd_us"]
    return out


def apply(gpu: str, run: str) -> int:
    probes = ROOT / "validation" / "workspace-free" / gpu
    path = ROOT / "traces" / f"{run}-{gpu}.vsim.json.gz"
    trace = load_trace(path)
    scale = ratios(probes, run)
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
    probe = json.loads((probes / f"{run}-short.convs.json").read_text())["meta"]
    meta["memory_algo_times"] = {
        "what": "dur_us_memory_algo of convolutions: recorded time x the layer's measured "
                "slowdown with no room for a cuDNN workspace (validation/workspace-free)",
        "probes": f"validation/workspace-free/{gpu}/{run}-{{room,short}}.convs.json",
        "device": probe["device"], "driver": probe["driver"], "torch": probe["torch"],
        "cudnn": probe["cudnn"], "date": probe["date"][:10],
        "command": f"python validation/workspace-free/apply_to_traces.py {gpu}"}
    save_trace(dataclasses.replace(trace, ops=tuple(ops), meta=meta), path)
    return changed


def main() -> None:
    gpu = sys.argv[1] if len(sys.argv) > 1 else "h100"
    for probe in sorted((ROOT / "validation" / "workspace-free" / gpu).glob("*-room.convs.json")):
        run = probe.name[: -len("-room.convs.json")]
        print(f"{run}: {apply(gpu, run)} convolution ops timed")


if __name__ == "__main__":
    main()
