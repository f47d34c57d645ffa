"""Reading untrusted input files with bounded memory and one-line errors.

Every YAML and JSON document vsim reads comes through here, so that a small file cannot make a
large amount of work or memory, and every way a parser can fail becomes the caller's error class
(a VsimError) naming the file:

- `read_bytes`: the file's bytes, gunzipped when they start with gzip's magic number, in chunks
  and stopped at MAX_INPUT_BYTES (a 2 MB gzip bomb would otherwise expand to gigabytes).
- `parse_yaml`: the safe loader (libyaml's when present) that refuses a document whose aliases
  expand to more than MAX_YAML_NODES nodes (billion laughs: nine lines that expand to 10^9
  strings as soon as anything walks the data) or that refers to itself.
- `parse_json`: json.loads whose RecursionError (deep nesting), ValueError (integers of more
  than Python's 4,300-digit conversion limit) and decode errors become one-line errors;
  `finite=True` also refuses NaN/Infinity, naming the JSON path of the first.
- `strict_dumps`: json.dumps that refuses NaN/Infinity (strict JSON, what other readers accept).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import VsimError

# 1 GiB of decompressed text: a 1M-op trace is about 0.4 GiB, and parsing JSON takes several
# times its text size in memory. VSIM_MAX_INPUT_BYTES raises it (an integer of bytes).
MAX_INPUT_BYTES = 2**30
MAX_INPUT_ENV = "VSIM_MAX_INPUT_BYTES"
# Node count of a YAML document with its aliases expanded. The largest shipped YAML file (the
# validation suite) has about 2,000 nodes; 10^6 leaves room and still bounds the work.
MAX_YAML_NODES = 1_000_000
_CHUNK = 1 << 20


def max_input_bytes() -> int:
    """MAX_INPUT_BYTES, or $VSIM_MAX_INPUT_BYTES when that is a positive integer."""
    text = os.environ.get(MAX_INPUT_ENV, "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return MAX_INPUT_BYTES


def _too_large(limit: int) -> str:
    size = f"{limit} bytes" + (f" ({limit / 2**20:.0f} MiB)" if limit >= 2**20 else "")
    return (f"more than {size} once decompressed; refused as a safeguard against "
            f"decompression bombs (set {MAX_INPUT_ENV} to a larger number of bytes to read it)")


def read_bytes(path: str | os.PathLike[str], error: type[VsimError], what: str = ""
               ) -> bytes | bytearray:
    """The file's bytes (a bytearray when gunzipped), gunzipped when gzip's magic number
    starts them, at most `max_input_bytes()` of them. `error` (naming the file) when it
    cannot be read, its gzip data is corrupt, or it is larger than the limit."""
    where = str(path)
    limit = max_input_bytes()
    label = f"cannot read {what}" if what else "cannot read"
    try:
        with open(path, "rb") as handle:
            head = handle.read(2)
            if head != b"\x1f\x8b":
                rest = handle.read(limit + 1 - len(head))
                if len(head) + len(rest) > limit:
                    raise error(_too_large(limit), where)
                return head + rest
            compressed = head + handle.read()
    except OSError as exc:
        raise error(f"{label}: {exc.strerror or exc}", where) from None
    return _gunzip(compressed, limit, where, error)


def _gunzip(data: bytes, limit: int, where: str, error: type[VsimError]) -> bytearray:
    """Decompress every gzip member of `data` (as gzip.decompress does) one chunk at a time,
    stopping as soon as the output passes `limit`. Into one growing bytearray, not a list of
    chunks joined at the end: the join wrote every byte a second time into fresh pages (a
    1M-op trace: 395 MB more to fault in, 0.2 s)."""
    import gzip
    import io

    out = bytearray()
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as handle:
            while piece := handle.read(_CHUNK):
                if len(out) + len(piece) > limit:
                    raise error(_too_large(limit), where)
                out += piece
    except (OSError, EOFError, zlib.error) as exc:
        raise error(f"corrupt gzip data ({exc})", where) from None
    return out


# ---------------------------------------------------------------- JSON

class _NonFinite:
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def parse_json(raw: bytes | bytearray | str, where: str, error: type[VsimError],
               finite: bool = False, what: str = "JSON",
               object_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """json.loads with every failure as `error` naming `where`. `finite`: NaN and Infinity are
    refused too, with the JSON path of the first (a trace must be strict JSON). `object_hook`:
    json.loads's (called with each object as it is built)."""
    seen: list[_NonFinite] = []

    def constant(text: str) -> Any:
        marker = _NonFinite(text)
        seen.append(marker)
        return marker

    try:
        doc = (json.loads(raw, parse_constant=constant, object_hook=object_hook) if finite
               else json.loads(raw, object_hook=object_hook))
    except UnicodeDecodeError:
        raise error(f"not a text {what} file (binary data)", where) from None
    except json.JSONDecodeError as exc:
        raise error(f"invalid {what} at line {exc.lineno} column {exc.colno}: {exc.msg}",
                    where) from None
    except RecursionError:
        raise error(f"invalid {what}: nested deeper than this reader can follow", where) \
            from None
    except ValueError as exc:  # integers beyond sys.get_int_max_str_digits()
        raise error(f"invalid {what}: {_digits_message(exc)}", where) from None
    if seen:
        path = _find(doc, seen[0]) or "?"
        raise error(f"{path}: {seen[0].text} is not a finite number (not valid JSON)", where)
    return doc


def _digits_message(exc: ValueError) -> str:
    text = str(exc)
    if "integer string conversion" in text:
        return "an integer with more than 4300 digits"
    return text.split(";")[0]


def _find(doc: Any, target: object) -> str | None:
    """The JSON path of `target` inside `doc` (iteratively: the document may be deep)."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if value is target:
            return path or "top level"
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def first_non_finite(doc: Any) -> str | None:
    """The path of the first NaN/Infinity float in plain data (dicts, lists, tuples), or None;
    for inputs that are not JSON text (a pickled memory snapshot)."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return path or "top level"
        elif isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k))
                         for k, v in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def strict_dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps with allow_nan=False: ValueError rather than the non-JSON NaN/Infinity."""
    return json.dumps(obj, allow_nan=False, **kwargs)


# ---------------------------------------------------------------- YAML

def parse_yaml(text: str, where: str, error: type[VsimError]) -> Any:
    """A YAML document through the safe loader (libyaml's when present), its alias expansion
    bounded; `error` naming `where` and the line on any failure."""
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where, error)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise error(f"invalid YAML{at}", where) from None
    except RecursionError:
        raise error("invalid YAML: nested deeper than this reader can follow", where) from None
    except ValueError as exc:  # an integer beyond Python's digit limit, a bad timestamp
        raise error(f"invalid YAML: {_digits_message(exc)}", where) from None
    finally:
        loader.dispose()


def _check_expansion(root: Any, where: str, error: type[VsimError]) -> None:
    """Count the nodes of the document as if every alias were copied out (memoised per node,
    so the count itself is linear in the file); refuse above MAX_YAML_NODES or on a cycle."""
    import yaml

    size: dict[int, int] = {}
    on_path: set[int] = set()
    # Iterative post-order walk: (node, children done?)
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node, yaml)
            total = 1 + sum(size[id(c)] for c in children)
            if total > MAX_YAML_NODES:
                raise error(f"YAML aliases expand to more than {MAX_YAML_NODES} nodes "
                            "(refused: a document this large is an alias bomb)", where)
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            line = node.start_mark.line + 1 if getattr(node, "start_mark", None) else "?"
            raise error(f"YAML alias at line {line} refers to a node that contains it "
                        "(a recursive document)", where)
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node, yaml):
            if id(child) in on_path:
                line = child.start_mark.line + 1 if getattr(child, "start_mark", None) else "?"
                raise error(f"YAML alias at line {line} refers to a node that contains it "
                            "(a recursive document)", where)
            if id(child) not in size:
                stack.append((child, False))


def _children(node: Any, yaml: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def read_yaml(path: str | os.PathLike[str], error: type[VsimError], what: str = "") -> Any:
    """A YAML file (UTF-8 text, at most `max_input_bytes()`), parsed with `parse_yaml`."""
    where = str(path)
    raw = read_bytes(Path(path), error, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise error(f"not a text YAML file (binary data, or not UTF-8 at line {line})",
                    where) from None
    return parse_yaml(text, where, error)
