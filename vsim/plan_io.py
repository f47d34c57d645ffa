"""Plans as JSON files: what `vsim search` writes and the `plan:file=PATH` policy reads.

    {"format": "vsim-plan", "version": 1,
     "trace": {"path", "file_sha256", "digest", "model", "batch_size"},
     "hardware": "h100-sxm", "capacity_bytes": 12884901888,
     "plan": {"wait_for_memory", "pinned", "pinned_lazy", "pinned_pool_bytes", "notes",
              "actions": [{"action": "offload", "tensor": 69, "at_op": 1, "after": true,
                           "release_after": 2}, ...]},
     "search": {...what the search found, for the record}}

Actions are those of vsim.plan, one object each with an `action` tag (offload,
prefetch, sync, drop, recompute, release, retime) and the dataclass's fields.

**Which trace a plan belongs to.** `trace.digest` is a SHA-256 of the trace *as planned*: its
tensors (id, bytes, kind, producer, consumers) and ops (id, name, stream, phase, start, duration,
reads, writes, frees, deps, attrs), canonical JSON. A plan names op and tensor ids and was timed
against those op times, so a trace whose digest differs is another trace and the plan is refused.
Provenance (meta), kernels, allocator events and counters are left out: they do not change what
a plan means. A trace retargeted to another GPU (`vsim run --hw OTHER`) has other op times, so
a plan searched on h100-sxm is refused on a trace retargeted to h200: search again there.
`trace.file_sha256` (the file's bytes) and `trace.path` are kept for the record only.

Reading checks every field and names the file and the JSON path of the first bad one
(ConfigError: exit code 2 on the command line).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .fileio import write_atomic
from .plan import (
    Action,
    Drop,
    Offload,
    Plan,
    Prefetch,
    Recompute,
    Release,
    Retime,
    Sync,
)
from .trace.schema import Trace

FORMAT = "vsim-plan"
VERSION = 1
ACTION_TAGS: dict[str, type[Any]] = {
    "offload": Offload, "prefetch": Prefetch, "sync": Sync, "drop": Drop,
    "recompute": Recompute, "release": Release, "retime": Retime,
}
_TAG_OF = {cls: tag for tag, cls in ACTION_TAGS.items()}


@dataclass(frozen=True)
class SavedPlan:
    """A plan with what it was made for. `where` is the file it was read from."""

    plan: Plan
    trace_digest: str
    trace_path: str = ""
    file_sha256: str = ""
    hardware: str = ""
    capacity_bytes: int = 0
    trace_label: str = ""
    search: dict[str, Any] = field(default_factory=dict)
    where: str = ""


# ---------------------------------------------------------------- digests

def trace_digest(trace: Trace) -> str:
    """SHA-256 (hex) of what a plan depends on: tensors and ops (see the module docstring)."""
    doc = {
        "tensors": [[t.id, t.size_bytes, t.kind, t.producer, list(t.consumers)]
                    for t in trace.tensors],
        "ops": [[o.id, o.name, o.stream, o.phase, o.start_us, o.dur_us, list(o.reads),
                 list(o.writes), list(o.frees), list(o.deps), [list(a) for a in o.attrs]]
                for o in trace.ops],
    }
    text = json.dumps(doc, separators=(",", ":"), sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------- writing

def action_to_json(a: Action) -> dict[str, Any]:
    out: dict[str, Any] = {"action": _TAG_OF[type(a)]}
    for f in dataclasses.fields(a):
        v = getattr(a, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def plan_to_json(saved: SavedPlan) -> dict[str, Any]:
    p = saved.plan
    return {
        "format": FORMAT, "version": VERSION,
        "trace": {"path": saved.trace_path, "file_sha256": saved.file_sha256,
                  "digest": saved.trace_digest, "label": saved.trace_label},
        "hardware": saved.hardware, "capacity_bytes": saved.capacity_bytes,
        "plan": {"wait_for_memory": p.wait_for_memory, "pinned": p.pinned,
                 "pinned_lazy": p.pinned_lazy, "pinned_pool_bytes": p.pinned_pool_bytes,
                 "notes": list(p.notes), "actions": [action_to_json(a) for a in p.actions]},
        "search": saved.search,
    }


def save_plan(saved: SavedPlan, path: str | os.PathLike[str]) -> None:
    """Write atomically (temporary file, then rename)."""
    path = Path(path)
    text = json.dumps(plan_to_json(saved), indent=1, allow_nan=False) + "\n"
    write_atomic(path, text)


# ---------------------------------------------------------------- reading

def load_plan(path: str | os.PathLike[str]) -> SavedPlan:
    """Read and check a plan file; ConfigError naming the file and the JSON path otherwise."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read plan: {reason}", where) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
                          where) from None
    return plan_from_json(doc, where)


def plan_from_json(doc: Any, where: str = "<plan>") -> SavedPlan:
    r = _Reader(where)
    doc = r.obj(doc, "")
    if doc.get("format") != FORMAT:
        raise ConfigError(f"format: not a {FORMAT} file (got {doc.get('format')!r})", where)
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ConfigError("version: missing or not an integer", where)
    if version > VERSION:
        raise ConfigError(f"version: {version} is newer than this vsim reads ({VERSION}); "
                          "upgrade vsim", where)
    tr = r.obj(doc.get("trace"), "trace")
    digest = r.typed(tr.get("digest"), str, "trace.digest")
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigError("trace.digest: not a SHA-256 in hex", where)
    pl = r.obj(doc.get("plan"), "plan")
    acts = pl.get("actions")
    if not isinstance(acts, list):
        raise ConfigError("plan.actions: missing or not a list", where)
    actions = tuple(r.action(a, f"plan.actions[{i}]") for i, a in enumerate(acts))
    notes = pl.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ConfigError("plan.notes: not a list of strings", where)
    plan = Plan(actions=actions, notes=tuple(notes),
                pinned_pool_bytes=r.typed(pl.get("pinned_pool_bytes", 0), int,
                                          "plan.pinned_pool_bytes", minimum=0),
                pinned_lazy=r.typed(pl.get("pinned_lazy", False), bool, "plan.pinned_lazy"),
                pinned=r.typed(pl.get("pinned", True), bool, "plan.pinned"),
                wait_for_memory=r.typed(pl.get("wait_for_memory", False), bool,
                                        "plan.wait_for_memory"))
    search = doc.get("search", {})
    return SavedPlan(
        plan=plan, trace_digest=digest,
        trace_path=r.typed(tr.get("path", ""), str, "trace.path"),
        file_sha256=r.typed(tr.get("file_sha256", ""), str, "trace.file_sha256"),
        trace_label=r.typed(tr.get("label", ""), str, "trace.label"),
        hardware=r.typed(doc.get("hardware", ""), str, "hardware"),
        capacity_bytes=r.typed(doc.get("capacity_bytes", 0), int, "capacity_bytes", minimum=0),
        search=search if isinstance(search, dict) else {}, where=where)


class _Reader:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, what: str) -> ConfigError:
        return ConfigError(f"{path}: {what}" if path else what, self.where)

    def obj(self, v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(path, "missing or not an object") if path else \
                self.fail("", "not a JSON object")
        return v

    def typed(self, v: Any, kind: type[Any], path: str, minimum: int | None = None) -> Any:
        if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
            raise self.fail(path, f"expected an integer, got {v!r}")
        if kind is float and (not isinstance(v, (int, float)) or isinstance(v, bool)
                              or v != v or v in (float("inf"), float("-inf"))):
            raise self.fail(path, f"expected a finite number, got {v!r}")
        if kind in (str, bool) and not isinstance(v, kind):
            raise self.fail(path, f"expected {kind.__name__}, got {v!r}")
        if minimum is not None and v < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {v!r}")
        return float(v) if kind is float else v

    def action(self, a: Any, path: str) -> Action:
        a = self.obj(a, path)
        tag = a.get("action")
        if tag not in ACTION_TAGS:
            raise self.fail(f"{path}.action", f"unknown action {tag!r}; known: "
                            f"{', '.join(ACTION_TAGS)}")
        cls = ACTION_TAGS[tag]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        extra = sorted(set(a) - set(fields) - {"action"})
        if extra:
            raise self.fail(f"{path}.{extra[0]}", f"not a field of {tag} (fields: "
                            f"{', '.join(fields)})")
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in a:
                if f.default is dataclasses.MISSING:
                    raise self.fail(f"{path}.{name}", f"missing ({tag} needs it)")
                continue
            kwargs[name] = self._field(a[name], hints[name], f"{path}.{name}")
        if cls is Retime and kwargs.get("parts", 1) < 1:
            raise self.fail(f"{path}.parts", f"must be at least 1, got {kwargs['parts']!r}")
        return typing.cast(Action, cls(**kwargs))

    def _field(self, v: Any, hint: Any, path: str) -> Any:
        if hint is int:
            return self.typed(v, int, path, minimum=0)
        if hint is bool:
            return self.typed(v, bool, path)
        if hint is float:
            return self.typed(v, float, path)
        if hint is str:
            return self.typed(v, str, path)
        if typing.get_origin(hint) is tuple:  # tuple[int, ...]
            if not isinstance(v, list):
                raise self.fail(path, f"expected a list of integers, got {v!r}")
            return tuple(self.typed(x, int, f"{path}[{i}]", minimum=0) for i, x in enumerate(v))
        args = typing.get_args(hint)  # int | None
        if type(None) in args:
            return None if v is None else self._field(v, args[0], path)
        raise self.fail(path, f"cannot read a {hint}")  # pragma: no cover (a new field type)
