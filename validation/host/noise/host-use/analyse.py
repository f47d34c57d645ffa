"""Does a host-bound iteration's time follow the core's speed of the moment? Reads the runs in
b/ (each measured iteration: the process's CPU time while it was issued, and the speed probe
taken just before it, vsim.record.hostprobe.speed_probe_us) and a/ (the same cases, no probe),
prints per run and per model the medians and the correlation, and draws host-use.png.

    python validation/host/noise/host-use/analyse.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def runs(sub: str) -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted((HERE / sub).glob("*.json"))]


def main() -> int:
    print("a/ (no probe): issue wall and CPU time per run, ms (medians over 20 iterations)")
    for name, r in runs("a"):
        u = r["host_use"]
        print(f"  {name:28s} issue {r['host_issue_us'] / 1e3:6.1f}  "
              f"CPU {statistics.median(u['issue_cpu_us']) / 1e3:6.1f}  "
              f"involuntary switches {sum(u['involuntary_switches'] or [])}")
    print("b/: CPU time while issued against the speed probe before it")
    pooled: dict[str, list[tuple[float, float]]] = {}
    for name, r in runs("b"):
        u = r["host_use"]
        cpu, probe = np.array(u["issue_cpu_us"]) / 1e3, np.array(u["speed_probe_us"])
        model = name.rsplit("-r", 1)[0]
        pooled.setdefault(model, []).extend(zip(probe, cpu, strict=True))
        print(f"  {name:28s} CPU {np.median(cpu):6.1f} ms ({cpu.min():5.1f}-{cpu.max():5.1f})"
              f"  probe {np.median(probe):6.0f} us ({probe.min():5.0f}-{probe.max():5.0f})"
              f"  r {np.corrcoef(cpu, probe)[0, 1]:+.2f}")
    for model, pts in pooled.items():
        p, c = np.array(pts).T
        slope, icept = np.polyfit(p, c, 1)
        print(f"  {model:28s} pooled r {np.corrcoef(p, c)[0, 1]:+.2f}; CPU ms = {icept:.1f} + "
              f"{slope * 1e3:.1f} x probe ms: {icept + slope * 650:.1f} ms at a 650 us probe, "
              f"{icept + slope * 1450:.1f} at 1450")
    if "--no-plot" not in sys.argv:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for model, pts in pooled.items():
            p, c = np.array(pts).T
            ax.scatter(p, c, s=14, label=model)
        ax.set_xlabel("speed probe just before the iteration (us; fixed Python loop)")
        ax.set_ylabel("process CPU time while the iteration was issued (ms)")
        ax.set_title("Host-bound iterations follow the core's speed of the moment\n"
                     "(H100 machine, one process, 2026-11-27)", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(HERE / "host-use.png", dpi=110)
        print(f"wrote {HERE / 'host-use.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
