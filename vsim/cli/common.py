"""What the verb modules share: the parser that ends usage errors like bad input, progress and
JSON printing, and the checks of outputs and capacities made before any work."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, VsimError
from ..fileio import default_file_mode
from ..units import format_size, parse_size

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """Usage errors end like every other bad input: one line, exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--memory -1GiB`: a value that starts with a minus and a digit is a value (negative
        # numbers with units), so that vsim's own check says what is wrong with it instead of
        # argparse's "expected one argument"; no vsim option looks like -1.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> Any:
        self.exit(EXIT_BAD_INPUT, f"vsim: error: {message} (see `{self.prog} --help`)\n")


class _LeftForExit:
    """What commands leave for the process's exit (`leave_for_exit`); `enabled` by
    vsim.cli.run_main, the entry point of the `vsim` command and `python -m vsim`."""

    enabled = False
    objects: list[object] = []


LEFT_FOR_EXIT = _LeftForExit()


def leave_for_exit(*objects: object) -> None:
    """Objects a command is done with that are expensive to free (a 1M-op trace, its lookups
    and its run's records: millions of objects, 0.7 s to free) kept until the process ends,
    which `run_main` then ends without freeing them: the system takes the memory back at once.
    Out of the cyclic collector's sight too (gc.freeze: every object tracked so far, which the
    exit drops anyway): a command that paused the collector resumes it as it returns, and its
    first pass would walk these objects (a 1M-op trace: 1.6 s). Nothing is kept when vsim runs
    inside another program (main() called directly)."""
    if LEFT_FOR_EXIT.enabled:
        LEFT_FOR_EXIT.objects.extend(objects)
        gc.freeze()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def strict_json(obj: Any, **kwargs: Any) -> str:
    """JSON as the standard has it: a NaN or an infinity in a result is a bug upstream, so it
    ends with one line saying where instead of printing `NaN`, which other JSON readers
    reject."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        where = _non_finite_path(obj, "")
        raise VsimError(f"internal error: the result holds a non-finite number at "
                        f"{where or 'the top'}; not printed as JSON (a bug: please report "
                        "it with the command)") from None


def _non_finite_path(obj: Any, path: str) -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return path
    items: Iterable[tuple[Any, Any]] = (
        obj.items() if isinstance(obj, dict) else
        enumerate(obj) if isinstance(obj, list | tuple) else ())
    for key, value in items:
        found = _non_finite_path(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def emit_json(obj: Any) -> None:
    print(strict_json(obj, indent=2, sort_keys=False))


def parse_capacity(text: str | None) -> int | None:
    if text is None:
        return None
    size = parse_size(text, "--memory")
    if size <= 0:
        raise ConfigError(f"--memory: capacity must be above zero, got {text!r}")
    return size


def check_output(path: str, flag: str) -> None:
    parent = Path(path).parent
    if str(parent) and not parent.exists():
        raise ConfigError(f"{flag}: folder {str(parent)!r} does not exist")
    if Path(path).is_dir():
        raise ConfigError(f"{flag}: {path!r} is a folder; give a file name")
    if not os.access(parent if str(parent) else ".", os.W_OK):
        raise ConfigError(f"{flag}: cannot write into folder {str(parent)!r}")


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: equal once resolved (links followed), or, when both
    exist, the same inode (hard links, other spellings)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_outputs(outputs: Iterable[tuple[str, str | None]], inputs: Iterable[str | None]
                  ) -> None:
    """The check every writing verb makes before any work: each output (flag, path) is a file
    in an existing folder, none is one of the command's inputs (a command never writes over
    what it reads), and no two outputs are one file."""
    given = [(flag, path) for flag, path in outputs if path]
    read = [str(p) for p in inputs if p]
    for i, (flag, path) in enumerate(given):
        check_output(path, flag)
        for source in read:
            if same_file(path, source):
                raise ConfigError(f"{flag}: {path!r} is one of this command's inputs "
                                  f"({source}); refusing to write over it")
        for other_flag, other in given[:i]:
            if same_file(path, other):
                raise ConfigError(f"{flag}: {path!r} is also the output of {other_flag}")


def spec_files(specs: Iterable[str | None]) -> list[str]:
    """The files a policy or allocator spec reads (`plan:file=PATH`) or a profile given as a
    path: inputs that no output may replace."""
    files: list[str] = []
    for spec in specs:
        if not spec:
            continue
        if os.path.exists(spec):
            files.append(spec)
        _, _, fields = spec.partition(":")
        for part in fields.split(","):
            key, eq, value = part.partition("=")
            if eq and key.strip() == "file" and value.strip():
                files.append(value.strip())
    return files


class StagedOutputs:
    """All-or-nothing outputs: each is written to a temporary file next to its target (same
    suffix, for writers that infer the format from the name); `commit` renames them all into
    place once every one is written. On an exception inside the `with` block, or in the
    renames, nothing this command wrote remains."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, str]] = []

    def path(self, target: str) -> str:
        name = Path(target)
        parent = name.parent if str(name.parent) else Path(".")
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{name.name}.", suffix=name.suffix)
        os.close(fd)
        self._staged.append((tmp, target))
        return tmp

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            self._commit()
        else:
            self._discard()

    def _commit(self) -> None:
        done: list[str] = []
        try:
            for tmp, target in self._staged:
                os.chmod(tmp, default_file_mode())
                os.replace(tmp, target)
                done.append(target)
        except BaseException:
            for target in done:
                with contextlib.suppress(OSError):
                    os.unlink(target)
            self._discard()
            raise
        self._staged = []

    def _discard(self) -> None:
        for tmp, _ in self._staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._staged = []



def check_capacity(trace_path: str, trace: Any, hw: Any, capacity: int | None) -> None:
    """A capacity below what is resident before the first op (weights, optimizer state,
    inputs) is impossible input, not an out-of-memory result: no policy can even start."""
    from ..metrics import resident_bytes

    resident = resident_bytes(trace)
    usable = hw.capacity_bytes if capacity is None else capacity
    if usable >= resident:
        return
    given = (f"--memory {format_size(usable)}" if capacity is not None else
             f"{hw.name}'s capacity {format_size(usable)} (give --memory or another --hw)")
    raise ConfigError(f"{given} is below the {format_size(resident)} ({resident} B) that must "
                      "be on the GPU before the first op (weights, optimizer state, inputs)",
                      trace_path)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"

