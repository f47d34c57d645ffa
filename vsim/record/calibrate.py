"""Measure the GPU this runs on into a hardware profile (the YAML format of hardware/*.yaml).

Measured here: device memory and what the CUDA context and libraries take; host<->device copy
time by transfer size, pinned and pageable, each direction and both at once; per-copy latency;
cudaMalloc and pinned host allocation cost; kernel launch cost; how much a DRAM-bound kernel slows
while the link copies both ways; achieved GEMM rates and DRAM copy bandwidth (for reference).
Peak compute rates and DRAM bandwidth are datasheet figures where the device is known (H100,
H200), else the achieved rates; provenance says which. Run it in a fresh process: the context
size is read before anything else uses the GPU.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..fileio import write_atomic
from . import RECORDER_VERSION
from .recorder import driver_version, hardware_guess

Progress = Callable[[str], None]
KiB, MiB, GiB = 2**10, 2**20, 2**30

# NVIDIA datasheets (dense tensor-core rates); DRAM bandwidth of the SXM parts.
_DATASHEET = {
    "h100-sxm": {"fp32": "67TFLOP/s", "tf32": "494.7TFLOP/s", "fp16": "989.4TFLOP/s",
                 "dram_bandwidth": "3.35TB/s", "source": "NVIDIA H100 SXM5 datasheet"},
    "h200": {"fp32": "67TFLOP/s", "tf32": "494.7TFLOP/s", "fp16": "989.4TFLOP/s",
             "dram_bandwidth": "4.8TB/s", "source": "NVIDIA H200 datasheet"},
}


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _us(t: float) -> str:
    return f"{t:.2f}us" if t < 1000 else f"{t / 1000:.3f}ms"


def _gbps(bytes_per_us: float) -> str:
    return f"{bytes_per_us / 1e3:.2f}GB/s"


def _pct(fraction: float) -> str:
    return f"{min(100.0, max(1e-4, fraction * 100)):.3g}%"


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def gpu(self, fn: Callable[[], Any], reps: int, stream: Any = None) -> list[float]:
        """Per-call GPU time (us) of fn, from CUDA events around each call."""
        out = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        return out

    def wall(self, fn: Callable[[], Any], reps: int) -> list[float]:
        """Per-call wall time (us) of fn, synchronising before and after."""
        out = []
        for _ in range(reps):
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(self.device)
            out.append((time.perf_counter() - t0) * 1e6)
        return out


PROBE_BYTES = 64  # the per-copy latency probe


def _fit_path(points: list[tuple[int, float]]) -> dict[str, Any]:
    """A copy path (bandwidth, latency, efficiency table) whose formula
    latency + size / (bandwidth x efficiency(size)) gives back every measured (size, us) point,
    the latency probe included. Bandwidth: the asymptotic rate, from a least-squares line through
    the points of 16 MiB and more, or the best size/time seen if higher. Latency: the largest
    intercept that keeps the efficiency of every copy up to 16 MiB at or below 100% (the fixed
    cost that small and middle-sized copies show); the efficiency table carries what that
    latency does not explain. Large copies hide part of the fixed cost, so their efficiency is
    capped at 100% and their time comes out up to `latency` long (a fraction of a percent). A
    copy smaller than the smallest point uses its efficiency."""
    big = [(s, t) for s, t in points if s >= 16 * MiB] or points[-2:]
    best = max(s / t for s, t in points)
    bw = best
    if len(big) >= 2:
        ms = statistics.mean(s for s, _ in big)
        mt = statistics.mean(t for _, t in big)
        var = sum((s - ms) ** 2 for s, _ in big)
        slope = sum((s - ms) * (t - mt) for s, t in big) / var if var else 0.0
        if slope > 0:
            bw = max(best, 1 / slope)
    small = [(s, t) for s, t in points if s <= 16 * MiB] or points
    latency = max(0.0, min(t - s / bw for s, t in small))
    table = [{"size": _size(s), "fraction": _pct((s / bw) / max(t - latency, 1e-9))}
             for s, t in sorted(points)]
    return {"bandwidth": _gbps(bw), "latency": _us(latency), "efficiency": table}


def refit_links(doc: dict[str, Any]) -> dict[str, Any]:
    """The profile with its link paths fitted again (by `_fit_path`) from its own
    `measurements` rows: for profiles written before the fit changed."""
    from ..units import parse_size, parse_time

    out = json.loads(json.dumps(doc))
    for direction in ("h2d", "d2h"):
        for kind in ("pinned", "pageable"):
            rows = out["measurements"][f"{direction}_{kind}"]
            points = [(parse_size(r["size"]), parse_time(r["time"])) for r in rows]
            out["link"][direction][kind] = _fit_path(points)
    return out


def calibrate(progress: Progress | None = None, name: str | None = None,
              base: str | None = None, quick: bool = False) -> dict[str, Any]:
    """A hardware profile document of this GPU (see the module docstring). `name`: the profile's
    name (default: hardware_guess of the device, else a slug of its name); `base`: a profile
    YAML whose compute peaks and DRAM bandwidth to keep; `quick`: fewer sizes and repeats.
    ConfigError without CUDA."""
    say = progress or (lambda _m: None)
    if not torch.cuda.is_available():
        raise ConfigError("calibrate needs a CUDA GPU; none is available here")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info(dev)
    context_bare = total - free0
    props = torch.cuda.get_device_properties(dev)
    say(f"device: {props.name}, {total / GiB:.2f} GiB; context before libraries "
        f"{context_bare / MiB:.0f} MiB")
    timer = _Timer(dev)

    # libraries (cuBLAS, cuDNN) load on first use; the context grows with them
    a = torch.randn(256, 256, device=dev, requires_grad=True)
    conv = torch.nn.Conv2d(3, 8, 3).to(dev)
    (a @ a).sum().backward()
    conv(torch.randn(2, 3, 16, 16, device=dev)).sum().backward()
    torch.cuda.synchronize(dev)
    del a, conv
    torch.cuda.empty_cache()
    free1, _ = torch.cuda.mem_get_info(dev)
    context = total - free1 - torch.cuda.memory_reserved(dev)
    say(f"context with cuBLAS and cuDNN loaded: {context / MiB:.0f} MiB")

    # cudaMalloc through the caching allocator with an empty cache
    malloc: dict[int, float] = {}
    for size in (2 * MiB, 32 * MiB, 256 * MiB, GiB):
        times = []
        for _ in range(3 if quick else 5):
            torch.cuda.empty_cache()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, device=dev)
            torch.cuda.synchronize(dev)
            times.append((time.perf_counter() - t0) * 1e6)
            del x
        malloc[size] = statistics.median(times)
    torch.cuda.empty_cache()
    cuda_malloc = statistics.median(malloc.values())
    say("cudaMalloc: " + ", ".join(f"{_size(s)} {_us(t)}" for s, t in malloc.items()))

    # pinned host allocation: increasing sizes, so the host caching allocator cannot reuse
    pinned_alloc: dict[int, float] = {}
    for size in (64 * MiB, 256 * MiB, GiB):
        t0 = time.perf_counter()
        x = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        pinned_alloc[size] = (time.perf_counter() - t0) * 1e6
        del x
    sizes_gib = [s / GiB for s in pinned_alloc]
    times = list(pinned_alloc.values())
    mean_s, mean_t = statistics.mean(sizes_gib), statistics.mean(times)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes_gib, times, strict=False)) / \
        sum((s - mean_s) ** 2 for s in sizes_gib)
    pinned_per_gib = slope if slope > 0 else times[-1] / sizes_gib[-1]
    say("pinned host allocation: " + ", ".join(f"{_size(s)} {_us(t)}"
                                               for s, t in pinned_alloc.items()))

    # link: copies by size
    sizes = ([64 * KiB, MiB, 16 * MiB, 256 * MiB] if quick else
             [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB])
    biggest = max(sizes)
    dbuf = torch.empty(biggest, dtype=torch.uint8, device=dev)
    pinned = torch.empty(biggest, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(biggest, dtype=torch.uint8)
    pageable.fill_(1)
    pinned.fill_(1)
    raw: dict[str, list[dict[str, str]]] = {}
    paths: dict[str, dict[str, Any]] = {}
    for direction in ("h2d", "d2h"):
        for kind, host in (("pinned", pinned), ("pageable", pageable)):
            def copy(n: int, host: torch.Tensor = host, direction: str = direction) -> None:
                if direction == "h2d":
                    dbuf[:n].copy_(host[:n], non_blocking=True)
                else:
                    host[:n].copy_(dbuf[:n], non_blocking=True)
            measure = timer.gpu if kind == "pinned" else timer.wall
            for _ in range(3):
                copy(MiB)  # warm the path
            lat = statistics.median(measure(partial(copy, PROBE_BYTES), 20 if quick else 50))
            points = [(PROBE_BYTES, lat)]
            rows = [{"size": _size(PROBE_BYTES), "time": _us(lat),
                     "bandwidth": _gbps(PROBE_BYTES / lat)}]
            for n in sizes:
                reps = max(3, min(20 if quick else 40, int(2 * GiB // n)))
                t = statistics.median(measure(partial(copy, n), reps))
                points.append((n, t))
                rows.append({"size": _size(n), "time": _us(t), "bandwidth": _gbps(n / t)})
            paths[f"{direction}.{kind}"] = _fit_path(points)
            raw[f"{direction}_{kind}"] = rows
            say(f"{direction} {kind}: latency {_us(lat)}, " + ", ".join(
                f"{r['size']} {r['bandwidth']}" for r in rows))

    # both directions at once, pinned, on two streams
    half = min(512 * MiB, biggest // 2)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def duplex() -> None:
        with torch.cuda.stream(s1):
            dbuf[:half].copy_(pinned[:half], non_blocking=True)
        with torch.cuda.stream(s2):
            pinned[half:2 * half].copy_(dbuf[half:2 * half], non_blocking=True)
    duplex_t = min(timer.wall(duplex, 3 if quick else 5))
    duplex_bw = 2 * half / duplex_t
    say(f"duplex: {_size(half)} each way at once: {_gbps(duplex_bw)} together")

    # launch cost: back-to-back tiny kernels
    one = torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    n_launch = 2000 if quick else 5000
    t0 = time.perf_counter()
    for _ in range(n_launch):
        one.add_(1)
    torch.cuda.synchronize(dev)
    launch = (time.perf_counter() - t0) * 1e6 / n_launch
    say(f"launch: {_us(launch)} per back-to-back tiny kernel")

    # DRAM copy bandwidth, alone and while the link copies both ways
    src = torch.empty(biggest // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def d2d() -> None:
        for _ in range(4):
            dst.copy_(src)
    alone = statistics.median(timer.gpu(d2d, 5))
    dram_bw = 2 * 4 * src.numel() / alone
    busy = []
    for _ in range(5):
        duplex()  # queued on s1/s2; the D2D copies below overlap them
        busy.extend(timer.gpu(d2d, 1))
        torch.cuda.synchronize(dev)
    interference = max(0.0, statistics.median(busy) / alone - 1)
    say(f"DRAM copy {_gbps(dram_bw)} (read+write); slower by {interference * 100:.1f}% while "
        "the link copies both ways")


    # achieved GEMM rates (reference only)
    gemm: dict[str, float] = {}
    n = 4096
    for label, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                               ("fp16", torch.float16, False)):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        x = torch.randn(n, n, device=dev, dtype=dtype)
        y = torch.randn(n, n, device=dev, dtype=dtype)
        for _ in range(2):
            x @ y
        t = statistics.median(timer.gpu(partial(torch.matmul, x, y), 5))
        gemm[label] = 2 * n**3 / t  # flops per us
        torch.backends.cuda.matmul.allow_tf32 = old
        del x, y
    say("GEMM 4096^3: " + ", ".join(f"{k} {v / 1e6:.1f} TFLOP/s" for k, v in gemm.items()))
    torch.cuda.empty_cache()

    guess = hardware_guess(props.name)
    profile_name = name or guess or re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-")
    peak, peak_source = _peaks(base, guess, gemm, dram_bw)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    today = _dt.date.today().isoformat()
    doc: dict[str, Any] = {
        "name": profile_name,
        "description": f"{props.name} ({total / GiB:.1f} GiB usable), measured by vsim calibrate",
        "provenance": {
            "source": f"vsim calibrate ({RECORDER_VERSION}) on this machine; {peak_source}",
            "date": today,
            "method": (
                "gpu.memory/context: cudaMemGetInfo total, and total - free - reserved once "
                "cuBLAS and cuDNN are loaded (context before libraries: "
                f"{context_bare / MiB:.0f} MiB); cuda_malloc: median over 2 MiB..1 GiB of "
                "torch.empty with an empty cache; link: median copy time per size (CUDA events "
                "for pinned, synchronised wall clock for pageable) from 64 B (the per-copy "
                "latency probe) to 1 GiB, in measurements; bandwidth = the asymptotic rate "
                "(least squares over 16 MiB and more, or the best size/time if higher), latency "
                "= the largest intercept keeping the efficiencies of copies up to 16 MiB at most "
                "100%, efficiency(size) = size / (bandwidth x (time - latency)) capped at 100%, "
                "so every measured size up to 16 MiB is reproduced and larger ones within "
                "latency; "
                "duplex: pinned copies both ways at once on two streams; "
                "launch_latency: wall time per back-to-back tiny kernel; copy_interference: "
                "slowdown of device-to-device copies while the link copies both ways; "
                "pinned_alloc_per_GiB: slope of torch.empty(pin_memory=True) time over "
                "64 MiB..1 GiB"),
            "assumed": "host.pinned_limit: 75% of the machine's physical memory; compute.peak "
                       "and dram_bandwidth as stated in source",
            "device": props.name,
            "driver": driver_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "gpu": {
            "memory": f"{total // MiB}MiB",
            "context": f"{max(0, context) // MiB}MiB",
            "cuda_malloc": _us(cuda_malloc),
        },
        "compute": {
            "peak": {k: v for k, v in peak.items() if k != "dram_bandwidth"},
            "dram_bandwidth": peak["dram_bandwidth"],
            "launch_latency": _us(launch),
            "copy_interference": _pct(interference) if interference >= 0.001 else "0%",
            "measured": {"fp32_gemm": f"{gemm['fp32'] / 1e6:.1f}TFLOP/s",
                         "tf32_gemm": f"{gemm['tf32'] / 1e6:.1f}TFLOP/s",
                         "fp16_gemm": f"{gemm['fp16'] / 1e6:.1f}TFLOP/s",
                         "dram_copy": _gbps(dram_bw)},
        },
        "link": {
            "h2d": {"pinned": paths["h2d.pinned"], "pageable": paths["h2d.pageable"]},
            "d2h": {"pinned": paths["d2h.pinned"], "pageable": paths["d2h.pageable"]},
            "duplex": _gbps(duplex_bw),
        },
        "host": {
            "pinned_limit": f"{int(ram * 0.75) // GiB}GiB",
            "pinned_alloc_per_GiB": _us(pinned_per_gib),
        },
        "measurements": {
            **raw,
            "cuda_malloc": [{"size": _size(s), "time": _us(t)} for s, t in malloc.items()],
            "pinned_alloc": [{"size": _size(s), "time": _us(t)} for s, t in pinned_alloc.items()],
        },
    }
    _check(doc)
    return doc


def _peaks(base: str | None, guess: str | None, gemm: dict[str, float],
           dram_bw: float) -> tuple[dict[str, str], str]:
    if base is not None:
        try:
            import yaml
            doc = yaml.safe_load(Path(base).read_text())
            compute = doc["compute"]
            peak = {k: str(v) for k, v in compute["peak"].items()}
            peak["dram_bandwidth"] = str(compute["dram_bandwidth"])
            return peak, f"compute peaks and DRAM bandwidth from {base}"
        except (ImportError, OSError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot take peaks from {base}: {exc}") from None
    if guess in _DATASHEET:
        sheet = _DATASHEET[guess]
        return ({k: v for k, v in sheet.items() if k != "source"},
                f"compute peaks and DRAM bandwidth: {sheet['source']}")
    return ({"fp32": f"{gemm['fp32'] / 1e6:.1f}TFLOP/s", "tf32": f"{gemm['tf32'] / 1e6:.1f}TFLOP/s",
             "fp16": f"{gemm['fp16'] / 1e6:.1f}TFLOP/s", "dram_bandwidth": _gbps(dram_bw)},
            "compute peaks and DRAM bandwidth: achieved here (no datasheet for this device)")


def _check(doc: dict[str, Any]) -> None:
    """The profile must load with vsim.hardware.parse_hardware (when PyYAML is importable)."""
    try:
        from ..hardware import parse_hardware
    except ImportError:
        return
    parse_hardware(doc, "<calibrated profile>")


# ---------------------------------------------------------------- YAML output

_PLAIN = re.compile(r"^[0-9][0-9A-Za-z./%]*$")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("non-finite number in a profile")
        return repr(value)
    text = str(value)
    return text if _PLAIN.match(text) else json.dumps(text)


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return _scalar(value)


def to_yaml(doc: dict[str, Any], indent: int = 0) -> str:
    """A small YAML emitter for profile documents: nested mappings in block style, lists in flow
    style, strings quoted unless they are plain quantities (PyYAML may be missing where this
    runs)."""
    lines = []
    pad = "  " * indent
    for key, value in doc.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 1).rstrip("\n"))
        else:
            lines.append(f"{pad}{key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def write_profile(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the profile atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, to_yaml(doc))
