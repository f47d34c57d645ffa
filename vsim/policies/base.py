"""The policy interface: a policy is a frozen dataclass that turns a trace into a Plan.

`plan(trace, hw, capacity_bytes)` is pure: it reads the trace and returns actions for the engine
(and, later, the real executor in vsim/record) to carry out. Policies never touch SimPy.

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
- Retime(op, dur_us, workspace_bytes, note): run an op with another algorithm (vDNN (m)/(p)).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import PolicyError
from ..hardware import Hardware
from ..trace.schema import Trace


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


@dataclass(frozen=True)
class Retime:
    op: int
    dur_us: float
    workspace_bytes: int | None = None
    note: str = ""


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
        self.retime: dict[int, Retime] = {}
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
            elif isinstance(a, Retime):
                self.retime[a.op] = a
        # Ops with something hung on them before they run / after they end (every other op
        # takes the engine's short path: most ops of most plans).
        self.acts_before: set[int] = {*self.prefetch_at, *self.recompute_before, *self.needs,
                                      *self.retime, *self.offload_at}
        self.acts_after: set[int] = {*self.offload_after, *self.sync_after, *self.drop_after,
                                     *self.release_after}

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
    SuperNeurons do) instead of failing at once; out of memory only when none is in flight."""

    actions: tuple[Action, ...] = ()
    notes: tuple[str, ...] = ()
    pinned_pool_bytes: int = 0
    pinned_lazy: bool = False
    pinned: bool = True
    wait_for_memory: bool = False


@dataclass(frozen=True)
class Policy:
    """Base of every policy. Subclasses are frozen dataclasses whose fields are the parameters."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def plan(self, trace: Trace, hw: Hardware, capacity_bytes: int) -> Plan:
        raise NotImplementedError

    def spec(self) -> str:
        """The spec string that rebuilds this policy: 'vdnn:mode=conv,algo=memory'."""
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}:{params}" if params else self.name


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its `name`."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise TypeError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Policy]]:
    return dict(_REGISTRY)


def describe(cls: type[Any]) -> dict[str, Any]:
    """Fields with their types, defaults and allowed values, for `vsim list`."""
    fields = []
    for f in dataclasses.fields(cls):
        entry: dict[str, Any] = {"name": f.name, "type": getattr(f.type, "__name__", str(f.type))}
        if f.default is not dataclasses.MISSING:
            entry["default"] = f.default
        choices = f.metadata.get("choices")
        if choices:
            entry["choices"] = list(choices)
        fields.append(entry)
    return {"name": cls.name, "description": cls.description, "fields": fields}


def choice(default: str, *choices: str) -> Any:
    """A string field limited to `choices` (checked by parse_spec)."""
    return field(default=default, metadata={"choices": (default, *choices)})


def parse_spec(spec: str, known: dict[str, type[Any]], what: str = "policy") -> Any:
    """'NAME:key=value,...' -> an instance. Errors name the bad part and list valid ones."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in known:
        raise PolicyError(f"unknown {what} {name!r}; known: {', '.join(sorted(known))}")
    cls = known[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq:
            raise PolicyError(f"{what} {name}: expected key=value, got {part!r}")
        if key not in fields:
            valid = ", ".join(fields) or "none"
            raise PolicyError(f"{what} {name}: unknown key {key!r}; valid keys: {valid}")
        kwargs[key] = _convert(fields[key], raw.strip(), f"{what} {name}: {key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{what} {name}: {exc}") from None


def _convert(f: dataclasses.Field[Any], raw: str, where: str) -> Any:
    choices = f.metadata.get("choices")
    if choices and raw not in choices:
        raise PolicyError(f"{where}={raw!r} is not one of {', '.join(choices)}")
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "int | None":
            return None if raw.lower() == "none" else int(raw)
        if kind == "bool":
            if raw.lower() not in _BOOLS:
                raise ValueError(raw)
            return _BOOLS[raw.lower()]
    except ValueError:
        raise PolicyError(f"{where}: cannot read {raw!r} as {kind}") from None
    return raw


_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
