"""A layer-level view of a trace, shared by the memory policies.

A recorded trace holds one op per aten op or autograd node, each tagged with its module (`layer`),
`layer_type` and `phase`. The papers reason per layer, so policies group ops: a Layer is a maximal
run of consecutive ops with the same (layer, phase). A module called twice (a ReLU module reused in
a ResNet block) gives two forward layers, as it would in a framework that unrolls the graph.

Positions: `pos[op]` is the op's index in trace order. Tensor liveness is expressed in slots, two
per op: slot 2p is "while op p runs" (its outputs are allocated), slot 2p+1 is "after op p ended
and its frees happened". A tensor produced by op p and freed by op q occupies slots [2p, 2q+1).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..trace.schema import Op, Tensor, Trace

# Tensor kinds a policy may move or drop: feature maps (and the network input, which vDNN
# offloads as layer 1's X). Weights, gradients and optimizer state stay where the trace has them.
SAVED_KINDS = ("activation", "input")


@dataclass(frozen=True)
class Layer:
    """One layer's ops in one phase, in trace order."""

    index: int
    name: str
    layer_type: str
    phase: str
    ops: tuple[int, ...]

    @property
    def first(self) -> int:
        return self.ops[0]

    @property
    def last(self) -> int:
        return self.ops[-1]


class TraceView:
    """Indexes over a trace that the policies share. Read-only; build one per plan() call."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        # Results of planning steps that depend only on the trace and their arguments, shared
        # by a policy's attempts (fitted.Attempt: the convolutions' algorithms per budget).
        self.memo: dict[Any, Any] = {}
        self.ops: tuple[Op, ...] = trace.ops
        self.op: dict[int, Op] = {o.id: o for o in trace.ops}
        self.pos: dict[int, int] = {o.id: i for i, o in enumerate(trace.ops)}
        self.tensor: dict[int, Tensor] = trace.tensor_by_id()
        self.layers: list[Layer] = []
        self.layer_of: dict[int, Layer] = {}
        run: list[Op] = []
        for o in trace.ops:
            if run and (o.layer, o.phase) != (run[-1].layer, run[-1].phase):
                self._close(run)
                run = []
            run.append(o)
        if run:
            self._close(run)
        self.fwd = [lay for lay in self.layers if lay.phase == "fwd"]
        self.bwd = [lay for lay in self.layers if lay.phase == "bwd"]
        self.fwd_index = {id(lay): i for i, lay in enumerate(self.fwd)}
        readers: dict[int, set[int]] = defaultdict(set)
        for o in trace.ops:
            for tid in o.reads:
                readers[tid].add(o.id)
        for ten in trace.tensors:
            readers[ten.id].update(c for c in ten.consumers if c in self.op)
        self.readers: dict[int, tuple[int, ...]] = {
            t: tuple(sorted(r, key=self.pos.__getitem__)) for t, r in readers.items()}
        self.free_op: dict[int, int] = {}
        for o in trace.ops:
            for t in o.frees:
                self.free_op.setdefault(t, o.id)
        self._fwd_readers: dict[int, tuple[int, ...]] = {}
        self._bwd_readers: dict[int, tuple[int, ...]] = {}
        for t, rs in self.readers.items():
            self._fwd_readers[t] = tuple(r for r in rs if self.op[r].phase == "fwd")
            self._bwd_readers[t] = tuple(r for r in rs if self.op[r].phase == "bwd")
        # op -> tensors it modifies in place (see inplace_ops); tensor -> those ops
        self.modifies: dict[int, frozenset[int]] = {}
        inplace: dict[int, list[int]] = defaultdict(list)
        for o in trace.ops:
            if o.phase != "fwd" or not is_inplace(o):
                continue
            targets = frozenset(t for t in o.reads if self.tensor[t].producer != o.id)
            self.modifies[o.id] = targets
            for t in targets:
                inplace[t].append(o.id)
        self._inplace = {t: tuple(sorted(ops, key=self.pos.__getitem__))
                         for t, ops in inplace.items()}
        # op -> the tensors it updates in place, exactly (see mutated); tensor -> those ops
        self.mutates: dict[int, frozenset[int]] = {}
        updates: dict[int, list[int]] = defaultdict(list)
        for o in trace.ops:
            if o.phase == "fwd" and (is_inplace(o) or o.attr("mutates")):
                self.mutates[o.id] = mutated(o, self)
                for t in self.mutates[o.id]:
                    updates[t].append(o.id)
        self._updates = {t: tuple(sorted(ops, key=self.pos.__getitem__))
                         for t, ops in updates.items()}

    def _close(self, run: list[Op]) -> None:
        lay = Layer(len(self.layers), run[0].layer, run[0].layer_type, run[0].phase,
                    tuple(o.id for o in run))
        self.layers.append(lay)
        for o in run:
            self.layer_of[o.id] = lay

    # ------------------------------------------------------------ tensors

    def fwd_readers(self, t: int) -> tuple[int, ...]:
        return self._fwd_readers.get(t, ())

    def bwd_readers(self, t: int) -> tuple[int, ...]:
        return self._bwd_readers.get(t, ())

    def last_fwd_reader(self, t: int) -> int | None:
        r = self.fwd_readers(t)
        return r[-1] if r else None

    def first_bwd_reader(self, t: int) -> int | None:
        r = self.bwd_readers(t)
        return r[0] if r else None

    def last_reader(self, t: int) -> int | None:
        r = self.readers.get(t, ())
        return r[-1] if r else None

    def is_saved(self, t: int) -> bool:
        """A feature map kept from the forward pass for the backward pass: the tensors that the
        policies of the vDNN family move and that checkpointing drops."""
        ten = self.tensor[t]
        if ten.kind not in SAVED_KINDS or not self.bwd_readers(t):
            return False
        return ten.producer is None or self.op[ten.producer].phase == "fwd"

    @cached_property
    def saved(self) -> tuple[int, ...]:
        """Saved feature maps, in the order they are produced (inputs first)."""
        ids = [t.id for t in self.trace.tensors if self.is_saved(t.id)]
        return tuple(sorted(ids, key=lambda t: (self.alloc_slot(t), t)))

    def updates(self, t: int) -> tuple[int, ...]:
        """Forward ops that update `t` in place, exactly (`mutated`), in trace order: `t`
        holds their result, not the state a reader before them saw."""
        return self._updates.get(t, ())

    def inplace_ops(self, t: int) -> tuple[int, ...]:
        """Forward ops other than its producer that modify `t` in place (aten::relu_, add_, ...):
        t's content is final only after them, and copying t while one runs would race."""
        return self._inplace.get(t, ())

    # ------------------------------------------------------------ slots (see module docstring)

    @property
    def n_slots(self) -> int:
        return 2 * len(self.ops)

    def alloc_slot(self, t: int) -> int:
        return self._alloc_slot[t]

    def free_slot(self, t: int) -> int:
        return self._free_slot[t]

    @cached_property
    def _alloc_slot(self) -> dict[int, int]:
        out = {}
        for t, ten in self.tensor.items():
            p = ten.producer
            out[t] = 0 if p is None or p not in self.pos else 2 * self.pos[p]
        return out

    @cached_property
    def _free_slot(self) -> dict[int, int]:
        out = {}
        for t in self.tensor:
            q = self.free_op.get(t)
            out[t] = self.n_slots if q is None else 2 * self.pos[q] + 1
        return out

    def start(self, op: int) -> int:
        return 2 * self.pos[op]

    def end(self, op: int) -> int:
        return 2 * self.pos[op] + 1

    def before(self, op: int) -> int:
        """The slot in which a recomputation before `op` runs: after the previous op ended and
        freed what it frees, before `op` allocates its outputs."""
        return max(0, 2 * self.pos[op] - 1)

    # ------------------------------------------------------------ layers

    def inputs(self, layer: Layer) -> tuple[int, ...]:
        """Feature maps a layer reads that it did not produce (its X, in vDNN's words)."""
        own = {t for o in layer.ops for t in self.op[o].writes}
        seen: list[int] = []
        for o in layer.ops:
            for t in self.op[o].reads:
                if t not in own and t not in seen and self.tensor[t].kind in SAVED_KINDS:
                    seen.append(t)
        return tuple(seen)

    def outputs(self, layer: Layer) -> tuple[int, ...]:
        """Feature maps a layer's ops produce (activation kind)."""
        return tuple(t for o in layer.ops for t in self.op[o].writes
                     if self.tensor[t].kind == "activation")

    def modifies_inplace(self, layer: Layer, t: int) -> bool:
        return any(o in layer.ops for o in self.inplace_ops(t))

    @cached_property
    def bwd_to_fwd(self) -> dict[int, int | None]:
        """Backward layer index (in self.bwd) -> forward layer index (in self.fwd) of the same
        module. Backward runs in reverse, so each match is the latest forward layer of that name
        at or before the previous match; None when the module has no forward layer."""
        by_name: dict[str, list[int]] = defaultdict(list)
        for i, lay in enumerate(self.fwd):
            by_name[lay.name].append(i)
        out: dict[int, int | None] = {}
        limit = len(self.fwd) - 1
        for j, lay in enumerate(self.bwd):
            cands = by_name.get(lay.name, [])
            below = [i for i in cands if i <= limit]
            match = below[-1] if below else (cands[-1] if cands else None)
            out[j] = match
            if match is not None:
                limit = match
        return out

    def fwd_layer_of(self, op: int) -> int | None:
        lay = self.layer_of[op]
        return self.fwd_index.get(id(lay)) if lay.phase == "fwd" else None

    def time_at(self, op: int) -> float:
        return self.op[op].start_us

    def end_time(self, op: int) -> float:
        o = self.op[op]
        return o.start_us + o.dur_us


def is_inplace(op: Op) -> bool:
    """An op that modifies an input: PyTorch's trailing-underscore naming (aten::relu_,
    aten::add_), or an `inplace` attribute the recorder kept."""
    if op.attr("inplace"):
        return True
    name = op.name.strip()
    return name.endswith("_") and not name.endswith("__")


def mutated(op: Op, view: TraceView) -> frozenset[int]:
    """The reads an in-place op updates. The recorder marks them (attribute `mutates`, from the
    aten schema's written arguments); traces recorded before it list an in-place update only
    as a read, and `modifies` takes every read the op did not produce (`out += identity`
    updates `out` and reads `identity`). For those, the one read updated is taken to be the
    most recently produced of them (`self` of `out += identity`, `result += x`, relu_)."""
    marked = op.attr("mutates")
    reads = [t for t in op.reads if view.tensor[t].producer != op.id]
    if marked is not None:
        return frozenset(t for t in marked if t in reads)
    if len(reads) <= 1:
        return frozenset(reads)
    return frozenset({max(reads, key=lambda t: (view.alloc_slot(t), t))})
