"""`vsim run`, `inspect`, `list` and `compare`: simulating traces and reading them."""

from __future__ import annotations

import argparse
import gc
import textwrap
from collections.abc import Callable
from typing import Any, cast

from ..errors import ConfigError
from ..units import format_size, format_time
from .common import (
    StagedOutputs,
    check_capacity,
    check_outputs,
    emit_json,
    leave_for_exit,
    parse_capacity,
    pct,
    progress,
    spec_files,
    strict_json,
)


def add_run_inspect_list(verbs: Any) -> None:
    """The verbs run, inspect and list."""
    p = verbs.add_parser("run", help="simulate a trace under a policy")
    p.add_argument("trace", help="trace file (.vsim.json.gz)")
    p.add_argument("--hw", required=True, help="hardware profile name (see `vsim list`) or "
                   "path, optionally with hypothetical links as in sweep: "
                   "h100-sxm:link=16GB/s (keys h2d, d2h, link, duplex)")
    p.add_argument("--memory", help="device capacity to simulate, e.g. 12GiB (default: the "
                   "profile's memory less the CUDA context)")
    p.add_argument("--policy", action="append", help="policy spec NAME[:key=value,...]; give "
                   "several to compare them side by side (default: none)")
    p.add_argument("--allocator", default="caching", help="allocator spec (default: caching, "
                   "PyTorch's default allocator; expandable models its expandable segments)")
    p.add_argument("--first-iteration", action=argparse.BooleanOptionalAction, help="run a "
                   "training process's first iteration before the reported one, on the same "
                   "allocator (its segments and fragmentation carry over; default: with the "
                   "caching allocator)")
    p.add_argument("--warm-start", action="store_true", help="start as vsim measure's "
                   "processes do: a plain step with the whole GPU ran before the cap, so the "
                   "optimizer's state and cuBLAS's workspaces already sit in the caching "
                   "allocator's segments when the first capped iteration begins (the plan is "
                   "made for that start too; caching allocator only)")
    p.add_argument("--workspace-fallback", action=argparse.BooleanOptionalAction, help="a "
                   "convolution whose workspace cannot be allocated runs without one, at its "
                   "workspace-free algorithm's time, as PyTorch falls back to another cuDNN "
                   "engine (default: with the caching allocator)")
    p.add_argument("--runtime-cost", action=argparse.BooleanOptionalAction, help="charge the "
                   "host costs of vsim's own Python runtime (its op tracker and its work per "
                   "offload, prefetch, free and recomputed op; hardware/host/NAME.yaml's "
                   "executor section), as the measured runs pay them; --no-runtime-cost "
                   "predicts an ideal (C++) runtime that pays none (default: on)")
    p.add_argument("--draws", type=int, default=3, metavar="N", help="where a policy's plan "
                   "fits a capacity that binds, run it N more times, each under a draw of the "
                   "timing variation measured between real iterations on the machine "
                   "(hardware/timing/; PyTorch's allocators only), and say how many fit: a "
                   "plan that fits by a hair in one timeline can run out of memory in another; "
                   "when most do not, the policy's plan for a budget 3-15%% lower that most "
                   "draws fit is run instead (default: 3; 0: none)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (an array "
                   "when several policies are given)")
    p.add_argument("--verbose", action="store_true", help="also print compute, stall and "
                   "recompute time, average allocated, prefetched and pinned host bytes")
    p.add_argument("--timeline", help="write the predicted trace (Perfetto-viewable) here")
    p.add_argument("--plot", help="write a PNG of memory over time and stream activity here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a hypothetical GPU: change a profile value, with its unit "
                   "(gpu.memory=24GiB, compute.peak.fp32=20TFLOP/s, compute.dram_bandwidth="
                   "1TB/s, link.h2d.pinned.bandwidth=32GB/s, link.bandwidth=16GB/s, ...); "
                   "repeatable")
    p.add_argument("--no-retarget", action="store_true", help="keep the recorded op times "
                   "when the trace comes from another GPU (default: retarget them through "
                   "the compute model)")
    p.set_defaults(handler=cmd_run)

    p = verbs.add_parser("inspect", help="validate and summarise a trace")
    p.add_argument("trace")
    p.add_argument("--json", action="store_true")
    p.add_argument("--replay-allocator", metavar="SPEC",
                   help="also replay the recorded allocator events through this allocator "
                   "model (e.g. caching) and compare its peaks with the measured ones")
    p.set_defaults(handler=cmd_inspect)

    p = verbs.add_parser("list", help="policies, allocators, hardware profiles and models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_list)


def add_compare(verbs: Any) -> None:
    """The verb compare."""
    p = verbs.add_parser("compare", help="metric deltas between two traces; --merge writes one "
                         "Perfetto file with both")
    p.add_argument("a", help="first trace (e.g. measured)")
    p.add_argument("b", help="second trace (e.g. predicted)")
    p.add_argument("--merge", help="write both runs into one Chrome-trace JSON (.json or "
                   ".json.gz) for ui.perfetto.dev, one process each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_compare)



# What `exact` is to a PyTorch user: said wherever it is used or listed.
EXACT_NOTE = ("allocator exact: no fragmentation and no allocator costs, a bound; PyTorch's "
              "default allocator is caching, and expandable models its expandable segments "
              "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")


ALLOCATOR_NOTES = {
    "caching": "the default: what PyTorch users get, PYTORCH_CUDA_ALLOC_CONF unset",
    "expandable": "PyTorch's expandable segments, "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: pages mapped as needed, "
                  "unmapped when the capacity binds, each at its probed host cost",
    "exact": "no fragmentation and no allocator costs: the optimistic bound"}


def cpu_trace_note(trace: Any, hw: Any) -> str | None:
    """A trace recorded on a CPU keeps its CPU op times on a GPU profile: retargeting needs a
    GPU's compute model on both sides. Its memory figures hold; its times are the CPU's."""
    meta = trace.meta
    on_cpu = meta.get("device_type") == "cpu" or str(meta.get("device") or "").lower() == "cpu"
    if not on_cpu or meta.get("source") != "measured":
        return None
    return (f"the trace was recorded on a CPU: its op times are CPU times, kept on {hw.name} "
            "(retargeting applies to GPU traces only); memory figures hold, times do not "
            "predict a GPU")


def run_notes(trace: Any, hw: Any, allocator_spec: str) -> list[str]:
    """Notes on the whole run (not one policy's), in text and in the JSON report."""
    notes = []
    if allocator_spec.split(":")[0].strip() == "exact":
        notes.append(EXACT_NOTE)
    cpu = cpu_trace_note(trace, hw)
    if cpu:
        notes.append(cpu)
    return notes


def cmd_run(args: argparse.Namespace) -> int:
    # The cyclic collector paused for the command: the trace, the engine's lookups and each
    # run's records are millions of objects that hold no cycles (an engine holds none after
    # its run), and every pass it made walked them: after each run (the collector is paused
    # during one, and resumed it walked the run's surviving records) and in full passes over
    # the trace (a 1M-op run: about 2.5 s of passes, before freezing the trace 4 s). The
    # command is short; what little cyclic garbage it leaves goes at the next collection.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(args)
    finally:
        if enabled:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    from ..allocator import make_allocator
    from ..engine import simulate
    from ..engine.prep import trace_prep
    from ..engine.warm import supports_warm_start
    from ..policies import make_policy
    from ..retarget import for_hardware, hardware_with_overrides
    from ..sweep import AMPLE_BYTES, load_hw_spec
    from ..trace import load_trace, save_trace

    specs = args.policy or ["none"]
    if (args.timeline or args.plot) and len(specs) > 1:
        raise ConfigError("--timeline and --plot take one --policy at a time")
    check_outputs([("--timeline", args.timeline), ("--plot", args.plot)],
                  [args.trace, *spec_files([args.hw, args.allocator, *specs])])
    # Parse every input before simulating anything, so bad input fails fast and writes nothing.
    capacity = parse_capacity(args.memory)
    if args.draws < 0:
        raise ConfigError(f"--draws must be 0 or more, got {args.draws}")
    if args.set and ":" in args.hw:
        raise ConfigError("--hw NAME:KEY=RATE and --set both change the profile: give the "
                          "link's rates as --set link.bandwidth=... (or h2d/d2h keys) instead")
    hw = hardware_with_overrides(args.hw, args.set) if args.set else load_hw_spec(args.hw)
    policies = [make_policy(s) for s in specs]
    allocator = make_allocator(args.allocator)
    trace = load_trace(args.trace)
    trace, retarget_note = for_hardware(trace, hw, enabled=not args.no_retarget)
    prep = trace_prep(trace)  # the engine's lookups of the trace, made once for every run on it
    if retarget_note and not args.json:
        progress(f"note: {retarget_note}")
    if args.warm_start and not args.json and (
            args.first_iteration is False or not supports_warm_start(allocator.build(1))):
        progress(f"note: --warm-start models the first iteration of PyTorch's caching allocator "
                 f"only: with {args.allocator}"
                 f"{' and --no-first-iteration' if args.first_iteration is False else ''} "
                 f"the run starts cold")
    check_capacity(args.trace, trace, hw, capacity)
    if capacity is not None and capacity > hw.capacity_bytes and not args.json:
        progress(f"note: --memory {format_size(capacity)} is more than {hw.name} has "
                  f"({format_size(hw.capacity_bytes)}): simulating a larger card")
    results = [simulate(trace, hw, p, allocator, capacity, args.first_iteration,
                        args.workspace_fallback, runtime_cost=args.runtime_cost,
                        draws=args.draws, warm_start=args.warm_start)
               for p in policies]
    # the slowdown's reference, as a sweep's: no policy with room for everything; a run of no
    # policy here that the capacity never constrained is that run (a 1M-op trace: half the time)
    none = make_policy("none")
    same = [r for p, r in zip(policies, results, strict=True) if p.spec() == none.spec()
            and args.runtime_cost is None and not r.capacity_bound]
    base = same[0].report if same else simulate(
        trace, hw, none, allocator, AMPLE_BYTES, args.first_iteration,
        args.workspace_fallback).report
    base_us = base["iteration_time_us"] if base["fits"] else None
    notes = run_notes(trace, hw, args.allocator)
    reports = []
    for r in results:
        report = dict(r.report)
        report["baseline_iteration_time_us"] = base_us
        report["slowdown"] = (report["iteration_time_us"] / base_us
                              if report["fits"] and base_us else None)
        report["notes"] = [*report["notes"], *notes]
        reports.append(report)
    # every output computed and written to temporaries first, renamed together at the end
    with StagedOutputs() as staged:
        if args.timeline:
            save_trace(results[0].predicted, staged.path(args.timeline))
        if args.plot:
            from ..plots import plot_run
            plot_run(results[0].predicted, results[0].report, staged.path(args.plot))
        text = (strict_json(reports[0] if len(reports) == 1 else reports, indent=2)
                if args.json else format_reports(reports, trace.meta, trace, args.verbose))
    print(text)
    leave_for_exit(trace, prep, results)  # freed by the system at exit (a 1M-op trace: 0.7 s)
    return 0


_DETAILS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("compute", "compute_time_us", format_time),
    ("stall", "stall_time_us", format_time),
    ("recompute", "recompute_time_us", format_time),
    ("avg alloc", "avg_allocated_bytes", format_size),
    ("prefetched", "h2d_bytes", format_size),
    ("pinned host", "pinned_host_peak_bytes", format_size),
]
_NAME_WIDTH = 30
_WIDTH = 100


def oom_text(report: dict[str, Any], trace: Any | None) -> str:
    """Where an out-of-memory run stopped: 'out of memory at op N (layer L)'."""
    o = report["oom"] or {}
    if o.get("op") is None:
        return "out of memory before the first op"
    layer = None
    if trace is not None:
        layer = next((op.layer for op in trace.ops if op.id == o["op"]), None)
    return f"out of memory at op {o['op']}" + (f" (layer {layer})" if layer else "")


def format_reports(reports: list[dict[str, Any]], meta: dict[str, Any], trace: Any = None,
                   verbose: bool = False) -> str:
    """One row per policy (within 100 columns): iteration time, slowdown against no policy at
    ample capacity, peaks and offloaded bytes; an out-of-memory row says where it stopped
    instead of a time. `verbose`: a second block with the other figures."""
    first = reports[0]
    head = (f"{meta.get('model', '?')} batch {meta.get('batch_size', '?')} "
            f"({meta.get('source', '?')} on {meta.get('device', '?')}) on {first['hardware']}, "
            f"capacity {format_size(first['capacity_bytes'])}, allocator {first['allocator']}")
    lines = [_wrap(head), "", f"{'policy':{_NAME_WIDTH}} {'iteration':>11} {'slowdown':>9} "
             f"{'peak alloc':>11} {'peak resv':>11} {'offloaded':>11}"]
    for r in reports:
        name = r["policy"]
        if len(name) > _NAME_WIDTH:  # a long spec on its own line, the figures below it
            lines.append(name)
            name = ""
        if r["fits"]:
            slow = "-" if r.get("slowdown") is None else f"{r['slowdown']:.2f}x"
            figures = (f"{format_time(r['iteration_time_us']):>11} {slow:>9} "
                       f"{format_size(r['peak_allocated_bytes']):>11} "
                       f"{format_size(r['peak_reserved_bytes']):>11} "
                       f"{format_size(r['d2h_bytes']):>11}")
        else:
            o = r["oom"] or {}
            figures = oom_text(r, trace)
            need_bytes, free_bytes = o.get("need_bytes", 0), o.get("free_bytes", 0)
            need = (f"needed {format_size(need_bytes)}, {format_size(free_bytes)} free"
                    + (" in pieces" if need_bytes <= free_bytes else ""))
            if _NAME_WIDTH + len(figures) + len(need) + 3 <= _WIDTH:
                figures = f"{figures}: {need}"
            else:  # a long layer name: the request on the next line
                lines.append(f"{name:{_NAME_WIDTH}} {figures}")
                name, figures = "", f"  {need}"
        lines.append(f"{name:{_NAME_WIDTH}} {figures}")
    base = first.get("baseline_iteration_time_us")
    lines.append("slowdown: iteration time over no policy's with ample memory ("
                 + (format_time(base) if base else "it does not run even then") + ")")
    if verbose:
        lines += ["", f"{'policy':{_NAME_WIDTH}} " + " ".join(
            f"{label:>10}" for label, _, _ in _DETAILS)]
        for r in reports:
            name = r["policy"]
            if len(name) > _NAME_WIDTH:
                lines.append(name)
                name = ""
            lines.append(f"{name:{_NAME_WIDTH}} " + " ".join(
                f"{fmt(r[key]):>10}" for _, key, fmt in _DETAILS))
        lines.append(_wrap("(times: compute, stall, recompute; bytes: average allocated, "
                           "prefetched (H2D), pinned host peak; an out-of-memory run's up to where "
                           "it stopped)"))
    shared = set(reports[0]["notes"]).intersection(*(r["notes"] for r in reports))
    texts = [f"{r['policy']}: {note}" for r in reports for note in r["notes"]
             if note not in shared]
    texts += [f"note: {note}" for note in reports[0]["notes"] if note in shared]
    if first.get("retargeted_from"):
        texts.append(f"op times retargeted from {first['retargeted_from']} to "
                     f"{first['hardware']} through the compute model")
    measured = first.get("measured")
    if measured:
        texts.append(f"measured (no policy, on {meta.get('device', '?')}): iteration "
                     f"{format_time(measured['iteration_time_us'])}, peak allocated "
                     f"{format_size(measured['peak_allocated_bytes'])}")
    lines += [_wrap(t) for t in texts]
    return "\n".join(lines)


def _wrap(text: str) -> str:
    return textwrap.fill(text, _WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..inspect import summarize
    from ..trace import load_trace

    trace = load_trace(args.trace)
    summary = summarize(trace)
    if args.replay_allocator:
        summary["allocator_replay"] = _allocator_replay(trace, args.replay_allocator)
    if args.json:
        emit_json(summary)
        return 0
    m = summary["meta"]
    print(f"{args.trace}: valid vsim-trace v{summary['version']} ({m.get('source')})")
    for key in ("model", "batch_size", "device", "torch", "cuda", "recorder", "date"):
        if m.get(key) is not None:
            print(f"  {key:12} {m[key]}")
    phases = ", ".join(f"{k} {v}" for k, v in summary["ops_by_phase"].items())
    print(f"  ops          {summary['ops']} ({phases})")
    print(f"  layers       {summary['layers']}; kernels {summary['kernels']}")
    print(f"  tensors      {summary['tensors']}")
    for kind, b in summary["bytes_by_kind"].items():
        print(f"    {kind:16} {format_size(b)}")
    print(f"  span         {format_time(summary['span_us'])} "
          f"(ops {format_time(summary['op_time_us'])})")
    print(f"  peak (replay) {format_size(summary['replay_peak_bytes'])}")
    replay = summary.get("allocator_replay")
    if replay:
        print(f"  allocator replay ({replay['allocator']}): peak allocated "
              f"{format_size(replay['peak_allocated_bytes'])}, peak reserved "
              f"{format_size(replay['peak_reserved_bytes'])}"
              + (f" ({replay['reserved_error'] * 100:+.1f}% against measured)"
                 if replay["reserved_error"] is not None else ""))
    if summary["measured"]:
        ms = summary["measured"]
        print(f"  measured     iteration {format_time(ms['iteration_time_us'])}, peak allocated "
              f"{format_size(ms['peak_allocated_bytes'])}, peak reserved "
              f"{format_size(ms['peak_reserved_bytes'])}")
    return 0


def _allocator_replay(trace: Any, spec_text: str) -> dict[str, Any]:
    from ..allocator import make_allocator
    from ..allocator.replay import replay_allocator
    from ..engine import allocator_spec_string

    spec = make_allocator(spec_text)
    capacity = 2**50  # no cap: what the model reserves for this sequence
    r = replay_allocator(trace, spec, capacity)
    m = trace.measured
    return {"allocator": allocator_spec_string(spec),
            "peak_allocated_bytes": r.peak_allocated_bytes,
            "peak_reserved_bytes": r.peak_reserved_bytes, "events": r.events,
            "reserved_error": None if m is None or not m.peak_reserved_bytes else
            r.peak_reserved_bytes / m.peak_reserved_bytes - 1}


def cmd_list(args: argparse.Namespace) -> int:
    from ..allocator.base import allocator_registry, describe_allocator
    from ..hardware import list_hardware, load_hardware
    from ..policies import registry
    from ..spec import describe

    hardware = []
    for name, path in list_hardware().items():
        hw = load_hardware(str(path))
        hardware.append({"name": name, "description": hw.description,
                         "memory_bytes": hw.memory_bytes, "capacity_bytes": hw.capacity_bytes,
                         "path": str(path)})
    allocators: list[dict[str, Any]] = [
        describe_allocator(cls) for _, cls in sorted(allocator_registry().items())]
    for entry in allocators:  # what each is to a PyTorch user
        if entry["name"] in ALLOCATOR_NOTES:
            entry["note"] = ALLOCATOR_NOTES[entry["name"]]
    listing: dict[str, list[dict[str, Any]]] = {
        "policies": [describe(cls) for _, cls in sorted(registry().items())],
        "allocators": allocators,
        "hardware": hardware,
        "models": _models(),
    }
    if args.json:
        emit_json(listing)
        return 0
    for section in ("policies", "allocators"):
        print(f"{section}:")
        for entry in listing[section]:
            fields = ", ".join(f"{f['name']}={f.get('default')}" +
                               (f" ({'|'.join(f['choices'])})" if "choices" in f else "")
                               for f in entry["fields"])
            print(f"  {entry['name']:14} {entry['description']}" + (f"\n  {'':14} {fields}"
                                                                    if fields else ""))
            if entry.get("note"):
                print(f"  {'':14} note: {entry['note']}")
    print("hardware:")
    for h in hardware:
        print(f"  {h['name']:16} {format_size(cast(float, h['memory_bytes'])):>12}  "
              f"{h['description']}")
    print("models:" + ("" if listing["models"] else " (the model zoo needs the record module)"))
    for m in listing["models"]:
        print(f"  {m['name']:16} {m['description']}")
    return 0


def _models() -> list[dict[str, str]]:
    try:
        from ..record.zoo import list_models
    except ImportError:
        return []
    return [{"name": k, "description": v} for k, v in list_models().items()]


def cmd_compare(args: argparse.Namespace) -> int:
    from ..compare import compare, save_merged
    from ..trace import load_trace

    check_outputs([("--merge", args.merge)], [args.a, args.b])
    a, b = load_trace(args.a), load_trace(args.b)
    result = compare(a, b, args.a, args.b)
    if args.merge:
        save_merged(a, b, args.merge, args.a, args.b)
    if args.json:
        emit_json({**result, "merged": args.merge})
        return 0
    print(format_comparison(result))
    if args.merge:
        print(f"merged: {args.merge} (open it in ui.perfetto.dev)")
    return 0


def format_comparison(result: dict[str, Any]) -> str:
    """A table: metric, A, B, B - A, (B - A) / A."""
    a, b = result["a"], result["b"]
    lines = [f"A: {a['path']} ({a['label']})", f"B: {b['path']} ({b['label']})", "",
             f"{'metric':22} {'A':>12} {'B':>12} {'B - A':>12} {'B / A - 1':>10}"]
    for key, d in result["delta"].items():
        unit: Callable[[Any], str] = format_size if key.endswith("_bytes") else format_time

        def fmt(v: Any, signed: bool = False, unit: Callable[[Any], str] = unit) -> str:
            if v is None:
                return "-"
            return ("-" if v < 0 else "+") + unit(abs(v)) if signed else unit(v)
        mark = "*" if any(key in s["from_measured_block"] for s in (a, b)) else ""
        lines.append(f"{key + mark:22} {fmt(d['a']):>12} {fmt(d['b']):>12} "
                     f"{fmt(d['diff'], True):>12} {pct(d['rel']):>10}")
    if a["from_measured_block"] or b["from_measured_block"]:
        lines.append("* from the trace's measured block (timed without the profiler)")
    return "\n".join(lines)

