"""Correlations of the step's time with each probe (between processes' medians, pooled
iterations, within a process) and a picture: `python validation/host/noise/processes/analyse.py
[--plot OUT.png]` over the JSON files beside it (probe_processes.py's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROBES = ("python_us", "dispatch_us", "launch_us", "memory_us")


def main() -> None:
    runs = {f.stem: json.loads(f.read_text())["processes"] for f in sorted(HERE.glob("*.json"))}
    for name, procs in runs.items():
        steps = np.array([p["median"]["step_us"] for p in procs])
        rows = [r for p in procs for r in p["rows"]]
        print(f"{name}: {len(procs)} processes, step medians {steps.min() / 1e3:.1f}-"
              f"{steps.max() / 1e3:.1f} ms")
        for k in PROBES:
            between = np.corrcoef([p["median"][k] for p in procs], steps)[0, 1]
            pooled = np.corrcoef([r[k] for r in rows], [r["step_us"] for r in rows])[0, 1]
            within = np.mean([np.corrcoef([r[k] for r in p["rows"]],
                                          [r["step_us"] for r in p["rows"]])[0, 1]
                              for p in procs])
            print(f"  {k:12s} r between processes {between:+.2f}, pooled {pooled:+.2f}, "
                  f"within a process (mean) {within:+.2f}")
    if "--plot" in sys.argv:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(runs), 2, figsize=(10, 4 * len(runs)), squeeze=False)
        for row, (name, procs) in zip(axes, runs.items(), strict=True):
            for ax, k in zip(row, ("python_us", "memory_us"), strict=True):
                for i, p in enumerate(procs):
                    ax.scatter([r[k] / 1e3 for r in p["rows"]],
                               [r["step_us"] / 1e3 for r in p["rows"]], s=14, label=f"process {i}")
                ax.set_xlabel(f"{k[:-3]} probe before the step (ms)")
                ax.set_ylabel("step (ms)")
                ax.set_title(f"{name}: step against the {k[:-3]} probe", fontsize=9)
            row[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(sys.argv[sys.argv.index("--plot") + 1], dpi=90)


if __name__ == "__main__":
    main()
