"""Recomputation inside the executor: the aten calls of a Recompute's chain recorded while the
forward pass runs them (`RecordedCall`, arguments as `TensorRef` storage references, RNG state
for random ops) and called again, outside autograd, before the op that needs their tensors
(see vsim.runtime.executor's docstring). `Recomputation` is the Executor's part that does it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..plan import Recompute

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


class _Gone(Exception):
    """A recorded argument's storage is gone or empty."""


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


@dataclass
class RecordedCall:
    func: Any
    args: Any
    kwargs: Any
    out_keys: list[tuple[int, int]]
    rng: Any
    index: int  # the call's number in the iteration


def written_args(func: Any, cache: dict[Any, tuple[tuple[int, str], ...]]
                  ) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an aten function writes to (in-place and out=)."""
    got = cache.get(func)
    if got is None:
        schema = getattr(func, "_schema", None)
        got = tuple((i, a.name) for i, a in enumerate(schema.arguments if schema else ())
                    if a.alias_info is not None and a.alias_info.is_write)
        cache[func] = got
    return got


class Recomputation:
    """The Executor's recording and recomputation (a mixin: the state it works on is the
    executor's, set up in Executor.__init__ and Executor._begin)."""

    map: OpMap
    device: torch.device
    gpu: bool
    strict: bool
    stats: IterationStats
    state: dict[int, str]
    nbytes: dict[int, int]
    recording: dict[int, list[RecordedCall]]
    keys: weakref.WeakKeyDictionary[Any, int]
    next_key: int
    rebuilt_storage: weakref.WeakKeyDictionary[Any, int]
    modifiers: dict[int, list[RecordedCall]]
    _written: dict[Any, tuple[tuple[int, str], ...]]
    _storage: Callable[[int], Any]
    constants: dict[int, torch.Tensor]

    def keep_constant(self, out: Any) -> None:
        """Keep the small tensors a constant-making call returned (see CONSTANT_FUNCS) for the
        iteration: recorded calls that read them hold them, not a reference to their storage."""
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.numel() <= CONSTANT_MAX_ELEMENTS:
                self.constants[self._key(x.untyped_storage())] = x

    def note_mutation(self, func: Any, args: Any, kwargs: Any, out: Any, k: int) -> None:
        """A call outside every recomputed chain that writes into a tensor a Recompute
        rebuilds (ResNet's `out += identity`, an in-place ReLU after the producer): the
        recomputation must re-run it too, or the rebuilt tensor would hold the producer's
        output instead of its final value (the trace lists in-place updates as reads)."""
        for i, name in written_args(func, self._written):
            x = args[i] if i < len(args) else kwargs.get(name)
            if not isinstance(x, torch.Tensor):
                continue
            t = self.rebuilt_storage.get(x.untyped_storage())
            if t is not None and self.state.get(t) == "device":
                self.modifiers[t].append(self.spec_call(func, args, kwargs, out, None, k))

    def _key(self, st: Any) -> int:
        k = self.keys.get(st)
        if k is None:
            k = self.next_key
            self.next_key += 1
            self.keys[st] = k
        return k

    def rng_state(self) -> Any:
        if self.gpu:
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def spec_call(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Any,
                  index: int) -> RecordedCall:
        def spec(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                key = self._key(st)
                if key in self.constants:  # kept as it is (a constant made in forward)
                    return x
                return TensorRef(key, weakref.ref(st), tuple(x.shape), tuple(x.stride()),
                                 int(x.storage_offset()), x.dtype, x.device)
            return x

        leaves, _ = tree_flatten(out)
        out_keys = [(j, self._key(x.untyped_storage())) for j, x in enumerate(leaves)
                    if isinstance(x, torch.Tensor)]
        return RecordedCall(func, tree_map(spec, args), tree_map(spec, kwargs), out_keys, rng,
                            index)

    def _recompute(self, rc: Recompute) -> None:
        target: dict[int, int] = {}
        for t in rc.tensors:
            if self.state.get(t) != "dropped":
                continue
            st = self._storage(t)
            if st is not None:
                target[self._key(st)] = t
        env: dict[int, Any] = {}

        def resolve(r: Any) -> Any:
            if not isinstance(r, TensorRef):
                return r
            st = env.get(r.key)
            if st is None:
                st = r.storage()
                if st is None or (st.nbytes() == 0 and r.key not in target):
                    raise _Gone
            return torch.empty(0, dtype=r.dtype, device=r.device).set_(st, r.offset, r.size,
                                                                       r.stride)

        calls = [c for op in rc.ops for c in self.recording.get(op, ())]
        first = min((c.index for c in calls), default=-1)
        extra = {c.index: c for t in target.values() for c in self.modifiers.get(t, ())
                 if c.index > first}
        calls = sorted([*calls, *extra.values()], key=lambda c: c.index)
        with torch.no_grad():
            for call in calls:
                try:
                    args = list(tree_map(resolve, call.args))
                    kwargs = dict(tree_map(resolve, call.kwargs))
                except _Gone:
                    op = self.map.call_op[call.index]
                    what = (f"ops {rc.ops} before op {rc.before_op} (tensors {rc.tensors})")
                    if call.index not in extra:
                        raise ExecutorError(f"recomputing {what}: {call.func} of op {op} reads "
                                            "a tensor that is no longer on the GPU") from None
                    if self.strict:
                        raise ExecutorError(
                            f"recomputing {what}: op {op} ({self.map.op_names[op]}) updated a "
                            "rebuilt tensor in place after its producer, and re-running it "
                            "needs a tensor that is no longer on the GPU; the plan cannot "
                            "rebuild the tensor's final value (the chain must include the "
                            "in-place ops, or the tensor must not be dropped)") from None
                    self.stats.inplace_missed += 1
                    continue
                self._protect_mutated(call, args, kwargs, env, target)
                out = self._call(call, args, kwargs)
                self.stats.recomputed_calls += 1
                self.stats.inplace_rerun += call.index in extra
                leaves, _ = tree_flatten(out)
                for j, key in call.out_keys:
                    o = leaves[j]
                    ost = o.untyped_storage()
                    if env.get(key) is ost:
                        continue
                    t_or_none = target.get(key)
                    if t_or_none is None:
                        env[key] = ost
                        continue
                    t = t_or_none
                    tst = self._storage(t)
                    if tst is None:
                        continue
                    if tst.nbytes() == 0:
                        n = self.nbytes[t]
                        if ost.nbytes() == n and hasattr(tst, "_swap_data_ptr_"):
                            tst._swap_data_ptr_(ost)
                        else:
                            tst.resize_(n)
                            view = torch.empty(0, dtype=o.dtype, device=o.device).set_(
                                tst, o.storage_offset(), o.shape, o.stride())
                            view.copy_(o)
                        self.state[t] = "device"
                    env[key] = tst

    @staticmethod
    def _protect_mutated(call: RecordedCall, args: list[Any], kwargs: dict[str, Any],
                         env: dict[int, Any],
                         target: dict[int, int]) -> None:
        """Give arguments the call writes to but the chain does not produce (running
        statistics) copies: the recomputation must not change state twice."""
        schema = getattr(call.func, "_schema", None)
        if schema is None:
            return
        for i, a in enumerate(schema.arguments):
            info = a.alias_info
            # native_batch_norm's schema does not mark the running statistics it updates
            if (info is None or not info.is_write) and a.name not in _RUNNING_STATS:
                continue
            if i < len(call.args) and not a.kwarg_only:
                ref = call.args[i]
                if isinstance(ref, TensorRef) and ref.key not in env and ref.key not in target:
                    args[i] = args[i].clone()
            elif a.name in call.kwargs:
                ref = call.kwargs[a.name]
                if isinstance(ref, TensorRef) and ref.key not in env and ref.key not in target:
                    kwargs[a.name] = kwargs[a.name].clone()

    def _call(self, call: RecordedCall, args: Any, kwargs: Any) -> Any:
        if call.rng is None:
            return call.func(*args, **kwargs)
        saved = self.rng_state()
        self._set_rng(call.rng)
        try:
            return call.func(*args, **kwargs)
        finally:
            self._set_rng(saved)

    def _set_rng(self, state: Any) -> None:
        if self.gpu:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)
