"""Which trace op and tensor each aten call of an iteration is: the map `vsim measure` acts by.

`map_ops` runs one iteration under the recorder's STRUCTURE pass (vsim.record.recorder: the
profiler, its dispatch mode, saved-tensor hooks, module hooks) with a counting dispatch mode on
top, and joins the two exactly as the recorder does (`assemble.structure_ops` and the trace
builder's op numbering: ops with kernels or allocator events on the GPU, every op on the CPU). The
result, an `OpMap`, says for every aten call that a dispatch mode sees in an iteration (profiler
ops not counted) which trace op it belongs to, and which of its outputs is which trace tensor. It
checks the enumeration against the trace it is given: the op names must be the trace's, op for
op, and a located tensor must have the trace's size (tensors are matched by producer op and
position among its outputs, so the ids of resident blocks need not agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import TraceError
from ..record.assemble import DISPATCH, align, structure_ops
from ..trace.importers import build_trace, short_op_name
from ..trace.schema import Trace

BLOCK_SLACK = (1 << 20) + 512  # kSmallSize: a larger remainder splits the block


class OpSequenceError(TraceError):
    """The run's ops are not the trace's (another model, batch, PyTorch version, or eager code
    that branches): the plan's op ids would point at the wrong places."""


def _addr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def is_profiler_op(func: Any) -> bool:
    return getattr(func, "namespace", "") == "profiler"


# ---------------------------------------------------------------- the map from calls to ops

@dataclass
class OpMap:
    """Aten calls of one iteration (as a dispatch mode sees them, profiler ops not counted) and
    where each belongs in the trace. `call_op[k]`: the trace op of call k (-1 before the first
    op; calls of ops the trace dropped -- views without kernels or allocations -- belong to the
    op before). `outputs[k]`: (index among the call's flattened outputs, trace tensor id) of the
    outputs that are allocations of the trace. `inputs`: trace tensor id -> index among the
    step's flattened input tensors."""

    funcs: list[Any]
    call_op: list[int]
    outputs: dict[int, list[tuple[int, int]]]
    inputs: dict[int, int]
    op_names: list[str]
    diagnostics: dict[str, Any] = field(default_factory=dict)

    @property
    def n_calls(self) -> int:
        return len(self.funcs)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (functions by name): a map made in another process can be used here."""
        return {"funcs": [str(f) for f in self.funcs], "call_op": self.call_op,
                "outputs": {str(k): v for k, v in self.outputs.items()},
                "inputs": {str(k): v for k, v in self.inputs.items()},
                "op_names": self.op_names, "diagnostics": self.diagnostics}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> OpMap:
        funcs = []
        for name in doc["funcs"]:
            ns, op, overload = name.split(".")
            funcs.append(getattr(getattr(getattr(torch.ops, ns), op), overload))
        return cls(funcs, list(doc["call_op"]),
                   {int(k): [tuple(x) for x in v] for k, v in doc["outputs"].items()},
                   {int(k): int(v) for k, v in doc["inputs"].items()}, list(doc["op_names"]),
                   dict(doc.get("diagnostics", {})))


class _CallLog(TorchDispatchMode):
    """On top of the recorder's dispatch mode: each call's function, the recorder's own index of
    the call (its marker d#N) and the storage addresses of its tensor outputs."""

    def __init__(self, dispatch_log: list[Any], device_type: str) -> None:
        super().__init__()
        self.dispatch_log = dispatch_log
        self.device_type = device_type
        self.funcs: list[Any] = []
        self.rec_index: list[int] = []
        self.outs: list[list[tuple[int, int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        before = len(self.dispatch_log)
        out = func(*args, **(kwargs or {}))
        if is_profiler_op(func):
            return out
        self.funcs.append(func)
        self.rec_index.append(len(self.dispatch_log) - 1 if len(self.dispatch_log) > before
                              else -1)
        leaves, _ = tree_flatten(out)
        self.outs.append([(j, _addr(x)) for j, x in enumerate(leaves)
                          if isinstance(x, torch.Tensor) and x.device.type == self.device_type])
        return out


def map_ops(step: Callable[[], Any], model: torch.nn.Module, optimizer: Any, inputs: Any,
            loss_fn: Any, device: torch.device, trace: Trace) -> OpMap:
    """Run `step()` once under the recorder's structure pass and map its aten calls to `trace`'s
    ops and tensors. OpSequenceError when the iteration's ops are not the trace's."""
    from ..record.recorder import Recorder

    rec = Recorder(model, optimizer, inputs=inputs, loss_fn=loss_fn, device=device)
    calls = _CallLog(rec.log.dispatch, device.type)
    rec.begin_structure()
    try:
        with calls:
            step()
    except BaseException:
        rec.cleanup()
        raise
    rec.end_structure()
    sops, allocs, _ = structure_ops(rec.structure_capture, rec.log)
    gpu = device.type == "cuda"
    names = [short_op_name(s.draft.name) for s in sops]
    want = [op.name for op in trace.ops]
    # The recorder keeps ops with kernels or allocator events (GPU) and every op (CPU).
    kept = [i for i, s in enumerate(sops) if not gpu or s.op.kernels or s.draft.events]
    if [names[i] for i in kept] != want:
        found: dict[int, int] = {}
        for a, b in align(names, want):
            if a is not None and b is not None:
                found[b] = a
        missing = [j for j in range(len(want)) if j not in found]
        if missing:
            j = missing[0]
            near = ", ".join(names[max(0, (found.get(j - 1, -1)) + 1):][:4]) or "nothing"
            raise OpSequenceError(
                f"the run's ops differ from the trace's: trace op {j} ({want[j]}, "
                f"{trace.ops[j].phase}) has no counterpart (the run has {near} there); "
                f"{len(missing)} of {len(want)} trace ops unmatched")
        kept = [found[j] for j in range(len(want))]
    op_of_draft = {i: n for n, i in enumerate(kept)}
    built = build_trace([sops[i].draft for i in kept], allocs, drop_idle=False)
    # tensor ids of this run's assembly -> the given trace's (by producer and output position)
    xlate: dict[int, int] = {}
    size_mismatch = 0
    mine = {t.id: t for t in built.tensors}
    theirs = trace.tensor_by_id()
    approximate = 0
    for a_op, b_op in zip(built.ops, trace.ops, strict=True):
        for a, b in zip(a_op.writes, b_op.writes, strict=False):
            # Sizes are block sizes: the caching allocator hands out a whole free block when the
            # rest would be 1 MiB or less, so one request can get blocks up to 1 MiB apart.
            diff = abs(mine[a].size_bytes - theirs[b].size_bytes)
            if diff <= BLOCK_SLACK:
                xlate[a] = b
                approximate += diff > 0
            else:
                size_mismatch += 1
    # the recorder's dispatch markers: which draft op each recorder call index fell in
    marker: dict[int, tuple[int, int]] = {}
    for i, s in enumerate(sops):
        for ts, name in s.op.markers:
            if name.startswith(DISPATCH):
                try:
                    marker[int(name[len(DISPATCH):])] = (i, ts)
                except ValueError:
                    continue
    prev_kept: list[int] = []
    last = -1
    for i in range(len(sops)):
        if i in op_of_draft:
            last = op_of_draft[i]
        prev_kept.append(last)
    call_op: list[int] = []
    outputs: dict[int, list[tuple[int, int]]] = {}
    located = 0
    for k, r in enumerate(calls.rec_index):
        where = marker.get(r)
        if where is None:
            call_op.append(call_op[-1] if call_op else -1)
            continue
        i, ts = where
        call_op.append(prev_kept[i])
        if i not in op_of_draft:
            continue
        events = sops[i].mem
        freed_here = {aid for m, aid in events if m.delta < 0}
        outs = []
        for j, ptr in calls.outs[k]:
            hits = [aid for m, aid in events if m.delta > 0 and m.addr == ptr and m.ts_ns <= ts]
            if not hits or hits[-1] in freed_here:
                continue
            tid = built.tensor_of_alloc.get(hits[-1])
            if tid is not None and tid in xlate:
                outs.append((j, xlate[tid]))
        if outs:
            outputs[k] = outs
            located += len(outs)
    inputs_map = {}
    for t in trace.tensors:
        if t.producer is None and t.kind == "input" and t.name.startswith("input "):
            try:
                inputs_map[t.id] = int(t.name.split()[1])
            except ValueError:
                continue
    diag = {"calls": len(calls.funcs), "ops": len(want), "structure_ops": len(sops),
            "tensors_located": located, "tensor_size_mismatches": size_mismatch,
            "tensor_sizes_within_a_block": approximate,
            "kept_by_rule": [names[i] for i in kept] == want}
    return OpMap(calls.funcs, call_op, outputs, inputs_map, want, diag)
