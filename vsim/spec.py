"""Spec strings 'NAME:key=value,...' for the registries of policies and allocator models.

A registered class is a frozen dataclass whose fields are its parameters; `parse_spec` builds one
from a spec string, `describe` lists its fields for `vsim list`, `choice` declares a string field
limited to some values. Below both registries (allocator and policies), so neither imports the
other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from .errors import PolicyError


def describe(cls: type[Any]) -> dict[str, Any]:
    """Fields with their types, defaults and allowed values, for `vsim list`."""
    fields = []
    for f in dataclasses.fields(cls):
        entry: dict[str, Any] = {"name": f.name, "type": getattr(f.type, "__name__", str(f.type))}
        if f.default is not dataclasses.MISSING:
            entry["default"] = f.default
        choices = f.metadata.get("choices")
        if choices:
            entry["choices"] = list(choices)
        fields.append(entry)
    return {"name": cls.name, "description": cls.description, "fields": fields}


def choice(default: str, *choices: str) -> Any:
    """A string field limited to `choices` (checked by parse_spec)."""
    return field(default=default, metadata={"choices": (default, *choices)})


def parse_spec(spec: str, known: dict[str, type[Any]], what: str = "policy") -> Any:
    """'NAME:key=value,...' -> an instance. Errors name the bad part and list valid ones."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in known:
        raise PolicyError(f"unknown {what} {name!r}; known: {', '.join(sorted(known))}")
    cls = known[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq:
            raise PolicyError(f"{what} {name}: expected key=value, got {part!r}")
        if key not in fields:
            valid = ", ".join(fields) or "none"
            raise PolicyError(f"{what} {name}: unknown key {key!r}; valid keys: {valid}")
        kwargs[key] = _convert(fields[key], raw.strip(), f"{what} {name}: {key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{what} {name}: {exc}") from None


def _convert(f: dataclasses.Field[Any], raw: str, where: str) -> Any:
    choices = f.metadata.get("choices")
    if choices and raw not in choices:
        raise PolicyError(f"{where}={raw!r} is not one of {', '.join(choices)}")
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "int | None":
            return None if raw.lower() == "none" else int(raw)
        if kind == "bool":
            if raw.lower() not in _BOOLS:
                raise ValueError(raw)
            return _BOOLS[raw.lower()]
    except ValueError:
        raise PolicyError(f"{where}: cannot read {raw!r} as {kind}") from None
    return raw


_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
