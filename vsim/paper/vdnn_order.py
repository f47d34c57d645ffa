"""vDNN's own allocation order replayed through the cnmem model (the VGG-16(256) headline).

The engine allocates as PyTorch runs a trace: an op's outputs at its launch, a prefetch when its
copy process starts (after the launching op's outputs), every tensor freed after its last use.
vDNN's framework allocates per layer, in the order its paper gives (shared/reference/
vdnn-titanx.md) and that its re-implementation by the vDNN++ authors (github.com/shriramsb/vDNN,
src/neural_net.cu, simulateCNMEMMemory) issues cnmemMalloc/cnmemFree in:

- weights first, for the whole run (outside the feature-map traffic);
- forward, per layer (ReLU in place, no layer of its own): malloc Y, malloc and free the
  workspace, then free X if the layer offloads it (after the per-layer sync);
- backward, from the top: malloc the loss gradient; per layer i, malloc the prefetch buffer of
  the closest offloaded layer below (search stops at the first CONV), then malloc dX_i, malloc and
  free the workspace, then free layer i's Y and dY ("X and dX are kept for the layer below").
- ReLU is a layer of its own in vDNN ("ReLU layers never offload"), in place: its backward
  overwrites dY with dX and, its backward done, its Y is released. That Y is the buffer of the
  CONV/FC below it, whose backward reads X, dY and W, never Y (cuDNN's convolution backward
  data/filter, cuBLAS), so a layer followed by a ReLU has its Y freed before its own dX is
  allocated. The re-implementation instead fuses the activation into the CONV layer and frees Y
  after the CONV's backward (`fused_relu=True`): that keeps four maps of 64x224x224 at conv1_2's
  backward (X, Y, dY, dX), 12.9 GiB at batch 256 with the weights, which no 12 GB card holds
  whatever the allocator, against the paper's measured run.

cnmem itself (NVIDIA/cnmem src/cnmem.cpp, read for this): best fit over an address-ordered free
list, strict `<` so the lowest address wins ties; the used block is the head of the free block
and the tail stays free; release merges with both neighbours unless a neighbour is the head of
another cudaMalloc; sizes rounded up to 512 B (CNMEM_GRANULARITY); a root that finds no block
cudaMallocs exactly the request unless CNMEM_FLAGS_CANNOT_GROW, and steals only between
per-stream child managers. vsim.allocator.pooled models all of that except growth and stream
children: with the pool sized to the whole card, as vDNN ran it, there is nothing to grow into.

Only chain networks (every layer's X is the previous layer's Y) are replayed; `replay` returns
None for others.
"""

from __future__ import annotations

from typing import Any

from ..allocator.pooled import PooledAllocator
from ..trace.schema import Trace
from .vdnn import FwdLayer, forks, forward_layers


def _bwd_workspace(trace: Trace) -> dict[str, int]:
    """Largest backward workspace per layer name, bytes."""
    tensors = trace.tensor_by_id()
    out: dict[str, int] = {}
    for op in trace.ops:
        if op.phase == "bwd":
            ws = sum(tensors[t].size_bytes for t in op.writes if tensors[t].kind == "workspace")
            out[op.layer] = max(out.get(op.layer, 0), ws)
    return out


class _Out(Exception):
    pass


def _relu_after(trace: Trace) -> set[str]:
    """Names of the forward layers whose output an in-place ReLU reads next."""
    out: set[str] = set()
    last = None
    for op in trace.ops:
        if op.phase != "fwd":
            continue
        if op.layer_type == "relu":
            if last is not None:
                out.add(last)
        elif op.layer_type != "loss":
            last = op.layer
    return out


def replay(trace: Trace, capacity_bytes: int, mode: str, memory_algo: bool,
           first_fit: bool = False, fused_relu: bool = False,
           dx_first: bool = False) -> dict[str, Any] | None:
    """vDNN_`mode` ('all' | 'conv') on `trace` in vDNN's allocation order through the cnmem
    model at `capacity_bytes`: {fits, peak_bytes (what was live at most), need_bytes and
    largest_free_bytes at the failing request, failed (what)}; None for a non-chain network.
    `fused_relu`: the re-implementation's order (Y freed after the CONV's backward);
    `dx_first`: a layer's dX allocated before the prefetch buffer (the order of vDNN++'s
    simulateNeuralNetworkMemory, shriramsb/vdnn-plus-plus vdnn/src/neural_net.cu)."""
    if forks(trace):
        return None
    layers: list[FwdLayer] = forward_layers(trace)
    relu = set() if fused_relu else _relu_after(trace)
    bws = _bwd_workspace(trace)
    pool = PooledAllocator(capacity_bytes, first_fit=first_fit)
    state = {"peak": 0}

    def malloc(size: int, what: str) -> object | None:
        if size <= 0:
            return None
        block = pool.malloc(size)
        if block is None:
            raise _Out(what, size)
        state["peak"] = max(state["peak"], pool.allocated_bytes)
        return block

    def free(block: object | None) -> None:
        if block is not None:
            pool.free(block)

    n = len(layers)
    offload = [mode == "all" or (mode == "conv" and lay.layer_type == "conv") for lay in layers]
    if n:
        offload[-1] = False  # the topmost layer: nothing above it to prefetch during
    images = max((t.size_bytes for t in trace.tensors if t.kind == "input"), default=0)
    x_size = [images] + [lay.y for lay in layers]
    x: list[object | None] = [None] * (n + 1)
    dx: list[object | None] = [None] * (n + 1)
    try:
        malloc(sum(t.size_bytes for t in trace.tensors if t.kind == "weight"), "weights")
        x[0] = malloc(images, "input")
        for i, lay in enumerate(layers):
            x[i + 1] = malloc(lay.y, f"Y of {lay.name}")
            free(malloc(0 if memory_algo else lay.ws, f"workspace of {lay.name}"))
            if offload[i]:
                free(x[i])
                x[i] = None
        dx[n] = malloc(layers[-1].y if n else 0, "loss gradient")
        fetched = [False] * n
        for i in range(n - 1, -1, -1):
            if layers[i].name in relu and layers[i].layer_type in ("conv", "fc"):
                # the ReLU layer above ran its backward in place: its Y (this layer's) goes
                free(x[i + 1])
                x[i + 1] = None
            if i > 0 and dx_first:
                dx[i] = malloc(x_size[i], f"dX of {layers[i].name}")
            if i > 0:
                for k in range(i - 1, -1, -1):
                    if offload[k] and not fetched[k]:
                        fetched[k] = True
                        x[k] = malloc(x_size[k], f"prefetch of {layers[k].name}'s X")
                        break
                    if layers[k].layer_type == "conv":
                        break
                if not dx_first:
                    dx[i] = malloc(x_size[i], f"dX of {layers[i].name}")
            free(malloc(0 if memory_algo else bws.get(layers[i].name, 0),
                        f"backward workspace of {layers[i].name}"))
            free(x[i + 1])
            free(dx[i + 1])
            x[i + 1] = dx[i + 1] = None
        return {"fits": True, "peak_bytes": state["peak"], "failed": None,
                "need_bytes": 0, "largest_free_bytes": pool.largest_free_bytes()}
    except _Out as out:
        what, size = out.args
        return {"fits": False, "peak_bytes": state["peak"], "failed": what,
                "need_bytes": pool.allocated_bytes + size,
                "largest_free_bytes": pool.largest_free_bytes(), "request_bytes": size,
                "free_bytes": pool.free_in_segments_bytes()}


def smallest_pool(trace: Trace, mode: str, memory_algo: bool, low: int, high: int,
                  dx_first: bool = False, step: int = 2**24) -> int | None:
    """The smallest cnmem pool (bytes, to `step`) in [low, high] in which vDNN's order fits,
    by bisection (fitting is taken as monotonic in the pool size); None if not even at high."""
    def fits(cap: int) -> bool:
        r = replay(trace, cap, mode, memory_algo, dx_first=dx_first)
        return bool(r and r["fits"])
    if not fits(high):
        return None
    while high - low > step:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return high
