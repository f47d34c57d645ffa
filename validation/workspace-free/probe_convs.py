"""Time every convolution of a model the way PyTorch runs it with room, and when memory is so
short that no large cuDNN workspace can be had (what PyTorch falls back to).

Why: vsim's workspace-free convolution time (`algo=memory`, and the workspace fallback of the
caching allocator's runs) was an assumption (implicit GEMM at 50% of the fp32 peak). This
measures it on the GPU at hand, per layer of the shipped traces.

For each Conv2d of the model (found by a forward hook in one training-mode forward pass, with its
input shape and whether its input needs a gradient), in one process per mode:
- `room`: forward, then backward (grad input if the layer's input needs one, grad weight, grad
  bias), timed with CUDA events, median of 5 after 2 warm-ups;
- `short`: the same, with the process capped (set_per_process_memory_fraction), for each pass,
  at what it holds plus room for that pass's results (in the segments the caching allocator
  would open for them) and MARGIN: cuDNN engines whose workspace does not fit are skipped and
  PyTorch runs (and caches) the first that fits, as when a real run is short of memory.
The bytes each pass allocated beyond its operands and results are kept (the workspace, roughly).

Usage: python validation/workspace-free/probe_convs.py OUT MODE MODEL:BATCH[:LAYER+LAYER...] ...
Writes OUT/MODEL-bBATCH-MODE.convs.json (meta: device, driver, torch, cuda, cudnn, date, command);
with layers named, those layers alone. In `short` mode a pass whose extra bytes exceed MARGIN
was not squeezed (its time is with a workspace).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vsim.allocator.caching import segment_size
from vsim.record.recorder import driver_version
from vsim.record.zoo import build_model

MARGIN = 32 * 2**20


def conv_layers(model: str, batch: int, dev: torch.device) -> list[dict[str, Any]]:
    net, (inputs, _), _ = build_model(model, batch, dev)
    net.train()
    found: list[dict[str, Any]] = []

    def hook(name: str) -> Any:
        def record(mod: nn.Conv2d, args: Any, _out: Any) -> None:
            x = args[0]
            found.append({"layer": name, "input": list(x.shape), "out_channels": mod.out_channels,
                          "kernel": list(mod.kernel_size), "stride": list(mod.stride),
                          "padding": list(mod.padding), "dilation": list(mod.dilation),
                          "groups": mod.groups, "bias": mod.bias is not None,
                          "input_grad": bool(x.requires_grad)})
        return record

    for name, mod in net.named_modules():
        if isinstance(mod, nn.Conv2d):
            mod.register_forward_hook(hook(name))
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    net(*args)
    del net, inputs, args
    torch.cuda.empty_cache()
    return found


def provenance(script: str) -> dict[str, Any]:
    """Where and how a probe ran: the GPU, driver and library versions, cuDNN's TF32 setting,
    the date, and the command (`script OUT` and this process's arguments after OUT)."""
    return {"device": torch.cuda.get_device_name(), "driver": driver_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": f"python {script} OUT " + " ".join(sys.argv[2:])}


def timed(fn: Any) -> float:
    times = []
    for i in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def plug_free_blocks(dev: torch.device) -> list[torch.Tensor]:
    """Tensors that fill every free block of the large pool's segments still in use after
    empty_cache. The cap counts reserved memory only: a workspace served from such a block is
    not held against it, and the squeeze then misses (the first probes, 2026-11-22: 205 MiB
    workspaces under a 32 MiB margin for vgg16's 14x14 layers, whose short times were with
    room). Repeated until none is left, as a plug may split a larger block."""
    plugs: list[torch.Tensor] = []
    for _ in range(8):
        free = [b["size"] for seg in torch.cuda.memory_snapshot()
                if seg["device"] == dev.index and seg["segment_type"] == "large"
                for b in seg["blocks"] if b["state"] == "inactive"]
        if not free:
            break
        plugs += [torch.empty(size, dtype=torch.uint8, device=dev) for size in free]
    return plugs


def squeeze(dev: torch.device, results: list[int], short: bool) -> list[torch.Tensor]:
    """Cap the process at what it holds now plus room for `results` (each in the segment the
    caching allocator would open for it) and MARGIN, every free cached block plugged (held
    by the returned tensors until the pass ends); no cap when not `short`."""
    torch.cuda.set_per_process_memory_fraction(1.0, dev)
    if not short:
        return []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    plugs = plug_free_blocks(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = torch.cuda.memory_reserved(dev) + sum(segment_size(r) for r in results) + MARGIN
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    return plugs


def measure(layer: dict[str, Any], short: bool, dev: torch.device) -> dict[str, Any]:
    x = torch.randn(layer["input"], device=dev, requires_grad=layer["input_grad"])
    c = layer["input"][1]
    w = torch.randn([layer["out_channels"], c // layer["groups"], *layer["kernel"]], device=dev,
                    requires_grad=True)
    b = torch.randn(layer["out_channels"], device=dev, requires_grad=True) \
        if layer["bias"] else None

    def forward() -> torch.Tensor:
        return torch.nn.functional.conv2d(x, w, b, layer["stride"], layer["padding"],
                                          layer["dilation"], layer["groups"])

    with torch.no_grad():
        y_shape = forward().shape
    dy = torch.randn(y_shape, device=dev)
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    out: dict[str, Any] = {}
    try:
        plugs = squeeze(dev, [dy.numel() * 4], short)  # forward: room for y
        out["fwd_plugged_bytes"] = sum(p.numel() for p in plugs)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            out["fwd_us"] = timed(forward)
        out["fwd_extra_bytes"] = torch.cuda.max_memory_allocated(dev) - base - dy.numel() * 4
        del plugs
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        y = forward()
        plugs = squeeze(dev, [t.numel() * 4 for t in wanted], short)  # backward: the grads
        out["bwd_plugged_bytes"] = sum(p.numel() for p in plugs)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out["bwd_us"] = timed(lambda: torch.autograd.grad(y, wanted, dy, retain_graph=True))
        out["bwd_extra_bytes"] = torch.cuda.max_memory_allocated(dev) - base - \
            sum(t.numel() * 4 for t in wanted)
        del plugs
    except torch.OutOfMemoryError as exc:
        out["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return out


def main() -> None:
    out_dir, mode, specs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if mode not in ("room", "short"):
        raise SystemExit("MODE is room or short")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    for spec in specs:
        model, batch, *only = spec.split(":")
        layers = conv_layers(model, int(batch), dev)
        if only:  # MODEL:BATCH:L1+L2: those layers alone (a probe again of some layers)
            wanted = set(only[0].split("+"))
            layers = [layer for layer in layers if layer["layer"] in wanted]
        print(f"{model} b{batch} {mode}: {len(layers)} convolutions", flush=True)
        for i, layer in enumerate(layers):
            layer.update(measure(layer, mode == "short", dev))
            torch.cuda.empty_cache()
            if i % 10 == 0 or "error" in layer:
                print(f"  {layer['layer']}: fwd {layer.get('fwd_us', 0):.1f} us, bwd "
                      f"{layer.get('bwd_us', 0):.1f} us {layer.get('error', '')}", flush=True)
        write_probe(out_dir / f"{model}-b{batch}-{mode}.convs.json",
                    {"model": model, "batch_size": int(batch), "mode": mode,
                     "margin_bytes": MARGIN}, "validation/workspace-free/probe_convs.py", layers)


def write_probe(path: Path, meta: dict[str, Any], script: str,
                layers: list[dict[str, Any]]) -> None:
    """A probe's file: its meta with the run's provenance, and its layers."""
    doc = {"meta": {**meta, **provenance(script)}, "layers": layers}
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
