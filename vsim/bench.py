"""`vsim bench`: how fast the simulator is on the machine it runs on.

Measures raw SimPy event throughput (one process doing timeouts: the ceiling for any SimPy
model), vsim's simulated events per second on the shipped traces, their ratio, the time to
simulate one vgg16(256) iteration under vdnn, a synthesized resnet1001 iteration, sweep
configurations per second, simulation time over the measured iteration it predicts, and each
built-in policy's planning time (densenet121, resnet152, the synthesized resnet1001 and
resnet1517, uncapped and at 0.6 and 0.3 of the uncapped peak; vgg16(64) uncapped under
--quick).
Each figure is the best of a few repetitions (least disturbed by other load).

A simulated event is an event of the modelled GPU: an op (or a recomputed op) starting or
ending, a copy starting or ending, an allocator event (alloc, free_requested, free_completed,
segment_alloc, segment_free). That count is a property of the run, not of how the engine is
written: an engine that skips SimPy events where nothing can interleave simulates the same
events. The SimPy events the engine schedules are reported beside it (simpy_event_ratio).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import simpy

from .allocator import make_allocator
from .engine import run_plan, simulate
from .errors import ConfigError
from .hardware import load_hardware
from .policies import make_policy
from .trace import load_trace
from .trace.schema import Trace


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Least wall time (s) over `repeats` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def simpy_events_per_s(n_events: int = 200_000, repeats: int = 3) -> float:
    """Raw SimPy: one process yielding `n_events` timeouts."""
    def run() -> None:
        env = simpy.Environment()

        def proc(env: simpy.Environment) -> Any:
            for _ in range(n_events):
                yield env.timeout(1.0)
        env.process(proc(env))
        env.run()
    seconds, _ = best_of(run, repeats)
    return n_events / seconds


def count_events(trace: Trace, hw_name: str, policy: str, capacity: int | None
                 ) -> tuple[int, int]:
    """(simulated events, SimPy events scheduled) of one run."""
    hw = load_hardware(hw_name)
    cap = hw.capacity_bytes if capacity is None else capacity
    plan = make_policy(policy).plan_with(trace, hw, cap, run_plan)
    result = run_plan(trace, hw, plan, make_allocator("exact"), cap)
    out = result.output
    simulated = 2 * len(out.executed) + 2 * len(out.copies) + out.memory.event_count
    return simulated, result.simpy_events


def simulate_seconds(trace: Trace, hw_name: str, policy: str, capacity: int | None,
                     repeats: int = 3) -> float:
    hw = load_hardware(hw_name)
    pol, alloc = make_policy(policy), make_allocator("exact")
    seconds, _ = best_of(lambda: simulate(trace, hw, pol, alloc, capacity), repeats)
    return seconds


# capacities that bind, as fractions of the uncapped peak reserved: the planners' profiling
# and escalation run longest where little fits (resnet1517 at 0.3: hybrid and optimal
# recomputation plan for 22 s, over issue 14's 20 s)
PLANNING_FRACTIONS = (0.6, 0.3)


def planning_specs() -> list[str]:
    """Every built-in policy at its defaults (but `plan`, which needs a file), sqrt
    recomputation and vDNN's dynamic mode (which profiles its candidates)."""
    from .policies import registry

    specs = [make_policy(name).spec() for name in sorted(registry()) if name != "plan"]
    return [*specs, make_policy("recompute:strategy=sqrt").spec(),
            make_policy("vdnn:mode=dyn").spec()]


def planning_seconds(trace: Trace, hw_name: str, fraction: float | None = None
                     ) -> dict[str, Any]:
    """Planning time (process CPU seconds, one core) of every built-in policy, as a run on the
    caching allocator plans it, uncapped (`fraction` None) or at `fraction` of the uncapped
    peak reserved bytes (a capacity that binds); with whether the plan fits as run."""
    import time as _time

    from .engine import planning_runner

    hw = load_hardware(hw_name)
    alloc = make_allocator("caching")
    cap = hw.capacity_bytes
    if fraction is not None:
        none = simulate(trace, hw, make_policy("none"), alloc, cap).report
        cap = int(none["peak_reserved_bytes"] * fraction)
    runner = planning_runner(alloc)
    out: dict[str, Any] = {"ops": len(trace.ops), "capacity_bytes": cap, "policies": {}}
    for spec in planning_specs():
        t0 = _time.process_time()
        plan = make_policy(spec).plan_with(trace, hw, cap, runner)
        seconds = _time.process_time() - t0
        fits = bool(run_plan(trace, hw, plan, alloc, cap).report["fits"])
        out["policies"][spec] = {"seconds": seconds, "fits": fits}
    return out


def sweep_configs_per_s(traces: list[Path], workers: int | None = None) -> dict[str, Any]:
    """A real sweep (local processes) over the vgg16 traces: capacities 8..24 GiB by 2 GiB
    (9) x three policies x the traces, written to a temporary CSV."""
    import tempfile

    from .sweep import build_grid, run_sweep

    grid = build_grid([str(t) for t in traces], ["h100-sxm"], ["8GiB..24GiB/2GiB"],
                      ["none", "vdnn:mode=conv", "superneurons"], ["exact"])
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_sweep(grid, [str(Path(tmp) / "bench.csv")], workers=workers)
    return {"configs": summary.ran, "seconds": summary.seconds, "workers": summary.workers,
            "configs_per_s": summary.ran / summary.seconds if summary.seconds else None}


def run_bench(root: Path, progress: Callable[[str], None] | None = None,
              quick: bool = False) -> dict[str, Any]:
    """The benchmark object of `vsim bench --json`; `root` holds traces/."""
    say = progress or (lambda _m: None)
    repeats = 1 if quick else 3
    traces = sorted((root / "traces").glob("*-h100.vsim.json.gz"))
    if not traces:
        raise ConfigError(f"no recorded traces (*-h100.vsim.json.gz) under {root / 'traces'}")
    say("raw SimPy event rate ...")
    raw = simpy_events_per_s(50_000 if quick else 200_000, repeats)
    events, simpy_events, seconds, per_trace = 0, 0, 0.0, {}
    for path in traces:
        trace = load_trace(path)
        hw = str(trace.meta.get("hardware") or "h100-sxm")
        say(f"simulating {path.name} (none) ...")
        s = simulate_seconds(trace, hw, "none", None, repeats)
        n, n_simpy = count_events(trace, hw, "none", None)
        per_trace[path.name] = {"ops": len(trace.ops), "simulated_events": n,
                                "simpy_events": n_simpy, "seconds": s,
                                "events_per_s": n / s, "us_per_op": s * 1e6 / len(trace.ops)}
        events += n
        simpy_events += n_simpy
        seconds += s
    vsim_rate = events / seconds
    vgg = load_trace(root / "traces" / "vgg16-b256-h100.vsim.json.gz")
    say("vgg16(256) under vdnn ...")
    vgg_s = simulate_seconds(vgg, "h100-sxm", "vdnn:mode=all", None, repeats)
    deep = root / "traces" / "resnet1001-b32-synthetic.vsim.json.gz"
    say("resnet1001(32), synthesized, under none ...")
    deep_s = simulate_seconds(load_trace(deep), "h100-sxm", "none", None, 1) \
        if deep.exists() else None
    say("planning time per policy ...")
    planning = {}
    if quick:
        planning["vgg16-b64"] = planning_seconds(
            load_trace(root / "traces" / "vgg16-b64-h100.vsim.json.gz"), "h100-sxm")
    else:
        for name in ("densenet121-b64-h100", "resnet152-b32-h100", "resnet1001-b32-synthetic",
                     "resnet1517-b32-synthetic"):
            path = root / "traces" / f"{name}.vsim.json.gz"
            if path.exists():
                t = load_trace(path)
                planning[name] = planning_seconds(t, "h100-sxm")
                for fraction in PLANNING_FRACTIONS:
                    planning[f"{name} at {fraction} of its peak"] = planning_seconds(
                        t, "h100-sxm", fraction)
    say("sweep ...")
    sweep = sweep_configs_per_s([root / "traces" / f"vgg16-b{b}-h100.vsim.json.gz"
                                 for b in (64, 128, 256)])
    measured_us = vgg.measured.iteration_time_us if vgg.measured else None
    return {
        "simpy_events_per_s": raw,
        "vsim_events_per_s": vsim_rate,
        "event_rate_ratio": vsim_rate / raw,
        "simpy_events_scheduled_per_s": simpy_events / seconds,
        "simpy_event_ratio": simpy_events / seconds / raw,
        "vgg16_256_vdnn_ms": vgg_s * 1e3,
        "resnet1001_s": deep_s,
        "sweep_configs_per_s": sweep["configs_per_s"],
        "sim_over_measured": None if not measured_us else vgg_s * 1e6 / measured_us,
        "sweep": sweep,
        "planning": planning,
        "traces": per_trace,
        "machine": machine(),
        "targets": TARGETS,
    }


TARGETS = {"event_rate_ratio": ">= 0.5", "vgg16_256_vdnn_ms": "<= 10",
           "resnet1001_s": "<= 1", "sim_over_measured": "<= 0.1",
           "planning_s": "<= 2 up to 2,000 ops, <= 20 up to 10,000 ops (issue 14)"}


def machine() -> dict[str, Any]:
    import os
    import platform

    return {"python": platform.python_version(), "processor": platform.processor() or
            platform.machine(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
