"""Bring captures made with PyTorch's own tools into vsim traces, without torch.

- `import_kineto(path)`: a torch.profiler Chrome-trace export (JSON, optionally gzip). Ops are the
  top-level CPU ops (one aten op in forward, one autograd node in backward, each optimizer op),
  timed by their GPU kernels when the capture has them, by their CPU span otherwise; tensors come
  from the "[memory]" events when the capture was made with profile_memory=True.
- `import_torch_snapshot(path)`: a pickle from torch.cuda.memory._dump_snapshot. It holds
  allocator events only, so each allocation becomes an op of its own, timed by the allocator's
  CPU clock. The pickle is read with an unpickler that refuses every class outside a few builtins.

The recorder (vsim.record) joins its passes through the same pieces, so they live here, free of
torch: `parse_chrome` (the profiler's event tree reduced to top-level ops with their kernels,
allocator events and markers), `build_trace` (ops with allocation events -> tensors, frees,
dependencies, kinds), `op_layer_type` and `stream_map`.

In parts: chrome.py (the Chrome trace's parsing), build.py (op vocabulary, trace builder,
allocation tracking), kineto.py and snapshot.py (one importer each); this package re-exports them.
"""

from __future__ import annotations

from .build import (
    BWD_PREFIX,
    OPTIMIZER_PREFIX,
    AllocDraft,
    AllocTracker,
    Built,
    OpDraft,
    build_trace,
    op_layer_type,
    short_op_name,
    stream_map,
)
from .chrome import (
    KERNEL_NAME_CHARS,
    Annotation,
    Capture,
    CpuOp,
    KernelRec,
    MemRec,
    containing,
    innermost,
    load_chrome,
    parse_chrome,
)
from .kineto import backward_layers, clip_overlaps, import_kineto
from .kineto import phases_of as phases_of  # vsim.record.assemble uses it
from .snapshot import block_size, import_torch_snapshot, snapshot_blocks

__all__ = [
    "BWD_PREFIX", "KERNEL_NAME_CHARS", "OPTIMIZER_PREFIX",
    "AllocDraft", "AllocTracker", "Annotation", "Built", "Capture", "CpuOp", "KernelRec",
    "MemRec", "OpDraft", "backward_layers", "build_trace", "clip_overlaps", "containing",
    "import_kineto", "import_torch_snapshot",
    "innermost", "load_chrome", "op_layer_type", "parse_chrome", "short_op_name",
    "block_size", "snapshot_blocks", "stream_map",
]
