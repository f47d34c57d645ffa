"""How much a kernel's duration varies from one training iteration to the next: the spread the
engine's timing draws take (vsim.engine.jitter). Per model, 13 SGD iterations of the zoo model
with no cap, iterations 4-13 under torch.profiler; each iteration launches the same kernels in
the same order, so the k-th kernel of each is one kernel measured 10 times. Per kernel: the
standard deviation of the log of its duration (sigma), and per iteration the GPU's busy time.

    python validation/jitter/probe_kernel_jitter.py OUT.json [MODEL:BATCH ...]
    python validation/jitter/probe_kernel_jitter.py --spread OUT.json > hardware/timing/HW.yaml

Writes per model: kernels, iterations, sigma quantiles (unweighted and weighted by duration),
the busy time per iteration, with provenance (device, driver, torch, date, command).
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys

import torch

from vsim.record.recorder import driver_version
from vsim.record.zoo import build_model

MODELS = ["resnet50:64", "densenet121:64", "vgg16:64", "mobilenet_v2:128", "gpt2-encoder:8",
          "vit_b_16:32"]


def quantiles(xs: list[float], ws: list[float] | None = None) -> dict[str, float]:
    pairs = sorted(zip(xs, ws or [1.0] * len(xs), strict=True))
    total = sum(w for _, w in pairs)
    out, acc, qs = {}, 0.0, [0.5, 0.75, 0.9, 0.99]
    for x, w in pairs:
        acc += w
        while qs and acc >= qs[0] * total:
            out[f"p{round(qs.pop(0) * 100)}"] = round(x, 5)
    return out


def probe(name: str, batch: int) -> dict:
    dev = torch.device("cuda")
    model, (x, y), loss_fn = build_model(name, batch, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # host issue time and iteration time of 10 unprofiled iterations
    import time
    issue, whole = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        issue.append((t1 - t0) * 1e6)
        whole.append((time.perf_counter() - t0) * 1e6)
    per_iter: list[list[float]] = []
    busy: list[float] = []
    for _ in range(10):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.device_time > 0), key=lambda e: e.time_range.start)
        per_iter.append([float(e.device_time) for e in ks])
        busy.append(sum(per_iter[-1]))
    n = min(len(k) for k in per_iter)
    same = all(len(k) == n for k in per_iter)
    sig, dur = [], []
    for j in range(n):
        ds = [k[j] for k in per_iter]
        if min(ds) <= 0:
            continue
        logs = [math.log(d) for d in ds]
        sig.append(statistics.pstdev(logs))
        dur.append(statistics.mean(ds))
    return {"model": name, "batch": batch, "kernels_per_iteration": n, "same_count": same,
            "sigma": quantiles(sig), "sigma_weighted_by_time": quantiles(sig, dur),
            "busy_us": [round(b, 1) for b in busy],
            "busy_sigma": round(statistics.pstdev([math.log(b) for b in busy]), 5),
            "host_issue_us": [round(v, 1) for v in issue],
            "iteration_us": [round(v, 1) for v in whole],
            "iteration_sigma": round(statistics.pstdev([math.log(v) for v in whole]), 5)}


def spread(path: str) -> str:
    """The timing spread the engine draws from (hardware/timing/NAME.yaml), from a probe's
    result: over its models, the median of each model's time-weighted median kernel sigma,
    and the median of each model's sigma of the host's issue time of a step."""
    doc = json.load(open(path))
    kernel = statistics.median(m["sigma_weighted_by_time"]["p50"] for m in doc["models"])
    host = statistics.median(statistics.pstdev([math.log(v) for v in m["host_issue_us"]])
                             for m in doc["models"])
    prov = doc["provenance"]
    return (f"# from {path}: python validation/jitter/probe_kernel_jitter.py --spread {path}\n"
            f"kernel_sigma: {kernel:.5f}\nhost_sigma: {host:.4f}\nprovenance:\n"
            f"  device: {prov['device']}\n  driver: {prov['driver']}\n"
            f"  torch: {prov['torch']}\n  date: '{prov['date']}'\n"
            f"  command: {prov['command']}\n"
            f"  models: [{', '.join(m['model'] for m in doc['models'])}]\n")


def main() -> int:
    if sys.argv[1] == "--spread":
        print(spread(sys.argv[2]), end="")
        return 0
    out = sys.argv[1]
    models = sys.argv[2:] or MODELS
    rows = []
    for m in models:
        name, batch = m.rsplit(":", 1)
        rows.append(probe(name, int(batch)))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    p = torch.cuda.get_device_properties(0)
    doc = {"probe": "kernel duration jitter across iterations", "models": rows,
           "provenance": {"device": p.name, "torch": torch.__version__,
                          "cuda": torch.version.cuda,
                          "driver": driver_version() or "unknown",
                          "date": datetime.datetime.now(datetime.timezone.utc)
                          .strftime("%Y-%m-%dT%H:%M:%SZ"),
                          "command": "python validation/jitter/probe_kernel_jitter.py " +
                          " ".join(sys.argv[1:])}}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
