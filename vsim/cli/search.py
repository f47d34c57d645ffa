"""`vsim search`: the fastest plan that fits, against the built-in policies and a bound."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..units import format_size, format_time
from .common import (
    check_capacity,
    check_outputs,
    emit_json,
    parse_capacity,
    progress,
    spec_files,
)


def add_search(verbs: Any) -> None:
    """The verb search."""
    p = verbs.add_parser("search", help="find the fastest plan that fits (greedy plus local "
                         "search, the simulator as the cost model); compare it with every "
                         "built-in policy and a lower bound")
    p.add_argument("trace", help="trace file (.vsim.json.gz)")
    p.add_argument("--hw", required=True, help="hardware profile name or path")
    p.add_argument("--memory", help="device capacity, e.g. 12GiB (default: the profile's "
                   "memory less the CUDA context)")
    p.add_argument("--allocator", default="caching", help="allocator spec (default: caching, "
                   "PyTorch's default allocator; expandable models its expandable segments)")
    p.add_argument("-o", "--output", help="write the plan here (JSON); run it with "
                   "--policy plan:file=PATH")
    p.add_argument("--budget", default="60", metavar="SECONDS", help="stop the search after "
                   "this long, with the best plan so far (default: 60; it usually converges "
                   "sooner)")
    p.add_argument("--seed", type=int, default=0, help="the local search's move order")
    p.add_argument("--kicks", type=int, default=4, help="perturbations after the first "
                   "local optimum (default: 4)")
    p.add_argument("--no-builtins", action="store_true", help="skip running the built-in "
                   "policies for comparison")
    p.add_argument("--no-builtin-starts", action="store_true", help="compare with the "
                   "built-in policies but do not start the local search from their plans too")
    p.add_argument("--warm-start", action="store_true", help="judge and run every plan for a "
                   "process that starts as vsim measure's do, after a plain step with the "
                   "whole GPU (as vsim run --warm-start; caching allocator only)")
    p.add_argument("--verbose", action="store_true", help="log each greedy step and "
                   "improvement on stderr")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_search)


def _budget_s(text: str) -> float:
    from ..units import parse_time
    try:
        value = float(text)
    except ValueError:
        value = parse_time(text, "--budget") / 1e6
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"--budget must be a positive number of seconds, got {text!r}")
    return value


def cmd_search(args: argparse.Namespace) -> int:
    from ..allocator import make_allocator
    from ..hardware import load_hardware
    from ..retarget import for_hardware
    from ..search.run import run_search
    from ..trace import load_trace

    check_outputs([("-o", args.output)], [args.trace, *spec_files([args.hw, args.allocator])])
    budget = _budget_s(args.budget)
    if args.kicks < 0:
        raise ConfigError(f"--kicks must be at least 0, got {args.kicks}")
    capacity = parse_capacity(args.memory)
    hw = load_hardware(args.hw)
    allocator = make_allocator(args.allocator)
    trace = load_trace(args.trace)
    trace, note = for_hardware(trace, hw)
    if note and not args.json:
        progress(f"note: {note}")
    check_capacity(args.trace, trace, hw, capacity)
    result = run_search(trace, args.trace, hw, hw.capacity_bytes if capacity is None
                        else capacity, allocator, seed=args.seed, budget_s=budget,
                        kicks=args.kicks, builtins=not args.no_builtins,
                        builtin_starts=not args.no_builtin_starts, output=args.output,
                        log=progress if args.verbose else None, warm_start=args.warm_start)
    if args.json:
        emit_json(result)
    else:
        print(format_search(result, trace.meta, args))
    return 0 if result["search"]["fits"] else 1


def format_search(result: dict[str, Any], meta: dict[str, Any], args: Any) -> str:
    s, bound, best = result["search"], result["bound"], result["best_builtin"]
    t = s["iteration_time_us"]

    def vs(other: float | None) -> str:
        if t is None or not other:
            return ""
        return f"  (search {(t / other - 1) * 100:+.2f}%)"

    lines = [f"{meta.get('model', '?')} batch {meta.get('batch_size', '?')} on "
             f"{result['hardware']}, capacity {format_size(result['capacity_bytes'])}, "
             f"allocator {result['allocator']}", ""]
    if t is None:
        lines.append("search         no plan found that fits")
    else:
        lines.append(f"search         {format_time(t):>10}  {s['swapped']} map(s) swapped "
                     f"({format_size(s['swapped_bytes'])}), {s['dropped']} recomputed "
                     f"({format_size(s['dropped_bytes'])}), "
                     f"{s['workspace_free_convolutions']} convolution(s) without workspace"
                     + (f", {s['micro_batched_convolutions']} as micro-batches"
                        if s.get("micro_batched_convolutions") else ""))
    g = s["greedy_iteration_time_us"]
    lines.append(f"greedy start   {format_time(g) if g is not None else 'did not fit':>10}")
    if s["origin"].startswith("builtin:"):
        own = s["search_iteration_time_us"]
        lines.append(f"  the plan is {s['origin'][8:]}'s: the local search's own plan "
                     + (f"took {format_time(own)}" if own is not None else "did not fit"))
    elif s["origin"] != "greedy":
        fg = s["from_greedy_iteration_time_us"]
        lines.append(f"  the search's plan came from {s['origin']}'s plan; from the greedy "
                     f"start alone: {format_time(fg) if fg is not None else 'did not fit'}")
    if best is not None:
        lines.append(f"best built-in  {format_time(best['iteration_time_us']):>10}  "
                     f"{best['policy']}{vs(best['iteration_time_us'])}")
    elif result["builtins"]:
        lines.append("best built-in  none of them fits")
    lines.append(f"lower bound    {format_time(bound['bound_us']):>10}  = max(compute "
                 f"{format_time(bound['compute_us'])}, link {format_time(bound['link_us'])} "
                 f"for the {format_size(bound['must_leave_bytes'])} that must leave)"
                 f"{vs(bound['bound_us'])}")
    if t is not None and t < bound["bound_us"]:
        lines.append("  (the search is below it: recomputation takes bytes off without the link)")
    lines.append(f"  with recomputation {format_time(bound['recompute_bound_us'])}"
                 f"{vs(bound['recompute_bound_us'])}")
    if s["bound_gap"] is not None:
        lines.append(f"gap to bound   {s['bound_gap'] * 100:+.2f}% (with recomputation "
                     f"{s['recompute_bound_gap'] * 100:+.2f}%)")
    if not bound["can_fit"]:
        lines.append(f"no plan can fit: op {bound['least_working_set_op']} needs "
                     f"{format_size(bound['least_working_set_bytes'])} even with every saved "
                     f"feature map it does not touch away")
    lines.append(f"{s['evaluations']} simulations in {s['seconds']:.1f} s, seed {s['seed']}"
                 + ("" if s["converged"] else f"; stopped by --budget {s['budget_s']:g} s "
                    "(a longer budget may find more; results then depend on machine speed)"))
    if result["builtins"]:
        lines += ["", "built-in policies:"]
        rows = sorted(result["builtins"], key=lambda r: (r["iteration_time_us"] is None,
                                                         r["iteration_time_us"] or 0))
        for r in rows:
            cell = (format_time(r["iteration_time_us"]) if r["fits"] else
                    "error" if r.get("error") else "does not fit")
            lines.append(f"  {r['policy']:44} {cell:>12}")
    if result["plan_file"]:
        mem = f" --memory {args.memory}" if args.memory else ""
        lines += ["", f"plan: {result['plan_file']} (vsim run {result['trace']} --hw "
                      f"{args.hw}{mem} --policy plan:file={result['plan_file']})"]
    return "\n".join(lines)

