"""`python -m vsim.record record MODEL ...` and `python -m vsim.record calibrate ...`: the recorder
standalone, for GPU machines without the simulator's dependencies (imports torch, numpy and
vsim.trace, vsim.errors, vsim.units, vsim.hardware only; never simpy)."""

from __future__ import annotations

import argparse
import sys

from ..errors import VsimError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vsim.record",
                                     description="Record training iterations or calibrate a GPU.")
    sub = parser.add_subparsers(dest="verb", required=True)
    rec = sub.add_parser("record", help="record one training iteration of a zoo model")
    rec.add_argument("model")
    rec.add_argument("--batch", type=int, required=True)
    rec.add_argument("--device", default="cuda")
    rec.add_argument("--warmup", type=int, default=3)
    rec.add_argument("--iters", type=int, default=10)
    rec.add_argument("--timing-iters", type=int, default=3)
    rec.add_argument("--no-gap-fit", action="store_true",
                     help="keep the profiled idle gaps instead of fitting them to the "
                     "measured time")
    rec.add_argument("--seq", type=int, default=None,
                     help="sequence length of a Hugging Face model (default: its own)")
    rec.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"))
    rec.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    rec.add_argument("-o", "--output", required=True)
    cal = sub.add_parser("calibrate", help="measure this GPU into a hardware profile")
    cal.add_argument("-o", "--output", required=True)
    cal.add_argument("--name", default=None, help="profile name (default: from the device)")
    cal.add_argument("--base", default=None,
                     help="profile whose datasheet fields (compute peaks) to keep")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    sub.add_parser("models", help="list the zoo")
    idx = sub.add_parser("index", help="markdown table of traces (for traces/README.md)")
    idx.add_argument("traces", nargs="+")
    args = parser.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.verb == "record":
            from ..trace import save_trace
            from .recorder import record_model
            trace = record_model(args.model, args.batch, args.device, warmup=args.warmup,
                                 iters=args.iters, progress=say, timing_iters=args.timing_iters,
                                 fit_gaps=not args.no_gap_fit, precision=args.precision,
                                 optimizer=args.optimizer, seq=args.seq)
            save_trace(trace, args.output)
            say(f"wrote {args.output}")
        elif args.verb == "calibrate":
            from .calibrate import calibrate, write_profile
            doc = calibrate(progress=say, name=args.name, base=args.base, quick=args.quick)
            write_profile(doc, args.output)
            say(f"wrote {args.output}")
        elif args.verb == "index":
            from .selfcheck import index_table
            print(index_table(args.traces), end="")
        else:
            from .zoo import list_models
            for name, text in list_models().items():
                print(f"{name:18s} {text}")
    except VsimError as exc:
        say(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
