"""Runs of the same plan compared: for every case with `repeats` (validation/cases), the latest
run's median iteration time over each earlier run's, the runs' own spreads, and the cases whose
runs disagree on fitting. Host-bound runs (host issue time at least 80% of the iteration) are
shown apart: the lent hosts' speed drifts, the GPUs' does not. Reads the repository; writes
nothing.

    python validation/host/noise/runs_compare.py [--list]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

from vsim.validate import load_cases

ROOT = Path(__file__).resolve().parents[3]


def spread(times: list[float]) -> float:
    return (max(times) - min(times)) / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", action="store_true", help="one line per case")
    args = ap.parse_args()
    rows, disagree = [], []
    for case in load_cases(sorted(glob.glob(str(ROOT / "validation/cases/*.yaml")))):
        if not case.repeats:
            continue
        runs = [json.loads(Path(p).read_text()) for p in [case.measured, *case.repeats]]
        if len({r["fits"] for r in runs}) > 1:
            disagree.append((case.id, [r["fits"] for r in runs]))
        last, earlier = runs[0], runs[1:]
        for e in earlier:
            if not (last["fits"] and e["fits"]):
                continue
            issue = last.get("host_issue_us")
            bound = "host" if issue and issue >= 0.8 * last["iteration_time_us"] else "gpu"
            rows.append((case.id, bound, last["iteration_time_us"] / e["iteration_time_us"],
                         spread(e["iteration_times_us"]), spread(last["iteration_times_us"])))
    if args.list:
        for r in sorted(rows, key=lambda r: r[2]):
            print(f"{r[0]:55} {r[1]:4} latest/earlier {r[2]:.3f}  spreads {r[3]:.2f} {r[4]:.2f}")
    print("| runs | pairs | latest/earlier median | pairs apart by >10% | median spread "
          "earlier, latest |")
    print("|---|---|---|---|---|")
    for name, sel in (("all", rows), ("host-bound", [r for r in rows if r[1] == "host"]),
                      ("GPU-bound", [r for r in rows if r[1] == "gpu"])):
        if not sel:
            continue
        ratios = [r[2] for r in sel]
        print(f"| {name} | {len(sel)} | {statistics.median(ratios):.3f} | "
              f"{sum(abs(x - 1) > 0.10 for x in ratios)} | "
              f"{statistics.median(r[3] for r in sel):.1%}, "
              f"{statistics.median(r[4] for r in sel):.1%} |")
    print(f"runs disagree on fitting: {len(disagree)}")
    for d in disagree:
        print(f"  {d[0]}: fits {d[1]} (latest first)")


if __name__ == "__main__":
    main()
