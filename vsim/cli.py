"""The `vsim` command line: the only module that prints.

Bad input (files, names, options) ends with one line `vsim: error: FILE: PLACE: what` on stderr
and exit code 2; nothing is written half-way because every output is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from . import __version__
from .errors import ConfigError, VsimError
from .units import format_size, format_time, parse_size

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """Usage errors end like every other bad input: one line, exit code 2."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_BAD_INPUT, f"vsim: error: {message} (see `{self.prog} --help`)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage error (printed by _Parser.error), --help or --version
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        result: int = args.handler(args)
        return result
    except VsimError as exc:
        print(f"vsim: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `vsim ... | head`: the reader left; not an error of ours
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # an output that cannot be written (permissions, disk full, ...)
        name = f"{exc.filename}: " if exc.filename else ""
        print(f"vsim: error: {name}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("vsim: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vsim", description="Trace-driven simulator of GPU memory virtualization for DNN "
        "training (vDNN, vDNN++, SuperNeurons, recomputation, ...).")
    parser.add_argument("--version", action="version", version=f"vsim {__version__}")
    verbs = parser.add_subparsers(title="verbs", metavar="VERB")

    p = verbs.add_parser("run", help="simulate a trace under a policy")
    p.add_argument("trace", help="trace file (.vsim.json.gz)")
    p.add_argument("--hw", required=True, help="hardware profile name (see `vsim list`) or path")
    p.add_argument("--memory", help="device capacity to simulate, e.g. 12GiB (default: the "
                   "profile's memory less the CUDA context)")
    p.add_argument("--policy", action="append", help="policy spec NAME[:key=value,...]; give "
                   "several to compare them side by side (default: none)")
    p.add_argument("--allocator", default="exact", help="allocator spec (default: exact)")
    p.add_argument("--first-iteration", action=argparse.BooleanOptionalAction, help="run a "
                   "training process's first iteration before the reported one, on the same "
                   "allocator (its segments and fragmentation carry over; default: with the "
                   "caching allocator)")
    p.add_argument("--workspace-fallback", action=argparse.BooleanOptionalAction, help="a "
                   "convolution whose workspace cannot be allocated runs without one, at its "
                   "workspace-free algorithm's time, as PyTorch falls back to another cuDNN "
                   "engine (default: with the caching allocator)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (an array "
                   "when several policies are given)")
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

    p = verbs.add_parser("validate", help="predicted vs measured; exit 1 outside tolerance")
    p.add_argument("cases", nargs="*", default=["validation/cases"],
                   help="case files or folders (default: validation/cases)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default="validation/predicted-vs-measured.png",
                   help="scatter plot of predicted against measured (default: %(default)s; "
                   "'none' for no plot)")
    p.add_argument("--first-iteration", action=argparse.BooleanOptionalAction,
                   help="simulate each case's first iteration first (see vsim run)")
    p.add_argument("--workspace-fallback", action=argparse.BooleanOptionalAction,
                   help="fall back to workspace-free convolutions (see vsim run)")
    p.set_defaults(handler=cmd_validate)

    p = verbs.add_parser("bench", help="how fast the simulator is on this machine")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="one repetition each (noisier)")
    p.set_defaults(handler=cmd_bench)

    p = verbs.add_parser("record", help="record a training iteration into a trace (needs torch)")
    p.add_argument("model", help="zoo model name, torchvision name or module:callable")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed iterations for `measured`")
    _add_step_flags(p)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(handler=cmd_record)

    p = verbs.add_parser("measure", help="train with a policy's plan carried out for real "
                         "and record time and memory (needs torch; a GPU, or --device cpu)")
    p.add_argument("model", help="zoo model name, torchvision name or module:callable")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--policy", required=True, help="policy spec NAME[:key=value,...]")
    p.add_argument("--memory", help="cap the process at this much device memory, e.g. 12GiB "
                   "(set_per_process_memory_fraction; also the capacity the plan is made for)")
    p.add_argument("--hw", default="h100-sxm", help="hardware profile the plan is made with "
                   "(default: %(default)s)")
    p.add_argument("--trace", help="the trace to plan (default: record one first)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the gradient check against the run without a policy")
    p.add_argument("--no-strict", action="store_true",
                   help="run a recomputation that cannot rebuild a tensor's final value as "
                   "planned instead of stopping (the check then shows the damage)")
    p.add_argument("-o", "--output", required=True, help="result JSON")
    p.set_defaults(handler=cmd_measure)

    p = verbs.add_parser("import", help="convert a PyTorch capture into a trace")
    p.add_argument("kind", choices=("torch-snapshot", "kineto"))
    p.add_argument("input")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(handler=cmd_import)

    p = verbs.add_parser("calibrate", help="measure this GPU into a hardware profile (needs torch)")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(handler=cmd_calibrate)
    _add_sweep_and_compare(verbs)
    _add_search_verb(verbs)
    _add_compute_verbs(verbs)
    return parser


# ------------------------------------------------------------------ helpers

def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _capacity(text: str | None) -> int | None:
    if text is None:
        return None
    size = parse_size(text, "--memory")
    if size <= 0:
        raise ConfigError(f"--memory: capacity must be above zero, got {text!r}")
    return size


def _check_output(path: str, flag: str) -> None:
    parent = Path(path).parent
    if str(parent) and not parent.exists():
        raise ConfigError(f"{flag}: folder {str(parent)!r} does not exist")
    if Path(path).is_dir():
        raise ConfigError(f"{flag}: {path!r} is a folder; give a file name")


def _check_capacity(trace_path: str, trace: Any, hw: Any, capacity: int | None) -> None:
    """A capacity below what is resident before the first op (weights, optimizer state,
    inputs) is impossible input, not an out-of-memory result: no policy can even start."""
    from .metrics import resident_bytes

    resident = resident_bytes(trace)
    usable = hw.capacity_bytes if capacity is None else capacity
    if usable >= resident:
        return
    given = (f"--memory {format_size(usable)}" if capacity is not None else
             f"{hw.name}'s capacity {format_size(usable)} (give --memory or another --hw)")
    raise ConfigError(f"{given} is below the {format_size(resident)} ({resident} B) that must "
                      "be on the GPU before the first op (weights, optimizer state, inputs)",
                      trace_path)


# ------------------------------------------------------------------ verbs

def cmd_run(args: argparse.Namespace) -> int:
    from .allocator import make_allocator
    from .engine import simulate
    from .hardware import load_hardware
    from .policies import make_policy
    from .retarget import for_hardware, hardware_with_overrides
    from .trace import load_trace, save_trace

    specs = args.policy or ["none"]
    if (args.timeline or args.plot) and len(specs) > 1:
        raise ConfigError("--timeline and --plot take one --policy at a time")
    for path, flag in ((args.timeline, "--timeline"), (args.plot, "--plot")):
        if path:
            _check_output(path, flag)
    # Parse every input before simulating anything, so bad input fails fast and writes nothing.
    capacity = _capacity(args.memory)
    hw = hardware_with_overrides(args.hw, args.set) if args.set else load_hardware(args.hw)
    policies = [make_policy(s) for s in specs]
    allocator = make_allocator(args.allocator)
    trace = load_trace(args.trace)
    trace, retarget_note = for_hardware(trace, hw, enabled=not args.no_retarget)
    if retarget_note and not args.json:
        _progress(f"note: {retarget_note}")
    _check_capacity(args.trace, trace, hw, capacity)
    if capacity is not None and capacity > hw.capacity_bytes and not args.json:
        _progress(f"note: --memory {format_size(capacity)} is more than {hw.name} has "
                  f"({format_size(hw.capacity_bytes)}): simulating a larger card")
    results = [simulate(trace, hw, p, allocator, capacity, args.first_iteration,
                        args.workspace_fallback) for p in policies]
    if args.timeline:
        save_trace(results[0].predicted, args.timeline)
    if args.plot:
        from .plots import plot_run
        plot_run(results[0].predicted, results[0].report, args.plot)
    if args.json:
        _emit_json(results[0].report if len(results) == 1 else [r.report for r in results])
    else:
        print(format_reports([r.report for r in results], trace.meta))
    return 0


_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("fits", "fits", lambda v: "yes" if v else "NO (out of memory)"),
    ("iteration time", "iteration_time_us", format_time),
    ("compute time", "compute_time_us", format_time),
    ("stall time", "stall_time_us", format_time),
    ("recompute time", "recompute_time_us", format_time),
    ("peak allocated", "peak_allocated_bytes", format_size),
    ("peak reserved", "peak_reserved_bytes", format_size),
    ("average allocated", "avg_allocated_bytes", format_size),
    ("offloaded (D2H)", "d2h_bytes", format_size),
    ("prefetched (H2D)", "h2d_bytes", format_size),
    ("pinned host peak", "pinned_host_peak_bytes", format_size),
]


def format_reports(reports: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Reports side by side, one column per policy."""
    first = reports[0]
    head = (f"{meta.get('model', '?')} batch {meta.get('batch_size', '?')} "
            f"({meta.get('source', '?')} on {meta.get('device', '?')}) on {first['hardware']}, "
            f"capacity {format_size(first['capacity_bytes'])}, allocator {first['allocator']}")
    names = [r["policy"] for r in reports]
    width = max(22, *(len(n) + 2 for n in names))
    lines = [head, "", f"{'':20}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, fmt in _ROWS:
        cells = []
        for r in reports:
            cell = fmt(r[key])
            if key == "iteration_time_us" and not r["fits"]:
                cell = f"(stopped at {cell})"  # an out-of-memory run has no iteration time
            cells.append(f"{cell:>{width}}")
        lines.append(f"{label:20}" + "".join(cells))
    for r in reports:
        if r["oom"]:
            o = r["oom"]
            where = "before the first op" if o["op"] is None else f"at op {o['op']}"
            lines.append(f"{r['policy']}: out of memory {where}: needed "
                         f"{format_size(o['need_bytes'])}, {format_size(o['free_bytes'])} free")
        for note in r["notes"]:
            lines.append(f"{r['policy']}: {note}")
    if first.get("retargeted_from"):
        lines.append(f"op times retargeted from {first['retargeted_from']} to "
                     f"{first['hardware']} through the compute model")
    measured = first.get("measured")
    if measured:
        lines.append(f"measured (no policy, on {meta.get('device', '?')}): iteration "
                     f"{format_time(measured['iteration_time_us'])}, peak allocated "
                     f"{format_size(measured['peak_allocated_bytes'])}")
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import summarize
    from .trace import load_trace

    trace = load_trace(args.trace)
    summary = summarize(trace)
    if args.replay_allocator:
        summary["allocator_replay"] = _allocator_replay(trace, args.replay_allocator)
    if args.json:
        _emit_json(summary)
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
    from .allocator import make_allocator
    from .allocator.replay import replay_allocator
    from .engine import allocator_spec_string

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
    from .allocator.base import allocator_registry, describe_allocator
    from .hardware import list_hardware, load_hardware
    from .policies import registry
    from .policies.base import describe

    hardware = []
    for name, path in list_hardware().items():
        hw = load_hardware(str(path))
        hardware.append({"name": name, "description": hw.description,
                         "memory_bytes": hw.memory_bytes, "capacity_bytes": hw.capacity_bytes,
                         "path": str(path)})
    listing = {
        "policies": [describe(cls) for _, cls in sorted(registry().items())],
        "allocators": [describe_allocator(cls) for _, cls in sorted(allocator_registry().items())],
        "hardware": hardware,
        "models": _models(),
    }
    if args.json:
        _emit_json(listing)
        return 0
    for section in ("policies", "allocators"):
        print(f"{section}:")
        for entry in listing[section]:
            fields = ", ".join(f"{f['name']}={f.get('default')}" +
                               (f" ({'|'.join(f['choices'])})" if "choices" in f else "")
                               for f in entry["fields"])
            print(f"  {entry['name']:14} {entry['description']}" + (f"\n  {'':14} {fields}"
                                                                    if fields else ""))
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
        from .record.zoo import list_models
    except ImportError:
        return []
    return [{"name": k, "description": v} for k, v in list_models().items()]


def _add_step_flags(p: argparse.ArgumentParser) -> None:
    """--seq, --precision, --optimizer (issue 17): the training step of vsim.record.step."""
    p.add_argument("--seq", type=int, default=None, help="sequence length of a Hugging Face "
                   "model (default: 1024 for GPT-2 and Llama, 512 for BERT)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"),
                   help="fp32 (PyTorch's TF32 defaults), tf32, or bf16/fp16 autocast (fp16 "
                   "with a grad scaler); default fp32")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                   help="sgd (momentum 0.9), adam or adamw; default sgd")


def cmd_record(args: argparse.Namespace) -> int:
    _check_output(args.output, "-o")
    if args.batch <= 0:
        raise ConfigError(f"--batch must be above zero, got {args.batch}")
    from .record.recorder import record_model
    from .trace import save_trace

    trace = record_model(args.model, args.batch, device=args.device, warmup=args.warmup,
                         iters=args.iters, progress=_progress, precision=args.precision,
                         optimizer=args.optimizer, seq=args.seq)
    save_trace(trace, args.output)
    _progress(f"wrote {args.output}")
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    _check_output(args.output, "-o")
    if args.batch <= 0:
        raise ConfigError(f"--batch must be above zero, got {args.batch}")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("--iters must be at least 1 and --warmup at least 0")
    memory = _capacity(args.memory)
    from .hardware import load_hardware
    from .policies import make_policy

    make_policy(args.policy)  # bad specs and profiles end here, before any GPU work
    load_hardware(args.hw)
    if args.trace:
        from .trace import load_trace
        load_trace(args.trace)
    from .record.measure import measure, measure_command, summary_line, write_json

    command = measure_command(args.model, args.batch, args.policy, memory, args.hw,
                              args.trace, args.output)
    result = measure(args.model, args.batch, args.policy, memory_bytes=memory,
                     hardware=args.hw, trace_path=args.trace, device=args.device,
                     warmup=args.warmup, iters=args.iters, check=not args.no_check,
                     strict=not args.no_strict, progress=_progress, command=command)
    write_json(result, args.output)
    _progress(f"{summary_line(result)}; wrote {args.output}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    _check_output(args.output, "-o")
    from .trace import importers, save_trace

    convert = (importers.import_torch_snapshot if args.kind == "torch-snapshot"
               else importers.import_kineto)
    trace = convert(args.input)
    save_trace(trace, args.output)
    _progress(f"wrote {args.output}: {len(trace.ops)} ops, {len(trace.tensors)} tensors")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    _check_output(args.output, "-o")
    import yaml

    from .hardware import parse_hardware
    from .record.calibrate import calibrate

    doc = calibrate(progress=_progress)
    parse_hardware(doc, "<calibrated profile>")  # what we write must load
    text = yaml.safe_dump(doc, sort_keys=False)
    tmp = Path(args.output).with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(args.output)
    _progress(f"wrote {args.output}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .allocator.history import HISTORY_SUFFIX, history_files
    from .validate import load_cases, paper_files

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
    from .allocator.history import TOLERANCE, load_history, replay_history

    histories = [load_history(f) for f in files]  # all read before any output
    rows: list[dict[str, Any]] = []
    for h in histories:
        if not as_json:
            _progress(f"replaying {h.name} ({len(h.entries)} allocator events)")
        exact, virtual = replay_history(h), replay_history(h, recorded_addresses=False)
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
            "ok": abs(exact.reserved_error) <= TOLERANCE})
    if as_json:
        _emit_json({"tolerance": TOLERANCE, "histories": rows})
    else:
        print(f"Caching allocator model against PyTorch's allocator histories (whole runs, "
              f"reserved after the last iteration; tolerance {TOLERANCE:.0%})")
        print(f"{'run':18} {'events':>7} {'recorded':>10} {'model':>10} {'err':>7} {'segments':>9}"
              f"  {'virtual addr':>12} {'err':>7}  ok")
        for r in rows:
            print(f"{r['run']:18} {r['events']:7d} {_gib(r['reserved_recorded_bytes']):>10} "
                  f"{_gib(r['reserved_model_bytes']):>10} {_pct(r['reserved_error']):>7} "
                  f"{r['segments_model']:>4}/{r['segments_recorded']:<4}"
                  f"  {_gib(r['reserved_model_virtual_addresses_bytes']):>12} "
                  f"{_pct(r['reserved_error_virtual_addresses']):>7}  "
                  f"{'ok' if r['ok'] else 'MISS'}")
        print("model: segments at the recorded cudaMalloc addresses; virtual addr: at the "
              "increasing addresses the simulator uses (best fit breaks ties by address)")
    return 0 if all(r["ok"] for r in rows) else 1


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"


def _validate_cases(cases: Any, args: argparse.Namespace) -> int:
    from .validate import validate

    if args.plot != "none":
        _check_output(args.plot, "--plot")
    result = validate(cases, progress=None if args.json else _progress,
                      first_iteration=args.first_iteration,
                      workspace_fallback=args.workspace_fallback)
    if args.plot != "none":
        from .plots import plot_validation
        plot_validation(result["cases"], args.plot)
    if args.json:
        _emit_json(result)
    else:
        print(format_validation(result))
        if args.plot != "none":
            print(f"plot: {args.plot}")
    return 0 if all(r["ok"] for r in result["cases"]) else 1


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _or_dash(fmt: Callable[[Any], str], value: Any) -> str:
    """A measured run that ran out of memory has no time or peak: shown '-'."""
    return "-" if value is None else fmt(value)


def format_validation(result: dict[str, Any]) -> str:
    lines = [f"{'case':38} {'time pred':>10} {'meas':>10} {'err':>7}  {'peak pred':>10} "
             f"{'meas':>10} {'err':>7}  {'resv err':>8}  fits  ok"]
    for r in result["cases"]:
        p, m, e = r["predicted"], r["measured"], r["error"]
        fits = ("yes" if p["fits"] else "no") + ("" if p["fits"] == bool(m["fits"]) else "!")
        lines.append(
            f"{r['id'][:38]:38} {_or_dash(format_time, p['iteration_time_us']):>10} "
            f"{_or_dash(format_time, m['iteration_time_us']):>10} "
            f"{_pct(e['iteration_time']):>7}  "
            f"{_or_dash(format_size, p['peak_allocated_bytes']):>10} "
            f"{_or_dash(format_size, m['peak_allocated_bytes']):>10} "
            f"{_pct(e['peak_allocated']):>7}  "
            f"{_pct(e['peak_reserved']):>8}  {fits:4}  {'ok' if r['ok'] else 'MISS'}")
    s = result["summary"]
    lines.append(f"{s['n']} cases, {s['ok']} within tolerance; iteration-time MAPE "
                 f"{_pct(s['time_mape']).lstrip('+')}, peak-allocated MAPE "
                 f"{_pct(s['peak_mape']).lstrip('+')}, fits right in {s['fits_correct']}/{s['n']}")
    return "\n".join(lines)



# ------------------------------------------------------------------ sweep and compare

def _add_sweep_and_compare(verbs: Any) -> None:
    p = verbs.add_parser("sweep", help="simulate a grid of configurations (local processes or "
                         "a Dask cluster)")
    p.add_argument("file", nargs="?", help="YAML sweep file with the axes trace, hw, memory, "
                   "policy, allocator (and output); flags given here replace its axes")
    p.add_argument("--trace", nargs="+", action="extend", help="trace files")
    p.add_argument("--hw", nargs="+", action="extend", help="hardware profiles, optionally with "
                   "hypothetical links: h100-sxm:link=16GB/s (keys h2d, d2h, link, duplex)")
    p.add_argument("--memory", nargs="+", action="extend", help="capacities: sizes, ranges "
                   "LOW..HIGH/STEP (4GiB..24GiB/0.5GiB), or default (the profile's)")
    p.add_argument("--policy", nargs="+", action="extend", help="policy specs (default: none)")
    p.add_argument("--allocator", nargs="+", action="extend",
                   help="allocator specs (default: exact)")
    p.add_argument("-o", "--output", action="append", help="results file, .csv or .jsonl "
                   "(repeat for both); configurations already in it are skipped")
    p.add_argument("--workers", type=int,
                   help="local processes (default: the CPUs this process may use)")
    p.add_argument("--scheduler", help="Dask scheduler address tcp://HOST:PORT (needs "
                   "vsim[sweep]); workers must see the trace files at the same paths")
    p.add_argument("--plot", metavar="DIR", help="write the sweep's plots (PNG) into DIR")
    p.add_argument("--json", action="store_true", help="print a summary object")
    p.set_defaults(handler=cmd_sweep)

    p = verbs.add_parser("compare", help="metric deltas between two traces; --merge writes one "
                         "Perfetto file with both")
    p.add_argument("a", help="first trace (e.g. measured)")
    p.add_argument("b", help="second trace (e.g. predicted)")
    p.add_argument("--merge", help="write both runs into one Chrome-trace JSON (.json or "
                   ".json.gz) for ui.perfetto.dev, one process each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_compare)


class _ProgressBar:
    """A text progress bar on stderr: redrawn in place on a terminal (at most 10 times a
    second), one line every few seconds otherwise."""

    def __init__(self) -> None:
        import time
        self.clock = time.monotonic
        self.start = self.clock()
        self.last = -1e9
        self.tty = sys.stderr.isatty()
        self.shown = 0

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if 0 < done < total and now - self.last < (0.1 if self.tty else 5.0):
            return
        self.last = now
        elapsed = now - self.start
        width = 30
        filled = width if total == 0 else width * done // total
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f", {(total - done) / rate:.0f} s left" if 0 < done < total and rate else ""
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} configurations, "
                f"{elapsed:.1f} s{eta}")
        if self.tty:  # padded: a shorter line must cover the longer one it redraws
            self.shown, line = max(self.shown, len(line)), line.ljust(self.shown)
            print(f"\r{line}", end="\n" if done >= total else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import build_grid, load_sweep_file, run_sweep

    axes = load_sweep_file(args.file) if args.file else {}
    where: dict[str, str] = {}

    def axis(name: str, flag: list[str] | None, default: list[str] | None) -> list[str]:
        if flag:
            return flag
        if name in axes:
            where[name] = f"{args.file}: {name}"
            return axes[name]
        if default is None:
            option = "-o" if name == "output" else f"--{name}"
            if args.file:
                raise ConfigError(f"no {name}: give it here or as {option}", args.file)
            raise ConfigError(f"{option}: required (or give a sweep file)")
        return default

    outputs = axis("output", args.output, None)
    for path in outputs:
        _check_output(path, "-o")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    plot_dir = Path(args.plot) if args.plot else None
    if plot_dir is not None and not plot_dir.is_dir() and not plot_dir.parent.is_dir():
        raise ConfigError(f"--plot: folder {str(plot_dir.parent)!r} does not exist")
    grid = build_grid(axis("trace", args.trace, None), axis("hw", args.hw, None),
                      axis("memory", args.memory, ["default"]),
                      axis("policy", args.policy, ["none"]),
                      axis("allocator", args.allocator, ["exact"]), where=where)
    if plot_dir is not None:
        plot_dir.mkdir(exist_ok=True)  # only once the grid is known to be good
    summary = run_sweep(grid, outputs, workers=args.workers, scheduler=args.scheduler,
                        progress=_ProgressBar())
    plots: list[str] = []
    if args.plot:
        from .plots import plot_sweep
        from .sweep import read_rows
        plots = plot_sweep(read_rows(outputs[0]), args.plot)
    result = {**summary.to_json(), "outputs": outputs, "plots": plots}
    for err in summary.errors[:5]:
        _progress(f"vsim: simulation failed: {' '.join(err['key'])}: {err['error']}")
    if args.json:
        _emit_json(result)
    else:
        rate = f" ({result['configs_per_s']} configurations/s)" if summary.ran else ""
        print(f"{summary.configs} configurations: {summary.ran} simulated in "
              f"{summary.seconds:.1f} s{rate} on {summary.workers} "
              f"{'Dask worker' if args.scheduler else 'process'}"
              f"{'' if summary.workers == 1 else 'es' if not args.scheduler else 's'}, "
              f"{summary.skipped} already "
              f"in {outputs[0]}, {len(summary.errors)} failed")
        for path in plots:
            print(f"plot: {path}")
    return 1 if summary.errors else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare, save_merged
    from .trace import load_trace

    if args.merge:
        _check_output(args.merge, "--merge")
    a, b = load_trace(args.a), load_trace(args.b)
    result = compare(a, b, args.a, args.b)
    if args.merge:
        save_merged(a, b, args.merge, args.a, args.b)
    if args.json:
        _emit_json({**result, "merged": args.merge})
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
                     f"{fmt(d['diff'], True):>12} {_pct(d['rel']):>10}")
    if a["from_measured_block"] or b["from_measured_block"]:
        lines.append("* from the trace's measured block (timed without the profiler)")
    return "\n".join(lines)


# ------------------------------------------------------------------ search (issue 7, part 2)

def _add_search_verb(verbs: Any) -> None:
    p = verbs.add_parser("search", help="find the fastest plan that fits (greedy plus local "
                         "search, the simulator as the cost model); compare it with every "
                         "built-in policy and a lower bound")
    p.add_argument("trace", help="trace file (.vsim.json.gz)")
    p.add_argument("--hw", required=True, help="hardware profile name or path")
    p.add_argument("--memory", help="device capacity, e.g. 12GiB (default: the profile's "
                   "memory less the CUDA context)")
    p.add_argument("--allocator", default="exact", help="allocator spec (default: exact)")
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
    p.add_argument("--verbose", action="store_true", help="log each greedy step and "
                   "improvement on stderr")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_search)


def _budget_s(text: str) -> float:
    from .units import parse_time
    try:
        value = float(text)
    except ValueError:
        value = parse_time(text, "--budget") / 1e6
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"--budget must be a positive number of seconds, got {text!r}")
    return value


def cmd_search(args: argparse.Namespace) -> int:
    from .allocator import make_allocator
    from .hardware import load_hardware
    from .retarget import for_hardware
    from .search.run import run_search
    from .trace import load_trace

    if args.output:
        _check_output(args.output, "-o")
    budget = _budget_s(args.budget)
    if args.kicks < 0:
        raise ConfigError(f"--kicks must be at least 0, got {args.kicks}")
    capacity = _capacity(args.memory)
    hw = load_hardware(args.hw)
    allocator = make_allocator(args.allocator)
    trace = load_trace(args.trace)
    trace, note = for_hardware(trace, hw)
    if note and not args.json:
        _progress(f"note: {note}")
    _check_capacity(args.trace, trace, hw, capacity)
    result = run_search(trace, args.trace, hw, hw.capacity_bytes if capacity is None
                        else capacity, allocator, seed=args.seed, budget_s=budget,
                        kicks=args.kicks, builtins=not args.no_builtins,
                        builtin_starts=not args.no_builtin_starts, output=args.output,
                        log=_progress if args.verbose else None)
    if args.json:
        _emit_json(result)
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
                     f"{s['workspace_free_convolutions']} convolution(s) without workspace")
    g = s["greedy_iteration_time_us"]
    lines.append(f"greedy start   {format_time(g) if g is not None else 'did not fit':>10}")
    if s["origin"] != "greedy":
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


# ------------------------------------------------------------------ compute model (issue 6)

def _add_compute_verbs(verbs: Any) -> None:
    p = verbs.add_parser("fit-compute", help="fit the compute model's per-class efficiencies "
                         "to traces recorded on one GPU")
    p.add_argument("traces", nargs="*", help="recorded traces (with kernels)")
    p.add_argument("--benchmarks", help="instead of traces: a YAML of published forward and "
                   "backward times of whole networks (kind: benchmarks) with their "
                   "synthesized traces; fits the convolution efficiencies only, the rest from "
                   "h100-sxm's fit")
    p.add_argument("--hw", required=True, help="the profile of the GPU they were recorded on")
    p.add_argument("-o", "--output", required=True, help="efficiency file to write, e.g. "
                   "hardware/efficiency/h100-sxm.yaml")
    p.add_argument("--source", help="provenance source text (default: names the traces)")
    p.add_argument("--date", help="provenance date (default: today)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_fit_compute)

    p = verbs.add_parser("synth", help="a trace from shapes (meta device: no GPU, no weights) "
                         "with op times from the compute model (needs torch)")
    p.add_argument("model", help="zoo model name (see `vsim list`), e.g. vgg416, resnet1517")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--hw", required=True, help="profile the op times are modelled for")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="hypothetical GPU values, as for `vsim run`")
    p.add_argument("--workspace", default="cudnn9-layout",
                   help="convolution workspace model: cudnn9-layout (cuDNN 9 on an H100, NCHW "
                   "fp32, as recorded; default) or none")
    p.add_argument("--no-tf32", action="store_true", help="fp32 convolutions without TF32 "
                   "(default: PyTorch's flags, TF32 convolutions, fp32 matmuls)")
    p.add_argument("--no-library-blocks", action="store_true", help="leave out the cuBLAS "
                   "workspaces a PyTorch process keeps resident (65 MiB on the H100)")
    _add_step_flags(p)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(handler=cmd_synth)

    p = verbs.add_parser("synth-check", help="synthesize each recorded trace's model and "
                         "compare the memory side (needs torch)")
    p.add_argument("traces", nargs="+", help="recorded traces (meta.model, meta.batch_size)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_synth_check)


def cmd_fit_compute(args: argparse.Namespace) -> int:
    import datetime

    from .compute import efficiencies_to_yaml, fit, read_efficiencies
    from .hardware import load_hardware
    from .trace import load_trace

    _check_output(args.output, "-o")
    hw = load_hardware(args.hw)
    if args.benchmarks:
        return _fit_to_benchmarks(args, hw)
    if not args.traces:
        raise ConfigError("fit-compute: give recorded traces or --benchmarks FILE")
    traces = [(Path(t).name, load_trace(t)) for t in args.traces]
    for path, (_, t) in zip(args.traces, traces, strict=True):
        if t.meta.get("hardware") not in (None, hw.name):
            raise ConfigError(f"recorded on {t.meta.get('hardware')}, not {hw.name}", path)
    provenance = {
        "source": args.source or f"vsim fit-compute over {', '.join(n for n, _ in traces)}",
        "date": args.date or datetime.date.today().isoformat(),
        "method": "per op class, a grid search of (compute, dram, overhead, output-channel "
                  "ramp) minimising sum(busy x (model/busy - 1)^2) over every op with kernels "
                  "(busy = the sum of its kernel durations), then the rate terms scaled so that "
                  "each class's summed model time equals its summed busy time; implicit_gemm "
                  "(vDNN's memory-optimal convolutions: cuDNN's IMPLICIT_GEMM, FP32 FMA "
                  "kernels) is assumed at 50% of the fp32 peak, not measured"}
    eff, report = fit(traces, hw, provenance=provenance)
    tmp = Path(args.output).with_suffix(".tmp")
    tmp.write_text(efficiencies_to_yaml(eff, report))
    read_efficiencies(tmp)  # what we write must load
    tmp.replace(args.output)
    if args.json:
        _emit_json(report)
        return 0
    print(f"{'class':12} {'compute':>8} {'dram':>8} {'overhead':>9} {'ramp':>10} {'ops':>5} "
          f"{'busy ms':>9}  median op error")
    for cls, e in eff.classes.items():
        r = report["classes"].get(cls, {})
        ramp = f"{e.ramp_channels:.0f}^{e.ramp_power:g}" if e.ramp_channels else "-"
        print(f"{cls:12} {e.compute * 100:7.1f}% {e.dram * 100:7.1f}% {e.overhead_us:7.1f}us "
              f"{ramp:>10} {r.get('ops', 0):5} {r.get('busy_ms', 0):9.2f}  "
              f"{r.get('median_abs_op_error', '-')}")
    print(f"\n{'trace':40} {'busy ms':>9} {'model ms':>9} {'error':>7}")
    for name, r in report["traces"].items():
        print(f"{name[:40]:40} {r['busy_ms']:9.2f} {r['model_ms']:9.2f} {r['error']:>7}")
    print(f"wrote {args.output}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    _check_output(args.output, "-o")
    if args.batch <= 0:
        raise ConfigError(f"--batch must be above zero, got {args.batch}")
    from .hardware import load_hardware
    from .retarget import hardware_with_overrides
    hw = hardware_with_overrides(args.hw, args.set) if args.set else load_hardware(args.hw)
    try:
        from .record.synth import synthesize
    except ImportError as exc:
        raise ConfigError(f"vsim synth needs torch ({exc})") from None
    from .synthcheck import memory_profile
    from .trace import save_trace

    trace = synthesize(args.model, args.batch, hw, workspace=args.workspace,
                       tf32=(not args.no_tf32, False),
                       library_residents=not args.no_library_blocks, progress=_progress,
                       precision=args.precision, optimizer=args.optimizer, seq=args.seq)
    save_trace(trace, args.output)
    prof = memory_profile(trace)
    _progress(f"wrote {args.output}: {prof['ops']} ops, {len(trace.tensors)} tensors, peak "
              f"(no policy) {format_size(prof['peak_bytes'])}, op time "
              f"{format_time(sum(o.dur_us for o in trace.ops))} on {hw.name}")
    return 0


def cmd_synth_check(args: argparse.Namespace) -> int:
    from .hardware import load_hardware
    from .synthcheck import compare
    from .trace import load_trace
    try:
        from .record.synth import synthesize
    except ImportError as exc:
        raise ConfigError(f"vsim synth-check needs torch ({exc})") from None

    rows = []
    for path in args.traces:
        rec = load_trace(path)
        model, batch = rec.meta.get("model"), rec.meta.get("batch_size")
        if not model or not batch:
            raise ConfigError("the trace names no model and batch size (meta.model, "
                              "meta.batch_size)", path)
        hw = load_hardware(str(rec.meta.get("hardware") or "h100-sxm"))
        if not args.json:
            _progress(f"synthesizing {model} batch {batch}")
        syn = synthesize(str(model), int(batch), hw)
        rows.append({"trace": path, "model": model, "batch_size": batch,
                     **compare(rec, syn)})
    if args.json:
        _emit_json(rows)
        return 0
    kinds = ("weight", "optimizer_state", "input", "activation", "gradient", "workspace",
             "temporary")
    print(f"{'trace':34} {'figure':22} {'recorded':>11} {'synth':>11} {'error':>8}")
    for r in rows:
        a, b, e = r["recorded"], r["synthesized"], r["error"]
        name = Path(r["trace"]).name[:34]
        for k in kinds:
            print(f"{name:34} {k + ' bytes':22} {format_size(a['bytes_by_kind'][k]):>11} "
                  f"{format_size(b['bytes_by_kind'][k]):>11} {_pct(e['bytes.' + k]):>8}")
            name = ""
        for k, key in (("peak", "peak_bytes"), ("peak_without_workspace",
                                                "peak_without_workspace_bytes")):
            print(f"{'':34} {k:22} {format_size(a[key]):>11} {format_size(b[key]):>11} "
                  f"{_pct(e[k]):>8}")
        print(f"{'':34} {'ops':22} {a['ops']:>11} {b['ops']:>11}   same names: "
              f"{'yes' if r['same_op_sequence'] else 'no'}")
    return 0


def _fit_to_benchmarks(args: argparse.Namespace, hw: Any) -> int:
    import datetime

    import yaml

    from .compute import (
        DEFAULT_EFFICIENCY,
        efficiencies_to_yaml,
        fit_to_timings,
        read_efficiencies,
    )
    from .hardware import load_hardware
    from .trace import load_trace
    from .units import parse_time

    path = Path(args.benchmarks)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read benchmarks file ({exc})", str(path)) from None
    if not isinstance(doc, dict) or doc.get("kind") != "benchmarks":
        raise ConfigError("expected a mapping with kind: benchmarks", str(path))
    nets = []
    for i, entry in enumerate(doc.get("networks") or []):
        where = f"{path}: networks[{i}]"
        trace = load_trace(path.parent / "traces" / str(entry["trace"]))
        nets.append((str(entry["id"]), trace, parse_time(entry["forward"], where),
                     parse_time(entry["backward"], where)))
    from .compute import load_efficiencies
    base = load_efficiencies(load_hardware(DEFAULT_EFFICIENCY))
    prov = doc.get("provenance") or {}
    provenance = {
        "source": f"{args.benchmarks}: {prov.get('source', '')}",
        "date": args.date or datetime.date.today().isoformat(),
        "method": "vsim fit-compute --benchmarks: the conv_fwd and conv_bwd compute fractions "
                  "(of the direct convolution's flops at the fp32 peak, no channel ramp) "
                  "fitted so that the model's forward and backward times of the listed "
                  "networks (synthesized traces, without loss and optimizer) match the "
                  "published ones in least squares of log errors; every other class, the "
                  "overheads and implicit_gemm are h100-sxm's fit (memory-bound classes as "
                  "fractions of this GPU's DRAM bandwidth)",
        "benchmarks": prov}
    eff, report = fit_to_timings(nets, hw, base, provenance)
    tmp = Path(args.output).with_suffix(".tmp")
    tmp.write_text(efficiencies_to_yaml(eff, report))
    read_efficiencies(tmp)
    tmp.replace(args.output)
    if args.json:
        _emit_json(report)
        return 0
    print(f"conv_fwd {eff.classes['conv_fwd'].compute * 100:.1f}%, conv_bwd "
          f"{eff.classes['conv_bwd'].compute * 100:.1f}% of the direct convolution's flops at "
          f"{hw.name}'s fp32 peak")
    for label, row in report["networks"].items():
        print(f"  {label:24} " + "  ".join(
            f"{ph} {r['model_ms']:8.2f} ms vs {r['published_ms']:8.2f} ({r['error']})"
            for ph, r in row.items()))
    print(f"wrote {args.output}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    from .validate import repo_root

    result = run_bench(repo_root(Path.cwd()), progress=_progress, quick=args.quick)
    if args.json:
        _emit_json(result)
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
    print(f"machine: {result['machine']}")
    return 0


# ------------------------------------------------------------------ the vDNN paper (issue 6)

def _validate_papers(papers: list[Path], as_json: bool) -> int:
    from .paper import check

    results = [check(p, progress=None if as_json else _progress) for p in papers]
    if as_json:
        _emit_json(results[0] if len(results) == 1 else results)
    else:
        print("\n\n".join(format_paper(r) for r in results))
    return 0 if all(r["ok"] for r in results) else 1


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def format_paper(r: dict[str, Any]) -> str:
    """The paper comparison as tables: Fig. 1/4, Fig. 6, the policies, the deep VGGs."""
    lines = [f"{r['paper']} on {r['hardware']}", "",
             "Fig. 1 and 4: baseline memory (MiB), vDNN's semantics, predicted / paper"]
    lines.append(f"{'network':15} {'weights':>12} {'feature maps':>14} {'gradient maps':>14} "
                 f"{'workspace':>12} {'total':>13} {'error':>7} {'(fig4 ws)':>9}  ok")
    for row in r["fig1"]:
        p, f = row["predicted"], row["paper_mib"]
        lines.append(
            f"{row['network']:15} {_mib(p['weights']):>6}/{f['weights']:<5} "
            f"{_mib(p['feature_maps']):>7}/{f['feature_maps']:<6} "
            f"{_mib(p['gradient_maps']):>7}/{f['gradient_maps']:<6} "
            f"{_mib(p['workspace']):>6}/{f['workspace']:<5} "
            f"{_mib(p['total']):>6}/{row['fig1_total_mib']:<6} {_pct(row['error']):>7} "
            f"{_pct(row['error_with_fig4_workspace']):>9}  {'ok' if row['ok'] else 'MISS'}")
    f6 = r["fig6"]
    t = f6["totals"]
    lines += ["", "Fig. 6: VGG-16(64) per-layer time (ms), predicted / paper"]
    for row in f6["rows"]:
        pf = "-" if row["paper_fwd_ms"] is None else row["paper_fwd_ms"]
        pb = "-" if row["paper_bwd_ms"] is None else row["paper_bwd_ms"]
        lines.append(f"  {row['layer']:7} fwd {row['fwd_ms']:7.1f} / {pf:>6}   bwd "
                     f"{row['bwd_ms']:7.1f} / {pb:>6}")
    lines.append(f"  total   fwd {t['fwd_ms']:7.1f} / {t['paper_fwd_ms']:6.1f}   bwd "
                 f"{t['bwd_ms']:7.1f} / {t['paper_bwd_ms']:6.1f}   all {_pct(f6['error'])} "
                 f"{'ok' if f6['ok'] else 'MISS'}")
    if "policies" in r:
        lines += ["", "Predicted outcome of the paper's policies (cnmem at the card's capacity; "
                  "base = network-wide allocation; throughput of the feature-extraction layers "
                  "relative to base(p) on a GPU with room for it; fits* = also without "
                  "fragmentation)"]
        lines.append(f"{'network':15} {'policy':8} {'fits':>5} {'fits*':>5} {'peak GiB':>9} "
                     f"{'avg GiB':>8} {'offload GiB':>11} {'throughput':>10}")
        for net, rows in r["policies"].items():
            for p in rows:
                thr = "-" if p["feature_throughput"] is None else f"{p['feature_throughput']:.2f}"
                lines.append(f"{net:15} {p['policy']:8} {'yes' if p['fits'] else 'no':>5} "
                             f"{'yes' if p['fits_exact'] else 'no':>5} "
                             f"{p['peak_bytes'] / 2**30:9.2f} {p['avg_bytes'] / 2**30:8.2f} "
                             f"{p['offloaded_bytes'] / 2**30:11.2f} {thr:>10}")
                for note in p["notes"]:
                    lines.append(f"{'':25}{note}")
                net = ""
    if "deep" in r:
        lines += ["", "vDNN_dyn on the very deep VGGs, batch 32 (GiB)"]
        lines.append(f"{'network':12} {'baseline':>9} {'fits':>5} {'GPU peak':>9} "
                     f"{'host pinned':>12}  choice")
        for d in r["deep"]:
            lines.append(f"{d['network']:12} {d['baseline_bytes'] / 2**30:9.2f} "
                         f"{'yes' if d['fits'] else 'no':>5} {d['peak_bytes'] / 2**30:9.2f} "
                         f"{d['pinned_host_bytes'] / 2**30:12.2f}  {d['choice']}")
    return "\n".join(lines)
