"""Recomputation inside the executor: the aten calls of a Recompute's chain recorded while the
forward pass runs them (`RecordedCall`, arguments as `TensorRef` storage references, RNG state
for random ops) and called again, outside autograd, before the op that needs their tensors
(see vsim.runtime.executor's docstring). `Recomputation` is the Executor's part that does it.
Under the native tracker, the first armed iteration's replays are logged as programs
(`_ProgramLog`) that later iterations run in C++ (native/replay.cpp, `_replay_compiled`).
"""

from __future__ import annotations

import time
import weakref
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..plan import Recompute
from .microbatch import split_call, splits

if TYPE_CHECKING:
    from .executor import IterationStats
    from .opmap import OpMap


class ExecutorError(RuntimeError):
    """The plan asked for something the run cannot do (a bug in a policy or in the executor)."""


_RUNNING_STATS = ("running_mean", "running_var")

# Calls that make tensor constants inside forward: torch.tensor(...) is aten.lift_fresh of a
# tensor built outside the dispatcher; scalar_tensor and full make scalars from numbers. Their
# results live only as long as forward's locals, so a recomputation after forward that reads
# one (torch.where(mask, scores, mask_value)) would find its storage gone: the executor keeps
# small ones (CONSTANT_MAX_ELEMENTS at most) for the iteration and passes them as they are.
CONSTANT_FUNCS = ("aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten.lift.default",
                  "aten.scalar_tensor.default", "aten.full.default")
CONSTANT_MAX_ELEMENTS = 4096


# In-place functions that overwrite their argument without reading it: the state it was in
# before them does not matter.
_OVERWRITE = ("aten.bernoulli_.", "aten.normal_.", "aten.uniform_.", "aten.random_.",
              "aten.exponential_.", "aten.geometric_.", "aten.cauchy_.", "aten.log_normal_.",
              "aten.fill_.", "aten.zero_.", "aten.copy_.")


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """`fn` applied to every tensor or TensorRef in an aten call's arguments or outputs (tuples,
    lists, dicts of them; nothing deeper occurs), the rest kept: torch's pytree costs about ten
    times as much per call, and the executor maps every recorded and replayed call's
    arguments (cProfile on the CPU stand-ins: most of its recording time)."""
    if isinstance(x, (torch.Tensor, TensorRef)):
        return fn(x)
    t = type(x)
    if t is tuple or t is list:
        if not any(isinstance(v, _NODES) for v in x):
            return x  # sizes, strides: nothing to map
        return t(_map(fn, v) for v in x)
    if t is dict:
        return {k: _map(fn, v) for k, v in x.items()}
    return x


def _leaves(x: Any) -> list[Any]:
    """The leaves of an aten call's arguments or outputs, in pytree's order (None a leaf,
    torch.return_types' tuples flattened)."""
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    if type(x) is dict:
        return [leaf for v in x.values() for leaf in _leaves(v)]
    return [x]


def _tensor_leaves(args: list[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among a call's arguments, in the order `_map` visits them."""
    return [x for x in _leaves([args, kwargs]) if isinstance(x, torch.Tensor)]


_ARG_AT: dict[tuple[Any, str], tuple[int, bool] | None] = {}


def _flag(call: RecordedCall, name: str) -> bool | None:
    """A recorded call's boolean argument `name` (batch norm's `training`), or None. Where the
    argument sits in the schema is looked up once per function (the replay asks per call)."""
    key = (call.func, name)
    if key not in _ARG_AT:
        schema = getattr(call.func, "_schema", None)
        _ARG_AT[key] = next(((i, a.kwarg_only) for i, a in enumerate(
            schema.arguments if schema is not None else ()) if a.name == name), None)
    found = _ARG_AT[key]
    if found is None:
        return None
    i, kwarg_only = found
    v = call.args[i] if i < len(call.args) and not kwarg_only else call.kwargs.get(name)
    return v if isinstance(v, bool) else None


_SWAP: list[Any] = []


def _swapper() -> Any:
    """swap(a, b): exchange two storages' memory, or None where neither PyTorch
    (UntypedStorage._swap_data_ptr_, not in the H100 machine's torch 2.11) nor the native extension
    (vsim.runtime.native's swap_storages) can: then a rebuilt tensor is copied into place."""
    if not _SWAP:
        swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
        if swap is None:
            from . import native

            mod = native.load()
            swap = mod.swap_storages if mod is not None else None
        _SWAP.append(swap)
    return _SWAP[0]


class _Describe:
    """A Recompute as errors name it, formatted only when one is raised (the replay's own host
    time is per call)."""

    def __init__(self, rc: Any) -> None:
        self.rc = rc

    def __str__(self) -> str:
        rc = self.rc
        return f"ops {rc.ops} before op {rc.before_op} (tensors {rc.tensors})"


def describe(rc: Any) -> str:
    """A Recompute as errors name it."""
    return str(_Describe(rc))


class _Gone(Exception):
    """A recorded argument's storage is gone or empty."""


class _Stale(Exception):
    """A recorded argument's storage was updated in place since the call read it, and the
    recomputation has not rebuilt the state the call read."""


@dataclass
class TensorRef:
    """A tensor argument of a recorded call: its storage (by key, and weakly), and its view."""

    key: int
    storage: Any  # weakref.ref to the UntypedStorage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    tensor: Any = None  # weakref.ref to the tensor the call read (passed again while it is
    # still that view of the storage: cheaper than a new view)


_NODES = (torch.Tensor, TensorRef, tuple, list, dict)  # what _map looks into


@dataclass
class RecordedCall:
    func: Any
    args: Any
    kwargs: Any
    out_keys: list[tuple[int, int]]
    rng: Any
    index: int  # the call's number in the iteration
    fresh: tuple[int, ...] = ()      # storages the call allocated (its outputs, not views)
    inplace: tuple[int, ...] = ()    # storages it updated in place (its schema's written args)
    unversioned: frozenset[int] = frozenset()  # arguments read in any state (running
    # statistics, which training-mode batch norm only updates; arguments it overwrites)


_SCHEMAS: dict[Any, tuple[tuple[int, str, bool, bool, bool, bool], ...]] = {}


def _schema_of(func: Any) -> tuple[tuple[int, str, bool, bool, bool, bool], ...]:
    """Per argument that can hold a tensor read or written by its storage: (position, name,
    keyword-only, written, overwritten (its state before does not matter: the function
    overwrites it, or it is an out= argument), a running statistic)."""
    got = _SCHEMAS.get(func)
    if got is None:
        schema = getattr(func, "_schema", None)
        overwrites = str(func).startswith(_OVERWRITE)
        rows = []
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            write = a.alias_info is not None and a.alias_info.is_write
            running = a.name in _RUNNING_STATS
            if write or running or "Tensor" in str(a.type):
                rows.append((i, a.name, a.kwarg_only, write, write and (overwrites or a.kwarg_only),
                             running))
        got = _SCHEMAS[func] = tuple(rows)
    return got


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an aten function writes to (in-place and out=): the
    written rows of `_schema_of`, kept per function (the Python tracker asks on every call)."""
    got = _WRITTEN.get(func)
    if got is None:
        got = _WRITTEN[func] = tuple((i, name) for i, name, _, write, _, _ in _schema_of(func)
                                     if write)
    return got


# argument sources and output kinds of a compiled replay (replay.cpp's Source and OutKind)
ENV, OWN, ASIS = 0, 1, 2
NO_PROTECT, SCRATCH, CLONE = 0, 1, 2
OUT_ENV, OUT_TARGET = 0, 1


class _ProgramLog:
    """What one Python replay of a Recompute decided, step by step, as replay.cpp's program:
    per replayed call its frame, where each tensor argument came from (the output of an
    earlier step, its own storage as captured, or the captured tensor itself), how it was
    protected, and what became of its outputs. The calls and their data flow repeat every
    iteration, so later iterations run the program in C++ (docs/design.md, "The compiled
    replay"). A replay that took a path the program cannot express (a stale state read
    loosely, a tensor copied into place, a call without its own frame) marks the log failed,
    and the executor keeps replaying in Python."""

    def __init__(self, frame_of: dict[int, int]) -> None:
        self.frame_of = frame_of
        self.steps: list[tuple[Any, ...]] = []
        self.origin: dict[int, tuple[int, int]] = {}  # storage key -> (step, output leaf)
        self.targets: list[int] = []                  # trace tensors, as replay passes them
        self.extra = 0                                # steps that re-run in-place updates
        self.why: str | None = None
        self.args: list[tuple[Any, ...]] = []         # the step being logged
        self.outs: list[tuple[int, int, int]] = []

    def fail(self, why: str) -> None:
        if self.why is None:
            self.why = why

    def arg(self, r: Any, source: int, live: bool = False, fresh: bool = False) -> None:
        slot = len(self.args)
        if source == ASIS:
            self.args.append((slot, ASIS, -1, -1, False, False, NO_PROTECT, None, r.dtype, 0,
                              [], []))
            return
        step, leaf = self.origin.get(r.key, (-1, -1)) if source == ENV else (-1, -1)
        if source == ENV and step < 0:
            self.fail("an argument read from a rebuilt storage whose step is unknown")
        self.args.append((slot, source, step, leaf, live, fresh, NO_PROTECT, None, r.dtype,
                          r.offset, list(r.size), list(r.stride)))

    def protect(self, slot: int, how: int, scratch: Any) -> None:
        a = self.args[slot]
        self.args[slot] = (*a[:6], how, scratch, *a[8:])

    def step(self, call: RecordedCall, what: str, extra: bool) -> None:
        key = self.frame_of.get(call.index)
        if key is None:
            self.fail(f"{call.func} (call {call.index}) has no frame of its own")
        self.steps.append((key if key is not None else -1, call.rng is not None, what,
                           self.args, self.outs))
        self.extra += extra
        self.args, self.outs = [], []


class Recomputation:
    """The Executor's recording and recomputation (a mixin: the state it works on is the
    executor's, set up in Executor.__init__ and Executor._begin)."""

    map: OpMap
    device: torch.device
    gpu: bool
    strict: bool
    stats: IterationStats
    recording: dict[int, list[RecordedCall]]
    keys: weakref.WeakKeyDictionary[Any, int]
    key_storage: dict[int, Any]
    next_key: int
    writes: dict[int, list[int]]
    mutations: dict[int, list[RecordedCall]]
    _storage: Callable[[int], Any]
    _state_of: Callable[[int], str | None]  # the tensors' state, the executor's or its core's
    _set_device: Callable[[int], None]
    _nbytes_of: Callable[[int], int]
    constants: dict[int, torch.Tensor]
    scratch: dict[tuple[Any, ...], torch.Tensor]
    constant_calls: frozenset[int]
    split_parts: dict[int, int]  # op -> micro-batches (vsim.runtime.microbatch)
    tracker_used: str
    track_until: int
    act: Any  # the native extension's actions and views, or None (vsim.runtime.native)
    _native: Any  # the native extension (vsim.runtime.nativerun)
    # the compiled replay (vsim.runtime.nativerun's _compile): the programs, and this
    # iteration's logs while compiling and whether it runs them
    _programs: dict[int, tuple[Any, list[int], int]] | None
    _frame_of_call: dict[int, int]
    _logs: dict[int, _ProgramLog] | None
    _compiled_iteration: bool

    def keep_constant(self, out: Any) -> None:
        """Keep the small tensors a constant-making call returned (see CONSTANT_FUNCS) for the
        iteration: recorded calls that read them hold them, not a reference to their storage."""
        for x in _leaves(out):
            if isinstance(x, torch.Tensor) and x.numel() <= CONSTANT_MAX_ELEMENTS:
                self.constants[self._key(x.untyped_storage())] = x

    def on_call(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Any, k: int) -> bool:
        """Call k has run (outputs `out`; `rng`: the RNG state before it, for random calls a
        chain records): keep its constants, record it where a recomputed chain needs it, else
        note an in-place update it made (either tracker calls this where the plan needs it).
        Its host time is the runtime's own too (`record_us`, part of `host_us`). Whether it
        kept, recorded or noted anything: the native tracker calls back only at the calls that
        did in its calibrating iteration (the iteration's calls and their data flow repeat)."""
        t0 = time.perf_counter()
        acted = self._on_call(func, args, kwargs, out, rng, k)
        dt = (time.perf_counter() - t0) * 1e6
        self.stats.record_us += dt
        self.stats.host_us += dt
        self.stats.recorded_calls += 1
        return acted

    def _on_call(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Any, k: int) -> bool:
        acted = k in self.constant_calls
        if acted:
            self.keep_constant(out)
        if self._compiled_iteration:
            return acted  # the frames the programs replay are captured in C++
        op = self.map.call_op[k]
        rec = self.recording.get(op)
        if rec is not None:
            self.record(rec, func, args, kwargs, out, rng, k)
            return True
        if op <= self.track_until:
            acted = self.note_mutation(func, args, kwargs, out, rng, k) or acted
        return acted

    def record(self, rec: list[RecordedCall], func: Any, args: Any, kwargs: Any, out: Any,
               rng: Any, k: int) -> None:
        """Call k belongs to a recomputed chain: record it, and number its writes."""
        call = self.spec_call(func, args, kwargs, out, rng, k)
        rec.append(call)
        self._note_writes(call)

    def note_mutation(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Any,
                      k: int) -> bool:
        """A call outside every recomputed chain that writes in place into a storage a recorded
        call read or wrote (ResNet's `out += identity` into a batch norm's output, an in-place
        activation after its producer): a recomputation that rebuilds the storage re-runs it,
        and one that reads the storage knows that its bytes changed since (see `_recompute`;
        the trace lists in-place updates as reads)."""
        for i, name in written_args(func):
            x = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(x, torch.Tensor) and x.untyped_storage() in self.keys:
                break
        else:
            return False
        self._note_writes(self.spec_call(func, args, kwargs, out, rng, k))
        return True

    def _note_writes(self, call: RecordedCall) -> None:
        for key in sorted({*call.fresh, *call.inplace}):
            self.writes[key].append(call.index)
        for key in call.inplace:
            self.mutations[key].append(call)

    def _key(self, st: Any) -> int:
        k = self.keys.get(st)
        if k is None:
            k = self.next_key
            self.next_key += 1
            self.keys[st] = k
            self.key_storage[k] = weakref.ref(st)
        return k

    def rng_state(self) -> Any:
        if self.gpu:
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def spec_call(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Any,
                  index: int) -> RecordedCall:
        """The call as recorded: tensor arguments as TensorRefs (constants made in forward as
        they are), its outputs' storages, the storages it reads, writes and allocates. One
        walk over the arguments, the schema's part looked up once per function (`_schema_of`):
        the recording is the runtime's own host cost on every recorded call."""
        read: set[int] = set()
        key_of, constants = self._key, self.constants

        def spec(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                key = key_of(st)
                if key in constants:  # kept as it is (a constant made in forward)
                    return x
                read.add(key)
                return TensorRef(key, weakref.ref(st), tuple(x.shape), tuple(x.stride()),
                                 int(x.storage_offset()), x.dtype, x.device, weakref.ref(x))
            return x

        sargs, skwargs = _map(spec, args), _map(spec, kwargs)
        out_keys = [(j, key_of(x.untyped_storage())) for j, x in enumerate(_leaves(out))
                    if isinstance(x, torch.Tensor)]
        inplace: list[int] = []
        unversioned: set[int] = set()
        schema = _schema_of(func)
        for i, name, kwarg_only, write, overwritten, running in schema:
            r = sargs[i] if i < len(sargs) and not kwarg_only else skwargs.get(name)
            if isinstance(r, TensorRef):
                key = r.key
            elif isinstance(r, torch.Tensor):
                key = key_of(r.untyped_storage())
            else:
                continue
            if write:
                if key not in inplace:
                    inplace.append(key)
                if overwritten:
                    unversioned.add(key)
            elif running:
                unversioned.add(key)
        fresh = tuple(dict.fromkeys(key for _, key in out_keys
                                    if key not in read and key not in inplace))
        return RecordedCall(func, sargs, skwargs, out_keys, rng, index, fresh, tuple(inplace),
                            frozenset(unversioned))

    def _recompute(self, rc: Recompute) -> None:
        """Re-run the chain's recorded calls, and the in-place updates other calls made to the
        storages the chain allocates, in their original order.

        A recorded call read each argument as it was at the call; a storage updated in place
        after that holds a later state now. Each storage's writes are numbered by call (fresh
        outputs and in-place updates, `writes`), so every argument is read in the state the
        call saw: the one this recomputation rebuilt (`env`) when it has reached that state,
        else the storage itself when nothing wrote to it since the call. ResNet's bottleneck:
        a chain that re-runs bn3 to rebuild its statistics must not hand its fresh output to
        the next block's conv1, which read it after `out += identity` and the ReLU; a chain
        that starts at an in-place SiLU whose input is kept must not apply it a second time.
        A state that is gone raises ExecutorError (strict) or is read as it is
        (`inplace_missed`). Where the replay has been compiled, its program runs in C++
        (`_replay_compiled`)."""
        if self._compiled_iteration:
            prog = self._programs.get(id(rc)) if self._programs else None
            if prog is not None:
                self._replay_compiled(rc, *prog)
                return
        target = {self._key(st): t for st, t in self._dropped(rc)}
        env: dict[int, Any] = {}      # storage key -> the storage this recomputation rebuilt
        at: dict[int, int] = {}       # ... and the call whose write it holds
        made_by: dict[int, torch.Tensor] = {}  # ... and the tensor that call returned there
        what = _Describe(rc)  # for errors only: formatted when one is raised
        log = None  # the program this replay compiles to, in the iteration that compiles
        if self._logs is not None:
            log = self._logs[id(rc)] = _ProgramLog(self._frame_of_call)
            log.targets = list(target.values())
            tindex = {key: i for i, key in enumerate(target)}

        chain = sorted((c for op in rc.ops for c in self.recording.get(op, ())),
                       key=lambda c: c.index)
        if not chain:
            return
        in_chain = {c.index for c in chain}
        first, last = chain[0].index, chain[-1].index
        made: dict[int, int] = {}     # storages the chain allocates -> the call that does
        for c in chain:
            for key in c.fresh:
                made.setdefault(key, c.index)
        extra: dict[int, RecordedCall] = {}
        for key in {*made, *target}:
            since = made.get(key, first)
            for m in self.mutations.get(key, ()):
                if m.index > since and m.index not in in_chain \
                        and (key in target or m.index < last):
                    extra[m.index] = m

        for call in sorted([*chain, *extra.values()], key=lambda c: c.index):
            k = call.index
            if k in in_chain and call.inplace and not call.fresh and all(
                    key not in env and key not in target and self._final(key) == k
                    and self._live(key) is not None for key in call.inplace):
                continue  # an in-place update whose result the storage still holds
            from_storage: set[int] = set()
            try:
                try:
                    args, kwargs = self._resolve(call, env, at, target, from_storage, False,
                                                 made_by, log)
                except _Stale:
                    if k in extra or self.strict:
                        raise
                    if log is not None:
                        log.fail("a recorded call read a state only a later one is left of")
                    from_storage.clear()
                    args, kwargs = self._resolve(call, env, at, target, from_storage, True,
                                                 made_by, log)
                    self.stats.inplace_missed += 1
            except (_Gone, _Stale) as exc:
                op = self.map.call_op[k]
                if k not in extra:
                    if isinstance(exc, _Gone):
                        raise ExecutorError(f"recomputing {what}: {call.func} of op {op} reads "
                                            "a tensor that is no longer on the GPU") from None
                    raise ExecutorError(
                        f"recomputing {what}: {call.func} of op {op} "
                        f"({self.map.op_names[op]}) reads a tensor that a later op updated in "
                        "place, and the chain does not rebuild the state it read; the plan "
                        "cannot recompute the op (the chain must start before the tensor's "
                        "producer, or the tensor must not be dropped)") from None
                if not any(key in target for key in call.inplace):
                    continue  # readers of the storage find its state kept, or fail themselves
                if log is not None:
                    log.fail("an in-place update of a rebuilt tensor could not be re-run")
                if self.strict:
                    raise ExecutorError(
                        f"recomputing {what}: op {op} ({self.map.op_names[op]}) updated a "
                        "rebuilt tensor in place after its producer, and re-running it "
                        "needs a tensor that is no longer on the GPU; the plan cannot "
                        "rebuild the tensor's final value (the chain must include the "
                        "in-place ops, or the tensor must not be dropped)") from None
                self.stats.inplace_missed += 1
                continue
            if log is not None and from_storage:
                before = _tensor_leaves(args, kwargs)
                self._protect_mutated(call, args, kwargs, from_storage)
                scratch = [id(v) for v in self.scratch.values()]
                for i, (x, y) in enumerate(zip(before, _tensor_leaves(args, kwargs), strict=True)):
                    if x is not y:
                        log.protect(i, SCRATCH if id(y) in scratch else CLONE,
                                    y if id(y) in scratch else None)
            else:
                self._protect_mutated(call, args, kwargs, from_storage)
            out = self._call(call, args, kwargs)
            self.stats.recomputed_calls += 1
            self.stats.inplace_rerun += k in extra
            leaves = _leaves(out)
            step = len(log.steps) if log is not None else -1
            for j, key in call.out_keys:
                o = leaves[j]
                ost = o.untyped_storage()
                if env.get(key) is ost:
                    if key in call.inplace:
                        at[key] = k
                    continue
                ref = self.key_storage.get(key)
                if ref is not None and ref() is ost and key not in target:
                    continue  # a view of a storage read as it is
                t_or_none = target.get(key)
                if t_or_none is None:
                    env[key], at[key], made_by[key] = ost, k, o
                    if log is not None:
                        log.outs.append((j, OUT_ENV, -1))
                        log.origin[key] = (step, j)
                    continue
                t = t_or_none
                tst = self._storage(t)
                if tst is None:
                    continue
                if log is not None:
                    log.outs.append((j, OUT_TARGET, tindex[key]))
                    log.origin[key] = (step, j)
                if tst.nbytes() == 0:
                    n = self._nbytes_of(t)
                    swap = _swapper() if ost.nbytes() == n else None
                    if swap is not None:
                        swap(tst, ost)
                    else:
                        if log is not None:
                            log.fail("a recomputed tensor was copied into place")
                        self.stats.skipped["recomputed tensor copied into place"] += 1
                        tst.resize_(n)
                        view = torch.empty(0, dtype=o.dtype, device=o.device).set_(
                            tst, o.storage_offset(), o.shape, o.stride())
                        view.copy_(o)
                    self._set_device(t)
                env[key], at[key] = tst, k
                made_by.pop(key, None)
            if log is not None:
                log.step(call, f"recomputing {what}: {call.func} of op {self.map.call_op[k]}",
                         k in extra)

    def _dropped(self, rc: Recompute) -> list[tuple[Any, int]]:
        """(storage, trace tensor) of the tensors `rc` rebuilds that are dropped now."""
        got = []
        for t in rc.tensors:
            st = self._storage(t) if self._state_of(t) == "dropped" else None
            if st is not None:
                got.append((st, t))
        return got

    def _replay_compiled(self, rc: Recompute, program: Any, targets: list[int],
                         extra: int) -> None:
        """Recompute `rc` by its program (replay.cpp) from this iteration's captured frames.
        Its targets must be the ones it was compiled with (the plan's drops repeat)."""
        now = {id(st): t for st, t in self._dropped(rc)}
        if list(now.values()) != targets:
            raise ExecutorError(f"recomputing {_Describe(rc)}: the tensors to rebuild are "
                                f"{list(now.values())}, the compiled replay's {targets}")
        try:
            rebuilt, calls, ns = self._native.replay(
                program, [(self._storage(t), self._nbytes_of(t)) for t in targets])
        except RuntimeError as exc:
            if str(exc).startswith("vsim replay:"):
                raise ExecutorError(str(exc)) from None
            raise
        for i in rebuilt:
            self._set_device(targets[i])
        self.stats.recomputed_calls += calls
        self.stats.inplace_rerun += extra
        self.stats.replay_call_us += ns / 1e3

    def _captured(self, frames: int, ns: int) -> None:
        """The frames a compiled iteration captured for its programs: the recording's cost."""
        self.stats.recorded_calls += frames
        self.stats.record_us += ns / 1e3
        self.stats.host_us += ns / 1e3

    def _state_before(self, key: int, k: int) -> int:
        """The call whose write a storage held when call k read it (-1: none seen)."""
        ws = self.writes.get(key, ())
        i = bisect_left(ws, k)
        return ws[i - 1] if i else -1

    def _final(self, key: int) -> int:
        ws = self.writes.get(key)
        return ws[-1] if ws else -1

    def _live(self, key: int) -> Any:
        ref = self.key_storage.get(key)
        st = ref() if ref is not None else None
        return st if st is not None and st.nbytes() > 0 else None

    def _resolve(self, call: RecordedCall, env: dict[int, Any], at: dict[int, int],
                 target: dict[int, int], from_storage: set[int], loose: bool,
                 made_by: dict[int, torch.Tensor],
                 log: _ProgramLog | None = None) -> tuple[list[Any], dict[str, Any]]:
        """The call's arguments, each in the state the call read (see `_recompute`):
        `env`'s storage when it holds that state, else the storage itself when nothing wrote
        to it since (added to `from_storage`). `loose`: a later state where the one read is
        gone. _Gone: the storage is gone; _Stale: only a later state is left.

        Where the tensor an earlier replayed call returned there, or the tensor the call read
        when it was recorded, is still that view of the storage resolved (same storage,
        offset, sizes, strides and dtype), it is passed as it is rather than as a new view
        (two dispatcher calls, the largest part of resolving), unless the call writes to it
        (an in-place metadata change would reach that tensor). With the native extension the
        check and the new view are one call each (views.cpp). `log`: where each tensor argument
        came from, for the compiled replay (_ProgramLog)."""
        k = call.index
        if log is not None:
            log.args = []
        act = self.act  # the native extension, or None (Python views)
        if act is not None and not hasattr(act, "view_of"):
            act = None  # built without views.cpp (vsim.runtime.native.views_error)

        def resolve(r: Any) -> Any:
            if not isinstance(r, TensorRef):
                if log is not None and isinstance(r, torch.Tensor):
                    log.arg(r, ASIS)
                return r
            st = env.get(r.key)
            source, live = ENV, False
            if st is None and r.key in target:
                st = r.storage()  # the rebuilt tensor, before the chain makes it
                if st is None:
                    raise _Gone
                source = OWN
            elif st is None or (at[r.key] != self._state_before(r.key, k)
                                and r.key not in call.unversioned):
                held = self._live(r.key)
                if held is None:
                    if st is None or not loose:
                        raise _Gone
                elif (self._final(r.key) == self._state_before(r.key, k) or loose
                      or r.key in call.unversioned):
                    st = held
                    from_storage.add(r.key)
                    source, live = OWN, True
                elif st is None or not loose:
                    raise _Stale
            if log is not None:
                log.arg(r, source, live, r.key in call.inplace)
            if r.key not in call.inplace:
                for o in (made_by.get(r.key), r.tensor() if r.tensor is not None else None):
                    if o is None:
                        continue
                    if act is not None:  # one call (vsim/runtime/native/views.cpp)
                        if act.is_view(o, st, r.dtype, r.offset, r.size, r.stride):
                            return o
                    elif o.dtype == r.dtype and o.untyped_storage() is st \
                            and o.storage_offset() == r.offset and o.shape == r.size \
                            and o.stride() == r.stride:
                        return o
            if act is not None:
                view = act.view_of(st, r.dtype, r.offset, r.size, r.stride)
                if view is not None:
                    return view
            if log is not None:
                log.fail("a view its storage is too small for (set_ resizes it)")
            return torch.empty(0, dtype=r.dtype, device=r.device).set_(st, r.offset, r.size,
                                                                       r.stride)

        return list(_map(resolve, call.args)), dict(_map(resolve, call.kwargs))

    def _protect_mutated(self, call: RecordedCall, args: list[Any], kwargs: dict[str, Any],
                         from_storage: set[int]) -> None:
        """Arguments the call writes to that were read from their storages as they are (running
        statistics; in-place updates of kept tensors): the recomputation must not change state
        twice. Running statistics go to a scratch buffer in training mode (batch norm then
        only updates them: their values do not matter, so no copy, and the buffer is reused
        by every replay; a clone cost an allocation and a copy kernel per statistic, two per
        batch norm on the GPU) and as they are in evaluation mode (only read); the rest get
        copies."""
        if not from_storage:
            return
        for i, name, kwarg_only, write, _, running in _schema_of(call.func):
            # native_batch_norm's schema does not mark the running statistics it updates
            if not write and not running:
                continue
            if i < len(call.args) and not kwarg_only:
                ref, held, at = call.args[i], args, i
            elif name in call.kwargs:
                ref, held, at = call.kwargs[name], kwargs, name  # type: ignore[assignment]
            else:
                continue
            if not isinstance(ref, TensorRef) or ref.key not in from_storage:
                continue
            if running:
                training = _flag(call, "training")
                if training is False and not write:
                    continue
                if training is True:
                    held[at] = self._scratch_like(held[at])  # type: ignore[index]
                    continue
            held[at] = held[at].clone()  # type: ignore[index]

    def _scratch_like(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, x.device)
        got = self.scratch.get(key)
        if got is None:
            got = self.scratch[key] = torch.empty(key[0], dtype=x.dtype, device=x.device)
        return got

    def _call(self, call: RecordedCall, args: Any, kwargs: Any) -> Any:
        if self.tracker_used == "native":
            # as under the Python tracker, whose handler replays below autograd: a native
            # callback runs above it (the recorded calls are the ones a dispatch mode sees)
            with torch._C._AutoDispatchBelowADInplaceOrView():
                return self._call_rng(call, args, kwargs)
        return self._call_rng(call, args, kwargs)

    def _call_rng(self, call: RecordedCall, args: Any, kwargs: Any) -> Any:
        if call.rng is None:
            return self._timed(call, args, kwargs)
        saved = self.rng_state()
        self._set_rng(call.rng)
        try:
            return self._timed(call, args, kwargs)
        finally:
            self._set_rng(saved)

    def _timed(self, call: RecordedCall, args: Any, kwargs: Any) -> Any:
        t0 = time.perf_counter()
        parts = self.split_parts.get(self.map.call_op[call.index]) if self.split_parts else None
        try:
            if parts is not None and splits(call.func, kwargs):
                self.stats.split_calls += 1
                return split_call(call.func, args, kwargs, parts)
            return call.func(*args, **kwargs)
        finally:
            self.stats.replay_call_us += (time.perf_counter() - t0) * 1e6

    def _set_rng(self, state: Any) -> None:
        if self.gpu:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)
