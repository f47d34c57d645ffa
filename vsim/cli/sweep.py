"""`vsim sweep`: a grid of configurations on local processes or Dask, with a progress bar."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .common import check_outputs, emit_json, progress, spec_files


def add_sweep(verbs: Any) -> None:
    """The verb sweep."""
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
                   help="allocator specs (default: caching, PyTorch's default "
                   "allocator; expandable models its expandable segments)")
    p.add_argument("-o", "--output", action="append", help="results file, .csv or .jsonl "
                   "(repeat for both); configurations already in it are skipped")
    p.add_argument("--workers", type=int,
                   help="local processes (default: the CPUs this process may use)")
    p.add_argument("--scheduler", help="Dask scheduler address tcp://HOST:PORT (needs "
                   "vsim[sweep]); workers must see the trace files at the same paths")
    p.add_argument("--plot", metavar="DIR", help="write the sweep's plots (PNG) into DIR")
    p.add_argument("--json", action="store_true", help="print a summary object")
    p.set_defaults(handler=cmd_sweep)


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
    from ..sweep import build_grid, load_sweep_file, run_sweep

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
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    plot_dir = Path(args.plot) if args.plot else None
    if plot_dir is not None and not plot_dir.is_dir() and not plot_dir.parent.is_dir():
        raise ConfigError(f"--plot: folder {str(plot_dir.parent)!r} does not exist")
    if plot_dir is not None and plot_dir.exists() and not plot_dir.is_dir():
        raise ConfigError(f"--plot: {args.plot!r} is a file; give a folder for the plots")
    traces, hws = axis("trace", args.trace, None), axis("hw", args.hw, None)
    policies = axis("policy", args.policy, ["none"])
    allocators = axis("allocator", args.allocator, ["caching"])
    # results are appended to an existing output (resume); only the inputs are refused
    check_outputs([("-o", path) for path in outputs],
                  [args.file, *map(str, traces),
                   *spec_files([str(h).partition(":")[0] for h in hws]),
                   *spec_files(map(str, [*policies, *allocators]))])
    grid = build_grid(traces, hws, axis("memory", args.memory, ["default"]), policies,
                      allocators, where=where)
    if plot_dir is not None:
        plot_dir.mkdir(exist_ok=True)  # only once the grid is known to be good
    summary = run_sweep(grid, outputs, workers=args.workers, scheduler=args.scheduler,
                        progress=_ProgressBar())
    plots: list[str] = []
    if args.plot:
        from ..plots import plot_sweep
        from ..sweep import read_rows
        plots = plot_sweep(read_rows(outputs[0]), args.plot)
    result = {**summary.to_json(), "outputs": outputs, "plots": plots}
    for err in summary.errors[:5]:
        progress(f"vsim: simulation failed: {' '.join(err['key'])}: {err['error']}")
    if args.json:
        emit_json(result)
    else:
        rate = f" ({result['configs_per_s']} configurations/s)" if summary.ran else ""
        print(f"{summary.configs} configurations: {summary.ran} simulated in "
              f"{summary.seconds:.1f} s{rate} on {summary.workers} "
              f"{'Dask worker' if args.scheduler else 'process'}"
              f"{'' if summary.workers == 1 else 'es' if not args.scheduler else 's'}, "
              f"{summary.skipped} already "
              f"in {outputs[0]}, {len(summary.errors)} failed")
        for spec, seconds in summary.slow_planning().items():
            n = summary.planning[spec][0]
            print(f"note: {spec} took {seconds:.2f} s of planning per configuration on average "
                  f"({n} simulated here): its planner simulates the plans it weighs, and "
                  "that, not the simulation, bounds this sweep's speed")
        for path in plots:
            print(f"plot: {path}")
    return 1 if summary.errors else 0

