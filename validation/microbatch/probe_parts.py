"""Time every convolution of a model run whole and as 2, 4, ... 32 micro-batches, the way vsim's
runtime splits it (vsim.runtime.microbatch.split_call: parts' results copied into place, weight
and bias gradients summed).

Why: vsim prices a convolution split into `parts` at its recorded time plus the copies
(vsim.workspace_free.microbatch_retime), i.e. a convolution's work linear in its batch. Small
parts do not fill the GPU, and each call has its own launch and setup: this measures what a
part count costs per layer, so that a model of it can be fitted on some models and checked on
others (validation/microbatch/README.md).

For each Conv2d of the model (found by a forward hook in one training-mode forward pass, with its
input shape and whether its input needs a gradient; validation/workspace-free/probe_convs.py),
with room (no cap): aten.convolution and aten.convolution_backward (the output mask the layer's
backward uses) through split_call, for each part count up to the batch; CUDA events, median of
5 after 2 warm-ups; the bytes each allocated beyond its operands and results (its workspace,
roughly); the layer's multiply-adds.

Usage: python validation/microbatch/probe_parts.py OUT MODEL:BATCH ...
Writes OUT/MODEL-bBATCH.parts.json (meta: device, driver, torch, cuda, cudnn, date, command).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workspace-free"))
from probe_convs import conv_layers, timed, write_probe  # noqa: E402

from vsim.runtime.microbatch import split_call  # noqa: E402

aten = torch.ops.aten
PARTS = (1, 2, 4, 8, 16, 32)


def extra_bytes(fn: Any, results: int, dev: torch.device) -> int:
    """What one call of `fn` allocated at its peak beyond what was held and its `results`."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated(dev) - base - results


def measure(layer: dict[str, Any], dev: torch.device) -> list[dict[str, Any]]:
    shape = layer["input"]
    x = torch.randn(shape, device=dev)
    w = torch.randn([layer["out_channels"], shape[1] // layer["groups"], *layer["kernel"]],
                    device=dev)
    b = torch.randn(layer["out_channels"], device=dev) if layer["bias"] else None
    conv = (layer["stride"], layer["padding"], layer["dilation"], False, [0, 0],
            layer["groups"])
    y = aten.convolution.default(x, w, b, *conv)
    dy = torch.randn_like(y)
    mask = [layer["input_grad"], True, layer["bias"]]
    bias_sizes = [layer["out_channels"]] if layer["bias"] else None
    layer["macs"] = y.numel() * w[0].numel()
    fwd_results = y.numel() * 4
    bwd_results = (x.numel() * 4 if layer["input_grad"] else 0) + w.numel() * 4 + \
        (b.numel() * 4 if b is not None else 0)
    del y
    rows = []
    for parts in PARTS:
        if parts > shape[0]:
            break

        def forward(p: int = parts) -> Any:
            return split_call(aten.convolution.default, (x, w, b, *conv), {}, p)

        def backward(p: int = parts) -> Any:
            return split_call(aten.convolution_backward.default,
                              (dy, x, w, bias_sizes, *conv, mask), {}, p)
        row: dict[str, Any] = {"parts": parts}
        try:
            row["fwd_us"] = timed(forward)
            row["fwd_extra_bytes"] = extra_bytes(forward, fwd_results, dev)
            row["bwd_us"] = timed(backward)
            row["bwd_extra_bytes"] = extra_bytes(backward, bwd_results, dev)
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: probe_parts.py OUT MODEL:BATCH ...")
    out_dir, specs = Path(sys.argv[1]), sys.argv[2:]
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    for spec in specs:
        model, batch = spec.split(":")
        layers = conv_layers(model, int(batch), dev)
        print(f"{model} b{batch}: {len(layers)} convolutions", flush=True)
        for layer in layers:
            layer["runs"] = measure(layer, dev)
            torch.cuda.empty_cache()
        whole = sum(r["fwd_us"] + r["bwd_us"] for lay in layers for r in lay["runs"][:1])
        for k in range(1, int(math.log2(int(batch))) + 1):
            split = [lay["runs"][k] for lay in layers if len(lay["runs"]) > k]
            if len(split) == len(layers) and all("error" not in r for r in split):
                total = sum(r["fwd_us"] + r["bwd_us"] for r in split)
                print(f"  {2 ** k:>2} parts: {total / whole:.3f} of the whole batch's time",
                      flush=True)
        write_probe(out_dir / f"{model}-b{batch}.parts.json",
                    {"model": model, "batch_size": int(batch), "parts": list(PARTS)},
                    "validation/microbatch/probe_parts.py", layers)


if __name__ == "__main__":
    main()
