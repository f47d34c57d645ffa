"""Plans: what a policy decides and the engine (and the real executor) carries out.

Below the engine and the policies: the engine runs a Plan without knowing which policy made it,
and the policies, the search and plan files (vsim/plan_io.py) build Plans from these actions.

Actions, all keyed by op ids of the trace:
- Offload(tensor, at_op, after=False): copy the tensor device->host on the D2H stream, starting
  when `at_op` starts (after=True: when it ends). The device copy is released once the copy is
  done and every op up to `release_after` has finished (default: at_op).
- Prefetch(tensor, at_op, needed_by): copy it back host->device on the H2D stream, issued when
  `at_op` starts; op `needed_by` waits for it. Device memory is taken when the copy is issued.
- Sync(after_op): at the end of `after_op` the compute stream waits for every copy issued so far
  (vDNN's per-layer cudaStreamSynchronize on both streams).
- Drop(tensor, after_op): release the tensor with no copy (it will be recomputed).
- Recompute(ops, before_op, tensors): re-run forward ops `ops` just before `before_op`, which
  re-allocates `tensors` (outputs of those ops that were dropped).
- Release(tensor, after_op): free the tensor earlier than the trace did (liveness analysis).
- Retime(op, dur_us, workspace_bytes, note, parts): run an op with another algorithm (vDNN
  (m)/(p)); parts > 1: a convolution run as that many micro-batches along its batch dimension,
  so that each needs a part of the workspace (workspace_bytes: what the split op allocates
  beyond its results: a part's workspace and output).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .allocator.base import AllocatorSpec
    from .hardware import Hardware
    from .trace.schema import Trace


@dataclass(frozen=True)
class Offload:
    tensor: int
    at_op: int
    after: bool = False
    release_after: int | None = None


@dataclass(frozen=True)
class Prefetch:
    tensor: int
    at_op: int
    needed_by: int


@dataclass(frozen=True)
class Sync:
    after_op: int


@dataclass(frozen=True)
class Drop:
    tensor: int
    after_op: int


@dataclass(frozen=True)
class Recompute:
    ops: tuple[int, ...]
    before_op: int
    tensors: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    tensor: int
    after_op: int


@dataclass(frozen=True, repr=False)
class Retime:
    op: int
    dur_us: float
    workspace_bytes: int | None = None
    note: str = ""
    parts: int = 1

    def __repr__(self) -> str:
        # parts left out where it is 1: plan_digest is the repr of the actions, and the plans
        # measured before micro-batching existed keep their digests
        more = f", parts={self.parts}" if self.parts != 1 else ""
        return (f"Retime(op={self.op!r}, dur_us={self.dur_us!r}, "
                f"workspace_bytes={self.workspace_bytes!r}, note={self.note!r}{more})")


Action = Offload | Prefetch | Sync | Drop | Recompute | Release | Retime


class PlanIndex:
    """A plan's actions grouped by the op they hang on: what the engine and the executor look
    up as they reach each op."""

    def __init__(self, plan: Plan) -> None:
        self.offload_at: dict[int, list[Offload]] = defaultdict(list)
        self.offload_after: dict[int, list[Offload]] = defaultdict(list)
        self.prefetch_at: dict[int, list[Prefetch]] = defaultdict(list)
        self.needs: dict[int, list[int]] = defaultdict(list)
        self.sync_after: set[int] = set()
        self.drop_after: dict[int, list[int]] = defaultdict(list)
        self.release_after: dict[int, list[int]] = defaultdict(list)
        self.recompute_before: dict[int, list[Recompute]] = defaultdict(list)
        self.recomputed_ops: set[int] = set()  # forward ops some Recompute re-runs
        self.retime: dict[int, Retime] = {}
        # what the engine derives from the index once per plan, not per iteration (a run's
        # iterations share their plan's index)
        self.memo: dict[object, Any] = {}
        for a in plan.actions:
            if isinstance(a, Offload):
                (self.offload_after if a.after else self.offload_at)[a.at_op].append(a)
            elif isinstance(a, Prefetch):
                self.prefetch_at[a.at_op].append(a)
                self.needs[a.needed_by].append(a.tensor)
            elif isinstance(a, Sync):
                self.sync_after.add(a.after_op)
            elif isinstance(a, Drop):
                self.drop_after[a.after_op].append(a.tensor)
            elif isinstance(a, Release):
                self.release_after[a.after_op].append(a.tensor)
            elif isinstance(a, Recompute):
                self.recompute_before[a.before_op].append(a)
                self.recomputed_ops.update(a.ops)
            elif isinstance(a, Retime):
                self.retime[a.op] = a
        # Ops with something hung on them before they run / after they end (every other op
        # takes the engine's short path: most ops of most plans).
        self.acts_before: set[int] = {*self.prefetch_at, *self.recompute_before, *self.needs,
                                      *self.retime, *self.offload_at}
        self.acts_after: set[int] = {*self.offload_after, *self.sync_after, *self.drop_after,
                                     *self.release_after}

    def track_until(self) -> int:
        """The last op before which a recomputation runs (-1: none): until it vsim's runtime
        notes in-place updates, which a recomputation must know of (its executor's
        `track_until`; the host clock charges them)."""
        return max(self.recompute_before, default=-1) if self.recomputed_ops else -1

    def tensors_acted_on(self) -> set[int]:
        """Tensors that an offload, prefetch, drop, release or recomputation acts on."""
        acted: set[int] = set()
        for offloads in (*self.offload_at.values(), *self.offload_after.values()):
            acted.update(a.tensor for a in offloads)
        for prefetches in self.prefetch_at.values():
            acted.update(a.tensor for a in prefetches)
        for tensors in (*self.drop_after.values(), *self.release_after.values()):
            acted.update(tensors)
        for recomputes in self.recompute_before.values():
            for rc in recomputes:
                acted.update(rc.tensors)
        return acted


@dataclass(frozen=True)
class Plan:
    """What a policy decided. `notes` are shown in the report (e.g. where retimed op durations
    come from); `pinned_pool_bytes` is pinned host memory allocated up front (0: per copy);
    `pinned_lazy` charges cudaMallocHost for each offload buffer; `pinned=False` stages copies
    through pageable memory: slower, and the host waits for each copy before the next launch.
    `wait_for_memory`: an allocation that does not fit waits for offloads in flight to give
    their device memory back (a runtime that blocks on its memory pool, as vDNN++ and
    SuperNeurons do) instead of failing at once; out of memory only when none is in flight.
    With PyTorch's allocator (caching, events=host) that wait is PyTorch's own: a request with
    no cached block and no room synchronizes the device, so every copy in flight ends and its
    blocks come back, then the whole cache is freed and cudaMalloc retried (the engine's
    sync_at_capacity)."""

    actions: tuple[Action, ...] = ()
    notes: tuple[str, ...] = ()
    pinned_pool_bytes: int = 0
    pinned_lazy: bool = False
    pinned: bool = True
    wait_for_memory: bool = False


class RunPlan(Protocol):
    """vsim.engine.run_plan's signature: one simulated iteration of a plan. Policies that check
    their plan by a profiling run are given one (they never import the engine). Allocator None:
    the allocator (and first iteration, workspace fallback) of the run the plan is made for
    (engine.planning_runner), or PyTorch's caching allocator outside a run."""

    def __call__(self, trace: Trace, hw: Hardware, plan: Plan, allocator: AllocatorSpec | None,
                 capacity_bytes: int | None = None) -> Any: ...


def iteration_floor(run_plan: RunPlan, trace: Trace, hw: Hardware, plan: Plan) -> float:
    """A lower bound on the iteration time `run_plan` reports for `plan` run with allocator None
    (a profiling run), where the runner knows one (engine.planning_runner: no op starts before
    the host has issued it); else 0. Planners skip candidates that cannot beat the best found."""
    floor = getattr(run_plan, "iteration_floor", None)
    return 0.0 if floor is None else float(floor(trace, hw, plan))


class Planner(Protocol):
    """What the engine needs of a policy (vsim.policies.base.Policy is one): its plan, made
    with `run_plan` for any profiling run, and its spec string for the report."""

    def plan_with(self, trace: Trace, hw: Hardware, capacity_bytes: int,
                  run_plan: RunPlan) -> Plan: ...

    def spec(self) -> str: ...


PlanBuilder = Callable[[int, frozenset[int]], Plan]
"""(budget, convolutions forced to their workspace-free algorithm) -> a plan."""


def _short_digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_digest(plan: Plan) -> str:
    """A short digest of a plan's actions: a measured run records it (vsim.runtime.results), so
    that `vsim validate` can tell when a policy now plans differently from the plan measured."""
    return _short_digest(repr(plan.actions))


def actions_digest(plan: Plan) -> str:
    """A short digest of what a runtime carries out of a plan: plan_digest's less the times a
    Retime predicts (a runtime runs the op workspace-free or in parts whatever time the model
    gives it), so that new workspace-free times leave it as it was (a case's `same_plan_as`)."""
    return _short_digest(repr([
        f"Retime(op={a.op!r}, workspace_bytes={a.workspace_bytes!r}, parts={a.parts!r})"
        if isinstance(a, Retime) else repr(a) for a in plan.actions]))
