"""Probe: the host (CPU) cost of issuing a PyTorch training step, per op, on the device machine.

For each model, at a batch small enough that the GPU is never the bottleneck, one training
iteration (forward, backward, SGD step) runs under torch.profiler after warm-up. From the
capture we keep, per top-level CPU op (an aten op not inside another on the main thread; an
autograd node on the backward thread; the optimizer's ops), its CPU span and the kernels it
launched. We also time, without the profiler, how long the host takes to issue one iteration
(`host_issue_us`: perf_counter around the step with no synchronize, GPU idle before it) and the
whole iteration with a synchronize (`iteration_us`).

The vsim host-time model (vsim/host.py) is fitted from the per-op spans of some models and
checked on the others (validation/host/README.md). Also measured here, for vDNN++'s CPU-side
compression: the fraction of zero bytes in ReLU outputs (random weights, random inputs).

    python validation/host/probe_host.py OUT.json (then gzip it) [--models a,b,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
from torch import nn

from vsim.record.hostprobe import probe_host
from vsim.record.recorder import driver_version

MODELS = ["resnet50", "densenet121", "mobilenet_v2", "vgg16", "wide_resnet50_2", "vit_b_16",
          "efficientnet_b0", "gpt2"]


def build(name: str, batch: int, device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_positions=256)).to(device)
        x = torch.randint(0, 50257, (batch, 256), device=device)
        return model, x, x
    import torchvision
    model = getattr(torchvision.models, name)(weights=None).to(device)
    x = torch.randn(batch, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    return model, x, y


def step_fn(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            opt: torch.optim.Optimizer):
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if name == "gpt2":
            loss = model(x, labels=y).loss
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return step


def top_level_ops(prof: torch.profiler.profile) -> list[dict]:
    """CPU events that no other CPU op of the same thread encloses, with their kernel count."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    by_thread: dict[int, list] = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append(e)
    out = []
    for thread, evs in by_thread.items():
        evs.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        end = -1.0
        for e in evs:
            if e.time_range.start >= end:
                name = e.name
                if name.startswith("ProfilerStep") or name.startswith("cuda") or \
                        name.startswith("Optimizer.zero_grad"):
                    continue
                kernels = sum(1 for c in _walk(e) if c.name in ("cudaLaunchKernel",
                              "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemsetAsync",
                              "cudaMemcpyAsync"))
                out.append({"name": name, "thread": thread, "cpu_us": e.time_range.elapsed_us(),
                            "launches": kernels})
                end = e.time_range.end
    return out


def _walk(e):
    for c in e.cpu_children:
        yield c
        yield from _walk(c)


def relu_zero_fraction(model: nn.Module, x: torch.Tensor) -> float | None:
    zeros, total = [0], [0]

    def hook(_m, _i, out):
        if isinstance(out, torch.Tensor):
            zeros[0] += int((out == 0).sum())
            total[0] += out.numel()
    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    return zeros[0] / total[0] if total[0] else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    device = "cuda"
    torch.backends.cudnn.benchmark = False
    results = {"provenance": {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "driver": driver_version() or "unknown",
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
        "host_probe": probe_host(device)}, "models": {}}
    for name in args.models.split(","):
        try:
            model, x, y = build(name, args.batch, device)
        except Exception as exc:  # noqa: BLE001 (a model the machine cannot build: say so)
            results["models"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = step_fn(name, model, x, y, opt)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        issue, whole = [], []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            issue.append((t1 - t0) * 1e6)
            whole.append((t2 - t0) * 1e6)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ops = top_level_ops(prof)
        kernels_us = sum(e.time_range.elapsed_us() for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        entry = {"batch": args.batch, "host_issue_us": statistics.median(issue),
                 "iteration_us": statistics.median(whole), "gpu_kernel_us": kernels_us,
                 "ops": ops}
        if name != "gpt2":
            entry["relu_zero_fraction"] = relu_zero_fraction(model, x)
        results["models"][name] = entry
        print(name, f"issue {entry['host_issue_us']:.0f} us, iteration "
              f"{entry['iteration_us']:.0f} us, {len(ops)} top-level ops", flush=True)
        del model, opt, step
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
