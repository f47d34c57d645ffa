"""Screening runs (issue 14, planning time): a profiling run cut short after its first iterations,
which goes on from there when its plan is then run whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vsim.allocator import make_allocator
from vsim.engine import planning_runner, run_plan
from vsim.hardware import load_hardware
from vsim.plan import Plan
from vsim.policies import make_policy
from vsim.trace import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
HW = load_hardware("h100-sxm")
CACHING = make_allocator("caching")


@pytest.mark.parametrize("name,spec,fraction", [
    ("squeezenet1_1-b128-h100", "accudnn", 0.5),  # 13 iterations: the layout never repeats
    ("resnet50-b64-h100", "vdnnpp", 0.5),  # settles in its 12th
    ("squeezenet1_1-b128-h100", "superneurons", 0.6),  # runs out of memory in its 6th
])
def test_a_screening_run_gone_on_reports_what_a_whole_run_reports(name: str, spec: str,
                                                                    fraction: float) -> None:
    trace = load_trace(TRACES / f"{name}.vsim.json.gz")
    none = run_plan(trace, HW, make_policy("none").plan(trace, HW, HW.capacity_bytes),
                    CACHING, HW.capacity_bytes).report
    cap = int(int(none["peak_reserved_bytes"]) * fraction)
    runner = planning_runner(CACHING)
    plan = make_policy(spec).plan_with(trace, HW, cap, runner)
    whole = runner(trace, HW, plan, None, cap)
    assert whole.output.iterations > 3  # a run a screening cuts short
    for n in (2, 3, 5):
        screened = runner.screen(trace, HW, plan, cap, n)
        assert screened.output.iterations == min(n, whole.output.iterations)
        assert screened.resume is not None or screened.output.iterations == \
            whole.output.iterations
        gone_on = screened.resume() if screened.resume is not None else screened
        assert json.dumps(gone_on.report, sort_keys=True) == json.dumps(whole.report,
                                                                         sort_keys=True)
        assert gone_on.resume is None


def test_a_run_simulates_at_least_two_iterations() -> None:
    trace = load_trace(TRACES / "alexnet-b128-h100.vsim.json.gz")
    with pytest.raises(ValueError, match="at least 2"):
        run_plan(trace, HW, Plan(), CACHING, None, iterations=1)
