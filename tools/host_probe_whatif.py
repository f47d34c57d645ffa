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
import glob
import json
import math
import statistics
import sys
from typing import Any

import vsim.engine as engine
from vsim.allocator import make_allocator
from vsim.engine import run_plan, simulate
from vsim.hardware import Hardware, load_hardware
from vsim.host import HostModel
from vsim.policies import make_policy
from vsim.retarget import for_hardware
from vsim.trace import load_trace
from vsim.trace.schema import Trace
from vsim.validate import Case, load_cases, measured_result, measured_tracker, relative_error

HELD_OUT = ("efficientnet_b0", "regnet_y_1_6gf", "swin_t", "wide_resnet50_2")
TIME_FIELDS = ("per_weight_us", "tracker_us_per_op", "copy_us", "free_us", "recompute_call_us",
               "record_call_us", "pack_us", "record_callback_us", "native_us_per_call")


def scaled(host: HostModel, s: float) -> HostModel:
    return dataclasses.replace(
        host, by_name={p: {n: v * s for n, v in d.items()} for p, d in host.by_name.items()},
        by_phase={p: v * s for p, v in host.by_phase.items()},
        **{f: getattr(host, f) * s for f in TIME_FIELDS})


def probes(case: Case) -> list[float]:
    out = []
    for path in [case.measured, *case.repeats]:
        with open(path) as f:
            doc = json.load(f)
        step = ((doc.get("provenance") or {}).get("host_probe") or {}).get("step_us")
        if step:
            out.append(float(step))
    return out


def within_plan(cases: list[Case]) -> None:
    """Pairs of runs of one plan on the H100: log time ratio against log probe ratio."""
    xs, ys = [], []
    for case in cases:
        if case.hardware != "h100-sxm" or not case.repeats:
            continue
        runs = []
        for path in [case.measured, *case.repeats]:
            with open(path) as f:
                doc = json.load(f)
            step = ((doc.get("provenance") or {}).get("host_probe") or {}).get("step_us")
            t, issue = doc.get("iteration_time_us"), doc.get("host_issue_us") or 0.0
            if doc.get("fits") and t and step and issue >= 0.8 * t:  # host-bound
                runs.append((float(step), float(t)))
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
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
    ref = {hw: statistics.median(p for c in cases if c.hardware == hw for p in probes(c))
           for hw in ("h100-sxm", "h200")}
    base = engine._host_model  # noqa: SLF001
    rows = []
    for case in cases:
        ps = probes(case)
        if not ps:
            continue
        s = (statistics.median(ps) / ref[case.hardware]) ** k
        hw = load_hardware(case.hardware)
        trace, _ = for_hardware(load_trace(case.trace), hw)
        m = measured_result(case, trace.measured)
        if not m["fits"] or not m.get("iteration_time_us"):
            continue
        sim = simulate(trace, hw, make_policy(case.policy), make_allocator(case.allocator),
                       case.memory_bytes, tracker=measured_tracker(m), plan_tracker="native")

        def host_model(trace: Trace, hw: Hardware, host_time: Any, tracker: Any = None,
                       s: float = s) -> HostModel | None:
            host = base(trace, hw, host_time, tracker)
            return None if host is None else scaled(host, s)

        engine._host_model = host_model  # noqa: SLF001
        again = run_plan(trace, hw, sim.plan, make_allocator(case.allocator), case.memory_bytes,
                         tracker=measured_tracker(m)).report
        engine._host_model = base  # noqa: SLF001
        if not (sim.report["fits"] and again["fits"]):
            continue
        before = relative_error(sim.report["timed_iteration_time_us"], m["iteration_time_us"])
        after = relative_error(again["timed_iteration_time_us"], m["iteration_time_us"])
        rows.append((case.id, case.hardware, s, before or 0.0, after or 0.0))
    for name, sel in (("h100-sxm", [r for r in rows if r[1] == "h100-sxm"]),
                      ("h200", [r for r in rows if r[1] == "h200"]), ("all", rows),
                      ("held-out models", [r for r in rows if r[0].startswith(HELD_OUT)])):
        was = 100 * statistics.mean(abs(r[3]) for r in sel)
        now = 100 * statistics.mean(abs(r[4]) for r in sel)
        print(f"{name}: {len(sel)} cases, time MAPE {was:.2f}% -> {now:.2f}%, over 15% "
              f"{sum(abs(r[3]) > 0.15 for r in sel)} -> {sum(abs(r[4]) > 0.15 for r in sel)}")


if __name__ == "__main__":
    main()
