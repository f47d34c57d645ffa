"""What scaling the host model by each run's measured host speed would do to validate's time
error, with the plans held: each case is planned as `vsim validate` plans it, then that plan is
run again with every host cost (per op, per weight, the executor's and the trackers') times
(median host probe of the case's runs / median host probe of all runs on its hardware) ** K.
Runs of one plan on different machines differ with their probes (log-log slope 0.74, r 0.81 over
69 pairs of host-bound H100 runs); this asks whether that carries across cases. Writes nothing.

    python tools/host_probe_whatif.py [K]   (default 1.0)

On 2026-11-26 (K 1): 4.41% -> 4.33% over 203 cases (h100-sxm 4.66 -> 4.65, h200 3.58 -> 3.25),
held-out models 5.42% -> 6.03%: not adopted.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import statistics
import sys
from typing import Any

from host_whatif import HELD_OUT, rerun_with_host

from vsim.host import HostModel
from vsim.validate import Case, load_cases, relative_error

TIME_FIELDS = ("per_weight_us", "tracker_us_per_op", "copy_us", "free_us", "recompute_call_us",
               "record_call_us", "pack_us", "save_us", "record_callback_us",
               "native_us_per_call")


def scaled(host: HostModel, s: float) -> HostModel:
    return dataclasses.replace(
        host, by_name={p: {n: v * s for n, v in d.items()} for p, d in host.by_name.items()},
        by_phase={p: v * s for p, v in host.by_phase.items()},
        **{f: getattr(host, f) * s for f in TIME_FIELDS})


def runs(case: Case) -> list[dict[str, Any]]:
    """The case's measured run and its repeats."""
    out = []
    for path in [case.measured, *case.repeats]:
        with open(path) as f:
            out.append(json.load(f))
    return out


def probe_us(run: dict[str, Any]) -> float | None:
    """The host probe's step time of the machine the run was measured on."""
    step = ((run.get("provenance") or {}).get("host_probe") or {}).get("step_us")
    return float(step) if step else None


def within_plan(cases: list[Case]) -> None:
    """Pairs of runs of one plan on the H100: log time ratio against log probe ratio."""
    xs, ys = [], []
    for case in cases:
        if case.hardware != "h100-sxm" or not case.repeats:
            continue
        timed = []
        for run in runs(case):
            step, t = probe_us(run), run.get("iteration_time_us")
            issue = run.get("host_issue_us") or 0.0
            if run.get("fits") and t and step and issue >= 0.8 * t:  # host-bound
                timed.append((step, float(t)))
        for i, a in enumerate(timed):
            for b in timed[i + 1:]:
                xs.append(math.log(a[0] / b[0]))
                ys.append(math.log(a[1] / b[1]))
    print(f"runs of one plan, host-bound, H100: {len(xs)} pairs, log-log slope "
          f"{statistics.linear_regression(xs, ys).slope:.2f}, r "
          f"{statistics.correlation(xs, ys):.2f}")


def main() -> None:
    k = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    cases = [c for c in load_cases(sorted(glob.glob("validation/cases/*.yaml")))
             if c.measured != "trace"]
    within_plan(cases)
    probes = {c.id: [p for p in map(probe_us, runs(c)) if p] for c in cases}
    ref = {hw: statistics.median(p for c in cases if c.hardware == hw for p in probes[c.id])
           for hw in ("h100-sxm", "h200")}
    rows = []
    for case in cases:
        if not probes[case.id]:
            continue
        s = (statistics.median(probes[case.id]) / ref[case.hardware]) ** k
        result = rerun_with_host(case, functools.partial(scaled, s=s))
        if result is None:
            continue
        m, before, (after,) = result
        if not (before["fits"] and after["fits"]):
            continue
        was = relative_error(before["timed_iteration_time_us"], m["iteration_time_us"])
        now = relative_error(after["timed_iteration_time_us"], m["iteration_time_us"])
        rows.append((case.id, case.hardware, s, was or 0.0, now or 0.0))
    for name, sel in (("h100-sxm", [r for r in rows if r[1] == "h100-sxm"]),
                      ("h200", [r for r in rows if r[1] == "h200"]), ("all", rows),
                      ("held-out models", [r for r in rows if r[0].startswith(HELD_OUT)])):
        was = 100 * statistics.mean(abs(r[3]) for r in sel)
        now = 100 * statistics.mean(abs(r[4]) for r in sel)
        print(f"{name}: {len(sel)} cases, time MAPE {was:.2f}% -> {now:.2f}%, over 15% "
              f"{sum(abs(r[3]) > 0.15 for r in sel)} -> {sum(abs(r[4]) > 0.15 for r in sel)}")


if __name__ == "__main__":
    main()
