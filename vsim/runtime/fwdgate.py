"""Forward gated by module hooks (opt-in: VSIM_NATIVE_FWD_GATE=modules; issue 13 item 2).

The native tracker counts every outermost aten call of the step (counter.cpp). Backward's nodes
with no call the plan acts at already run without it (counter.cpp's Gate); this does the same
for forward's module calls: the calibrating iteration notes each module call's first count and
the count after it (`module_calls`, global module hooks), the outermost calls in which the
executor acts at no count are chosen (`choose`), and in armed iterations a forward pre-hook
and a forward hook on those modules (`ForwardGate`) exclude the tracker's key over the call
and set the count to calibration's after it (counter.cpp's gate_forward / ungate_forward).
Module calls are numbered per module in the order they start, so a module called several
times (torchvision's ResNet calls one ReLU three times a block) is gated call by call.

What it saves is the counter's cost on the calls inside, less two Python hooks per call of a
hooked module; tools/forward_gate_estimate.py puts it at under 0.5% of the step for plans that
act in nearly every module and 4-5% for the transformers' sparse plans (docs/design.md).
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.modules import module as nn_module

# a module call: (the module's id, a weak reference to it, first count, count after; -1 where
# it started or ended inside a counted call)
Call = tuple[int, Any, int, int]


@contextmanager
def module_calls(counter: Any) -> Iterator[list[Call]]:
    """Every module call of the calibrating iteration run inside, as `Call`s in the order
    they start (`counter`: the native extension, for its count and depth)."""
    calls: list[list[Any]] = []
    open_calls: list[int] = []

    def pre(mod: torch.nn.Module, args: Any) -> None:
        at = counter.count() if counter.depth() == 0 else -1
        open_calls.append(len(calls))
        calls.append([id(mod), weakref.ref(mod), at, -1])

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if open_calls:
            calls[open_calls.pop()][3] = counter.count() if counter.depth() == 0 else -1

    got: list[Call] = []
    h1 = nn_module.register_module_forward_pre_hook(pre)
    h2 = nn_module.register_module_forward_hook(post, always_call=True)
    try:
        yield got
    finally:
        h1.remove()
        h2.remove()
        got.extend((m, ref, a, b) for m, ref, a, b in calls)


def choose(calls: list[Call], acted: set[int]
           ) -> dict[int, tuple[Any, list[tuple[int, int] | None]]]:
    """The module calls to gate: the outermost with at least one count, none of them `acted`
    (a count the executor calls back at, turns hooks on at, or frames). Per module with a
    gated call: its weak reference and, per call in order, (first count, count after) where
    gated, else None."""
    marks = sorted(acted)

    def clear(a: int, b: int) -> bool:
        i = bisect_left(marks, a)
        return i == len(marks) or marks[i] >= b

    per_module: dict[int, tuple[Any, list[tuple[int, int] | None]]] = {}
    covered = -1  # the count after the last gated call: calls inside it are not hooked
    for mid, ref, a, b in calls:
        entry = per_module.setdefault(mid, (ref, []))
        if a >= 0 and b > a and a >= covered and clear(a, b):
            entry[1].append((a, b))
            covered = b
        else:
            entry[1].append(None)
    return {m: e for m, e in per_module.items() if any(s is not None for s in e[1])}


class _Module:
    __slots__ = ("calls", "i", "ends")

    def __init__(self, calls: list[tuple[int, int] | None]) -> None:
        self.calls = calls
        self.i = 0
        self.ends: list[int] = []


class ForwardGate:
    """The hooks of one calibration's choice, on its modules until `close`; they act only
    between `begin` and `end` (an armed native iteration)."""

    def __init__(self, counter: Any, chosen: dict[int, tuple[Any, list[Any]]]) -> None:
        self.counter = counter
        self.live = False
        self.gated = 0  # module calls gated this iteration
        self.modules: list[_Module] = []
        self.handles: list[Any] = []
        for ref, calls in chosen.values():
            mod = ref()
            if mod is None:
                continue
            state = _Module(calls)
            self.modules.append(state)
            self.handles.append(mod.register_forward_pre_hook(self._pre(state)))
            self.handles.append(mod.register_forward_hook(self._post(state), always_call=True))

    def _pre(self, state: _Module) -> Any:
        gate = self.counter.gate_forward

        def pre(mod: Any, args: Any) -> None:
            i = state.i
            state.i = i + 1
            span = state.calls[i] if i < len(state.calls) else None
            if span is not None and self.live and gate(span[0]):
                state.ends.append(span[1])
                self.gated += 1
            else:
                state.ends.append(-1)
        return pre

    def _post(self, state: _Module) -> Any:
        ungate = self.counter.ungate_forward

        def post(mod: Any, args: Any, out: Any) -> None:
            end = state.ends.pop() if state.ends else -1
            if end >= 0:
                ungate(end)
        return post

    def begin(self) -> None:
        for m in self.modules:
            m.i = 0
            m.ends.clear()
        self.gated = 0
        self.live = True

    def end(self) -> None:
        self.live = False

    def close(self) -> None:
        self.live = False
        for h in self.handles:
            h.remove()
        self.handles.clear()


def acted_counts(targets: Any) -> set[int]:
    """The counts an armed iteration acts at (vsim.runtime.native.Targets): a flag other than
    OFF, a frame or a save called back at."""
    got = {c for c, f in enumerate(targets.flags) if f & 0x0F}
    got.update(key >> 20 for key in targets.frame_flags)
    got.update(key >> 20 for key in targets.packs)
    return got
