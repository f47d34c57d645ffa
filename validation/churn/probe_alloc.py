"""Probe: what PyTorch's caching allocator costs the host when memory is tight.

Run twice, once per allocator mode (the mode is fixed at CUDA initialisation):
    python validation/churn/probe_alloc.py OUT-plain.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python validation/churn/probe_alloc.py OUT-exp.json

Measured per size (2 MiB .. 1 GiB), median of 9, with the GPU idle (so no sync waits for work):
- `grow_us`: torch.empty of that size when no cached block fits (a cudaMalloc, or page maps
  with expandable segments), then the free;
- `release_us`: torch.cuda.empty_cache() of one such free segment (cudaFree, or page unmaps);
- `sync_us`: torch.cuda.synchronize() on an idle GPU;
- `retry_busy_us`: host time of an allocation that must release cached segments while the GPU
  is busy for ~20 ms (the device-wide sync of release_cached_blocks waits for that work).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

MiB = 1 << 20
SIZES = [2 * MiB, 20 * MiB, 100 * MiB, 512 * MiB, 1024 * MiB]


def timed(fn, n: int = 9) -> float:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main() -> int:
    torch.cuda.init()
    dev = torch.device("cuda")
    res = {"provenance": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
                          "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                          "command": " ".join(sys.argv)}, "sizes": {}}
    res["sync_us"] = timed(torch.cuda.synchronize)
    for size in SIZES:
        def grow(size: int = size) -> None:
            torch.cuda.empty_cache()
            t = torch.empty(size, dtype=torch.uint8, device=dev)
            del t
        grow_us = timed(grow) - timed(torch.cuda.empty_cache)  # less an empty cache's own cost

        def release() -> None:
            torch.cuda.empty_cache()

        rel = []
        for _ in range(9):
            t = torch.empty(size, dtype=torch.uint8, device=dev)
            del t
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda.empty_cache()
            rel.append((time.perf_counter() - t0) * 1e6)
        res["sizes"][str(size)] = {"grow_us": grow_us, "release_us": statistics.median(rel)}
        print(size // MiB, "MiB", res["sizes"][str(size)], flush=True)
    # A retry under load: fill the device with cached free segments so that a large request
    # must release them (release_cached_blocks: a device-wide sync, then frees), while ~20 ms of
    # matmuls are queued.
    a = torch.randn(8192, 8192, device=dev)
    free, _ = torch.cuda.mem_get_info()
    chunk = 512 * MiB
    n = max(1, int(free * 0.85) // chunk)
    busy = []
    for _ in range(5):
        blocks = [torch.empty(chunk, dtype=torch.uint8, device=dev) for _ in range(n)]
        del blocks  # cached, free
        torch.cuda.synchronize()
        for _ in range(15):
            a = a @ a * 1e-4
        t0 = time.perf_counter()
        big = torch.empty(int(free * 0.9), dtype=torch.uint8, device=dev)
        busy.append((time.perf_counter() - t0) * 1e6)
        del big
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    for _ in range(15):
        a = a @ a * 1e-4
    torch.cuda.synchronize()
    res["queued_work_us"] = (time.perf_counter() - t0) * 1e6
    res["retry_busy_us"] = statistics.median(busy)
    res["retry_segments"] = n
    print(json.dumps({k: v for k, v in res.items() if k != "sizes"}), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
