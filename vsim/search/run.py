"""The `vsim search` verb's work: search a plan, run the built-in policies for comparison, compute
the lower bound, save the plan, and return one result object (the CLI prints it).

Built-in policies: every registered policy at its defaults plus its key variants (the
policy class's `examples`), found through the registry. They run in a child
process (fork, where there is one) while the search runs: each policy plans once and its plan
is simulated as `vsim run` would (engine.simulate: planned with the run's allocator as judge,
engine.planning_runner, and run on it). Once the search from its greedy start is done, the local
search starts again from the BUILTIN_STARTS fastest fitting built-in plans (as genomes,
repaired when leaving out what a genome cannot say makes them not fit); the result says which
start its plan came from (`origin`) and what the greedy line alone reached
(`from_greedy_iteration_time_us`).

The plan returned is judged as `vsim run` judges it (the run's allocator, first iteration and
workspace fallback), the same way as the built-ins, by the time a measurement reports (the
report's `timed_iteration_time_us`, the median of the iterations it times, which `vsim validate`
holds against measured runs; every `iteration_time_us` here is that): when the search's own plan does not fit so
judged, or is slower than the fastest fitting built-in, the built-in's plan is returned instead
(`origin` "builtin:SPEC"). So `vsim search` fits whenever a built-in does and is never slower
than the best of them. `bound_gap` says how far the result is from the lower bound (as a
fraction over it: 0.05 is 5% slower than the bound), for both bounds.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from ..allocator.base import AllocatorSpec
from ..engine import allocator_spec_string, run_plan, simulate
from ..hardware import Hardware
from ..plan import Drop, Offload, Plan, Retime
from ..plan_io import SavedPlan, file_sha256, save_plan, trace_digest
from ..policies import make_policy, registry
from ..policies.base import example_specs
from ..policies.saved import SavedPlanPolicy
from ..trace.schema import Trace
from .bound import lower_bound
from .local import search

BUILTIN_STARTS = 3
"""The local search also starts from this many of the fastest fitting built-in plans."""


def builtin_specs() -> list[str]:
    """Normalised specs: every registered policy (but `plan`, which needs a file) at its
    defaults, then every policy's examples, by name."""
    policies = [cls for name, cls in sorted(registry().items()) if name != "plan"]
    specs = [make_policy(cls.name).spec() for cls in policies]
    for cls in policies:
        specs += [s for s in example_specs(cls) if s not in specs]
    return specs


def run_builtins(trace: Trace, hw: Hardware, capacity_bytes: int, allocator: AllocatorSpec,
                 specs: list[str], warm_start: bool = False
                 ) -> tuple[list[dict[str, Any]], dict[str, Plan]]:
    """One row per policy, each simulated as `vsim run` would (engine.simulate: its profiling
    runs judged on `allocator`): fits, iteration time (None when it does not fit), and where
    the time went; and each policy's plan (by its spec). A policy that raises is a row with
    `error` (a bug there, not here)."""
    rows, plans = [], {}
    for spec in specs:
        policy = make_policy(spec)
        try:
            sim = simulate(trace, hw, policy, allocator, capacity_bytes, warm_start=warm_start)
            plan, r = sim.plan, sim.report
        except Exception as exc:  # noqa: BLE001 (report another policy's bug, keep going)
            rows.append({"policy": spec, "fits": False, "iteration_time_us": None,
                         "error": f"{type(exc).__name__}: {exc}"})
            continue
        plans[policy.spec()] = plan
        rows.append({"policy": policy.spec(), "fits": r["fits"],
                     "iteration_time_us": r["timed_iteration_time_us"] if r["fits"] else None,
                     "stall_time_us": r["stall_time_us"],
                     "recompute_time_us": r["recompute_time_us"],
                     "d2h_bytes": r["d2h_bytes"],
                     "peak_allocated_bytes": r["peak_allocated_bytes"]})
    return rows, plans


Builtins = tuple[list[dict[str, Any]], dict[str, Plan]]


def plan_counts(trace: Trace, plan: Plan) -> dict[str, Any]:
    """What a plan does, in the search's summary terms (for a built-in's plan)."""
    size = {t.id: t.size_bytes for t in trace.tensors}
    out = {a.tensor for a in plan.actions if isinstance(a, Offload)}
    dropped = {a.tensor for a in plan.actions if isinstance(a, Drop)}
    slow = {a.op for a in plan.actions if isinstance(a, Retime) and a.workspace_bytes == 0}
    split = {a.op for a in plan.actions if isinstance(a, Retime) and a.parts > 1}
    return {"swapped": len(out), "dropped": len(dropped),
            "swapped_bytes": sum(size.get(t, 0) for t in out),
            "dropped_bytes": sum(size.get(t, 0) for t in dropped),
            "workspace_free_convolutions": len(slow), "micro_batched_convolutions": len(split),
            "wait_for_memory": plan.wait_for_memory}


def _start_builtins(trace: Trace, hw: Hardware, capacity: int, allocator: AllocatorSpec,
                    warm_start: bool) -> tuple[Future[Builtins] | None, ProcessPoolExecutor | None]:
    if "fork" not in multiprocessing.get_all_start_methods():
        return None, None
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
    return pool.submit(run_builtins, trace, hw, capacity, allocator, builtin_specs(),
                       warm_start), pool


def run_search(trace: Trace, trace_path: str, hw: Hardware, capacity_bytes: int,
               allocator: AllocatorSpec, *, seed: int = 0, budget_s: float = 60.0,
               kicks: int = 4, builtins: bool = True, builtin_starts: bool = True,
               output: str | None = None, log: Callable[[str], None] | None = None,
               warm_start: bool = False) -> dict[str, Any]:
    """Search, compare, bound, and save the plan to `output` (when given). With
    `builtin_starts`, the local search also starts from the BUILTIN_STARTS fastest fitting
    built-in plans. Returns {trace, hardware, capacity_bytes, allocator, search, best_builtin,
    builtins, bound, plan_file}; `search.report` is the `vsim run --json` report of the plan
    found (the plan returned: the search's, or the fastest fitting built-in's when that is
    faster; `search.origin` says which), `search.bound_gap` its time over the bound less 1.
    `warm_start`: every plan judged and run for a process that starts warm, as `vsim measure`'s
    do (engine.run_plan's; `vsim run --warm-start`)."""
    future, pool = (_start_builtins(trace, hw, capacity_bytes, allocator, warm_start)
                    if builtins else (None, None))
    done: list[Builtins] = []

    def builtin_results() -> Builtins:
        if not done:
            done.append(future.result() if future is not None else run_builtins(
                trace, hw, capacity_bytes, allocator, builtin_specs(), warm_start))
        return done[0]

    def starts() -> list[tuple[str, Plan]]:
        rows, plans = builtin_results()
        fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["iteration_time_us"])
        return [(r["policy"], plans[r["policy"]]) for r in fitting[:BUILTIN_STARTS]]

    try:
        bound = lower_bound(trace, hw, capacity_bytes)
        found = search(trace, hw, capacity_bytes, allocator, seed=seed, budget_s=budget_s,
                       kicks=kicks, log=log,
                       starts=starts if builtins and builtin_starts else None,
                       warm_start=warm_start)
        rows = builtin_results()[0] if builtins else []
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    # The search's plan judged as `vsim run` judges it, as the built-ins were: the fastest of
    # it and the fitting built-ins is the result.
    searched = run_plan(trace, hw, found.plan, allocator, capacity_bytes,
                        warm_start=warm_start).report
    own_us = searched["timed_iteration_time_us"] if searched["fits"] else None
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["iteration_time_us"]) if fitting else None
    plan, origin, report = found.plan, found.origin, searched
    counts = found.summary_counts()
    if best is not None and (own_us is None or best["iteration_time_us"] < own_us - 1e-6):
        plans = builtin_results()[1]
        origin = f"builtin:{best['policy']}"
        why = ("does not fit" if own_us is None else
               f"takes {own_us / 1e3:.3f} ms")
        plan = dataclasses.replace(plans[best["policy"]], notes=(
            *plans[best["policy"]].notes,
            f"search: {best['policy']}'s plan, the fastest that fits (the local search's own "
            f"plan {why})"))
        report = run_plan(trace, hw, plan, allocator, capacity_bytes,
                          warm_start=warm_start).report
        counts = {**plan_counts(trace, plan), "candidates": counts.get("candidates")}
    t = report["timed_iteration_time_us"] if report["fits"] else None
    greedy_line = found.from_greedy
    summary = {
        "iteration_time_us": t,
        "fits": report["fits"],
        "origin": origin,
        "search_iteration_time_us": own_us,
        "from_greedy_iteration_time_us": (greedy_line.time_us if greedy_line is not None
                                          and greedy_line.fits else None),
        "greedy_iteration_time_us": (found.greedy_outcome.time_us
                                     if found.greedy_outcome.fits else None),
        "bound_gap": None if t is None else t / bound["bound_us"] - 1,
        "recompute_bound_gap": None if t is None else t / bound["recompute_bound_us"] - 1,
        "seed": seed, "kicks": kicks, "budget_s": budget_s, "warm_start": warm_start,
        "evaluations": found.evaluations,
        "seconds": round(found.seconds, 3), "sim_seconds": round(found.sim_seconds, 3),
        "converged": found.converged, **counts,
    }
    saved = SavedPlan(
        plan=plan, trace_digest=trace_digest(trace), trace_path=trace_path,
        file_sha256=file_sha256(trace_path), hardware=hw.name, capacity_bytes=capacity_bytes,
        trace_label=f"{trace.meta.get('model', '?')} batch {trace.meta.get('batch_size', '?')}",
        search={**summary, "allocator": allocator_spec_string(allocator),
                "best_builtin": None if best is None else {
                    "policy": best["policy"], "iteration_time_us": best["iteration_time_us"]},
                "bound_us": bound["bound_us"],
                "recompute_bound_us": bound["recompute_bound_us"]})
    if output:
        save_plan(saved, output)
        report = simulate(trace, hw, SavedPlanPolicy(file=output), allocator,
                          capacity_bytes, warm_start=warm_start).report
    else:
        report = {**report, "policy": "search (not saved: give -o)"}
    return {
        "trace": trace_path, "hardware": hw.name, "capacity_bytes": capacity_bytes,
        "allocator": allocator_spec_string(allocator),
        "search": {**summary, "report": report},
        "best_builtin": best, "builtins": rows, "bound": bound, "plan_file": output,
    }
