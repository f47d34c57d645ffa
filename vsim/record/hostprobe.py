"""How fast this machine's host issues a training step: a one-second probe taken where a trace
is recorded, a plan is measured, and the host model is probed.

Why: the lent GPU machines differ in their CPUs. The same densenet121 batch-64 step, host-bound,
took 58.5 ms where it was recorded and 83.9 ms where it was measured a day later on another
H100 machine (validation/README.md). A recorded trace's launch gaps and the host model
(hardware/host/) are in the host speed of the machine they came from. The probe was meant to
scale them to another machine's speed, but its own value moved 9.2-19.8 ms within one call's
runs and did not track the models' host times (validation/host/README.md, "Host speed is noisy
on the lent machines"), so it is kept as provenance: the engine applies no scale.

The probe is a fixed small network (no dependence on what is being measured), at a size where
every kernel is tiny: the host issue time of its SGD training step (perf_counter around the
step, the GPU idle before it, no synchronize inside) is the host's speed at issuing PyTorch ops:
Python, the dispatcher, autograd, launches. Median of repeats, after warm-up.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn

PROBE_VERSION = 1
LAYERS = 48   # 48 x (linear, layer norm, GELU): about 430 aten calls and launches a step
WIDTH = 64
REPEATS = 25


SPIN = 20_000  # the speed probe's loop: about 1 ms of interpreter work on the lent hosts


def speed_probe_us() -> float:
    """The wall time of a fixed pure-Python loop: how fast this core runs interpreter work at
    this moment (best of three, to skip an interruption). Taken just before an iteration, it
    asks whether an iteration's host time follows the core's speed of the moment."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x = 0
        for i in range(SPIN):
            x += i & 7
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6, 2)


def _net(device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU())
              for _ in range(LAYERS)]
    return nn.Sequential(*blocks).to(device), torch.randn(8, WIDTH, device=device)


def probe_host(device: torch.device | str) -> dict[str, Any]:
    """{"version", "step_us" (median host issue time of the probe's step), "spread" (max/min
    over the repeats), "repeats", "cpu" (model name), "cpus"}. The probe's tensors are freed
    on return (the caching allocator may keep their small blocks); the caller's RNG state is
    left as it was."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    held = torch.cuda.memory_allocated(dev) if gpu else 0
    with torch.random.fork_rng(devices=[dev] if gpu else []):  # the caller's RNG untouched
        result = _probe(dev, gpu)
    if gpu and torch.cuda.memory_allocated(dev) > held:
        # Its linear layers made cuBLAS allocate its workspaces (2 x 32 MiB on the H100),
        # which stay for the process: a model with no matrix product of its own (squeezenet1_1)
        # never has them, and they sat in every capped run measured after the probe (its
        # measured runs held 64.5 MiB more at their start than its trace's residents). A model
        # with matrix products made them in its warm-up already: nothing is left over then.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # noqa: SLF001
        if clear is not None:
            clear()
    return result


def _probe(dev: torch.device, gpu: bool) -> dict[str, Any]:
    net, x = _net(dev)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(dev)

    for _ in range(5):
        step()
    sync()
    times = []
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return {"version": PROBE_VERSION, "step_us": round(statistics.median(times), 1),
            "spread": round(max(times) / min(times), 2), "repeats": REPEATS,
            "cpu": cpu_model(), "cpus": os.cpu_count()}


def cpu_model() -> str | None:
    """The CPU's model name (Linux), to tell machines apart in provenance."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
