"""The vsim-trace data model: frozen dataclasses, one per thing a trace records.

A trace is one training iteration. Ops run on CUDA streams in trace order; tensors are allocated
when their producer op starts (or before the iteration when they have no producer: weights,
optimizer state, inputs) and released when the op that lists them in `frees` ends; a tensor no op
frees lives to the end of the iteration. Times are microseconds from the iteration's start,
sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT = "vsim-trace"
SCHEMA_VERSION = 1

TENSOR_KINDS = (
    "weight", "activation", "gradient", "optimizer_state", "workspace", "temporary", "input",
)
PHASES = ("fwd", "bwd", "opt", "other")
SOURCES = ("measured", "predicted", "synthetic")
MEM_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom")
COPY_DIRECTIONS = ("h2d", "d2h")


@dataclass(frozen=True, slots=True)
class Tensor:
    """One device allocation. `producer` is the op that allocates it (None: resident from the
    start); `consumers` are the ops that read it after it was written."""

    id: int
    size_bytes: int
    kind: str
    name: str = ""
    producer: int | None = None
    consumers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Kernel:
    """One GPU kernel (or memset/memcpy activity) an op launched, as the profiler saw it."""

    name: str
    stream: int
    start_us: float
    dur_us: float


@dataclass(frozen=True, slots=True)
class Op:
    """One unit of work on a stream: a layer's forward or backward piece, or an optimizer step.

    `start_us`/`dur_us` span the op's kernels on its stream. `reads` lists tensors it reads,
    `writes` the tensors it allocates and writes (it is their producer), `frees` the tensors
    released when it ends. `deps` are ops that must finish first besides the previous op on the
    same stream. `flops` and `dram_bytes` (0 when unknown) let a compute model retarget the time.
    """

    id: int
    name: str
    layer: str
    layer_type: str
    phase: str
    start_us: float
    dur_us: float
    stream: int = 0
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()
    deps: tuple[int, ...] = ()
    kernels: tuple[Kernel, ...] = ()
    flops: float = 0.0
    dram_bytes: float = 0.0
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str, default: Any = None) -> Any:
        """An extra attribute the recorder kept (e.g. conv algorithm, workspace bytes)."""
        for name, value in self.attrs:
            if name == key:
                return value
        return default


@dataclass(frozen=True, slots=True)
class Copy:
    """A host<->device transfer on a copy stream (in predicted traces, or measured runs)."""

    tensor: int
    direction: str
    size_bytes: int
    start_us: float
    dur_us: float
    stream: int


@dataclass(frozen=True, slots=True)
class MemEvent:
    """One caching-allocator event in PyTorch's vocabulary
    (torch.cuda.memory._record_memory_history): alloc, free_requested, free_completed, ..."""

    action: str
    time_us: float
    addr: int
    size_bytes: int
    stream: int = 0
    tensor: int | None = None
    op: int | None = None


@dataclass(frozen=True, slots=True)
class Measured:
    """What the real run measured, without the profiler: median iteration time and peaks."""

    iteration_time_us: float
    peak_allocated_bytes: int
    peak_reserved_bytes: int


@dataclass(frozen=True)  # one per trace: no __slots__ (callers copy it through __dict__)
class Trace:
    """One training iteration. `meta` holds provenance (source, model, batch_size, device, torch,
    cuda, cudnn, recorder, hardware, date, command, ...)."""

    meta: dict[str, Any]
    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    measured: Measured | None = None
    copies: tuple[Copy, ...] = ()
    mem_events: tuple[MemEvent, ...] = ()
    counters: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    @property
    def source(self) -> str:
        return str(self.meta.get("source", ""))

    def tensor_by_id(self) -> dict[int, Tensor]:
        return {t.id: t for t in self.tensors}
