"""Where a measured iteration's host time goes, per thread: the suite runner with its
`--profile-last` iteration profiled with CPU activity too (torch.profiler, CPU + CUDA), and
that iteration summarised by CUDA runtime call (count, total and largest duration per thread)
and by the aten calls with the most self CPU time. Asks: does a recomputing plan's host issue
time hold waits for the GPU (synchronisations, blocked launches, cudaMalloc) that the
executor's timers do not see? On the GPU machine:

    python validation/host/waits/profile_waits.py validation/suite.yaml OUT --only IDS

writes OUT/ID.json as the suite runner does, with `profile_last` replaced by this summary.
The profiler's own cost per CPU event (a few us) inflates the profiled iteration's time; its
wall time is not a measurement of the case, only its breakdown is used."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from vsim.runtime import session  # noqa: E402
from vsim.runtime.suite import main  # noqa: E402


def profiler() -> Any:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    return prof


def summary(prof: Any, wall_us: float) -> dict[str, Any]:
    runtime: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    aten: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_thread: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0, 0.0])
    threads: dict[int, list[float]] = defaultdict(lambda: [float("inf"), 0.0, 0])
    gpu_busy: list[tuple[float, float]] = []
    for e in prof.events():
        start, end = e.time_range.start, e.time_range.end
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu_busy.append((start, end))
            continue
        t = threads[e.thread]
        t[0], t[1], t[2] = min(t[0], start), max(t[1], end), t[2] + 1
        b = by_thread[(e.thread, e.name)]
        b[0] += 1
        b[1] += e.self_cpu_time_total
        if e.name.startswith("cuda") or e.name.startswith("cu"):
            r = runtime[(e.thread, e.name)]
            r[0] += 1
            r[1] += end - start
            r[2] = max(r[2], end - start)
        elif e.name.startswith("aten::"):
            a = aten[e.name]
            a[0] += 1
            a[1] += e.self_cpu_time_total
    busy, last = 0.0, float("-inf")
    for a, b in sorted(gpu_busy):
        if b > last:
            busy += b - max(a, last)
            last = b
    return {
        "wall_us": round(wall_us, 1), "gpu_busy_us": round(busy, 1),
        "threads": {str(k): {"span_us": round(v[1] - v[0], 1), "events": v[2]}
                    for k, v in threads.items()},
        "runtime": [{"thread": k[0], "name": k[1], "calls": v[0], "us": round(v[1], 1),
                     "max_us": round(v[2], 1)}
                    for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:40]],
        "self_by_thread": [{"thread": k[0], "name": k[1][:120], "calls": v[0],
                            "us": round(v[1], 1)}
                           for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1][1])[:60]],
        "self_total_by_thread": {str(t): round(sum(v[1] for k, v in by_thread.items()
                                                   if k[0] == t), 1) for t in threads},
        "aten_self": [{"name": n, "calls": c, "us": round(us, 1)}
                      for n, (c, us) in sorted(aten.items(), key=lambda kv: -kv[1][1])[:30]],
    }


if __name__ == "__main__":
    session.kernel_profiler = profiler
    session.kernel_summary = summary
    sys.argv.append("--profile-last")
    main()
