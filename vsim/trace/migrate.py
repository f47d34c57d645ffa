"""Upgrade older trace documents to the current version, one step at a time.

Each step takes the JSON document of version N and returns version N+1. The version is read from
`vsim.version` only; a reader never guesses it from which keys are present. Version 1 is the
first, so there is no step yet: when v2 comes, add `_STEPS[1] = _v1_to_v2`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import TraceError
from .schema import SCHEMA_VERSION

Step = Callable[[dict[str, Any]], dict[str, Any]]
_STEPS: dict[int, Step] = {}


def upgrade(doc: dict[str, Any], version: int, where: str) -> dict[str, Any]:
    """Apply the steps from `version` to SCHEMA_VERSION; TraceError if a step is missing."""
    while version < SCHEMA_VERSION:
        step = _STEPS.get(version)
        if step is None:
            raise TraceError(f"no upgrade from trace version {version}", where)
        doc = step(doc)
        version += 1
        doc["vsim"]["version"] = version
    return doc
