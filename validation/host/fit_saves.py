"""Saves through the runtime's saved-tensor hooks per forward op, by op name (issue 13/15: the
hooks cost per save, and a forward op saves what its autograd node keeps: batch norm under
cuDNN 7 tensors, max pooling 2, an in-place ReLU none). Over every measured run of the native
tracker with an executor's report (`executed.packs`, the saves that went through the hooks):
the forward ops the hooks were on for (the hooks "always": every forward op of the trace;
"armed": vsim.engine.hostclock.hooked_ops of the plan `vsim validate` makes for the run), then
non-negative least squares of the runs' saves on their hooked ops' counts by name. Prints the
table as YAML for hardware/host/NAME.yaml's `executor.saves_per_op` (fitted on the runs with
the hooks armed, whose charge it is; `default`: for names the table leaves out) and, with
`--hold-out`, the held-out models' runs predicted by the table fitted without them. Writes
nothing.

    PYTHONPATH=tools python validation/host/fit_saves.py [--hold-out M,...] [--min-runs 3]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import statistics
from pathlib import Path

import numpy as np

from vsim.engine.hostclock import hooked_ops
from vsim.plan import PlanIndex
from vsim.trace import load_trace
from vsim.validate import load_cases

# (case id, model, the hooks armed, hooked ops by name, saves through the hooks)
Row = tuple[str, str, bool, dict[str, int], int]


def runs() -> list[Row]:
    from host_whatif import planned  # tools/, planned as vsim validate plans

    rows: list[Row] = []
    for case in load_cases(sorted(glob.glob("validation/cases/*.yaml"))):
        if case.measured == "trace":
            continue
        doc = json.loads(Path(case.measured).read_text())
        ex = doc.get("executed") or {}
        if ex.get("tracker") != "native" or "packs" not in ex or not doc.get("fits"):
            continue
        armed = ex.get("native_hooks") == "armed"
        if armed:
            trace, plan = planned(case)
            hooked = hooked_ops(trace, PlanIndex(plan))
            ops = [o for o in trace.ops if o.id in hooked]
        else:
            ops = [o for o in load_trace(case.trace).ops if o.phase == "fwd"]
        model = (doc.get("provenance") or {}).get("model") or case.id.split("-")[0]
        rows.append((case.id, model, armed, dict(collections.Counter(o.name for o in ops)),
                     int(ex["packs"])))
    return rows


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative column until none is
    (the columns are op names; enumerating subsets, fit_executor's way, does not scale)."""
    cols = list(range(a.shape[1]))
    while True:
        c, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (c >= 0).all():
            out = np.zeros(a.shape[1])
            out[cols] = c
            return out
        del cols[int(np.argmin(c))]


def fit(rows: list[Row], min_runs: int) -> tuple[dict[str, float], float]:
    """(saves per op by name for names hooked in at least `min_runs` runs, the default for the
    rest, fitted as one column), by NNLS over the runs with the hooks armed: their few hooked
    ops (batch norm, max pooling, layer norm, attention) each put all their saves through
    the hooks. The runs with the hooks on for every forward op are left out: conv2d, batch
    norm and ReLU come together in them, and one fit trades those against each other."""
    armed = [r for r in rows if r[2] and r[3]]
    seen = collections.Counter(n for *_, ops, _ in armed for n in ops)
    names = sorted(n for n, k in seen.items() if k >= min_runs)
    a = np.array([[ops.get(n, 0) for n in names] +
                  [sum(k for n, k in ops.items() if n not in names)] for *_, ops, _ in armed],
                 dtype=float)
    x = nnls(a, np.array([s for *_, s in armed], dtype=float))
    table = {n: round(float(v), 2) for n, v in zip(names, x[:-1], strict=True)}
    return table, round(float(x[-1]), 2)


def predict(ops: dict[str, int], table: dict[str, float], default: float) -> float:
    return sum(k * table.get(n, default) for n, k in ops.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-out", default="", help="models left out of the fit, to check on")
    ap.add_argument("--min-runs", type=int, default=3)
    args = ap.parse_args()
    held = set(filter(None, args.hold_out.split(",")))
    rows = runs()
    fitted = [r for r in rows if r[1] not in held]
    table, default = fit(fitted, args.min_runs)
    print(f"# fit_saves.py over {len(fitted)} runs ({sum(r[2] for r in fitted)} "
          f"armed) of {len({r[1] for r in fitted})} models (held out: {sorted(held) or 'none'})")
    print("saves_per_op:")
    for n, v in table.items():
        print(f"  {n}: {v}")
    print(f"  default: {default}")
    always = [s / sum(ops.values()) for _, _, armed, ops, s in rows if not armed and ops]
    if always:
        print(f"# the hooks always on: {statistics.median(always):.2f} saves per forward op "
              f"(median over {len(always)} runs; `pack_us` charges it per forward op)")
    checked = [r for r in rows if r[2]]
    for label, group in (("fitted", [r for r in checked if r[1] not in held]),
                         ("held out", [r for r in checked if r[1] in held])):
        errs = [abs(predict(ops, table, default) - s) / s for *_, ops, s in group if s]
        if errs:
            print(f"# {label}: {len(errs)} runs with saves, |error| median "
                  f"{100 * statistics.median(errs):.1f}%, largest {100 * max(errs):.1f}%")
    for cid, *_, ops, s in (r for r in checked if r[1] in held):
        print(f"#   {cid}: {s} saves, predicted {predict(ops, table, default):.0f}")


if __name__ == "__main__":
    main()
