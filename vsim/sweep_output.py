"""Sweep outputs: result rows as .csv or .jsonl files, appended one row at a time and read
back for resuming (vsim.sweep runs the grid). An existing output is checked to be a vsim sweep
before anything is cut or appended."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .safeload import strict_dumps

KEY_COLUMNS = ("trace_path", "hw_spec", "memory", "policy_spec", "allocator_spec")
OUTPUT_SUFFIXES = (".csv", ".jsonl")


def to_row(result: dict[str, Any]) -> dict[str, Any]:
    """A result as one flat row: key columns, then the report with nested keys joined by '.',
    then the baseline, the slowdown and the wall time of the simulation with its planning
    (sim_seconds, the one figure that differs between two runs of a configuration)."""
    row: dict[str, Any] = dict(zip(KEY_COLUMNS, result["key"], strict=True))
    _flatten(result["report"], "", row)
    if result.get("seq_len") is not None:
        row["trace.seq_len"] = result["seq_len"]
    row["baseline_iteration_time_us"] = result["baseline_iteration_time_us"]
    row["slowdown"] = result["slowdown"]
    row["sim_seconds"] = result["sim_seconds"]
    return row


def _flatten(obj: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for k, v in obj.items():
        if isinstance(v, dict):
            _flatten(v, f"{prefix}{k}.", out)
        else:
            out[f"{prefix}{k}"] = v


def row_key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(row.get(c, "")) for c in KEY_COLUMNS)


def _csv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (list, tuple)):
        return strict_dumps(list(v))
    if isinstance(v, float):
        return repr(v)
    return str(v).replace("\n", " ")  # one line per row: the resume reader relies on it


def _parse_cell(text: str) -> Any:
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[0] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


class ResultWriter:
    """Appends rows to a .csv or .jsonl file, one write and one flush per row, skipping keys
    already there. Opening an existing file reads its keys (resume) and cuts a last line that an
    interrupted write left incomplete. A CSV row with columns the header lacks rewrites the file
    with the wider header (atomically) before appending."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        if self.path.suffix not in OUTPUT_SUFFIXES:
            raise ConfigError(f"output must end in {' or '.join(OUTPUT_SUFFIXES)}", str(path))
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"folder {str(parent)!r} does not exist", str(path))
        self.csv = self.path.suffix == ".csv"
        self.header: list[str] = []
        self.keys: set[tuple[str, ...]] = set()
        existed = self.path.exists()
        if existed:
            _check_sweep_output(self.path)  # before the file is opened for writing at all
        self.created = not existed
        self.handle = self.path.open("a", newline="")
        try:
            self._lock()
            if existed:
                _check_sweep_output(self.path)  # again, under the lock: it may have changed
                self._cut_incomplete_line()
                rows = read_rows(str(self.path))
                self.keys = {row_key(r) for r in rows}
                if self.csv:
                    with self.path.open(newline="") as f:
                        self.header = next(csv.reader(f), [])
        except BaseException:
            self.handle.close()
            raise

    def _lock(self) -> None:
        """Two sweeps appending to one file would each miss the other's rows."""
        try:
            import fcntl
        except ImportError:  # not on this platform: no guard
            return
        try:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError("another sweep is writing to this file", str(self.path)) from None

    def _cut_incomplete_line(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def write(self, row: dict[str, Any]) -> bool:
        """Append the row unless its key is already there; True when written."""
        key = row_key(row)
        if key in self.keys:
            return False
        if self.csv:
            missing = [c for c in row if c not in self.header]
            if missing:
                self._widen(self.header + missing)
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerow([_csv_cell(row.get(c)) for c in self.header])
            text = buf.getvalue()
        else:
            text = strict_dumps(row, default=str) + "\n"
        self.handle.write(text)
        self.handle.flush()
        self.keys.add(key)
        return True

    def _widen(self, header: list[str]) -> None:
        """Rewrite the file with a wider header: a temporary file, locked, renamed over it;
        the old file stays locked until then."""
        self.handle.flush()
        rows = read_rows(str(self.path)) if self.header else []
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        for r in rows:
            writer.writerow([_csv_cell(r.get(c)) for c in header])
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        old = self.handle
        self.handle = tmp.open("w", newline="")
        try:
            self._lock()
            self.handle.write(buf.getvalue())
            self.handle.flush()
            os.replace(tmp, self.path)
        except BaseException:
            self.handle.close()
            self.handle = old
            raise
        old.close()
        self.header = header

    def close(self) -> None:
        self.handle.close()

    def discard(self) -> None:
        """Close, and remove the file when this writer created it and wrote nothing."""
        self.close()
        if self.created and not self.keys and not self.header:
            self.path.unlink(missing_ok=True)


def _check_sweep_output(path: Path) -> None:
    """ConfigError unless the existing file at `path` is empty or a vsim sweep output: UTF-8
    text whose CSV header starts with the key columns, or whose JSONL lines are objects with
    them (an incomplete last line, an interrupted write, is allowed). Checked before anything
    is cut or appended: a foreign .csv/.jsonl or a binary file is left untouched."""
    where = str(path)
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_CHECK_BYTES)
    except OSError as exc:
        raise ConfigError(f"cannot read output: {exc.strerror or exc}", where) from None
    if not data:
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - 4:  # not just a character cut by the read's size limit
            raise ConfigError("not a vsim sweep output (binary data); choose another output "
                              "file", where) from None
        text = data[:exc.start].decode("utf-8")
    lines = text.split("\n")
    complete = lines[:-1]  # the last piece has no newline yet: incomplete or cut by the limit
    if path.suffix == ".csv":
        header = next(csv.reader(io.StringIO(lines[0])), [])
        if len(lines) > 1 and header[:len(KEY_COLUMNS)] != list(KEY_COLUMNS):
            raise ConfigError("not a vsim sweep CSV (its first columns are not "
                              f"{', '.join(KEY_COLUMNS)}); choose another output file", where)
        if len(lines) == 1 and not ",".join(KEY_COLUMNS).startswith(lines[0]):
            raise ConfigError("not a vsim sweep CSV (no header line); choose another output "
                              "file", where)
        return
    for n, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError):
            row = None
        if not isinstance(row, dict) or not all(c in row for c in KEY_COLUMNS):
            raise ConfigError(f"line {n}: not a vsim sweep row (a JSON object with "
                              f"{', '.join(KEY_COLUMNS)}); choose another output file", where)


_MAX_CHECK_BYTES = 1 << 26  # 64 MiB of a large output are checked; its rows are read later


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a sweep output (.csv or .jsonl) with values typed back (numbers, booleans,
    None, lists). An incomplete last line (an interrupted write) is ignored."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read results: {exc.strerror or exc}", path) from None
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    if p.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        return [{k: _parse_cell(v or "") for k, v in r.items()} for r in reader]
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ConfigError(f"line {n} is not JSON", path) from None
    return rows
