"""A host model by aten calls, fitted on the suite's runs without a plan (issue 15): host issue
time = a x forward aten calls (the runtime's op maps' calls per op, HostModel.calls) + b x
backward ops (autograd nodes) + c x other ops (the optimizer's) + d x weights, by least squares
on relative error over the H100 runs of the models not held out; against it, the probe's
per-name model times one scale (fit_scale.py). Prints both models' error per model. Not
applied: any change to host costs moves validation plans, which must be remeasured first.
Reads the repository; writes nothing.

    python validation/host/fit_calls.py [--hardware h100-sxm] [--hold-out M,...]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from fit_scale import HELD_OUT, plain_runs  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--hold-out", default=HELD_OUT)
    args = ap.parse_args()
    held = set(filter(None, args.hold_out.split(",")))
    rows = []
    for case, m, trace, host in plain_runs():
        if case.hardware != args.hardware:
            continue
        ops = trace.ops
        x = [sum(host.calls(o) for o in ops if o.phase == "fwd"),
             sum(o.phase == "bwd" for o in ops), sum(o.phase not in ("fwd", "bwd") for o in ops),
             sum(t.kind == "weight" for t in trace.tensors)]
        rows.append((case.id, str(trace.meta.get("model")) in held, float(m["host_issue_us"]),
                     host.iteration_us(trace), x))
    y = np.array([r[2] for r in rows])
    x = np.array([r[4] for r in rows], dtype=float)
    probe = np.array([r[3] for r in rows])
    fit = np.array([not r[1] for r in rows])
    coef, *_ = np.linalg.lstsq(x[fit] / y[fit, None], np.ones(int(fit.sum())), rcond=None)
    calls_err = np.abs(x @ coef / y - 1)
    scale = statistics.median((y / probe)[fit])
    probe_err = np.abs(scale * probe / y - 1)
    print(f"calls model: {coef[0]:.1f} us per forward aten call, {coef[1]:.1f} per backward op, "
          f"{coef[2]:.1f} per other op, {coef[3]:.1f} per weight ({int(fit.sum())} runs)")
    print("| run | host issue measured | calls model | probe model x scale |")
    print("|---|---|---|---|")
    for r, e1, e2 in zip(rows, calls_err, probe_err, strict=True):
        print(f"| {r[0]}{' (held out)' if r[1] else ''} | {r[2] / 1e3:.1f} ms | "
              f"{100 * e1:.1f}% | {100 * e2:.1f}% |")
    for name, sel in (("fit", fit), ("held out", ~fit)):
        if sel.any():
            print(f"{name}: calls model MAPE {100 * calls_err[sel].mean():.1f}%, probe model x "
                  f"{scale:.3f} {100 * probe_err[sel].mean():.1f}%")


if __name__ == "__main__":
    main()
