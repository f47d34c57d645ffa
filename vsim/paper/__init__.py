"""The seed papers' published figures against the simulator (validation/paper/, `kind: paper`).

vsim.paper.vdnn: the vDNN paper (Fig. 1/4 baseline, Fig. 6 times, the policies, the deep VGGs);
vsim.paper.headline: vDNN's VGG-16(256) headline under cnmem, in the engine's and in vDNN's own
allocation order (vsim.paper.vdnn_order); vsim.paper.seeds: the other seeds' figures, with
vsim.paper.superneurons for SuperNeurons' semantics (trace transforms) and Fig. 10's CONV offload;
vsim.paper.report: the text `vsim validate` prints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .report import format_result
from .vdnn import (
    FwdLayer,
    feature_time_us,
    forks,
    forward_layers,
    is_paper_file,
    layer_times,
    load_paper,
    policy_rows,
    policy_rows_dyn,
    vdnn_baseline,
    vdnn_semantics,
)

__all__ = ["FwdLayer", "check", "feature_time_us", "forks", "format_result", "forward_layers",
           "is_paper_file", "layer_times", "load_paper", "policy_rows", "policy_rows_dyn",
           "vdnn_baseline", "vdnn_semantics"]


def check(path: str | Path, progress: Callable[[str], None] | None = None,
          policies: bool = True) -> dict[str, Any]:
    """Every comparison of one paper file (the vDNN file or a seed file with `figures:`)."""
    import yaml

    from ..errors import ConfigError
    from . import vdnn
    from .seeds import check_figures

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read ({exc})", str(path)) from None
    if isinstance(doc, dict) and doc.get("kind") == "paper" and "figures" in doc:
        for key in ("hardware", "tolerance"):
            if key not in doc:
                raise ConfigError(f"missing required field {key!r}", str(path))
        return check_figures(path, doc, progress or (lambda _m: None))
    return vdnn.check(path, progress, policies)
