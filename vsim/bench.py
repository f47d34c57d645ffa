"""`vsim bench`: how fast the simulator is on the machine it runs on.

Measures raw SimPy event throughput (one process doing timeouts: the ceiling for any SimPy
model), vsim's simulated events per second on the shipped traces, their ratio, the time to
simulate one vgg16(256) iteration under vdnn, a synthesized resnet1001 iteration, sweep
configurations per second, and simulation time over the measured iteration it predicts.
Each figure is the best of a few repetitions (least disturbed by other load).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import simpy

from .allocator import make_allocator
from .engine import simulate
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


def count_events(trace: Trace, hw_name: str, policy: str, capacity: int | None) -> int:
    """Events the engine schedules for one run (SimPy numbers every scheduled event)."""
    from .engine.simulator import Engine

    hw = load_hardware(hw_name)
    cap = hw.capacity_bytes if capacity is None else capacity
    plan = make_policy(policy).plan(trace, hw, cap)
    engine = Engine(trace, hw, plan, make_allocator("exact").build(cap))
    engine.run()
    return next(engine.env._eid)  # noqa: SLF001  (SimPy's event counter)


def simulate_seconds(trace: Trace, hw_name: str, policy: str, capacity: int | None,
                     repeats: int = 3) -> float:
    hw = load_hardware(hw_name)
    pol, alloc = make_policy(policy), make_allocator("exact")
    seconds, _ = best_of(lambda: simulate(trace, hw, pol, alloc, capacity), repeats)
    return seconds


def run_bench(traces: list[Path], progress: Callable[[str], None] | None = None
              ) -> dict[str, Any]:
    """The benchmark object of `vsim bench --json`."""
    say = progress or (lambda _m: None)
    say("raw SimPy event rate ...")
    raw = simpy_events_per_s()
    events = 0
    seconds = 0.0
    per_trace = {}
    for path in traces:
        trace = load_trace(path)
        hw = str(trace.meta.get("hardware") or "h100-sxm")
        say(f"simulating {path.name} ...")
        s = simulate_seconds(trace, hw, "none", None)
        n = count_events(trace, hw, "none", None)
        per_trace[path.name] = {"events": n, "seconds": s, "events_per_s": n / s,
                                "ops": len(trace.ops)}
        events += n
        seconds += s
    vsim_rate = events / seconds if seconds else None
    return {
        "simpy_events_per_s": raw,
        "vsim_events_per_s": vsim_rate,
        "event_rate_ratio": None if vsim_rate is None else vsim_rate / raw,
        "traces": per_trace,
    }
