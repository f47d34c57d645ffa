"""Running plans for real on a GPU: the layer above the policies and the engine.

Modules: `opmap` (which trace op and tensor each aten call of an iteration is), `executor`
(carries a policy's plan out inside PyTorch training iterations), `measure` (`vsim measure` and
`python -m vsim.runtime.measure SUITE.yaml OUT_DIR`: train with a plan and record what it cost).
It builds on vsim.record (zoo models, the recorder's passes), so importing it without torch
raises TorchMissing, as vsim.record does. Nothing below this package imports it.
"""

from __future__ import annotations

from ..record import TorchMissing  # noqa: F401  (raises TorchMissing where torch is absent)
