"""Recording real training iterations with PyTorch: the only package of vsim that imports torch.

Modules: `zoo` (models), `recorder` (Recorder, record_step, record_model), `calibrate` (hardware
profiles), `selfcheck` (replay estimate without simpy), `assemble` (joining the recorder's passes
into a trace). Importing this package without torch raises ConfigError.
"""

from __future__ import annotations

from ..errors import ConfigError

try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where torch is absent
    raise ConfigError("recording needs PyTorch, which is not installed: pip install 'vsim[torch]' "
                      "(a CUDA build for GPU traces)") from None

RECORDER_VERSION = "vsim-record 0.1"
