"""The verbs that make traces and profiles, most with torch: `vsim record`, `measure`, `import`,
`calibrate`, `synth`, `synth-check`, `fit-compute`."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError
from ..fileio import write_atomic
from ..units import format_size, format_time
from .common import check_outputs, emit_json, parse_capacity, pct, progress, spec_files


def add_record_verbs(verbs: Any) -> None:
    """The verbs record, measure, import and calibrate."""
    p = verbs.add_parser("record", help="record a training iteration into a trace (needs torch)")
    p.add_argument("model", help="zoo model name, torchvision name or module:callable")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="timed iterations for `measured`")
    add_step_flags(p)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--verbose", action="store_true", help="also print the recorder's "
                   "checks (timing fit, structure check, the passes' join)")
    p.set_defaults(handler=cmd_record)

    p = verbs.add_parser("measure", help="train with a policy's plan carried out for real "
                         "and record time and memory (needs torch; a GPU, or --device cpu)")
    p.add_argument("model", nargs="?", help="zoo model name, torchvision name or "
                   "module:callable (default: the trace's)")
    p.add_argument("--batch", type=int, help="batch size (default: the trace's)")
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
    p.add_argument("--seq", type=int, default=None, help="sequence length of a Hugging Face "
                   "model (default: the trace's)")
    p.add_argument("--precision", default=None, choices=("fp32", "tf32", "bf16", "fp16"),
                   help="the step's precision (default: the trace's; another is an error)")
    p.add_argument("--optimizer", default=None, choices=("sgd", "adam", "adamw"),
                   help="the step's optimizer (default: the trace's; another is an error)")
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


def add_compute_verbs(verbs: Any) -> None:
    """The verbs fit-compute, synth and synth-check."""
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
    add_step_flags(p)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(handler=cmd_synth)

    p = verbs.add_parser("synth-check", help="synthesize each recorded trace's model and "
                         "compare the memory side (needs torch)")
    p.add_argument("traces", nargs="+", help="recorded traces (meta.model, meta.batch_size)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_synth_check)


def add_step_flags(p: argparse.ArgumentParser) -> None:
    """--seq, --precision, --optimizer: the training step of vsim.record.step."""
    p.add_argument("--seq", type=int, default=None, help="sequence length of a Hugging Face "
                   "model (default: 1024 for GPT-2 and Llama, 512 for BERT)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"),
                   help="fp32 (PyTorch's TF32 defaults), tf32, or bf16/fp16 autocast (fp16 "
                   "with a grad scaler); default fp32")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                   help="sgd (momentum 0.9), adam or adamw; default sgd")


def model_source(model: str) -> str | None:
    """The file a `module:callable` model is read from (an input no output may replace);
    None for a zoo or torchvision name, or a module that cannot be found (recording says so)."""
    module = model.partition(":")[0] if ":" in model else ""
    if not module:
        return None
    import importlib.util
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) \
        else None


def cmd_record(args: argparse.Namespace) -> int:
    check_outputs([("-o", args.output)], [model_source(args.model)])
    if args.batch <= 0:
        raise ConfigError(f"--batch must be above zero, got {args.batch}")
    from ..record.recorder import record_model
    from ..trace import save_trace

    with _quiet_profiler() as err:
        def phase(message: str) -> None:
            line = _phase_line(message, args.verbose)
            if line:
                print(line, file=err, flush=True)
        trace = record_model(args.model, args.batch, device=args.device, warmup=args.warmup,
                             iters=args.iters, progress=phase,
                             precision=args.precision, optimizer=args.optimizer,
                             seq=args.seq)
    save_trace(trace, args.output)
    progress(f"wrote {args.output}")
    return 0


# the recorder's lines that are checks rather than phases: shown with --verbose only
_DETAIL_PREFIXES = ("timing: ", "structure check: ")
# what Kineto prints on stderr at every profiler start and stop (no setting turns it off)
_KINETO_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\]")


def _phase_line(message: str, verbose: bool) -> str | None:
    """One line per phase of the recording: the checks only with --verbose, the trace line
    without its join counts."""
    if verbose:
        return message
    if message.startswith(_DETAIL_PREFIXES):
        return None
    if message.startswith("trace: "):
        return message.split("; join ")[0]
    return message


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[TextIO]:
    """Yield a stream on the real stderr for progress while file descriptor 2 goes to a
    temporary file; afterwards pass on what was written there (warnings, errors) less
    Kineto's lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    spool = tempfile.TemporaryFile()
    os.dup2(spool.fileno(), 2)
    real = os.fdopen(os.dup(saved), "w", encoding="utf-8", errors="replace")
    try:
        yield real
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        spool.seek(0)
        kept = b"".join(line for line in spool if not _KINETO_LINE.match(line))
        spool.close()
        real.close()
        if kept:
            sys.stderr.write(kept.decode("utf-8", "replace"))
            sys.stderr.flush()


def cmd_measure(args: argparse.Namespace) -> int:
    check_outputs([("-o", args.output)],
                  [args.trace, model_source(args.model) if args.model else None,
                   *spec_files([args.policy, args.hw])])
    if args.batch is not None and args.batch <= 0:
        raise ConfigError(f"--batch must be above zero, got {args.batch}")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("--iters must be at least 1 and --warmup at least 0")
    memory = parse_capacity(args.memory)
    from ..hardware import load_hardware
    from ..policies import make_policy

    make_policy(args.policy)  # bad specs and profiles end here, before any GPU work
    load_hardware(args.hw)
    model, batch, flags = args.model, args.batch, ""
    if args.trace:
        from ..record.step import step_config
        from ..trace import load_trace
        cfg = step_config(load_trace(args.trace).meta, args.model, args.batch, args.precision,
                          args.optimizer, args.seq, what=f"the trace {args.trace}")
        model, batch = cfg.model, cfg.batch
    elif args.model is None or args.batch is None:
        raise ConfigError("give MODEL and --batch, or --trace (whose meta names them)")
    else:
        from ..record.step import StepConfig
        flags = StepConfig(args.model, args.batch, args.precision or "fp32",
                           args.optimizer or "sgd", args.seq).flags()
    from ..runtime.measure import measure, measure_command, summary_line, write_json

    command = measure_command(model, batch, args.policy, memory, args.hw, args.trace,
                              args.output, flags)
    result = measure(model, batch, args.policy, memory_bytes=memory,
                     hardware=args.hw, trace_path=args.trace, device=args.device,
                     warmup=args.warmup, iters=args.iters, check=not args.no_check,
                     strict=not args.no_strict, progress=progress, command=command,
                     precision=args.precision, optimizer=args.optimizer, seq=args.seq)
    write_json(result, args.output)
    progress(f"{summary_line(result)}; wrote {args.output}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    check_outputs([("-o", args.output)], [args.input])
    from ..trace import importers, save_trace

    convert = (importers.import_torch_snapshot if args.kind == "torch-snapshot"
               else importers.import_kineto)
    trace = convert(args.input)
    save_trace(trace, args.output)
    progress(f"wrote {args.output}: {len(trace.ops)} ops, {len(trace.tensors)} tensors")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_outputs([("-o", args.output)], [])
    import yaml

    from ..hardware import parse_hardware
    from ..record.calibrate import calibrate

    doc = calibrate(progress=progress)
    parse_hardware(doc, "<calibrated profile>")  # what we write must load
    text = yaml.safe_dump(doc, sort_keys=False)
    write_atomic(args.output, text)
    progress(f"wrote {args.output}")
    return 0


def cmd_fit_compute(args: argparse.Namespace) -> int:
    import datetime

    from ..compute import efficiencies_to_yaml, read_efficiencies
    from ..compute_fit import fit
    from ..hardware import load_hardware
    from ..trace import load_trace

    check_outputs([("-o", args.output)], [*args.traces, args.benchmarks, *spec_files([args.hw])])
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
    # what we write must load
    write_atomic(args.output, efficiencies_to_yaml(eff, report), check=read_efficiencies)
    if args.json:
        emit_json(report)
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


def _fit_to_benchmarks(args: argparse.Namespace, hw: Any) -> int:
    import datetime

    import yaml

    from ..compute import DEFAULT_EFFICIENCY, efficiencies_to_yaml, read_efficiencies
    from ..compute_fit import fit_to_timings
    from ..hardware import load_hardware
    from ..trace import load_trace
    from ..units import parse_time

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
    from ..compute import load_efficiencies
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
    write_atomic(args.output, efficiencies_to_yaml(eff, report), check=read_efficiencies)
    if args.json:
        emit_json(report)
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


def cmd_synth(args: argparse.Namespace) -> int:
    check_outputs([("-o", args.output)], spec_files([args.hw]))
    if args.batch <= 0:
        raise ConfigError(f"--batch must be above zero, got {args.batch}")
    from ..hardware import load_hardware
    from ..retarget import hardware_with_overrides
    hw = hardware_with_overrides(args.hw, args.set) if args.set else load_hardware(args.hw)
    try:
        from ..record.synth import synthesize
    except ImportError as exc:
        raise ConfigError(f"vsim synth needs torch ({exc})") from None
    from ..synthcheck import memory_profile
    from ..trace import save_trace

    trace = synthesize(args.model, args.batch, hw, workspace=args.workspace,
                       tf32=(not args.no_tf32, False),
                       library_residents=not args.no_library_blocks, progress=progress,
                       precision=args.precision, optimizer=args.optimizer, seq=args.seq)
    save_trace(trace, args.output)
    prof = memory_profile(trace)
    progress(f"wrote {args.output}: {prof['ops']} ops, {len(trace.tensors)} tensors, peak "
              f"(no policy) {format_size(prof['peak_bytes'])}, op time "
              f"{format_time(sum(o.dur_us for o in trace.ops))} on {hw.name}")
    return 0


def cmd_synth_check(args: argparse.Namespace) -> int:
    from ..hardware import load_hardware
    from ..synthcheck import compare
    from ..trace import load_trace
    try:
        from ..record.synth import synthesize
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
            progress(f"synthesizing {model} batch {batch}")
        syn = synthesize(str(model), int(batch), hw)
        rows.append({"trace": path, "model": model, "batch_size": batch,
                     **compare(rec, syn)})
    if args.json:
        emit_json(rows)
        return 0
    kinds = ("weight", "optimizer_state", "input", "activation", "gradient", "workspace",
             "temporary")
    print(f"{'trace':34} {'figure':22} {'recorded':>11} {'synth':>11} {'error':>8}")
    for r in rows:
        a, b, e = r["recorded"], r["synthesized"], r["error"]
        name = Path(r["trace"]).name[:34]
        for k in kinds:
            print(f"{name:34} {k + ' bytes':22} {format_size(a['bytes_by_kind'][k]):>11} "
                  f"{format_size(b['bytes_by_kind'][k]):>11} {pct(e['bytes.' + k]):>8}")
            name = ""
        for k, key in (("peak", "peak_bytes"), ("peak_without_workspace",
                                                "peak_without_workspace_bytes")):
            print(f"{'':34} {k:22} {format_size(a[key]):>11} {format_size(b[key]):>11} "
                  f"{pct(e[k]):>8}")
        print(f"{'':34} {'ops':22} {a['ops']:>11} {b['ops']:>11}   same names: "
              f"{'yes' if r['same_op_sequence'] else 'no'}")
    return 0

