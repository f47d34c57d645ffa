"""Timing draws (issue 15): a run under a draw of the timing variation measured between real
iterations is reproducible by its seed, differs between seeds, is the recorded timing's run when
the spread is nil, and validate's verdict for a case is what most draws give."""

from __future__ import annotations

from pathlib import Path

import pytest

from vsim.allocator import make_allocator
from vsim.engine import TimingDraw, run_plan, timing_draws
from vsim.errors import HardwareError
from vsim.hardware import load_hardware
from vsim.host import load_timing_spread
from vsim.policies import make_policy
from vsim.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
HW = load_hardware("h100-sxm")
CACHING = make_allocator("caching")


@pytest.fixture(scope="module")
def resnet50_hybrid() -> tuple:
    trace = load_trace(ROOT / "traces" / "resnet50-b64-h100.vsim.json.gz")
    cap = 6 << 30
    plan = make_policy("hybrid").plan(trace, HW, cap)
    return trace, plan, cap


def test_a_draw_is_reproducible_by_its_seed_and_differs_between_seeds(resnet50_hybrid: tuple
                                                                      ) -> None:
    trace, plan, cap = resnet50_hybrid
    spread = load_timing_spread(HW.name)
    assert spread is not None and spread.host_sigma > 0 and spread.kernel_sigma > 0

    def run(seed: int) -> dict:
        draw = TimingDraw(seed, spread.kernel_sigma, spread.host_sigma)
        return run_plan(trace, HW, plan, CACHING, cap, draw=draw).report

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a["iteration_time_us"] != c["iteration_time_us"]
    # every iteration of a measured run is simulated: none alike, no early stop
    assert a["fits"] and "iteration 13 of the run reported" in " ".join(a["notes"])


def test_a_draw_with_no_spread_is_the_recorded_timings_run(resnet50_hybrid: tuple) -> None:
    trace, plan, cap = resnet50_hybrid
    plain = run_plan(trace, HW, plan, CACHING, cap).report
    drawn = run_plan(trace, HW, plan, CACHING, cap, draw=TimingDraw(7, 0.0, 0.0)).report
    for key in ("fits", "iteration_time_us", "timed_iteration_time_us", "peak_allocated_bytes",
                "peak_reserved_bytes"):
        assert drawn[key] == pytest.approx(plain[key], rel=1e-12), key


def test_timing_draws_apply_to_pytorchs_allocators_on_probed_hardware(resnet50_hybrid: tuple
                                                                      ) -> None:
    trace, plan, cap = resnet50_hybrid
    drawn = timing_draws(trace, HW, plan, CACHING, cap)
    assert drawn is not None and len(drawn) == 3
    assert len({d.report["iteration_time_us"] for d in drawn}) == 3
    assert timing_draws(trace, HW, plan, make_allocator("exact"), cap) is None
    assert timing_draws(trace, load_hardware("k40"), plan, CACHING, cap) is None


def test_a_malformed_timing_spread_names_its_file_and_key(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text("kernel_sigma: 0.01\nhost_sigma: -1\n")
    with pytest.raises(HardwareError, match=r"x\.yaml: host_sigma must be"):
        load_timing_spread("x", tmp_path)
    assert load_timing_spread("absent", tmp_path) is None


def test_validate_gives_the_verdict_most_draws_give() -> None:
    from vsim.validate import load_cases, run_case
    yaml = ROOT / "validation" / "cases" / "mobilenet_v2-b128-hybrid-7p6g.yaml"
    case = load_cases([str(yaml)])[0]
    row = run_case(case)
    draws = row["predicted"]["timing_draws"]
    assert draws["draws"] == 3
    assert row["predicted"]["fits"] == (2 * draws["fit"] > 3)


def test_simulate_plans_with_a_margin_when_most_draws_run_out_of_memory() -> None:
    """wide_resnet50_2 hybrid at 5.7 GiB: its plan fits the recorded timing and at most 1 of 3
    draws; the plan for 3% less fits all 3, and is the result, with a note. (5.8 GiB was the
    place under the runtime before the gated backward and the saves from frames; its cheaper
    host costs moved it; under that runtime, "native-frames-gated": the executor's core's
    cheaper costs, the default since, move it again.) A plan made for another runtime than
    the one that runs it takes the margin its planner's costs give."""
    from vsim.engine import simulate
    trace = load_trace(ROOT / "traces" / "wide_resnet50_2-b64-h100.vsim.json.gz")
    cap = int(5.7 * 2**30)
    python = "native-frames-gated"
    plain = simulate(trace, HW, make_policy("hybrid"), CACHING, cap, tracker=python)
    drawn = simulate(trace, HW, make_policy("hybrid"), CACHING, cap, draws=3, tracker=python)
    core = simulate(trace, HW, make_policy("hybrid"), CACHING, cap, draws=3,
                    tracker="native-frames-gated-core", plan_tracker=python)
    assert core.plan == drawn.plan and core.report["timing_draws"]["under_tracker"] == python
    assert "timing_draws" not in plain.report and plain.report["fits"]
    times = drawn.report["timing_draws"].pop("times_us")
    assert drawn.report["timing_draws"] == {"draws": 3, "fit": 3, "margin": 0.03}
    assert len(times) == 3 and all(t > 0 for t in times)  # the fitting draws' timed times
    assert drawn.plan != plain.plan
    assert any("3% below the capacity" in n for n in drawn.report["notes"])
    one = timing_draws(trace, HW, plain.plan, CACHING, cap, tracker=python)
    assert one is not None and sum(d.report["fits"] for d in one) <= 1
