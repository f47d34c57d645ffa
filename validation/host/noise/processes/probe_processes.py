"""Which host probe follows the training step's host-bound time from one process to the next?

Run on the GPU machine: `python validation/host/noise/processes/probe_processes.py OUT.json
[MODEL BATCH PROCESSES] [--cpus A,B,...]` (default densenet169 32 6; --cpus: process i pinned to
the i-th CPU of the list, cycled). Each of PROCESSES fresh processes builds
the model (torchvision, SGD, fp32, as `vsim record` does), runs 3 warm-up steps, then 10 steps,
each after four probes:
- `python_us`: vsim.record.hostprobe.speed_probe_us, a pure-Python loop (what the recorder and
  the measuring runtime take now);
- `dispatch_us`: 2,000 `torch.add` calls on 4-element CPU tensors (the dispatcher's path);
- `launch_us`: 1,000 `torch.add` calls on 4-element CUDA tensors, host time only (dispatch and
  kernel launch: the path of a host-bound step), then a synchronize;
- `memory_us`: a sum over a 256 MiB numpy array (the memory system's bandwidth of the moment).
and the step's wall time (synchronized before and after). The question: between processes, the
same step on the same GPU ran 68 ms in one and 112 ms in another (densenet169, 2026-11-28,
validation/README.md); the Python loop did not follow it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time


def child(model: str, batch: int, cpu: int | None = None) -> dict:
    import os

    if cpu is not None:  # the whole process on one CPU (its threads too)
        os.sched_setaffinity(0, {cpu})
    import numpy as np
    import torch
    import torchvision

    from vsim.record.hostprobe import speed_probe_us

    dev = torch.device("cuda")
    net = getattr(torchvision.models, model)().to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    a, b = torch.zeros(4), torch.zeros(4)
    ga, gb = torch.zeros(4, device=dev), torch.zeros(4, device=dev)
    big = np.ones(64 * 2**20, dtype=np.float32)

    def timed(f, *args) -> float:
        t0 = time.perf_counter()
        f(*args)
        return (time.perf_counter() - t0) * 1e6

    def dispatch() -> None:
        for _ in range(2000):
            torch.add(a, b)

    def launch() -> None:
        for _ in range(1000):
            torch.add(ga, gb)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    rows = []
    for _ in range(10):
        r = {"python_us": speed_probe_us(), "dispatch_us": min(timed(dispatch) for _ in range(3))}
        torch.cuda.synchronize()
        r["launch_us"] = min(timed(launch) for _ in range(3))
        torch.cuda.synchronize()
        r["memory_us"] = min(timed(big.sum) for _ in range(3))
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        r["step_us"] = (time.perf_counter() - t0) * 1e6
        rows.append(r)
    return {"model": model, "batch": batch, "cpu": cpu, "rows": rows}


def main() -> None:
    if sys.argv[1] == "--child":
        cpu = int(sys.argv[4]) if len(sys.argv) > 4 else None
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), cpu)))
        return
    out, model, batch, n = sys.argv[1], "densenet169", 32, 6
    if len(sys.argv) > 2:
        model, batch, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    # --cpus A,B,...: process i pinned to CPU i of the list (cycled)
    cpus = [int(c) for c in sys.argv[sys.argv.index("--cpus") + 1].split(",")] \
        if "--cpus" in sys.argv else None
    procs = []
    for i in range(n):
        pin = [] if cpus is None else [str(cpus[i % len(cpus)])]
        got = subprocess.run([sys.executable, __file__, "--child", model, str(batch), *pin],
                             capture_output=True, text=True, check=True)
        res = json.loads(got.stdout.strip().splitlines()[-1])
        med = {k: statistics.median(r[k] for r in res["rows"]) for k in res["rows"][0]}
        where = "" if cpus is None else f" (cpu {pin[0]})"
        print(f"process {i}{where}: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()),
              flush=True)
        procs.append({**res, "median": med})
    import torch
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": " ".join(["python", *sys.argv]), "processes": procs}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
