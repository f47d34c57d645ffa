"""SuperNeurons' semantics (Wang et al., PPoPP 2018) as trace -> trace transforms, for its Fig. 10.

Read from its runtime (linnanwang/superneurons-release, src/layer/*.cpp, src/liveness.cpp,
src/mem_control.cpp), as vsim.paper.vdnn does for vDNN:

- `collapse_lrn`: PyTorch builds LocalResponseNorm from seven small ops whose intermediates are
  saved for backward; cuDNN's LRN (cudnnLRNCrossChannelForward/Backward, what
  local_response_norm_layer.cpp calls) is one op each way: forward reads X and writes Y, backward
  reads X, Y and dY and writes dX. Each LRN layer's chain becomes that one op, under the layer's
  name, its time the sum of the chain's.
- `superneurons_semantics`: each layer's backward reads what its `register_backward_dependency`
  lists: ACT and LRN read X and Y, POOL reads X and Y (no indices), CONV and FC read X, DROPOUT
  neither (its mask is a PARAM reserve space); ACT and LRN write dX into dY
  (set_b_data(dEdD): in place); the first CONV also computes dX of the data (backward_setup
  allocates b_data for every CONV). Fig. 10 counts DATA tensors only (its baseline is 36 tensors:
  23 layer outputs and 13 backward b_data; mem_control.cpp regulates DATA and CONV_BUFF), so
  weights, their gradients and momentum, the data layer's images, workspaces and dropout masks
  take no bytes here.
- `ConvOffload`: UTP's offload of every CONV output after its last forward reader and prefetch
  one backward CONV ahead of its first backward need (Fig. 10's third step names the CONV
  outputs it offloads), added to another policy's plan.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from ..hardware import Hardware
from ..plan import Offload, Plan, Prefetch, Recompute, RunPlan
from ..trace.schema import Op, Tensor, Trace

# per layer type, what SuperNeurons' backward reads of its forward op: X (inputs), Y (outputs)
BWD_READS = {"relu": "XY", "lrn": "XY", "pool": "XY", "conv": "X", "fc": "X", "dropout": ""}
IN_PLACE_BWD = ("relu", "lrn")  # act_layer_t and LRN_layer_t: b_data is the next layer's dEdD
FEATURE_KINDS = ("activation", "input")


def _chains(ops: tuple[Op, ...], layer_type: str) -> list[list[int]]:
    """Runs of consecutive ops (indices) of one layer and phase of type `layer_type`."""
    runs: list[list[int]] = []
    for i, op in enumerate(ops):
        prev = ops[i - 1] if i else None
        if op.layer_type != layer_type:
            continue
        if runs and prev is not None and runs[-1][-1] == i - 1 and prev.layer == op.layer \
                and prev.phase == op.phase:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _rebuild(trace: Trace, ops: list[Op], tensors: dict[int, Tensor], note: str) -> Trace:
    """The trace with `ops` and `tensors`, producers and consumers recomputed from reads/writes."""
    producer: dict[int, int] = {}
    consumers: dict[int, list[int]] = defaultdict(list)
    for op in ops:
        for t in op.writes:
            producer.setdefault(t, op.id)
        for t in op.reads:
            if producer.get(t) != op.id and op.id not in consumers[t]:
                consumers[t].append(op.id)
    new = tuple(dataclasses.replace(t, producer=producer.get(t.id),
                                    consumers=tuple(consumers.get(t.id, ())))
                for t in sorted(tensors.values(), key=lambda t: t.id))
    meta = {**trace.meta, "semantics": f"{trace.meta.get('semantics', '')} {note}".strip()}
    return dataclasses.replace(trace, ops=tuple(ops), tensors=new, meta=meta)


def _move_frees(ops: list[Op], t: int, to: int) -> None:
    """Free tensor `t` at the end of ops[to] and nowhere else."""
    for i, op in enumerate(ops):
        if t in op.frees and i != to:
            ops[i] = dataclasses.replace(op, frees=tuple(x for x in op.frees if x != t))
    if t not in ops[to].frees:
        ops[to] = dataclasses.replace(ops[to], frees=(*ops[to].frees, t))


def _free_index(ops: list[Op], t: int) -> int | None:
    return next((i for i, op in enumerate(ops) if t in op.frees), None)


def collapse_lrn(trace: Trace) -> Trace:
    """Each LRN layer's forward and backward op chain as one cuDNN LRN op (module docstring)."""
    ops = list(trace.ops)
    tensors = dict(trace.tensor_by_id())
    runs = _chains(trace.ops, "lrn")
    if not runs:
        return trace
    merged_into: dict[int, int] = {}   # removed op id -> the merged op's id
    y_of: dict[str, int] = {}          # layer -> its forward Y
    x_of: dict[str, tuple[int, ...]] = {}
    removed: set[int] = set()
    for run in runs:
        chain = [trace.ops[i] for i in run]
        ids = {op.id for op in chain}
        written = {t for op in chain for t in op.writes}
        ext_reads = tuple(dict.fromkeys(t for op in chain for t in op.reads if t not in written))
        # tensors the chain writes that an op after it reads: Y forward, dX backward
        later = {t for op in trace.ops[run[-1] + 1:] for t in op.reads}
        first, phase = chain[0], chain[0].phase
        if phase == "fwd":
            outs = [t for t in written if t in later and any(
                t in o.reads for o in trace.ops[run[-1] + 1:] if o.phase == "fwd")]
            reads = tuple(t for t in ext_reads if tensors[t].kind in FEATURE_KINDS)
            x_of[first.layer] = reads
            if len(outs) != 1:
                return trace  # not the chain this transform knows: leave the trace as it is
            y_of[first.layer] = outs[0]
        else:
            outs = [t for t in written if t in later]
            if len(outs) != 1 or first.layer not in y_of:
                return trace
            dys = [t for t in ext_reads if tensors[t].kind == "gradient"]
            reads = (*x_of[first.layer], y_of[first.layer], *dys)
        drop = written - set(outs)
        removed |= drop
        frees = tuple(dict.fromkeys(t for op in chain for t in op.frees if t not in drop))
        ops[run[0]] = dataclasses.replace(
            first, name="cudnnLRNCrossChannel" + ("Forward" if phase == "fwd" else "Backward"),
            dur_us=sum(op.dur_us for op in chain), reads=reads, writes=tuple(outs), frees=frees,
            deps=tuple(dict.fromkeys(d for op in chain for d in op.deps if d not in ids)),
            kernels=tuple(k for op in chain for k in op.kernels),
            flops=sum(op.flops for op in chain), dram_bytes=sum(op.dram_bytes for op in chain))
        for op in chain[1:]:
            merged_into[op.id] = first.id
    # the forward intermediates the backward chain read are gone: drop them from other ops too
    keep = [op for i, op in enumerate(ops) if op.id not in merged_into]
    keep = [dataclasses.replace(
        op, reads=tuple(t for t in op.reads if t not in removed),
        writes=tuple(t for t in op.writes if t not in removed),
        frees=tuple(t for t in op.frees if t not in removed),
        deps=tuple(dict.fromkeys(merged_into.get(d, d) for d in op.deps if
                                 merged_into.get(d, d) != op.id))) for op in keep]
    # Y and X are read by the backward op now: they live until it at least
    pos = {op.id: i for i, op in enumerate(keep)}
    for run in runs:
        op_id = trace.ops[run[0]].id
        i = pos[op_id]
        if keep[i].phase != "bwd":
            continue
        for t in keep[i].reads:
            f = _free_index(keep, t)
            if f is not None and f < i:
                _move_frees(keep, t, i)
    for t in removed:
        tensors.pop(t)
    return _rebuild(trace, keep, tensors, "lrn as cuDNN's (vsim.paper.superneurons)")


def _layer_ops(ops: list[Op]) -> tuple[dict[str, int], dict[str, int]]:
    """Per layer, the index of its (first) forward op and of its last backward op."""
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    for i, op in enumerate(ops):
        if op.phase == "fwd":
            fwd.setdefault(op.layer, i)
        elif op.phase == "bwd" and op.layer_type != "other":
            bwd[op.layer] = i
    return fwd, bwd


def superneurons_semantics(trace: Trace) -> Trace:
    """The trace as SuperNeurons' runtime holds AlexNet for Fig. 10 (module docstring)."""
    t0 = collapse_lrn(trace)
    ops = list(t0.ops)
    tensors = dict(t0.tensor_by_id())
    fwd, bwd = _layer_ops(ops)
    # 1. backward reads per SuperNeurons' backward dependencies
    for layer, b in bwd.items():
        f = fwd.get(layer)
        what = BWD_READS.get(ops[b].layer_type)
        if f is None or what is None:
            continue
        fop = ops[f]
        xs = [t for t in fop.reads if tensors[t].kind in FEATURE_KINDS]
        ys = [t for t in fop.writes if tensors[t].kind == "activation"]
        if fop.layer_type == "pool" and len(ys) == 2:  # indices: cuDNN's pooling keeps none
            ys = [min(ys, key=lambda t: tensors[t].size_bytes)]
        want = (xs if "X" in what else []) + (ys if "Y" in what else [])
        first_b = min(i for i, op in enumerate(ops) if op.layer == layer and op.phase == "bwd")
        ops[first_b] = dataclasses.replace(
            ops[first_b], reads=tuple(dict.fromkeys((*ops[first_b].reads, *want))))
        for t in want:
            fi = _free_index(ops, t)
            if fi is not None and fi < first_b:
                _move_frees(ops, t, first_b)
    # 2. the first CONV computes dX of the data too (a b_data of the images' size)
    zero: set[int] = set()
    next_id = max(tensors) + 1
    for i, op in enumerate(ops):
        if op.phase == "bwd" and op.layer_type == "conv":
            data = [t for t in op.reads if tensors[t].kind == "input"]
            if data:
                size = tensors[data[0]].size_bytes
                tensors[next_id] = Tensor(next_id, size, "gradient", f"b_data of {op.layer}")
                ops[i] = dataclasses.replace(op, writes=(*op.writes, next_id),
                                             frees=(*op.frees, next_id))
                next_id += 1
    # 3. ACT and LRN backward in place: dX takes no bytes, dY lives until dX's last use
    for op in list(ops):
        if op.phase != "bwd" or op.layer_type not in IN_PLACE_BWD:
            continue
        dxs = [t for t in op.writes if tensors[t].kind == "gradient"]
        dys = [t for t in op.frees if tensors[t].kind == "gradient" and t in op.reads]
        if len(dxs) != 1 or not dys:
            continue
        dx, dy = dxs[0], dys[0]
        j = _free_index(ops, dx)
        if j is None:
            continue
        zero.add(dx)
        _move_frees(ops, dy, j)
    # 4. Fig. 10 counts DATA tensors only
    for ten in tensors.values():
        if ten.kind in ("weight", "optimizer_state", "workspace", "input") or (
                ten.kind == "gradient" and ten.name.startswith("grad ")):
            zero.add(ten.id)
    for op in ops:
        if op.phase == "fwd" and op.layer_type == "pool":
            ys = [t for t in op.writes if tensors[t].kind == "activation"]
            if len(ys) == 2:
                zero.add(max(ys, key=lambda t: tensors[t].size_bytes))
        if op.phase == "fwd" and op.layer_type == "dropout":
            ys = [t for t in op.writes if tensors[t].kind == "activation"]
            if len(ys) == 2:
                zero.add(min(ys, key=lambda t: tensors[t].size_bytes))
    for z in zero:
        tensors[z] = dataclasses.replace(tensors[z], size_bytes=0)
    return _rebuild(t0, ops, tensors, "superneurons (vsim.paper)")


@dataclasses.dataclass(frozen=True)
class ConvOffload:
    """A Planner: `base`'s plan plus UTP's offload of every CONV output (module docstring)."""

    base: Any  # a vsim Policy

    def spec(self) -> str:
        return f"{self.base.spec()} + every CONV output offloaded (vsim.paper.superneurons)"

    def plan_with(self, trace: Trace, hw: Hardware, capacity_bytes: int,
                  run_plan: RunPlan) -> Plan:
        plan = self.base.plan_with(trace, hw, capacity_bytes, run_plan)
        return dataclasses.replace(plan, actions=(*plan.actions, *conv_offloads(trace, plan)))


def conv_offloads(trace: Trace, plan: Plan) -> list[Offload | Prefetch]:
    """Offload each CONV output after its last forward reader; prefetch it at the start of the
    last backward CONV before its first backward need (a backward reader or a recomputation
    that reads it)."""
    ops = trace.ops
    pos = {op.id: i for i, op in enumerate(ops)}
    tensors = trace.tensor_by_id()
    acts: list[Offload | Prefetch] = []
    for op in ops:
        if op.phase != "fwd" or op.layer_type != "conv":
            continue
        for t in op.writes:
            if tensors[t].kind != "activation" or not tensors[t].size_bytes:
                continue
            readers = [pos[c] for c in tensors[t].consumers]
            fwd_r = [i for i in readers if ops[i].phase == "fwd"]
            bwd_r = [i for i in readers if ops[i].phase == "bwd"]
            bwd_r += [pos[a.before_op] for a in plan.actions if isinstance(a, Recompute)
                      and any(t in ops[pos[o]].reads for o in a.ops)]
            if not bwd_r:
                continue
            last_f, need = max(fwd_r, default=pos[op.id]), min(bwd_r)
            need_layer_start = min(i for i in range(need + 1)
                                   if ops[i].layer == ops[need].layer
                                   and ops[i].phase == ops[need].phase)
            at = need_layer_start
            for i in range(len(ops)):
                if i >= need_layer_start:
                    break
                if ops[i].phase == "bwd" and ops[i].layer_type == "conv" and (
                        i == 0 or ops[i - 1].layer != ops[i].layer):
                    at = i
            acts.append(Offload(t, ops[last_f].id, after=True))
            acts.append(Prefetch(t, ops[at].id, ops[need].id))
    return acts
