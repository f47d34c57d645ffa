"""`vdnn`: vDNN (Rhu et al., MICRO'16), with the rules of shared/reference/vdnn-titanx.md.

Forward: during layer n's forward, its input feature map X is copied to the host, starting with
the layer's first op, if layer n is X's last forward reader (and X is needed again in backward).
ReLU layers, layers that modify X in place, and the topmost layer (the loss, whose backward comes
right after its forward, with no layer above it to prefetch during) never offload. Both streams
synchronise at the end of layer n's forward (Sync), and X's device copy is released then.

Backward: before layer m's backward, search layers m-1, m-2, ... for the closest layer that was
offloaded and not yet prefetched, and prefetch its X (needed by the first backward op that reads
it); the search stops at the first CONV layer it meets. At the end of a backward layer that issued
a prefetch, both streams synchronise, so that a prefetch issued during layer n's backward completes
before layer n-1's backward starts.

Modes: all (offload every layer's X), conv (only CONV layers'), dyn (profiling runs: vDNN_all(m)
must fit at all; then no offload, vDNN_conv, vDNN_all with the fastest algorithms; then a greedy
per-layer downgrade to the memory-optimal algorithm, vDNN_conv first, then vDNN_all; else
vDNN_all(m)). algo=memory runs every convolution with its workspace-free algorithm (see
vsim/workspace_free.py for where those times come from).

Mapping to a recorded trace: a layer is a run of ops of one module in one phase (layers.py), so
"layer n's forward" spans its first to its last forward op. Where the search rule does not reach
an offloaded X before a backward op reads it (a module with no backward op of its own, or a
forward graph that is not a chain), X is fetched when that op's layer starts and the plan's notes
count those on-demand fetches.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import Hardware
from ..plan import Action, Offload, Plan, Prefetch, Retime, RunPlan, Sync
from ..spec import choice
from ..trace.schema import Trace
from ..workspace_free import memory_optimal_retimes
from .base import Policy, register
from .fitted import check
from .layers import TraceView
from .planning import anchor_prefetches


def offload_sets(view: TraceView, mode: str) -> dict[int, list[int]]:
    """Forward layer index -> the X it offloads: its inputs of which it is the last forward
    reader, needed in backward, not modified in place by it; ReLU layers never offload.
    mode 'conv' keeps CONV layers only."""
    out: dict[int, list[int]] = {}
    # The topmost layer (the loss) never offloads: its X could only be prefetched during the
    # backward of a layer above it, and there is none; its backward follows its forward at once.
    top = max((m for m in view.bwd_to_fwd.values() if m is not None), default=len(view.fwd))
    for i, lay in enumerate(view.fwd):
        if i >= top:
            break
        if lay.layer_type == "relu" or (mode == "conv" and lay.layer_type != "conv"):
            continue
        xs = []
        for x in view.inputs(lay):
            last = view.last_fwd_reader(x)
            if not view.is_saved(x) or last is None or view.layer_of[last] is not lay:
                continue
            if view.modifies_inplace(lay, x):
                continue
            xs.append(x)
        if xs:
            out[i] = xs
    return out


def vdnn_actions(view: TraceView, offloaded: dict[int, list[int]]
                 ) -> tuple[list[Action], list[str]]:
    """The offload, sync and prefetch actions of vDNN for the given offload sets."""
    actions: list[Action] = []
    for i, xs in sorted(offloaded.items()):
        lay = view.fwd[i]
        # The copy starts with the layer and overlaps its compute (X is read-only there);
        # released at the layer's end, after the synchronisation.
        actions += [Offload(x, lay.first, False, lay.last) for x in xs]
        actions.append(Sync(lay.last))
    away = {x for xs in offloaded.values() for x in xs}
    need = {x: view.first_bwd_reader(x) for x in away}
    done_layers: set[int] = set()
    fetched: set[int] = set()
    on_demand = 0
    for j, bl in enumerate(view.bwd):
        issued: list[int] = []
        m = view.bwd_to_fwd[j]
        if m is not None:
            for k in range(m - 1, -1, -1):
                if k in offloaded and k not in done_layers:
                    done_layers.add(k)
                    issued += [x for x in offloaded[k] if x not in fetched]
                    break
                if view.fwd[k].layer_type == "conv":
                    break
        # Safety net outside the paper's rule: anything this layer reads that is still away.
        for o in bl.ops:
            for t in view.op[o].reads:
                if t in away and t not in fetched and t not in issued:
                    issued.append(t)
                    on_demand += 1
        for x in issued:
            fetched.add(x)
            needed_by = need[x]
            assert needed_by is not None
            actions.append(Prefetch(x, bl.first, needed_by))
        if issued:
            actions.append(Sync(bl.last))
    notes = []
    if on_demand:
        notes.append(f"vdnn: {on_demand} prefetch(es) issued on demand where the search rule "
                     f"did not reach the offloaded tensor before its backward reader")
    return actions, notes


def _retimes_for(trace: Trace, hw: Hardware, layers: set[str] | None
                 ) -> tuple[list[Retime], list[str]]:
    """Memory-optimal retimes for the CONV layers named (None: all of them)."""
    retimes, notes = memory_optimal_retimes(trace, hw)
    if layers is None:
        return retimes, notes
    by_id = {o.id: o for o in trace.ops}
    return [r for r in retimes if by_id[r.op].layer in layers], notes if layers else []


@register
@dataclass(frozen=True)
class VDNN(Policy):
    name = "vdnn"
    description = ("vDNN: offload each layer's input during its forward when it is the last "
                   "reader, sync per layer, prefetch back to the closest CONV (mode all|conv|dyn)")
    mode: str = choice("all", "conv", "dyn")
    algo: str = choice("performance", "memory")
    examples = ("vdnn:mode=conv", "vdnn:mode=dyn", "vdnn:algo=memory",
                "vdnn:mode=conv,algo=memory")

    def plan_with(self, trace: Trace, hw: Hardware, capacity_bytes: int,
                  run_plan: RunPlan) -> Plan:
        view = TraceView(trace)
        if self.mode == "dyn":
            return self._dyn(trace, hw, capacity_bytes, view, run_plan)
        return self._static(trace, hw, view, self.mode,
                            None if self.algo == "memory" else set())

    def _static(self, trace: Trace, hw: Hardware, view: TraceView, mode: str,
                memory_layers: set[str] | None, note: str = "") -> Plan:
        actions, notes = vdnn_actions(view, offload_sets(view, mode))
        retimes, rnotes = _retimes_for(trace, hw, memory_layers)
        extra = [note] if note else []
        return anchor_prefetches(view, Plan(actions=tuple([*actions, *retimes]),
                                            notes=tuple([*notes, *rnotes, *extra])))

    def _dyn(self, trace: Trace, hw: Hardware, capacity: int, view: TraceView,
             run_plan: RunPlan) -> Plan:
        """vDNN_dyn's profiling passes, each one simulated iteration with the exact allocator."""
        runs = 0

        def fits(plan: Plan) -> bool:
            nonlocal runs
            runs += 1
            return bool(check(run_plan, trace, hw, plan, capacity)["fits"])

        def done(plan: Plan, what: str) -> Plan:
            return Plan(actions=plan.actions, notes=(*plan.notes,
                        f"vdnn dyn: chose {what} after {runs} profiling run(s)"))

        all_m = self._static(trace, hw, view, "all", None)
        if not fits(all_m):
            # The paper stops here: vDNN_all(m) holds the least memory of its configurations.
            # Under PyTorch's caching allocator it need not (its blocks split and cache
            # otherwise: on a random network vDNN_conv(p) fitted at 0.8 of the peak where
            # vDNN_all(m) did not), so the cheaper configurations are still tried; not the
            # greedy downgrades, whose every step is a run (issue 14: fall back, and say so).
            for what, p in (("no offload with performance-optimal algorithms", Plan()),
                            ("vDNN_conv(p)", self._static(trace, hw, view, "conv", set())),
                            ("vDNN_all(p)", self._static(trace, hw, view, "all", set())),
                            ("vDNN_conv(m)", self._static(trace, hw, view, "conv", None))):
                if fits(p):
                    return done(p, f"{what}, though vDNN_all(m) does not fit (where the "
                                   "paper's rule gives up)")
            return done(all_m, "vDNN_all(m), which does not fit either: the network cannot be "
                               "trained at this capacity")
        base_p = Plan()
        if fits(base_p):
            return done(base_p, "no offload with performance-optimal algorithms")
        for mode in ("conv", "all"):
            p = self._static(trace, hw, view, mode, set())
            if fits(p):
                return done(p, f"vDNN_{mode}(p)")
        conv_layers = [lay.name for lay in view.fwd if lay.layer_type == "conv"]
        for mode in ("conv", "all"):
            downgraded: list[str] = []
            for name in dict.fromkeys(conv_layers):  # forward order, each module once
                downgraded.append(name)
                p = self._static(trace, hw, view, mode, set(downgraded))
                if fits(p):
                    return done(p, f"vDNN_{mode} with {len(downgraded)} CONV layer(s) "
                                   f"downgraded to memory-optimal: {', '.join(downgraded)}")
        return done(all_m, "vDNN_all(m)")
