"""Convolution algorithm variants: vDNN's performance-optimal (p) and memory-optimal (m).

Below the engine and the policies: the engine's workspace fallback (vsim.engine.simulate) and
the policies' `algo` parameter both take their workspace-free times from here. The policies'
`algo`: auto (default) runs a convolution without workspace only where its working set cannot
fit otherwise, as cuDNN frameworks do when the workspace allocation fails; performance keeps the
recorded algorithms; memory runs all of them without workspace (policies.planning.
algorithm_retimes).

A recorded trace holds one algorithm per convolution: the one cuDNN picked (PyTorch's default, with
benchmark off, is the heuristic's fastest pick and may take a workspace). The (m) variant is
implicit GEMM with no workspace. Its time, in order of preference:
1. the op's `dur_us_memory_algo` attr: measured (the H100 traces: validation/workspace-free),
   or written by retargeting and synthesis (`memory_algo` says which: "model" when
   vsim.compute modelled it);
2. when the trace names the GPU its times belong to (meta.hardware), the compute model on the
   hardware `hw` the run is given, which takes the trace's op times as its own (`vsim run`
   retargets a trace recorded on another GPU first): the recorded time scaled by the model's
   (m)/(p) ratio for that op (vsim.compute.memory_algo_time_us: implicit GEMM at the profile's
   `implicit_gemm` fraction of the fp32 peak, no layout transform). The profile is the one given,
   with its `--set` overrides, never one looked up by name;
3. without a known GPU, MEMORY_ALGO_SLOWDOWN times the recorded time (SLOWDOWN_NOTE).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

from .compute import Efficiencies, load_efficiencies, memory_algo_ratio, op_class, op_costs
from .errors import HardwareError
from .hardware import Hardware
from .plan import Retime
from .trace.schema import Op, Tensor, Trace

# Implicit-GEMM (no workspace) against the fastest algorithm, for traces whose GPU is unknown:
# cuDNN's own benchmarks put IMPLICIT_GEMM at about 1.3-2x the fastest algorithm on large 3x3
# convolutions; 1.5x is that range's middle. An estimate, and the report says so.
MEMORY_ALGO_SLOWDOWN = 1.5
SLOWDOWN_NOTE = (f"algo=memory: convolution times without a recorded or modelled implicit-GEMM "
                 f"time are estimated as {MEMORY_ALGO_SLOWDOWN}x the recorded (fastest) time")


_EFFICIENCIES: dict[str, Efficiencies | None] = {}


def _efficiencies(hw: Hardware) -> Efficiencies | None:
    """The profile's fitted efficiencies (None: no efficiency file), cached by the profile's
    full text (overrides included): a run plans several times, and reading the file costs about
    a millisecond."""
    key = _hw_text(hw)
    if key not in _EFFICIENCIES:
        if len(_EFFICIENCIES) >= 16:
            _EFFICIENCIES.clear()
        try:
            _EFFICIENCIES[key] = load_efficiencies(hw)
        except HardwareError:
            _EFFICIENCIES[key] = None
    return _EFFICIENCIES[key]


_RETIMES: dict[tuple[int, str], tuple[weakref.ref[Trace], list[Retime], list[str]]] = {}
_HW_TEXT: dict[int, tuple[Hardware, str]] = {}


def _hw_text(hw: Hardware) -> str:
    """repr(hw), the profile's full text (a frozen dataclass: it cannot change), once per
    profile object (the runs of a planning ask for every one of them)."""
    got = _HW_TEXT.get(id(hw))
    if got is None or got[0] is not hw:
        if len(_HW_TEXT) >= 64:
            _HW_TEXT.clear()
        got = _HW_TEXT[id(hw)] = (hw, repr(hw))  # (held: its id is not reused meanwhile)
    return got[1]



def memory_optimal_retimes(trace: Trace, hw: Hardware) -> tuple[list[Retime], list[str]]:
    """Retime every convolution op to its workspace-free algorithm on `hw` (see the module
    docstring for where each time comes from); notes say how many times were modelled or
    estimated. Computed once per trace and profile (a trace is immutable; the profile is
    keyed by its full text, overrides included): a capacity-aware policy asks at every budget
    it plans for, and the compute model's pass over the trace was a sixth of superneurons'
    own planning. Fresh lists on every call."""
    key = (id(trace), _hw_text(hw))
    got = _RETIMES.get(key)
    if got is None or got[0]() is not trace:
        got = _RETIMES[key] = (weakref.ref(trace), *_memory_optimal_retimes(trace, hw))
        weakref.finalize(trace, _RETIMES.pop, key, None)
    return list(got[1]), list(got[2])


def _memory_optimal_retimes(trace: Trace, hw: Hardware) -> tuple[list[Retime], list[str]]:
    eff = _efficiencies(hw) if trace.meta.get("hardware") else None
    costs = op_costs(trace) if eff is not None else {}
    retimes: list[Retime] = []
    counts = {"measured": 0, "modelled": 0, "estimated": 0}
    for op in trace.ops:
        if op.layer_type != "conv" or op_class(op) not in ("conv_fwd", "conv_bwd"):
            continue
        attr = op.attr("dur_us_memory_algo")
        if attr is not None:
            how = "modelled" if op.attr("memory_algo") == "model" else "measured"
            dur = float(attr)
        elif eff is not None and op.dur_us > 0:
            busy = math.fsum(k.dur_us for k in op.kernels) if op.kernels else op.dur_us
            ratio = memory_algo_ratio(costs[op.id], hw, eff)
            how, dur = "modelled", op.dur_us - busy + busy * ratio
        else:
            how, dur = "estimated", op.dur_us * MEMORY_ALGO_SLOWDOWN
        counts[how] += 1
        retimes.append(Retime(op=op.id, dur_us=dur, workspace_bytes=0, note=how))
    notes = []
    if counts["modelled"]:
        notes.append(f"algo=memory: {counts['modelled']} convolution time(s) modelled "
                     f"(implicit GEMM without workspace, by the compute model of "
                     f"{hw.name})")
    if counts["estimated"]:
        notes.append(SLOWDOWN_NOTE + f" ({counts['estimated']} ops)")
    return retimes, notes


# Micro-batching: a convolution run as `parts` calls on slices of its batch, each result copied
# into place (vsim.runtime.microbatch). cuDNN's workspace grows with the batch, so each part
# needs about 1/parts of it (VGG-16's conv 0.2 on the H100: 1.64 GB at batch 64, 6.58 GB at 256,
# validation/workspace-free/h100/vgg16-b*-room.convs.json) while the work stays the same.
MICROBATCH_PARTS = (2, 4, 8, 16, 32)
# What each part beyond the first adds to a pass (us): its own calls' issue and launch, and a
# kernel too small to fill the GPU. Fitted: the median, over every convolution of vgg16(256),
# resnet50(64) and alexnet(128) and every part count, of a split pass's time beyond its
# recorded time and copies, per extra part, measured on the H100 with the runtime's own
# split (validation/microbatch/probe_parts.py, README.md). Held out (densenet121,
# efficientnet_b0, mobilenet_v2, regnet_y_1_6gf): summed split time within -23% to +29% for
# every part count, where work linear in the batch alone missed by -14% to -94%. Probed on
# the H100 only; other GPUs take it as it is.
MICROBATCH_PART_US = 59.7


def workspace_bytes(op: Op, tensors: Mapping[int, Tensor]) -> int:
    """The bytes of the workspaces `op` writes."""
    return sum(tensors[t].size_bytes for t in op.writes if tensors[t].kind == "workspace")


def microbatch_retime(op: Op, tensors: Mapping[int, Tensor], hw: Hardware,
                      parts: int) -> Retime | None:
    """`op` (a convolution's forward or backward op that writes a workspace) run as `parts`
    micro-batches with its recorded algorithm: the same kernels' work (the recorded time), plus
    copying each part's results into place (read and written once at the profile's DRAM
    bandwidth), plus MICROBATCH_PART_US for each part beyond the first. Beyond its results it
    allocates one part's workspace and one part's results, `workspace_bytes`. None: no
    workspace to split."""
    ws = workspace_bytes(op, tensors)
    results = sum(tensors[t].size_bytes for t in op.writes if tensors[t].kind != "workspace")
    if ws == 0 or parts < 2:
        return None
    copy_us = 2 * results / hw.dram_bytes_per_us
    extra = -(-ws // parts) + -(-results // parts)
    return Retime(op=op.id, dur_us=op.dur_us + copy_us + (parts - 1) * MICROBATCH_PART_US,
                  workspace_bytes=extra,
                  note="micro-batched", parts=parts)
