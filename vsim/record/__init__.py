"""Recording real training iterations with PyTorch (with vsim.runtime, the only torch code).

Modules: `zoo` (models), `recorder` (Recorder, record_step, record_model), `calibrate` (hardware
profiles), `selfcheck` (replay estimate without simpy), `assemble` (joining the recorder's passes
into a trace). Importing this package without torch raises TorchMissing, which is a ConfigError
(one line, exit code 2 on the command line) and an ImportError (for code that probes for it).
"""

from __future__ import annotations

from ..errors import ConfigError

RECORDER_VERSION = "vsim-record 0.1"


class TorchMissing(ImportError, ConfigError):
    """PyTorch is not installed."""

    def __init__(self, message: str) -> None:
        ImportError.__init__(self, message)
        self.message = message
        self.where = None


try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where torch is absent
    raise TorchMissing("recording needs PyTorch, which is not installed: pip install "
                       "'vsim[torch]' (a CUDA build for GPU traces)") from None
