"""`vsim validate` (cases, allocator histories, the vDNN paper) and `vsim bench`."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..units import format_size, format_time
from .common import check_outputs, emit_json, pct, progress, strict_json


def add_validate_bench(verbs: Any) -> None:
    """The verbs validate and bench."""
    p = verbs.add_parser("validate", help="predicted vs measured; exit 1 outside tolerance")
    p.add_argument("cases", nargs="*", default=["validation/cases"],
                   help="case files or folders (default: validation/cases)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png", help="write a scatter plot of predicted "
                   "against measured here (default: none; the repository's is "
                   "validation/predicted-vs-measured.png)")
    p.add_argument("--first-iteration", action=argparse.BooleanOptionalAction,
                   help="simulate each case's first iteration first (see vsim run)")
    p.add_argument("--workspace-fallback", action=argparse.BooleanOptionalAction,
                   help="fall back to workspace-free convolutions (see vsim run)")
    p.add_argument("--runtime-cost", action=argparse.BooleanOptionalAction,
                   help="charge vsim's own runtime's host costs (see vsim run; default: on)")
    p.set_defaults(handler=cmd_validate)

    p = verbs.add_parser("bench", help="how fast the simulator is on this machine")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="one repetition each (noisier)")
    p.set_defaults(handler=cmd_bench)


def cmd_validate(args: argparse.Namespace) -> int:
    from ..allocator.history import HISTORY_SUFFIX, history_files
    from ..validate import load_cases, paper_files

    histories = history_files(args.cases)
    others = [p for p in args.cases if not p.endswith(HISTORY_SUFFIX)]
    cases, papers = load_cases(others), paper_files(others)
    if not (cases or papers or histories):
        raise ConfigError(f"no validation cases found in {', '.join(args.cases)}")
    code = 0
    if histories:
        code = max(code, _validate_histories(histories, args.json))
    if papers:
        code = max(code, _validate_papers(papers, args.json))
    if cases:
        code = max(code, _validate_cases(cases, args))
    return code


def _validate_histories(files: list[Path], as_json: bool) -> int:
    """The caching model against PyTorch's whole-run allocator histories."""
    from ..allocator.history import TOLERANCE, load_history, replay_history

    histories = [load_history(f) for f in files]  # all read before any output
    rows: list[dict[str, Any]] = []
    for h in histories:
        if not as_json:
            progress(f"replaying {h.name} ({len(h.entries)} allocator events)")
        exact, virtual = replay_history(h), replay_history(h, recorded_addresses=False)
        down = replay_history(h, recorded_addresses=False, top_down=True)
        rows.append({
            "history": h.path, "run": h.name, "device": h.meta.get("device"),
            "iterations": len(h.iterations), "events": len(h.entries),
            "reserved_recorded_bytes": exact.reserved[-1][0],
            "reserved_model_bytes": exact.reserved[-1][1],
            "reserved_error": exact.reserved_error,
            "allocated_exact": all(a == b for a, b in exact.allocated),
            "segments_recorded": len(exact.recorded_segments),
            "segments_model": len(exact.model_segments),
            "first_divergent_segment": exact.first_divergence(),
            "reserved_model_virtual_addresses_bytes": virtual.reserved[-1][1],
            "reserved_error_virtual_addresses": virtual.reserved_error,
            "first_divergent_segment_virtual_addresses": virtual.first_divergence(),
            "reserved_model_top_down_bytes": down.reserved[-1][1],
            "reserved_error_top_down": down.reserved_error,
            "first_divergent_segment_top_down": down.first_divergence(),
            "ok": abs(exact.reserved_error) <= TOLERANCE})
    if as_json:
        emit_json({"tolerance": TOLERANCE, "histories": rows})
    else:
        print(f"Caching allocator model against PyTorch's allocator histories (whole runs, "
              f"reserved after the last iteration; tolerance {TOLERANCE:.0%})")
        print(f"{'run':18} {'events':>7} {'recorded':>10} {'model':>10} {'err':>7} {'segments':>9}"
              f"  {'virtual addr':>12} {'err':>7}  {'top-down':>10} {'err':>7}  ok")
        for r in rows:
            print(f"{r['run']:18} {r['events']:7d} {_gib(r['reserved_recorded_bytes']):>10} "
                  f"{_gib(r['reserved_model_bytes']):>10} {pct(r['reserved_error']):>7} "
                  f"{r['segments_model']:>4}/{r['segments_recorded']:<4}"
                  f"  {_gib(r['reserved_model_virtual_addresses_bytes']):>12} "
                  f"{pct(r['reserved_error_virtual_addresses']):>7}  "
                  f"{_gib(r['reserved_model_top_down_bytes']):>10} "
                  f"{pct(r['reserved_error_top_down']):>7}  "
                  f"{'ok' if r['ok'] else 'MISS'}")
        print("model: segments at the recorded cudaMalloc addresses; virtual addr: at the "
              "increasing addresses the simulator uses (best fit breaks ties by address); "
              "top-down: as the driver places them (caching:addresses=down)")
    return 0 if all(r["ok"] for r in rows) else 1


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"


def _validate_cases(cases: Any, args: argparse.Namespace) -> int:
    from ..validate import validate

    plot = None if args.plot in (None, "none") else args.plot  # 'none': as before
    inputs = [*args.cases, *(c.source for c in cases), *(str(c.trace) for c in cases),
              *(c.measured for c in cases if c.measured != "trace")]
    check_outputs([("--plot", plot)], inputs)
    result = validate(cases, progress=None if args.json else progress,
                      first_iteration=args.first_iteration,
                      workspace_fallback=args.workspace_fallback,
                      runtime_cost=args.runtime_cost)
    text = strict_json(result, indent=2) if args.json else format_validation(result)
    if plot:
        from ..plots import plot_validation
        plot_validation(result["cases"], plot)
    print(text)
    if plot and not args.json:
        print(f"plot: {plot}")
    return 0 if all(r["ok"] for r in result["cases"]) else 1


def _or_dash(fmt: Callable[[Any], str], value: Any) -> str:
    """A measured run that ran out of memory has no time or peak: shown '-'."""
    return "-" if value is None else fmt(value)


def format_validation(result: dict[str, Any]) -> str:
    from ..validate import runtime_own_share

    lines = [f"{'case':38} {'time pred':>10} {'meas':>10} {'err':>7}  {'peak pred':>10} "
             f"{'meas':>10} {'err':>7}  {'resv err':>8}  fits  ok   own  +trk"]
    shares: list[float] = []
    native: list[float] = []  # runs of the runtime with the C++ actions
    tracked: list[float] = []  # their own share with the tracker's estimate added
    for r in result["cases"]:
        p, m, e = r["predicted"], r["measured"], r["error"]
        own = runtime_own_share(m)  # the runtime's own host share of the measured iteration
        with_tracker = None
        if own is not None:
            shares.append(own)
            if "executor_event_us" in (m.get("executed") or {}):
                native.append(own)
            if "tracker_estimate_us" in r:
                with_tracker = own + r["tracker_estimate_us"] / m["iteration_time_us"]
                tracked.append(with_tracker)
        fits = ("plan!" if "plan_error" in r else
                ("yes" if p["fits"] else "no") + ("" if p["fits"] == bool(m["fits"]) else "!"))
        lines.append(
            f"{r['id'][:38]:38} {_or_dash(format_time, p['iteration_time_us']):>10} "
            f"{_or_dash(format_time, m['iteration_time_us']):>10} "
            f"{pct(e['iteration_time']):>7}  "
            f"{_or_dash(format_size, p['peak_allocated_bytes']):>10} "
            f"{_or_dash(format_size, m['peak_allocated_bytes']):>10} "
            f"{pct(e['peak_allocated']):>7}  "
            f"{pct(e['peak_reserved']):>8}  {fits:4}  {'ok' if r['ok'] else 'MISS':4} "
            f"{_or_dash(lambda x: f'{100 * x:.1f}%', own):>5} "
            f"{_or_dash(lambda x: f'{100 * x:.1f}%', with_tracker):>5}"
            + (" *" if r.get("plan_changed") else ""))
    lines += [f"{r['id']}: the policy's plan does not run: {r['plan_error']}"
              for r in result["cases"] if "plan_error" in r]
    s = result["summary"]
    lines.append(f"{s['n']} cases, {s['ok']} within tolerance; iteration-time MAPE "
                 f"{pct(s['time_mape']).lstrip('+')}, peak-allocated MAPE "
                 f"{pct(s['peak_mape']).lstrip('+')}, fits right in {s['fits_correct']}/{s['n']}")
    for what, got in (("", shares), (" with the C++ actions (since 2026-11-27)", native)):
        if got:
            lines.append(
                f"own: vsim's runtime's own host time over the measured iteration, {len(got)} "
                f"run(s) whose plan acts{what}: median {100 * statistics.median(got):.1f}%, "
                f"largest {100 * max(got):.1f}%, over 10% in {sum(x > 0.1 for x in got)}")
    if shares:
        lines.append("  (the executor's timed work only: the native tracker's counter and saved-"
                     "tensor hooks, 1.8-3.6 us per counted call and 4.6-8.6 us per save on the "
                     "H100, are not in it; validation/host/waits/)")
    if tracked:
        lines.append(
            f"+trk: with the tracker's estimate added (the profile's charge per call through "
            f"its key and per save), {len(tracked)} native run(s): median "
            f"{100 * statistics.median(tracked):.1f}%, largest {100 * max(tracked):.1f}%, "
            f"over 10% in {sum(x > 0.1 for x in tracked)}")
    if s.get("with_repeats"):
        lines.append(f"the measured runs' own iterations vary by a median "
                     f"{pct(s['median_repeat_spread']).lstrip('+')} (max - min over median, "
                     f"{s['with_repeats']} runs); {s['time_within_repeats']} predicted times lie "
                     "within their run's range")
    if s.get("at_recorded_speed"):
        m = s["at_recorded_speed"]
        lines.append(f"at the recording's core speed (the speed probe before each iteration, in "
                     f"trace and run): iteration-time MAPE {pct(m['time_mape']).lstrip('+')} "
                     f"over {m['n']} cases")
    if s.get("churn"):
        c = s["churn"]
        lines.append(
            f"allocator churn, {c['n']} case(s) measured with it, per iteration summed over "
            f"them: releases {c['predicted_num_alloc_retries']:.1f} predicted against "
            f"{c['measured_num_alloc_retries']:.1f} measured; memory mapped or cudaMalloc'd "
            f"{c['predicted_reserved_bytes.all.allocated'] / 2**30:.1f} GiB against "
            f"{c['measured_reserved_bytes.all.allocated'] / 2**30:.1f} GiB")
    if s.get("cases_run_repeatedly"):
        lines.append(f"{s['cases_run_repeatedly']} cases measured in several runs of the same plan "
                     "(iterations pooled; fits only if every run fit): "
                     f"{s['runs_disagree_on_fit']} of them ran out of memory in some runs only")
    if s.get("plans_changed"):
        lines.append(f"* {s['plans_changed']} case(s): the policy now plans differently from the "
                     "plan measured (its digest); remeasure them to compare like with like")
    for title, key in (("family", "by_family"), ("policy", "by_policy"),
                       ("hardware", "by_hardware")):
        groups = result.get(key) or {}
        if not groups:
            continue
        lines += ["", f"{'by ' + title:22} {'cases':>5} {'ok':>4} {'time MAPE':>10} "
                      f"{'peak MAPE':>10} {'fits right':>10}"]
        for name, g in groups.items():
            lines.append(f"{name[:22]:22} {g['n']:5d} {g['ok']:4d} "
                         f"{pct(g['time_mape']).lstrip('+'):>10} "
                         f"{pct(g['peak_mape']).lstrip('+'):>10} "
                         f"{str(g['fits_correct']) + '/' + str(g['n']):>10}")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench import run_bench
    from ..validate import repo_root

    result = run_bench(repo_root(Path.cwd()), progress=progress, quick=args.quick)
    if args.json:
        emit_json(result)
        return 0
    t = result["targets"]
    rows = [("raw SimPy events/s", f"{result['simpy_events_per_s']:,.0f}", ""),
            ("vsim simulated events/s", f"{result['vsim_events_per_s']:,.0f}", ""),
            ("ratio", f"{result['event_rate_ratio']:.2f}", t["event_rate_ratio"]),
            ("vsim SimPy events/s (ratio)", f"{result['simpy_events_scheduled_per_s']:,.0f} "
             f"({result['simpy_event_ratio']:.2f})", ""),
            ("vgg16(256) vdnn, one iteration", f"{result['vgg16_256_vdnn_ms']:.1f} ms",
             t["vgg16_256_vdnn_ms"] + " ms"),
            ("resnet1001(32) synthesized", "-" if result["resnet1001_s"] is None else
             f"{result['resnet1001_s']:.2f} s", t["resnet1001_s"] + " s"),
            ("sweep configurations/s", f"{result['sweep_configs_per_s']:.1f}", ""),
            ("simulation / measured, vgg16(256)", f"{result['sim_over_measured']:.3f}",
             t["sim_over_measured"])]
    for name, value, target in rows:
        print(f"{name:36} {value:>14}  {('target ' + target) if target else ''}")
    print(f"planning time per policy (CPU s; target {t['planning_s']}):")
    for case, res in result["planning"].items():
        cells = ", ".join(f"{spec.split(',algo')[0]} {r['seconds']:.2f}"
                          + ("" if r["fits"] else " (oom)")
                          for spec, r in res["policies"].items())
        print(f"  {case} ({res['ops']} ops): {cells}")
    print(f"machine: {result['machine']}")
    return 0


def _validate_papers(papers: list[Path], as_json: bool) -> int:
    from ..paper import check, format_result

    results = [check(p, progress=None if as_json else progress) for p in papers]
    if as_json:
        emit_json(results[0] if len(results) == 1 else results)
    else:
        print("\n\n".join(format_result(r) for r in results))
    return 0 if all(r["ok"] for r in results) else 1
