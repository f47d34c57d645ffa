import json
from pathlib import Path

import pytest

from vsim.cli import main
from vsim.errors import ConfigError
from vsim.validate import load_cases

TINY = Path(__file__).parent / "data" / "tiny.vsim.json"


def write_case(root: Path, **fields) -> Path:
    (root / "validation" / "cases").mkdir(parents=True, exist_ok=True)
    (root / "traces").mkdir(exist_ok=True)
    (root / "traces" / "tiny.vsim.json").write_text(TINY.read_text())
    case = {"id": "tiny-none", "trace": "traces/tiny.vsim.json", "hardware": "h100-sxm",
            "policy": "none", "measured": "trace", **fields}
    path = root / "validation" / "cases" / f"{case['id']}.yaml"
    path.write_text(json.dumps(case))  # JSON is YAML
    return path


def test_case_errors_are_computed_against_the_trace_measurement(tmp_path, capsys):
    # tiny: op0 0-10 us, op1 15-40 us (5 us launch gap kept): predicted 40 us = measured 40 us.
    # Peak: w 1000 + x 500 + y 1500 + dw 1000 = 4000 B against 3000 measured: +33%, a miss at
    # the default 3% tolerance, so the command exits 1.
    write_case(tmp_path)
    code = main(["validate", str(tmp_path / "validation" / "cases"), "--json",
                 "--plot", str(tmp_path / "scatter.png")])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    row = out["cases"][0]
    assert row["error"]["iteration_time"] == pytest.approx(0.0)
    assert row["error"]["peak_allocated"] == pytest.approx(1 / 3)
    assert row["ok"] is False
    assert out["summary"] == {"n": 1, "time_mape": pytest.approx(0.0),
                              "peak_mape": pytest.approx(1 / 3), "reserved_mape": pytest.approx(
                                  abs(4000 - 4096) / 4096), "fits_correct": 1, "ok": 0,
                              "plans_changed": 0, "with_repeats": 0,
                              "median_repeat_spread": None, "time_within_repeats": 0,
                              "cases_run_repeatedly": 0, "runs_disagree_on_fit": 0,
                              "at_recorded_speed": None, "churn": None}
    assert (tmp_path / "scatter.png").read_bytes()[:4] == b"\x89PNG"


def test_churn_per_iteration_compares_releases_and_mapped_bytes():
    """A measured run with the allocator's counters gives its releases and mapped bytes per
    timed iteration, set against the prediction's report; runs without the bytes (measured
    before they were kept) or that did not fit give none."""
    from vsim.validate import churn_per_iteration, summarize

    run = {"fits": True, "iterations": {"warmup": 3, "measured": 10},
           "allocator_churn": {"num_alloc_retries": 67, "num_device_alloc": 208,
                               "reserved_bytes.all.allocated": 20 * 2**30,
                               "reserved_bytes.all.freed": 20 * 2**30}}
    assert churn_per_iteration(run) == {"num_alloc_retries": 6.7,
                                        "reserved_bytes.all.allocated": 2 * 2**30}
    old = {**run, "allocator_churn": {"num_alloc_retries": 67}}
    assert churn_per_iteration(old) is None
    assert churn_per_iteration({**run, "fits": False}) is None
    row = {"predicted": {"fits": True}, "measured": run, "error": {}, "ok": True,
           "churn": {"measured": churn_per_iteration(run),
                     "predicted": {"num_alloc_retries": 6,
                                   "reserved_bytes.all.allocated": 3 * 2**30}}}
    churn = summarize([row, {**row, "churn": None}])["churn"]
    assert churn["n"] == 1 and churn["predicted_num_alloc_retries"] == 6
    assert churn["measured_reserved_bytes.all.allocated"] == 2 * 2**30


def test_within_a_wide_tolerance_exits_0(tmp_path, capsys):
    write_case(tmp_path, tolerance={"peak_allocated": "40%"})
    assert main(["validate", str(tmp_path / "validation"), "--plot", "none"]) == 0
    assert "1 cases, 1 within tolerance" in capsys.readouterr().out


def test_measured_out_of_memory_must_be_predicted(tmp_path, capsys):
    measured = tmp_path / "validation" / "measured" / "tiny-oom.json"
    measured.parent.mkdir(parents=True)
    measured.write_text(json.dumps({"iteration_time_us": 0, "peak_allocated_bytes": 0,
                                    "fits": False}))
    # 2 KiB cannot even hold w + x + y (3000 B): predicted out of memory too -> ok.
    write_case(tmp_path, memory="2KiB", measured="validation/measured/tiny-oom.json")
    assert main(["validate", str(tmp_path / "validation"), "--json", "--plot", "none"]) == 0
    row = json.loads(capsys.readouterr().out)["cases"][0]
    assert row["predicted"]["fits"] is False and row["ok"] is True


@pytest.mark.parametrize("fields,fragment", [
    ({"policy": None}, "missing required field 'policy'"),
    ({"colour": "red"}, "unknown field(s) colour"),
    ({"tolerance": {"speed": "5%"}}, "tolerance.speed: unknown metric"),
    ({"tolerance": {"iteration_time": 0.05}}, "percentage"),
    ({"memory": "12"}, "without a unit"),
    ({"repeats": "validation/measured/a.json"}, "repeats: expected a list"),
    ({"repeats": ["validation/measured/a.json"]}, "repeats: only with a measured file"),
])
def test_bad_cases_name_file_and_key(tmp_path, fields, fragment):
    path = write_case(tmp_path, **fields)
    with pytest.raises(Exception) as err:
        load_cases([str(path)])
    assert str(path) in str(err.value) and fragment in str(err.value)


def test_missing_case_path_is_an_error():
    with pytest.raises(ConfigError, match="no such case file"):
        load_cases(["/nonexistent/cases"])


@pytest.mark.parametrize("changed", [True, False])
def test_a_plan_that_changed_since_it_was_measured_is_marked(tmp_path, capsys, changed):
    """A measured run records its plan's digest; a policy that now plans otherwise is compared
    with a run of another plan, and validate says so (row plan_changed, '*' in the table)."""
    from vsim.hardware import load_hardware
    from vsim.plan import plan_digest
    from vsim.policies import make_policy
    from vsim.trace import load_trace

    hw = load_hardware("h100-sxm")
    plan = make_policy("none").plan(load_trace(TINY), hw, hw.capacity_bytes)
    measured = {"iteration_time_us": 40.0, "peak_allocated_bytes": 4000, "fits": True,
                "plan": {"digest": "0" * 16 if changed else plan_digest(plan)}}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    write_case(tmp_path, measured=str(tmp_path / "m.json"))
    main(["validate", str(tmp_path / "validation" / "cases"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert bool(out["cases"][0].get("plan_changed")) is changed
    assert out["summary"]["plans_changed"] == int(changed)


def test_repeat_spread_is_the_runs_own_variation():
    from vsim.validate import repeat_spread

    got = repeat_spread({"fits": True, "iteration_times_us": [110.0, 90.0, 100.0, 105.0]})
    assert got == {"min_us": 90.0, "max_us": 110.0, "relative": 20.0 / 102.5}
    assert repeat_spread({"fits": True, "iteration_times_us": [1.0, 2.0]}) is None
    assert repeat_spread({"fits": False, "iteration_times_us": [1.0, 2.0, 3.0]}) is None
    assert repeat_spread({"fits": True}) is None


def test_time_at_recorded_speed_keeps_the_iterations_at_the_traces_core_speed():
    from vsim.validate import pool_runs, time_at_recorded_speed

    meta = {"measured_speed_probe_us": [700.0, 690.0, 1400.0, 710.0]}  # median 705
    fast_slow = {"fits": True, "iteration_times_us": [60.0, 95.0, 62.0, 98.0, 61.0],
                 "host_use": {"speed_probe_us": [680.0, 1390.0, 720.0, 1420.0, 700.0]}}
    got = time_at_recorded_speed(fast_slow, meta)
    assert got == {"iteration_time_us": 61.0, "iterations": 3, "probe_us": 705.0}
    # a run in the other state throughout, a trace or a run without probes: nothing to compare
    slow = {**fast_slow, "host_use": {"speed_probe_us": [1400.0] * 5}}
    assert time_at_recorded_speed(slow, meta) is None
    assert time_at_recorded_speed(fast_slow, {}) is None
    assert time_at_recorded_speed({"fits": True, "iteration_times_us": [1.0] * 3}, meta) is None
    # runs pooled carry their probes in the iterations' order; one without drops them all
    pooled = pool_runs([fast_slow, slow])
    assert pooled["speed_probes_us"][:5] == fast_slow["host_use"]["speed_probe_us"]
    assert time_at_recorded_speed(pooled, meta)["iterations"] == 3
    assert pool_runs([fast_slow, {"fits": True, "iteration_times_us": [5.0]}])[
        "speed_probes_us"] is None


def _runs(tmp_path, *runs):
    """Measured files m0.json, m1.json, ... of the tiny trace's plan; the case lists the first
    as `measured` and the rest as `repeats`."""
    paths = []
    for i, run in enumerate(runs):
        doc = {"peak_allocated_bytes": 4000, "iteration_time_us": None, **run}
        (tmp_path / f"m{i}.json").write_text(json.dumps(doc))
        paths.append(str(tmp_path / f"m{i}.json"))
    write_case(tmp_path, measured=paths[0], repeats=paths[1:],
               tolerance={"peak_allocated": "40%"})


def test_repeated_runs_of_a_plan_are_pooled(tmp_path, capsys):
    """Several runs of one plan: the time is the median of all their iterations, not of either
    run's median (the lent hosts drift between runs)."""
    _runs(tmp_path, {"fits": True, "iteration_time_us": 40.0, "iteration_times_us": [38, 40, 42]},
          {"fits": True, "iteration_time_us": 60.0, "iteration_times_us": [50, 60, 70]})
    main(["validate", str(tmp_path / "validation" / "cases"), "--json"])
    out = json.loads(capsys.readouterr().out)
    m = out["cases"][0]["measured"]
    assert m["iteration_time_us"] == pytest.approx(46.0)  # median of 38 40 42 50 60 70
    assert m["fits"] is True and m["runs_fit"] == [True, True]
    assert out["summary"]["cases_run_repeatedly"] == 1
    assert out["summary"]["runs_disagree_on_fit"] == 0


def test_a_plan_fits_only_if_every_run_fit(tmp_path, capsys):
    _runs(tmp_path, {"fits": True, "iteration_time_us": 40.0, "iteration_times_us": [40, 40, 40]},
          {"fits": False, "oom": {"iteration": 7}})
    assert main(["validate", str(tmp_path / "validation" / "cases"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    row = out["cases"][0]
    assert row["measured"]["fits"] is False and row["measured"]["oom"] == {"iteration": 7}
    assert row["predicted"]["fits"] is True and row["ok"] is False
    assert out["summary"]["runs_disagree_on_fit"] == 1 and out["summary"]["fits_correct"] == 0


def test_a_repeat_of_another_plan_is_refused(tmp_path, capsys):
    _runs(tmp_path, {"fits": True, "iteration_time_us": 40.0, "plan": {"digest": "a" * 16}},
          {"fits": True, "iteration_time_us": 40.0, "plan": {"digest": "b" * 16}})
    assert main(["validate", str(tmp_path / "validation" / "cases"), "--json"]) == 2
    err = capsys.readouterr().err
    assert "tiny-none.yaml" in err and "m1.json: ran another plan" in err
    assert "repeats[0]" in err and len(err.strip().splitlines()) == 1


def test_a_repeat_under_another_tracker_is_refused_unless_one_has_none(tmp_path, capsys):
    """Runs pooled must share the op tracker; a run stopped out of memory before its executor
    reported has none and pools with either."""
    native = {"fits": True, "iteration_time_us": 40.0, "iteration_times_us": [40, 40, 40],
              "executed": {"tracker": "native", "iterations": 3}}
    python = dict(native, executed={"tracker": "python", "iterations": 3})
    _runs(tmp_path, native, python)
    assert main(["validate", str(tmp_path / "validation" / "cases"), "--json"]) == 2
    assert "m1.json: ran another op tracker (python)" in capsys.readouterr().err
    _runs(tmp_path, native, {"fits": False, "oom": {"iteration": 0}, "executed": None})
    assert main(["validate", str(tmp_path / "validation" / "cases"), "--json"]) == 1
    row = json.loads(capsys.readouterr().out)["cases"][0]
    assert row["measured"]["runs_fit"] == [True, False]


def test_the_validation_table_shows_the_runtimes_own_host_share() -> None:
    """Issue 13: the runtime's own host time per case, in the table, and over the runs whose
    plan acts; each file's definition (three since 2026-11-26) read as it was written."""
    from vsim.cli import format_validation
    from vsim.validate import runtime_own_us

    acts = {"offloads": 2, "releases": 0, "drops": 0, "recomputed_calls": 3,
            "executor_host_us": 900.0, "executor_alloc_us": 100.0, "executor_copy_us": 200.0,
            "executor_pool_wait_us": 0.0, "executor_event_us": 50.0,
            "executor_recompute_us": 300.0, "executor_replay_call_us": 120.0,
            "executor_record_us": 30.0}
    now = {**acts, "executor_own_us": 400.0, "executor_own_includes_replay": True,
           "executor_iterations_timed": 10}
    medians = {**acts, "executor_own_us": 220.0, "executor_iterations_timed": 10}
    assert runtime_own_us(now) == 400.0
    # from 2026-11-27: the frame call backs and the call backs' crossings, outside host time
    timed = {**now, "executor_frame_us": 60.0, "executor_callback_us": 500.0,
             "executor_callback_py_us": 470.0}
    assert runtime_own_us(timed) == 400.0 + 60.0 + 30.0
    # from the executor's advance timed inside them: all of the call backs' cost but that
    assert runtime_own_us({**timed, "executor_callback_timed_us": 350.0}) == \
        400.0 + 60.0 + 150.0
    assert runtime_own_us(medians) == 220.0 + 300.0 - 120.0 + 30.0  # recording, bookkeeping
    assert runtime_own_us(acts) == 900.0 - 100.0 - 200.0 - 120.0 - 50.0  # parts subtracted
    assert runtime_own_us({**acts, "offloads": 0, "recomputed_calls": 0}) is None  # no plan
    assert runtime_own_us(None) is None

    def row(executed: dict | None, **extra: float) -> dict:
        return {"id": "x", "ok": True,
                "predicted": {"iteration_time_us": 1e4, "peak_allocated_bytes": 2**30,
                              "fits": True},
                "measured": {"iteration_time_us": 1e4, "peak_allocated_bytes": 2**30,
                             "fits": True, "executed": executed},
                "error": {"iteration_time": 0.0, "peak_allocated": 0.0, "peak_reserved": 0.0},
                **extra}
    summary = {"n": 2, "ok": 2, "time_mape": 0.0, "peak_mape": 0.0, "fits_correct": 2}
    text = format_validation({"cases": [row(now, tracker_estimate_us=300.0), row(None)],
                              "summary": summary}).splitlines()
    # the own share, then with the native tracker's estimate added
    assert text[1].split()[-2:] == ["4.0%", "7.0%"] and text[2].split()[-2:] == ["-", "-"]
    assert any(line.startswith("own:") and "median 4.0%" in line and "1 run(s)" in line
               for line in text)
    assert any(line.startswith("+trk:") and "median 7.0%" in line for line in text)


def test_the_tracker_estimate_counts_calls_through_its_key_and_saves() -> None:
    """The native tracker's host time, outside the executor's timers: the H100 profile's
    charge per call through its key (a gated backward's count) and per save; a run that
    counted every call is charged its trace's counted calls; none for a Python-tracked run."""
    from vsim.host import load_host_model
    from vsim.trace import load_trace
    from vsim.validate import tracker_estimate_us

    host = load_host_model("h100-sxm")
    assert host is not None and host.native_us_per_call > 0 and host.save_us > 0
    trace = load_trace(Path(__file__).parent / "data" / "tiny.vsim.json")
    ex = {"tracker": "native", "offloads": 1, "releases": 0, "drops": 0, "recomputed_calls": 0,
          "executor_replay_call_us": 0.0, "executor_own_us": 10.0,
          "executor_own_includes_replay": True, "packs": 10}
    gated = {"executed": {**ex, "calls_through_tracker": 1000}}
    assert tracker_estimate_us(gated, trace, "h100-sxm") == pytest.approx(
        1000 * host.native_us_per_call + 10 * host.save_us)
    every = tracker_estimate_us({"executed": ex}, trace, "h100-sxm")
    assert every == pytest.approx(sum(host.counted(o) for o in trace.ops)
                                  * host.native_us_per_call + 10 * host.save_us)
    assert tracker_estimate_us({"executed": {**ex, "tracker": "python"}}, trace,
                               "h100-sxm") is None


def test_actions_digest_leaves_out_the_times_a_retime_predicts():
    from vsim.plan import Plan, Retime, actions_digest, plan_digest

    def plan(dur: float, workspace: int = 0, parts: int = 1) -> Plan:
        return Plan(actions=(Retime(3, dur, workspace, "measured", parts=parts),))

    assert plan_digest(plan(720.5)) != plan_digest(plan(6613.0))
    assert actions_digest(plan(720.5)) == actions_digest(plan(6613.0))
    assert actions_digest(plan(720.5)) != actions_digest(plan(720.5, 2**20))
    assert actions_digest(plan(720.5)) != actions_digest(plan(720.5, parts=4))


@pytest.mark.parametrize("same", [True, False])
def test_same_plan_as_accepts_a_plan_that_differs_in_times_only(tmp_path, capsys, same):
    """A case's `same_plan_as` (tools/same_plans.py) names the actions_digest of the plan as
    planned now: while it holds, the measured run's other digest is not a changed plan."""
    from vsim.hardware import load_hardware
    from vsim.plan import actions_digest
    from vsim.policies import make_policy
    from vsim.trace import load_trace

    hw = load_hardware("h100-sxm")
    plan = make_policy("none").plan(load_trace(TINY), hw, hw.capacity_bytes)
    measured = {"iteration_time_us": 40.0, "peak_allocated_bytes": 4000, "fits": True,
                "plan": {"digest": "0" * 16}}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    write_case(tmp_path, measured=str(tmp_path / "m.json"),
               same_plan_as=actions_digest(plan) if same else "1" * 16)
    main(["validate", str(tmp_path / "validation" / "cases"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert bool(out["cases"][0].get("plan_changed")) is not same
