"""The host (CPU) clock: when PyTorch's host thread has issued each op (vsim.host's model).

A GPU waits for a slow host. For a recorded op the host's issue time is known only as a bound:
the model's cumulative host cost, but never later than the op's recorded start (it did start
then), so `issue[i] = min(issue[i-1] + host_us(op i), recorded start)`; replaying the recording
unchanged, the bound never binds. What a plan adds on the host delays every later issue by the
same amount (`extra_us`): recomputed ops (re-run by the runtime at their forward host cost),
the caching allocator's driver calls (cudaMalloc of a new segment, cudaFree of released ones),
and a device-wide synchronize (an allocation retry), after which the host has no lead left.
Hidden while the host is ahead of the GPU, they show where it is not: host-bound models, and
after every sync. A synthesized trace has no recorded start to bound it: its issue times are the
model's alone.

Tracked (`tracked=True`): the run is vsim's own runtime (vsim.runtime's executor) carrying out
a plan, whose Python costs the host more (validation/host/README.md): its Python dispatch mode
costs `model.tracker_us_per_op` per op, its native tracker `native_us_per_call` per counted aten
call (`HostModel.counted(op)`), and carrying out the plan's actions costs `copy_us` per
offload or prefetch, `free_us` per release or drop (at the op the action hangs on: before the op
for prefetches and offloads at it, after it for the rest), a forward op some Recompute re-runs
is recorded after it runs at `record_call_us` (and, under the native tracker, its call back into
Python at `record_callback_us`) per aten call, as is an in-place update of what a recorded
call touched up to the last recomputation (noted_ops), the executor's saved-tensor hooks
cost `HostModel.hooks_us` per forward op they are on for (`save_us` per tensor it saves, or
`pack_us` per op; every forward op, or those with a save the plan acts on: `model.hooks`,
hooked_ops), and a recomputed op is replayed at `recompute_call_us` per aten
call instead of PyTorch's forward cost; an op's calls are
`HostModel.calls(op)` (by op name, from the runtime's op maps).
These accumulate on top of the bounded issue times, hidden while the host's lead lasts. An ideal
(C++) runtime would not pay them: `tracked=False` predicts that.
"""

from __future__ import annotations

from ..host import HostModel
from ..plan import PlanIndex
from ..trace.schema import Op, Trace
from .prep import trace_prep


def noted_ops(trace: Trace, index: PlanIndex) -> frozenset[int]:
    """The in-place ops (`aten::*_`; one in-place call each in the runtime's op maps) the
    runtime notes, and so records and calls back: up to `PlanIndex.track_until`, outside the
    recomputed chains, updating a tensor that a chain op or an earlier noted op read or wrote
    (vsim.runtime.recompute's `note_mutation`, whose storages are the trace's tensors). The
    tensor updated is the op's `mutates` attribute where recorded, else its first read (aten's
    in-place functions update their first argument)."""
    until = index.track_until()
    touched: set[int] = set()
    noted: set[int] = set()
    recomputed = index.recomputed_ops
    if not recomputed:  # (nothing touched: nothing to note)
        return frozenset()
    # Only the recomputed ops and the in-place ones matter, in trace order up to the first op
    # past `until`: walked over the trace's in-place ops and the plan's recomputed ones (a
    # pass over every op per profiling run's clock before)
    prep = trace_prep(trace)
    pos, ops, inplace = prep.position, trace.ops, prep.inplace_updates()
    stop = prep.stop_after(until)
    walk = sorted({*(p for o in recomputed if (p := pos.get(o)) is not None and p < stop),
                   *(p for p in inplace if p < stop)})
    for p in walk:
        op = ops[p]
        if op.id in recomputed:
            touched.update(op.reads)
            touched.update(op.writes)
        else:  # an in-place op (TracePrep.inplace_updates)
            if any(t in touched for t in inplace[p]):
                noted.add(op.id)
                touched.update(op.reads)
                touched.update(op.writes)
    return frozenset(noted)


def gated_calls(trace: Trace, index: PlanIndex) -> dict[int, float]:
    """Counted calls a gated native tracker makes in backward's ops other than its first
    (counter.cpp's Gate; every other op is counted whole): an op (an autograd node) the plan
    acts before, or after the op before it, one call, its first, where the runtime acts (then
    the node's last flagged call, after which it runs untracked); every other backward op
    none."""
    acting, after = index.acts_before, index.acts_after
    got: dict[int, float] = {}
    first = True
    prev = -1
    for op in trace.ops:
        if op.phase == "bwd":
            if not first:
                got[op.id] = 1.0 if op.id in acting or prev in after else 0.0
            first = False
        prev = op.id
    return got


def forward_gated(trace: Trace, index: PlanIndex) -> tuple[frozenset[int], dict[int, int]]:
    """Forward gated by module hooks (vsim.runtime.fwdgate; HostModel.forward_gated): the
    forward ops inside the outermost module calls in which the runtime acts at no op (an
    action before or after it, a recorded or noted op, a hooked save, the producer of a tensor
    the plan acts on), which the tracker does not count, and per such call its first op (where
    its hooks are charged) -> 1. A module call is a run of consecutive forward ops whose layer
    names share a dotted prefix (the trace knows no module calls as such)."""
    acted = {*index.acts_before, *index.acts_after, *index.recomputed_ops,
             *noted_ops(trace, index), *hooked_ops(trace, index)}
    touched = index.tensors_acted_on()
    acted.update(op.id for op in trace.ops if any(t in touched for t in op.writes))
    fwd = [op for op in trace.ops if op.phase == "fwd"]
    depth = max((op.layer.count(".") + 1 for op in fwd if op.layer), default=0)
    gated: set[int] = set()
    firsts: dict[int, int] = {}
    for d in range(1, depth + 1):  # outermost first: a gated call hides the calls inside
        run: list[Op] = []
        key: str | None = None
        for op in [*fwd, None]:
            parts = op.layer.split(".") if op is not None and op.layer else []
            k = ".".join(parts[:d]) if len(parts) >= d else None
            if k is None or k != key:
                if run and not any(o.id in acted or o.id in gated for o in run):
                    gated.update(o.id for o in run)
                    firsts[run[0].id] = 1
                run, key = [], k
            if op is not None and k is not None:
                run.append(op)
    return frozenset(gated), firsts


def hooked_ops(trace: Trace, index: PlanIndex) -> frozenset[int]:
    """The forward ops the native tracker's saved-tensor hooks are on for (hooks "armed"): those
    with an output the plan acts on other than their first, which their counted call does not
    return (batch norm's saved statistics, max pooling's indices): the runtime finds it where
    autograd saves it (vsim.runtime.native.targets)."""
    acted = index.tensors_acted_on()
    # (by tensor: per output of a forward op other than its first, those ops)
    by_output = trace_prep(trace).later_outputs()
    return frozenset(o for t in acted for o in by_output.get(t, ()))


def executor_us(model: HostModel, index: PlanIndex | None, op: Op,
                noted: frozenset[int] = frozenset(),
                hooked: frozenset[int] | None = None) -> tuple[float, float]:
    """The executor's host time for the actions hung on `op`: (before it, after it). Recording
    a forward op that a Recompute re-runs is after it (the runtime records its calls as they
    return), and so is noting an in-place update (`noted`: noted_ops), which the runtime calls
    back and records as it does a recorded call. `hooked`: the forward ops the saved-tensor
    hooks are on for (hooked_ops; None: every one)."""
    if index is None:
        return 0.0, 0.0
    oid = op.id
    before = model.copy_us * (len(index.prefetch_at.get(oid, ())) +
                               len(index.offload_at.get(oid, ())))
    after = model.copy_us * len(index.offload_after.get(oid, ())) + model.free_us * (
        len(index.release_after.get(oid, ())) + len(index.drop_after.get(oid, ())))
    if oid in index.recomputed_ops:
        after += (model.record_call_us + model.record_callback_us) * model.calls(op)
    elif oid in noted:
        after += model.record_call_us + model.record_callback_us
    if op.phase == "fwd" and (hooked is None or oid in hooked):
        before += model.hooks_us(op)  # the saved-tensor hooks on what the op saves for backward
    return before, after


def _model_clock(trace: Trace, model: HostModel) -> tuple[list[float], list[float]]:
    """Per op in trace order, the model's bounded issue time without the executor's costs, and
    the aten calls the native tracker counts: the same for every plan, so computed once per
    trace and model tables (every profiling run builds a clock; this pass was most of it)."""
    tables = trace_prep(trace).host_tables
    key = (id(model.by_name), id(model.by_phase), id(model.counted_calls), model.counted_default)
    got = tables.get(key)
    if got is None or got[0] is not model.by_name or got[1] is not model.by_phase \
            or got[2] is not model.counted_calls:
        bounded = trace.meta.get("source") == "measured"
        clocks, counted = [], []
        clock = 0.0
        for op in trace.ops:
            clock += model.op_us(op)
            if bounded and op.start_us < clock:
                clock = op.start_us
            clocks.append(clock)
            counted.append(model.counted(op))
        got = tables[key] = (model.by_name, model.by_phase, model.counted_calls, clocks, counted)
    return got[3], got[4]


class HostClock:
    def __init__(self, trace: Trace, model: HostModel, tracked: bool = False,
                 index: PlanIndex | None = None) -> None:
        self.model = model
        self.alloc = model.allocator
        self.tracked = tracked
        self.issue: dict[int, float] = {}
        clocks, counted = _model_clock(trace, model)
        per_op = model.tracker_us_per_op if tracked else 0.0
        per_call = model.native_us_per_call if tracked else 0.0
        runtime = 0.0  # vsim's runtime's own host time so far (tracked)
        acting = index if tracked else None
        noted = noted_ops(trace, acting) if acting is not None else frozenset()
        hooked = (hooked_ops(trace, acting) if acting is not None and
                  model.hooks in ("armed", "frames") else None)
        # The ops executor_us may charge: every other one costs (0.0, 0.0), asked without the
        # call (most ops of most plans)
        charged: set[int] | None = set()
        if acting is not None:
            charged = {*acting.prefetch_at, *acting.offload_at, *acting.offload_after,
                       *acting.release_after, *acting.drop_after, *acting.recomputed_ops,
                       *noted, *(hooked or ())} if hooked is not None else None
        # a gated backward counts only the nodes the plan acts at (HostModel.gated)
        gated = gated_calls(trace, acting) if acting is not None and model.gated else {}
        # and a gated forward none inside its gated module calls, which pay their hooks
        hooks_at: dict[int, int] = {}
        if acting is not None and model.forward_gated:
            quiet, hooks_at = forward_gated(trace, acting)
            gated.update(dict.fromkeys(quiet, 0.0))
        issue = self.issue
        for op, clock, calls in zip(trace.ops, clocks, counted, strict=True):
            if charged is None or op.id in charged:
                before, after = executor_us(model, acting, op, noted, hooked)
            else:
                before = after = 0.0
            runtime += per_op + before
            if per_call:
                runtime += per_call * min(calls, gated.get(op.id, calls))
            if hooks_at and op.id in hooks_at:
                runtime += model.module_hooks_us
            issue[op.id] = clock + runtime
            runtime += after
        self.unscaled = self.issue  # the issue times at the host's usual speed
        self.extra_us = 0.0  # host time the plan added so far

    def fresh(self, scale: float = 1.0) -> HostClock:
        """The same clock at the start of another iteration of the same plan (nothing the plan
        added yet), sharing the issue times (an O(ops) pass per iteration otherwise); `scale`:
        a host that issues this iteration `scale` times as slowly (a timing draw,
        vsim.engine.TimingDraw)."""
        clock = HostClock.__new__(HostClock)
        clock.__dict__.update(self.__dict__)
        clock.extra_us = 0.0
        if scale != 1.0:
            clock.issue = {o: t * scale for o, t in self.unscaled.items()}
        return clock

    def ready_us(self, op: int) -> float:
        """When the host issues recorded op `op`."""
        return self.issue[op] + self.extra_us

    def recompute_us(self, op: Op) -> float:
        """Host time to re-run a forward op (the executor's replay when tracked)."""
        if self.tracked and self.model.recompute_call_us > 0:
            return self.model.recompute_call_us * self.model.calls(op)
        return self.model.op_us(op)

    def recompute(self, op: Op) -> None:
        """The host re-runs a forward op before the one that needs its output."""
        self.extra_us += self.recompute_us(op)

    def spend(self, us: float) -> None:
        self.extra_us += us

    def synced(self, op: int, now_us: float) -> None:
        """The host waited for the device at `now_us` while issuing `op`: no lead is left."""
        lag = now_us - self.issue[op]
        if lag > self.extra_us:
            self.extra_us = lag
