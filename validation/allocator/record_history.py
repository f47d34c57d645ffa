"""Record PyTorch's full caching-allocator history of a few training iterations, from before the
model is built, with reserved/allocated memory after each iteration.

Why: `vsim inspect --replay-allocator caching` replays one recorded steady-state iteration and
misses measured peak reserved memory by up to 16% (vgg16 b128). Replaying the whole history,
warm-up included, through the allocator model tells a wrong model apart from a replay that leaves
out what the warm-up reserved.

Usage (on a GPU machine): python validation/allocator/record_history.py OUT_DIR MODEL:BATCH ...
Writes OUT_DIR/MODEL-bBATCH.history.json.gz: meta (device, torch, cuda, date, command), the
allocator's trace entries (action, addr, size, stream; no stack frames) and, per iteration, the
index of its first entry and memory_allocated / memory_reserved / max_memory_reserved after it.
"""

from __future__ import annotations

import datetime
import gzip
import json
import sys
import time
from pathlib import Path

import torch

from vsim.record.recorder import driver_version, sgd_training

ITERATIONS = 6


def record(model: str, batch: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history("all", context=None, stacks="python",
                                             max_entries=5_000_000)
    base = len(torch.cuda.memory._snapshot()["device_traces"][0])
    training = sgd_training(model, batch, torch.device("cuda"))  # the recorder's step
    torch.cuda.synchronize()
    marks = []
    for i in range(ITERATIONS):
        start = len(torch.cuda.memory._snapshot()["device_traces"][0])
        t0 = time.perf_counter()
        training.step()
        torch.cuda.synchronize()
        marks.append({"iteration": i, "first_entry": start - base,
                      "seconds": time.perf_counter() - t0,
                      "allocated": torch.cuda.memory_allocated(),
                      "reserved": torch.cuda.memory_reserved(),
                      "max_reserved": torch.cuda.max_memory_reserved(),
                      "max_allocated": torch.cuda.max_memory_allocated()})
        print(f"{model} b{batch} iteration {i}: reserved {marks[-1]['reserved'] / 2**30:.3f} GiB,"
              f" max allocated {marks[-1]['max_allocated'] / 2**30:.3f} GiB", flush=True)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    entries = [{k: e[k] for k in ("action", "addr", "size", "stream") if k in e}
               for e in snap["device_traces"][0][base:]]
    del training
    torch.cuda.empty_cache()
    return {"meta": {"model": model, "batch_size": batch,
                     "device": torch.cuda.get_device_name(), "driver": driver_version(),
                     "torch": torch.__version__,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     "command": "python validation/allocator/record_history.py OUT "
                                + " ".join(sys.argv[2:])},
            "entries": entries, "iterations": marks}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2:]:
        model, batch = spec.split(":")
        result = record(model, int(batch))
        path = out / f"{model}-b{batch}.history.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(result, f)
        print(f"wrote {path}: {len(result['entries'])} entries", flush=True)


if __name__ == "__main__":
    main()
