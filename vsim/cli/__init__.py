"""The `vsim` command line: the only package that prints.

Bad input (files, names, options) ends with one line `vsim: error: FILE: PLACE: what` on stderr
and exit code 2; nothing is written half-way because every output is written atomically.

One module per verb group: simulate (run, inspect, list, compare), validate (validate, bench),
record (record, measure, import, calibrate, fit-compute, synth, synth-check), sweep, search;
common holds what they share (the parser, printing, checks of outputs and capacities).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__
from ..errors import VsimError
from .common import EXIT_BAD_INPUT, LEFT_FOR_EXIT, Parser
from .record import add_compute_verbs, add_record_verbs
from .search import add_search, format_search
from .simulate import add_compare, add_run_inspect_list, format_comparison, format_reports
from .sweep import add_sweep
from .validate import add_validate_bench, format_validation

__all__ = ["EXIT_BAD_INPUT", "build_parser", "format_comparison",
           "format_reports", "format_search", "format_validation", "main", "run_main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage error (printed by Parser.error), --help or --version
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


def run_main() -> NoReturn:
    """The `vsim` command and `python -m vsim`: main(), then the process's exit. A command that
    left objects for the exit (common.leave_for_exit: `vsim run` its trace and records) ends
    without the interpreter freeing them one by one: stdout and stderr flushed, the atexit
    handlers run, then os._exit. The usual exit instead while another thread runs, a tracer
    or profiler is set (coverage, cProfile: they write their results at the usual exit), or
    a flush fails (a closed pipe: the usual exit says so, as before)."""
    LEFT_FOR_EXIT.enabled = True
    code = main()
    if LEFT_FOR_EXIT.objects and threading.active_count() == 1 \
            and sys.gettrace() is None and sys.getprofile() is None and _flushed():
        atexit._run_exitfuncs()  # (logging's shutdown, weakref finalizers, ...)
        if _flushed():  # what the handlers printed
            os._exit(code)
    sys.exit(code)


def _flushed() -> bool:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="vsim", description="Trace-driven simulator of GPU memory virtualization for DNN "
        "training (vDNN, vDNN++, SuperNeurons, recomputation, ...).")
    parser.add_argument("--version", action="version", version=f"vsim {__version__}")
    verbs = parser.add_subparsers(title="verbs", metavar="VERB")
    # in the order `vsim --help` has always listed them
    add_run_inspect_list(verbs)
    add_validate_bench(verbs)
    add_record_verbs(verbs)
    add_sweep(verbs)
    add_compare(verbs)
    add_search(verbs)
    add_compute_verbs(verbs)
    return parser
