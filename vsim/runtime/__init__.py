"""Running plans for real on a GPU: the layer above the policies and the engine.

Modules: `opmap` (which trace op and tensor each aten call of an iteration is), `executor`
(carries a policy's plan out inside PyTorch training iterations), `measure` (`vsim measure` and
`python -m vsim.runtime.measure SUITE.yaml OUT_DIR`: train with a plan and record what it cost),
`planned` (`PlannedStep`: train with a plan in one's own loop, with one's own step).
It builds on vsim.record (zoo models, the recorder's passes), so importing it without torch
raises TorchMissing, as vsim.record does. Nothing below this package imports it.
"""

from __future__ import annotations

from typing import Any

from ..record import TorchMissing  # noqa: F401  (raises TorchMissing where torch is absent)

__all__ = ["PlannedStep"]


def __getattr__(name: str) -> Any:
    # lazily: `import vsim.runtime` stays light; the executor loads with the first PlannedStep
    if name == "PlannedStep":
        from .planned import PlannedStep

        return PlannedStep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
