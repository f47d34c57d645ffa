"""The host model's per-op costs against the suite's own runs without a plan: each run's host
issue time (`host_issue_us`: the step returned, before the final sync; no profiler, the suite's
batch, the machines and days the validation runs were measured on) over the model's summed
cost for the trace (HostModel.iteration_us). The probe the costs come from ran at batch 2 under
the profiler on one machine on 2026-11-24 (validation/host/README.md); the lent hosts' speed
differs by machine and day. Prints each run's ratio and, per hardware profile, the median over
the models not held out (a factor the per-op costs could be scaled by), with the held-out
models' error under it. Reads the repository; writes nothing. Not applied: scaling the H100's
costs by 0.615 and the H200's by 0.857 moves 31 validation plans (validation/README.md).

    python validation/host/fit_scale.py [--hold-out efficientnet_b0,regnet_y_1_6gf,...]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vsim.host import HostModel, load_host_model
from vsim.trace import Trace, load_trace
from vsim.validate import Case, load_cases

ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = "efficientnet_b0,regnet_y_1_6gf,swin_t,wide_resnet50_2"


def plain_runs() -> Iterator[tuple[Case, dict[str, Any], Trace, HostModel]]:
    """(case, measured run, trace, host model) of every validation case without a plan or a
    cap whose run fit and recorded its host issue time, on a profile with a host model."""
    for f in sorted(glob.glob(str(ROOT / "validation/cases/*-none*.yaml"))):
        case = load_cases([f])[0]
        if case.policy.split(":")[0] != "none" or case.memory_bytes is not None:
            continue
        m = json.loads(Path(case.measured).read_text())
        if not m.get("fits") or not m.get("host_issue_us"):
            continue
        host = load_host_model(case.hardware)
        if host is not None:
            yield case, m, load_trace(case.trace), host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-out", default=HELD_OUT)
    args = ap.parse_args()
    held = set(filter(None, args.hold_out.split(",")))
    rows: dict[str, list[tuple[str, bool, float]]] = {}
    for case, m, trace, host in plain_runs():
        model = str(trace.meta.get("model"))
        ratio = float(m["host_issue_us"]) / host.iteration_us(trace)
        rows.setdefault(case.hardware, []).append((case.id, model in held, ratio))
    for hw, rs in rows.items():
        fit = [r for _, out, r in rs if not out]
        scale = statistics.median(fit)
        print(f"{hw}: scale {scale:.3f} (median over {len(fit)} runs; ratios "
              f"{min(fit):.2f}-{max(fit):.2f})")
        for rid, out, r in rs:
            print(f"  {rid:45} measured/model {r:.2f}  error under the scale "
                  f"{100 * (scale / r - 1):+.1f}%{'  (held out)' if out else ''}")
        errs = [abs(scale / r - 1) for _, out, r in rs if out]
        if errs:
            print(f"  held out: MAPE {100 * statistics.mean(errs):.1f}% over {len(errs)} runs")
        print(f"  fit: MAPE {100 * statistics.mean(abs(scale / r - 1) for r in fit):.1f}%")


if __name__ == "__main__":
    main()
