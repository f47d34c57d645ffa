"""Hold predictions against measured runs: cases, comparison, tolerances.

A case (validation/cases/*.yaml) names a trace, a hardware profile, a policy, an allocator, a
capacity, where the measured result is, and the tolerances:

    id: vgg16-b64-h100-none
    trace: traces/vgg16-b64-h100.vsim.json.gz
    hardware: h100-sxm
    policy: none
    allocator: exact          # optional, default exact
    memory: 12GiB             # optional, default the profile's capacity
    measured: trace           # the trace's own `measured` block, or a JSON file from `vsim measure`
    repeats: [validation/measured/earlier/ID-DATE.json]  # optional: more runs of the same plan
    same_plan_as: 1f2e...     # optional: the plan now differs from the measured one in times only
    tolerance: {iteration_time: 10%, peak_allocated: 3%}
    family: plain-cnn         # optional, default from the model's name (FAMILIES)

`repeats` are earlier runs of the same plan under the same op tracker (checked): the case's
time is the median of every run's measured iterations pooled, and it fits only if every run fit
(a plan that ran out of memory in one real run of two does not reliably fit). The lent
machines' host speed drifts between and within runs (validation/README.md): one run of a
host-bound plan can be 0.7-1.5x another, so several runs estimate its time better than one.

A file may hold one case or a list under `cases:`. Paths are relative to the repository root
(the folder holding validation/), so cases run from anywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, VsimError
from .hardware import parse_percent
from .safeload import parse_json, read_bytes, read_yaml
from .units import parse_size

if TYPE_CHECKING:
    from .engine import SimResult
    from .hardware import Hardware
    from .trace.schema import Trace

METRICS = ("iteration_time", "peak_allocated", "peak_reserved")
# A case's family when its file names none: the first prefix of its trace's (or id's) name, in
# order (so that "resnet" does not take "wide_resnet" before it could be told apart).
FAMILIES: tuple[tuple[str, str], ...] = (
    ("alexnet", "plain-cnn"), ("overfeat", "plain-cnn"), ("vgg", "plain-cnn"),
    ("handmade", "plain-cnn"), ("wide_resnet", "resnet"), ("resnext", "resnet"),
    ("resnet", "resnet"), ("googlenet", "inception"), ("inception", "inception"),
    ("densenet", "densenet"), ("mobilenet", "mobile-cnn"), ("efficientnet", "mobile-cnn"),
    ("gpt", "transformer"), ("bert", "transformer"), ("vit", "transformer"),
    ("transformer", "transformer"))
DEFAULT_TOLERANCE = {"iteration_time": 0.10, "peak_allocated": 0.03}


@dataclass(frozen=True)
class Case:
    id: str
    trace: Path
    hardware: str
    policy: str
    allocator: str
    memory_bytes: int | None
    measured: str            # "trace" or a path
    tolerance: dict[str, float]
    source: str              # the case file, for messages
    family: str = "other"    # the model's family, for the per-family summary
    repeats: tuple[str, ...] = ()  # more measured runs of the same plan (paths)
    # the actions_digest of the plan as planned now where the measured run's plan had other
    # retime times only (checked when written: tools/same_plans.py)
    same_plan_as: str | None = None


def repo_root(start: Path) -> Path:
    """The nearest folder above `start` that holds validation/ (or `start`'s folder)."""
    for folder in [start, *start.parents]:
        if (folder / "validation").is_dir():
            return folder
    return start if start.is_dir() else start.parent


def load_cases(paths: list[str]) -> list[Case]:
    """Cases from files or folders (all *.yaml inside). ConfigError naming file and key."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(path.rglob("*.yaml")))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"no such case file or folder: {p}")
    cases: list[Case] = []
    for f in files:
        doc = read_yaml(f, ConfigError, "case file")
        if isinstance(doc, dict) and doc.get("kind") in ("paper", "benchmarks"):
            continue  # paper figures are checked by vsim.paper (benchmarks: its calibration)
        entries = doc.get("cases") if isinstance(doc, dict) and "cases" in doc else [doc]
        if not isinstance(entries, list):
            raise ConfigError("'cases' must be a list", str(f))
        root = repo_root(f.resolve().parent)
        for i, entry in enumerate(entries):
            cases.append(_case(entry, f, root, f"cases[{i}]" if len(entries) > 1 else ""))
    ids = [c.id for c in cases]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate case ids: {', '.join(dupes)}")
    return cases


def _case(entry: Any, f: Path, root: Path, place: str) -> Case:
    where = f"{f}: {place}" if place else str(f)
    if not isinstance(entry, dict):
        raise ConfigError("a case must be a mapping", where)
    for key in ("id", "trace", "hardware", "policy", "measured"):
        if not entry.get(key):
            raise ConfigError(f"missing required field {key!r}", where)
    known = {"id", "trace", "hardware", "policy", "allocator", "memory", "measured", "tolerance",
             "note", "family", "repeats", "same_plan_as"}
    unknown = set(entry) - known
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(sorted(unknown))}; valid: "
                          f"{', '.join(sorted(known))}", where)
    tolerance = dict(DEFAULT_TOLERANCE)
    tolerances = entry.get("tolerance") or {}
    if not isinstance(tolerances, dict):
        raise ConfigError(f"tolerance: expected a mapping of metric: percentage, got "
                          f"{tolerances!r}", where)
    for key, value in tolerances.items():
        if key not in METRICS:
            raise ConfigError(f"tolerance.{key}: unknown metric; valid: {', '.join(METRICS)}",
                              where)
        tolerance[key] = parse_percent(value, f"{where}: tolerance.{key}")
    measured = str(entry["measured"])
    if measured != "trace":
        measured = str(root / measured)
    repeats = entry.get("repeats") or []
    if not isinstance(repeats, list) or not all(isinstance(r, str) and r for r in repeats):
        raise ConfigError(f"repeats: expected a list of measured files, got {repeats!r}", where)
    if repeats and measured == "trace":
        raise ConfigError("repeats: only with a measured file, not `measured: trace`", where)
    memory = entry.get("memory")
    family = entry.get("family")
    if family is not None and (not isinstance(family, str) or not family.strip()):
        raise ConfigError(f"family: expected a name such as plain-cnn, got {family!r}", where)
    return Case(id=str(entry["id"]), trace=root / str(entry["trace"]),
                hardware=str(entry["hardware"]), policy=str(entry["policy"]),
                allocator=str(entry.get("allocator", "exact")),
                memory_bytes=None if memory is None else parse_size(memory, f"{where}: memory"),
                measured=measured, tolerance=tolerance, source=str(f),
                family=family or family_of(Path(str(entry["trace"])).name, str(entry["id"])),
                repeats=tuple(str(root / r) for r in repeats),
                same_plan_as=str(entry["same_plan_as"]) if entry.get("same_plan_as") else None)


def family_of(*names: str) -> str:
    """The family of the first of `names` (trace file name, case id) that FAMILIES knows."""
    for name in names:
        low = name.lower()
        for prefix, family in FAMILIES:
            if low.startswith(prefix):
                return family
    return "other"


def measured_result(case: Case, trace_measured: Any) -> dict[str, Any]:
    """{iteration_time_us, peak_allocated_bytes, peak_reserved_bytes, fits} of the real run."""
    if case.measured == "trace":
        if trace_measured is None:
            raise ConfigError(f"case {case.id}: measured: trace, but the trace has no measured "
                              "block", case.source)
        return {"iteration_time_us": trace_measured.iteration_time_us,
                "peak_allocated_bytes": trace_measured.peak_allocated_bytes,
                "peak_reserved_bytes": trace_measured.peak_reserved_bytes, "fits": True}
    doc = _measured_file(case.measured)
    if not case.repeats:
        return doc
    runs = [doc]
    for i, path in enumerate(case.repeats):
        run = _measured_file(path)
        for what, get in (("plan", _plan_digest), ("op tracker", measured_tracker)):
            # a run stopped out of memory before its executor reported has no tracker: it
            # agrees with any (the plan's digest is always there)
            theirs, ours = get(run), get(doc)
            if theirs != ours and None not in (theirs, ours):
                raise ConfigError(f"ran another {what} ({theirs}) than the measured run "
                                  f"({ours}); the case's repeats[{i}] must be a run of the "
                                  "same plan", path)
        runs.append(run)
    return pool_runs(runs)


def _plan_digest(measured: dict[str, Any]) -> str | None:
    plan = measured.get("plan")
    return plan.get("digest") if isinstance(plan, dict) else None


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several measured runs of one plan as one: it fits only if every run fit; its time is the
    median of the fitting runs' iterations pooled (of their medians where a run lists none),
    its peaks the median of their peaks. `runs_fit` lists each run's outcome (the first is the
    measured file's)."""
    out = dict(runs[0])
    fit = [r for r in runs if r["fits"]]
    out["fits"] = len(fit) == len(runs)
    out["runs_fit"] = [bool(r["fits"]) for r in runs]
    if not out["fits"] and not out.get("oom"):
        out["oom"] = next((r.get("oom") for r in runs if not r["fits"]), None)
    times = [float(t) for r in fit for t in (r.get("iteration_times_us") or
                                             [r.get("iteration_time_us")]) if t is not None]
    out["iteration_times_us"] = times
    out["iteration_time_us"] = statistics.median(times) if times else None
    # the speed probe before each iteration, where every fitting run has one per iteration
    probes = [_speed_probes(r) for r in fit]
    out["speed_probes_us"] = ([p for run in probes for p in run]  # type: ignore[union-attr]
                              if fit and all(p is not None for p in probes) else None)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        vals = [float(r[key]) for r in fit if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


def _speed_probes(run: dict[str, Any]) -> list[float] | None:
    """A run's speed probe per measured iteration (vsim.runtime.hostuse), None if it has
    none or not one per iteration."""
    use = run.get("host_use")
    probes = use.get("speed_probe_us") if isinstance(use, dict) else None
    times = run.get("iteration_times_us")
    if not isinstance(probes, list) or not isinstance(times, list) or not probes \
            or len(probes) != len(times):
        return None
    return [float(p) for p in probes]


SPEED_BAND = 1.25
"""Iterations "at the recording's core speed": a speed probe within this factor of the
trace's median probe. The lent hosts' cores read about 680 or about 1,400 us, 2x apart
(validation/host/noise/host-use/): the band separates the two states without a fitted cut."""


def time_at_recorded_speed(measured: dict[str, Any], trace_meta: dict[str, Any]
                           ) -> dict[str, Any] | None:
    """The median of the measured iterations whose core ran at the recording's speed (the
    speed probe taken before each, on both sides): {"iteration_time_us", "iterations",
    "probe_us"}; None where either side has no probes or fewer than 3 iterations match. A
    trace predicts its host time at the core speed it was recorded at; on the shared hosts a
    run's iterations come at either of two speeds, so this compares like with like."""
    ref = trace_meta.get("measured_speed_probe_us")
    # pooled runs carry theirs (pool_runs); a single run its own
    probes = (measured["speed_probes_us"] if "speed_probes_us" in measured
              else _speed_probes(measured))
    times = measured.get("iteration_times_us")
    if not isinstance(ref, list) or not ref or not probes or not measured.get("fits") \
            or not isinstance(times, list) or len(times) != len(probes):
        return None
    at = statistics.median(float(p) for p in ref)
    kept = [float(t) for t, p in zip(times, probes, strict=True)
            if at / SPEED_BAND <= p <= at * SPEED_BAND]
    if len(kept) < 3:
        return None
    return {"iteration_time_us": statistics.median(kept), "iterations": len(kept),
            "probe_us": round(at, 1)}


def _measured_file(where: str) -> dict[str, Any]:
    doc = parse_json(read_bytes(where, ConfigError, "measured file"), where, ConfigError,
                     finite=True)
    if not isinstance(doc, dict):
        raise ConfigError(f"top level: expected an object with iteration_time_us, "
                          f"peak_allocated_bytes and fits, got {type(doc).__name__}", where)
    for key in ("iteration_time_us", "peak_allocated_bytes", "fits"):
        if key not in doc:
            raise ConfigError(f"missing required field {key!r}", where)
    if not isinstance(doc["fits"], bool):
        raise ConfigError(f"fits: expected true or false, got {doc['fits']!r}", where)
    for key in ("iteration_time_us", "peak_allocated_bytes", "peak_reserved_bytes"):
        value = doc.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0):
            raise ConfigError(f"{key}: expected a number, not negative, got {value!r}", where)
    return doc


def relative_error(predicted: float, measured: float) -> float | None:
    return None if not measured else (predicted - measured) / measured


def repeat_spread(measured: dict[str, Any]) -> dict[str, float] | None:
    """How much the measured run's own iterations varied: {min_us, max_us, relative: (max -
    min) / median}; None without at least 3 repeats. Host-bound models vary by 20-40% between
    the iterations of one run on the lent machines (validation/host/README.md): an error
    smaller than that is not a miss of the model's."""
    times = measured.get("iteration_times_us")
    if not isinstance(times, list) or len(times) < 3 or not measured.get("fits"):
        return None
    vals = sorted(float(t) for t in times if isinstance(t, (int, float)) and t > 0)
    if len(vals) < 3:
        return None
    mid = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] +
                                                        vals[len(vals) // 2]) / 2
    return {"min_us": vals[0], "max_us": vals[-1], "relative": (vals[-1] - vals[0]) / mid}


def runtime_own_us(executed: dict[str, Any] | None) -> float | None:
    """The host time of vsim's runtime itself in a measured iteration (issue 13): all of the
    executor's host time but what any runtime of the plan waits for or calls (allocations,
    copy launches, pinned-pool waits, the actions' event and stream calls, the replayed calls
    themselves). None without an executor, or for a plan with nothing to carry out. Runs
    with `executor_own_includes_replay` (from 2026-11-27 03:30 UTC) report it as
    `executor_own_us` (per iteration, then the median); runs since the medians (2026-11-27)
    report `executor_own_us` without the recording and the replay's bookkeeping, added back
    here (steady between iterations, unlike the allocator's waits under a cap); earlier runs
    have their parts subtracted (one iteration's)."""
    ex = executed
    if not ex or "executor_replay_call_us" not in ex or not (
            ex["offloads"] or ex["releases"] or ex["drops"] or ex["recomputed_calls"]):
        return None
    # Outside executor_host_us, added from 2026-11-27: the frame call backs (timed in C++,
    # `executor_frame_us`; where one records a call, that part, at most executor_record_us, is
    # inside it too) and the crossings of the call backs at counts (`executor_callback_us` in
    # C++ less `executor_callback_py_us`, their body in Python; timed from then on)
    outside = float(ex.get("executor_frame_us") or 0.0)
    if "executor_callback_timed_us" in ex:  # all of the call backs but their timed advance
        outside += ex["executor_callback_us"] - ex["executor_callback_timed_us"]
    elif "executor_callback_us" in ex:  # their crossings alone
        outside += ex["executor_callback_us"] - ex["executor_callback_py_us"]
    if ex.get("executor_own_includes_replay"):
        return float(ex["executor_own_us"]) + outside
    if "executor_own_us" in ex and "executor_iterations_timed" in ex:
        return float(ex["executor_own_us"] + ex["executor_recompute_us"]
                     - ex["executor_replay_call_us"] + ex["executor_record_us"])
    waits = (ex["executor_alloc_us"] + ex["executor_copy_us"] + ex["executor_pool_wait_us"]
             + ex["executor_replay_call_us"] + ex.get("executor_event_us", 0.0))
    return float(ex["executor_host_us"] - waits)


def runtime_own_share(measured: dict[str, Any]) -> float | None:
    """`runtime_own_us` over the measured iteration time, or None."""
    own, it = runtime_own_us(measured.get("executed")), measured.get("iteration_time_us")
    return None if own is None or not it else own / it


def tracker_estimate_us(measured: dict[str, Any], trace: Any, hardware: str) -> float | None:
    """The native tracker's host time in a measured run of a plan that acts, estimated: it is
    outside the executor's timers (`runtime_own_us`). Its counter per call through its key
    (`executed.calls_through_tracker`; runs before the gated backward counted every call, the
    trace's counted calls by the profile) at the run's hardware profile's
    `native_us_per_call`, and the saved-tensor hooks at `save_us` per save
    (`executed.packs`). None without a native run, or where the profile charges neither
    (validation/host/waits/ measured them on the H100)."""
    from .host import load_host_model

    ex = measured.get("executed")
    if not isinstance(ex, dict) or ex.get("tracker") != "native" or runtime_own_us(ex) is None:
        return None
    host = load_host_model(hardware)
    if host is None or not (host.native_us_per_call and host.save_us):
        return None
    calls = ex.get("calls_through_tracker")
    if calls is None:
        calls = sum(host.counted(op) for op in trace.ops)
    return host.native_us_per_call * calls + host.save_us * (ex.get("packs") or 0)


def measured_tracker(measured: dict[str, Any]) -> str | None:
    """The op tracker the measured run's executor used (`executed.tracker`; runs before the
    native tracker used the Python one); None without an executor (the runtime's choice), and
    for a run stopped out of memory in its first iteration, which calibrates the native
    tracker under the Python one: the runtime would have gone on natively."""
    executed = measured.get("executed")
    if not isinstance(executed, dict):
        return None
    calibrating = any(str(n).startswith("instrumented: the native op tracker")
                      for n in measured.get("notes") or ())
    if calibrating and not measured.get("fits") and executed.get("iterations", 0) <= 1:
        return None
    got = executed.get("tracker", "python")
    if got == "native":
        if executed.get("native_hooks") != "armed":
            return "native-always"
        name = "native-frames" if executed.get("native_saved") == "frames" else "native"
        gated = executed.get("gated")
        if not measured.get("fits", True) and executed.get("native_gate") == "nodes" \
                and not executed.get("gate_note"):
            gated = True  # stopped before its backward: it would have been gated
        return name + ("-gated" if gated else "") + \
            ("-modules" if executed.get("fwd_gated") else "") + \
            ("-core" if executed.get("executor_core") == "native" else "")
    return "python"


def planned_tracker(measured: dict[str, Any]) -> str:
    """The tracker vsim's runtime planned the measured run for (Session._plan, also where the
    run then fell back to the Python one): its provenance's `plan_tracker`; runs before
    2026-11-27T08:30 have none and were planned for the native tracker with its saved-tensor
    hooks on every forward op."""
    return (measured.get("provenance") or {}).get("plan_tracker") or "native-always"


WARM_START = True
"""vsim validate's runs start warm, as vsim measure's do (False: as a fresh process, the model
before the eighteenth session of 2026-11-27). They are planned from a cold start, as vsim's
runtime plans them (Session._plan: engine.simulate's default)."""


def case_inputs(case: Case) -> tuple[Trace, Hardware, dict[str, Any]]:
    """The case's trace on its hardware (recorded on another GPU: retargeted, as `vsim run`
    does), the hardware, and the measured result it is held against."""
    from .hardware import load_hardware
    from .retarget import for_hardware
    from .trace import load_trace

    trace = load_trace(case.trace)
    measured = measured_result(case, trace.measured)
    hw = load_hardware(case.hardware)
    trace, _ = for_hardware(trace, hw)
    return trace, hw, measured


def run_tracker(measured: dict[str, Any]) -> str:
    """The op tracker a case is predicted under: the measured run's, and for a run with no
    executor's report, the tracker it was planned for."""
    return measured_tracker(measured) or planned_tracker(measured)


def simulate_case(case: Case, trace: Trace, hw: Hardware, measured: dict[str, Any],
                  first_iteration: bool | None = None, workspace_fallback: bool | None = None,
                  runtime_cost: bool | None = None) -> SimResult:
    """The case's plan and its simulation as `vsim validate` makes them (case_inputs' trace,
    hardware and measured result): planned for the tracker the run was planned for, run under
    the one it ran, with timing draws. Every run of vsim measure starts warm (its session ran
    the plain step with the whole GPU before it capped itself: engine.run_plan's
    `warm_start`), from a plan its runtime made for a cold start (WARM_START). Raises
    PlanError where the plan is not runnable."""
    from .allocator import make_allocator
    from .engine import TIMING_DRAWS, simulate
    from .policies import make_policy

    return simulate(trace, hw, make_policy(case.policy), make_allocator(case.allocator),
                    case.memory_bytes, first_iteration, workspace_fallback,
                    runtime_cost=runtime_cost, tracker=run_tracker(measured),
                    plan_tracker=planned_tracker(measured), draws=TIMING_DRAWS,
                    warm_start=WARM_START, plan_warm_start=False)


def run_case(case: Case, first_iteration: bool | None = None,
             workspace_fallback: bool | None = None,
             runtime_cost: bool | None = None) -> dict[str, Any]:
    """Simulate one case and compare; the row of `vsim validate --json`."""
    from .engine.simulator import PlanError
    from .plan import actions_digest, plan_digest

    trace, hw, measured = case_inputs(case)
    keys = ("iteration_time_us", "peak_allocated_bytes", "peak_reserved_bytes", "fits")
    try:
        result = simulate_case(case, trace, hw, measured, first_iteration, workspace_fallback,
                               runtime_cost)
        report = result.report
    except PlanError as exc:  # the policy's plan is not runnable: a miss of the planner's
        return {"id": case.id, "family": case.family, "policy": case.policy.split(":")[0],
                "hardware": case.hardware,
                "predicted": dict.fromkeys(keys), "measured": measured,
                "error": dict.fromkeys(METRICS), "tolerance": case.tolerance, "ok": False,
                "plan_error": str(exc)}
    predicted = {k: report[k] for k in keys}
    # a measurement reports the median of its timed iterations (4 to 13); so does this
    predicted["iteration_time_us"] = report["timed_iteration_time_us"]
    if "timing_draws" in report:
        # One real run is one draw of the timing that varies between its iterations: it fits
        # when most draws do (engine.timing_draws; times and peaks stay the recorded timing's)
        fit, n = report["timing_draws"]["fit"], report["timing_draws"]["draws"]
        predicted["timing_draws"] = {"draws": n, "fit": fit,
                                     "times_us": report["timing_draws"].get("times_us")}
        predicted["fits"] = bool(predicted["fits"]) and 2 * fit > n
    measured_plan = measured.get("plan")
    measured_digest = measured_plan.get("digest") if isinstance(measured_plan, dict) else None
    error: dict[str, float | None] = {}
    ok = predicted["fits"] == bool(measured["fits"])
    for metric in METRICS:
        key = f"{metric}_us" if metric == "iteration_time" else f"{metric}_bytes"
        if measured.get(key) is None or not measured["fits"] or not predicted["fits"]:
            error[metric] = None
            continue
        err = relative_error(float(predicted[key]), float(measured[key]))
        error[metric] = err
        if metric in case.tolerance and err is not None and abs(err) > case.tolerance[metric]:
            ok = False
    row = {"id": case.id, "family": case.family, "policy": case.policy.split(":")[0],
           "hardware": case.hardware,
           "predicted": predicted, "measured": measured, "error": error,
           "tolerance": case.tolerance, "ok": ok}
    spread = repeat_spread(measured)
    if spread is not None:
        row["time_spread"] = spread
        lo, hi = spread["min_us"], spread["max_us"]
        row["time_within_repeats"] = bool(predicted["fits"] and measured["fits"] and
                                          lo <= float(predicted["iteration_time_us"]) <= hi)
    matched = time_at_recorded_speed(measured, trace.meta)
    if matched is not None and predicted["fits"]:
        matched["error"] = relative_error(float(predicted["iteration_time_us"]),
                                          matched["iteration_time_us"])
        row["time_at_recorded_speed"] = matched
    if measured_digest and measured_digest != plan_digest(result.plan) \
            and case.same_plan_as != actions_digest(result.plan):
        row["plan_changed"] = True  # the policy plans differently now than the plan measured
    tracker_us = tracker_estimate_us(measured, trace, case.hardware)
    if tracker_us is not None:
        row["tracker_estimate_us"] = round(tracker_us, 1)
    churn = churn_per_iteration(measured)
    if churn is not None and predicted["fits"]:
        row["churn"] = {"measured": churn, "predicted": {
            k: report["allocator_churn"].get(k, 0) for k in churn}}
    return row


CHURN_KEYS = ("num_alloc_retries", "reserved_bytes.all.allocated")


def churn_per_iteration(measured: dict[str, Any]) -> dict[str, float] | None:
    """A fitting measured run's allocator releases (retries) and bytes mapped or cudaMalloc'd
    per timed iteration (its allocator_churn over them); None for a run measured without the
    bytes (before 2026-11-28)."""
    churn, its = measured.get("allocator_churn"), (measured.get("iterations") or {})
    n = its.get("measured") if isinstance(its, dict) else None
    if not measured.get("fits") or not isinstance(churn, dict) or not n or \
            any(k not in churn for k in CHURN_KEYS):
        return None
    return {k: churn[k] / n for k in CHURN_KEYS}


def validate(cases: list[Case], progress: Callable[[str], None] | None = None,
             first_iteration: bool | None = None, workspace_fallback: bool | None = None,
             runtime_cost: bool | None = None) -> dict[str, Any]:
    """Run every case; {cases: [...], summary: {n, time_mape, peak_mape, fits_correct},
    by_family: {family: summary}, by_policy: {policy name: summary}, by_hardware: {hardware
    profile: summary}}."""
    rows = []
    for i, case in enumerate(cases, 1):
        if progress:
            progress(f"[{i}/{len(cases)}] {case.id}")
        try:
            rows.append(run_case(case, first_iteration, workspace_fallback, runtime_cost))
        except VsimError as exc:
            raise ConfigError(f"case {case.id}: {exc}", case.source) from None
    return {"cases": rows, "summary": summarize(rows), "by_family": summarize_by(rows, "family"),
            "by_policy": summarize_by(rows, "policy"),
            "by_hardware": summarize_by(rows, "hardware")}


def summarize_by(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """The summary of each group of rows with one value of `key`, groups sorted by name."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r[key]), []).append(r)
    return {name: summarize(groups[name]) for name in sorted(groups)}


def metric_ok(row: dict[str, Any], metric: str) -> bool:
    """Whether one metric of a validated case is within its tolerance (no figure to compare, or
    no tolerance for it: true; the case's fits must still agree)."""
    fits = row["predicted"]["fits"] == bool(row["measured"]["fits"])
    err, tol = row["error"].get(metric), row["tolerance"].get(metric)
    return fits and (err is None or tol is None or abs(err) <= tol)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean_abs(errs: list[float]) -> float | None:
        return math.fsum(abs(e) for e in errs) / len(errs) if errs else None

    def mape(metric: str) -> float | None:
        return mean_abs([r["error"][metric] for r in rows if r["error"].get(metric) is not None])

    spreads = [r["time_spread"]["relative"] for r in rows if r.get("time_spread")]
    churned = [r for r in rows if r.get("churn")]
    matched = [r["time_at_recorded_speed"]["error"] for r in rows
               if r.get("time_at_recorded_speed", {}).get("error") is not None]
    return {"n": len(rows), "time_mape": mape("iteration_time"),
            # over the cases whose trace and run both probed the core's speed per iteration:
            # the measured iterations at the recording's speed only (time_at_recorded_speed)
            "at_recorded_speed": ({"n": len(matched), "time_mape": mean_abs(matched)}
                                  if matched else None),
            "peak_mape": mape("peak_allocated"), "reserved_mape": mape("peak_reserved"),
            "fits_correct": sum(r["predicted"]["fits"] == bool(r["measured"]["fits"])
                                for r in rows),
            "ok": sum(r["ok"] for r in rows),
            "plans_changed": sum(bool(r.get("plan_changed")) for r in rows),
            # the allocator's releases and bytes mapped per iteration, summed over the cases
            # measured with them (validate's check of the churn mechanism, not only the time)
            "churn": ({"n": len(churned),
                       **{f"{side}_{k}": math.fsum(r["churn"][side][k] for r in churned)
                          for side in ("predicted", "measured") for k in CHURN_KEYS}}
                      if churned else None),
            "with_repeats": len(spreads),
            "median_repeat_spread": (sorted(spreads)[len(spreads) // 2] if spreads else None),
            "time_within_repeats": sum(bool(r.get("time_within_repeats")) for r in rows),
            # cases measured in several runs of the same plan, and those whose runs disagreed
            # on fitting (ran out of memory in some, not all: counted as not fitting)
            "cases_run_repeatedly": sum(len(r["measured"].get("runs_fit") or ()) > 1
                                        for r in rows),
            "runs_disagree_on_fit": sum(len(set(r["measured"].get("runs_fit") or ())) > 1
                                        for r in rows)}


def paper_files(paths: list[str]) -> list[Path]:
    """The `kind: paper` files among `paths` (files, or every *.yaml in folders), which
    vsim.paper checks."""
    from .paper import is_paper_file

    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(f for f in sorted(path.rglob("*.yaml")) if is_paper_file(f))
        elif path.is_file() and is_paper_file(path):
            files.append(path)
    return files
