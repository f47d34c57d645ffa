"""Fit the executor's op-tracker host cost (HostModel.tracker_us_per_op) to the `*-tracked` runs.

A `*-tracked` run is policy `none` carried out under vsim's executor with its op tracker on
(validation/measured/*-tracked.json): the same iteration as the untracked `none` run plus the
tracker's host time per op. For each candidate cost the simulator predicts the tracked run
(`run_plan(..., tracked=True)`: the host model's per-op times, bounded by the recording, plus
the cost per op), and the cost that minimizes the fit models' mean absolute error is kept; the
other tracked runs are the held-out check. Writes nothing: prints the table and the value for
hardware/host/NAME.yaml's `executor.tracker_us_per_op`.

    python validation/host/fit_tracker.py --fit resnet50,googlenet
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from vsim.allocator import make_allocator
from vsim.engine import run_plan
from vsim.hardware import load_hardware
from vsim.host import load_host_model
from vsim.plan import Plan
from vsim.retarget import for_hardware
from vsim.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]


def runs() -> list[tuple[str, object, float, object]]:
    out = []
    hw = load_hardware("h100-sxm")
    for f in sorted(glob.glob(str(ROOT / "validation/measured/*-tracked.json"))):
        d = json.loads(Path(f).read_text())
        trace, _ = for_hardware(load_trace(ROOT / d["trace"]), hw)
        out.append((d["model"], trace, float(d["iteration_time_us"]), hw))
    return out


def predict(trace: object, hw: object, per_op: float) -> float:
    import dataclasses

    import vsim.engine as eng

    model = load_host_model("h100-sxm")
    assert model is not None
    model = dataclasses.replace(model, tracker_us_per_op=per_op)
    orig = eng.load_host_model
    eng.load_host_model = lambda name: model  # type: ignore[assignment]
    try:
        r = run_plan(trace, hw, Plan(actions=()), make_allocator("caching"),  # type: ignore[arg-type]
                     tracked=True).report
    finally:
        eng.load_host_model = orig
    return float(r["iteration_time_us"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", default="resnet50,googlenet")
    args = ap.parse_args()
    fit = set(args.fit.split(","))
    data = runs()
    best = None
    for per_op in [x * 0.5 for x in range(0, 161)]:
        errs = [abs(predict(t, hw, per_op) - m) / m for name, t, m, hw in data if name in fit]
        score = sum(errs) / len(errs)
        if best is None or score < best[0]:
            best = (score, per_op)
    assert best is not None
    per_op = best[1]
    print(f"tracker_us_per_op: {per_op} (fit on {sorted(fit)})")
    print("| model | in fit | measured | predicted untracked | predicted tracked | error |")
    print("|---|---|---|---|---|---|")
    for name, t, m, hw in data:
        p0, p = predict(t, hw, 0.0), predict(t, hw, per_op)
        print(f"| {name} | {'yes' if name in fit else 'held out'} | {m / 1000:.2f} ms | "
              f"{p0 / 1000:.2f} ms | {p / 1000:.2f} ms | {100 * (p - m) / m:+.1f}% |")


if __name__ == "__main__":
    main()
