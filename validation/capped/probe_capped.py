"""Why is a capped run slower than the same run with room? Probe one model at several memory caps.

For each cap (a fresh process each, as `vsim measure` runs one case per process): train a few
iterations under torch.cuda.set_per_process_memory_fraction, then per iteration record the
allocator's counters (cudaMalloc / cudaFree calls, allocation retries after freeing the cache)
and time it; profile the last iteration's kernels (CUPTI) and sum their time by kernel name.

Usage: python validation/capped/probe_capped.py OUT MODEL BATCH CAP_GIB|none
Writes OUT/MODEL-bBATCH-CAP.probe.json with meta (device, driver, torch, date, command).
"""

from __future__ import annotations

import collections
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from vsim.record.recorder import driver_version, sgd_training

WARMUP, TIMED = 3, 5
COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms",
            "allocated_bytes.all.peak", "reserved_bytes.all.peak")


def main() -> None:
    out, model, batch, cap = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    if cap != "none":
        torch.cuda.set_per_process_memory_fraction(float(cap) * 2**30 / total, dev)
    step = sgd_training(model, batch, dev).step  # the recorder's training step
    rows = []
    for i in range(WARMUP + TIMED):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(dev)
        rows.append({"iteration": i, "ms": (time.perf_counter() - t0) * 1e3,
                     **{k: stats.get(k, 0) for k in COUNTERS}})
        print(f"{model} b{batch} cap {cap}: iteration {i} {rows[-1]['ms']:.2f} ms, "
              f"cudaMalloc {rows[-1]['num_device_alloc']}, cudaFree {rows[-1]['num_device_free']}"
              f", retries {rows[-1]['num_alloc_retries']}", flush=True)
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    result = {"meta": {"model": model, "batch_size": batch, "cap_gib": cap,
                       "device": torch.cuda.get_device_name(), "driver": driver_version(),
                       "torch": torch.__version__, "cuda": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "command": "python validation/capped/probe_capped.py OUT "
                                  + " ".join(sys.argv[2:])},
              "iterations": rows,
              "kernels_us": {n: {"calls": c, "us": round(us, 3)}
                             for n, (c, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])}}
    path = out / f"{model}-b{batch}-{cap}.probe.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
