"""SimPy's environment as the engine uses it, with its conditions and its run loop lighter.

`Environment.all_of` and `any_of` build a condition that schedules itself as SimPy's AllOf and
AnyOf do (in the step where the last, or the first, of its events is processed, at NORMAL
priority), without the value they build when processed (a ConditionValue of its events, which
the engine never reads) and without checking each event's environment. `run_until(event)` is
`run(until=event)` with SimPy's step written out in its loop. Same events, same steps, same
order: only the work per event is less (SimPy's conditions and its step per event were a tenth
of an offloading plan's run).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from heapq import heappop, heappush
from typing import Any

import simpy
from simpy.core import BoundClass
from simpy.events import NORMAL, PENDING


class Event(simpy.Event):
    """simpy.Event whose `succeed` puts it on the queue itself, with the key env.schedule
    gives it (now, NORMAL, the next id): the engine's events (ops another stream waits for,
    copies' ends) succeed a few hundred thousand times per planning."""

    def succeed(self, value: Any = None) -> Event:
        if self._value is not PENDING:
            raise RuntimeError(f"{self} has already been triggered")
        self._ok = True
        self._value = value
        env = self.env
        heappush(env._queue, (env._now, NORMAL, next(env._eid), self))  # noqa: SLF001
        return self


class Timeout(simpy.Timeout):
    """simpy.Timeout put on the queue itself, with env.schedule's key (now + delay, NORMAL,
    the next id): the streams' and copies' waits."""

    def __init__(self, env: simpy.Environment, delay: float, value: Any = None) -> None:
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        self.env = env
        self.callbacks = []
        self._value = value
        self._delay = delay
        self._ok = True
        heappush(env._queue, (env._now + delay, NORMAL, next(env._eid), self))  # noqa: SLF001


class _Condition(simpy.Event):
    """SimPy's AllOf and AnyOf without their value (a ConditionValue nobody reads): triggered
    once `_met` says so as `events` are processed, failed with the first that fails."""

    def __init__(self, env: simpy.Environment, events: Sequence[simpy.Event]) -> None:
        self.env = env
        self.callbacks = []
        self._left = len(events)
        if not events:  # (SimPy's: succeeds at once)
            self._ok, self._value = True, None
            env.schedule(self)
            return
        check = self._check
        for event in events:
            if event.callbacks is None:
                check(event)
            else:
                event.callbacks.append(check)

    def _met(self) -> bool:
        raise NotImplementedError

    def _check(self, event: simpy.Event) -> None:
        if self._value is not PENDING:
            return
        if not event._ok:  # noqa: SLF001  (as SimPy's: the condition fails with it)
            event._defused = True  # noqa: SLF001
            self.fail(event._value)  # noqa: SLF001
            return
        if self._met():
            self._ok, self._value = True, None
            self.env.schedule(self)


class AllOf(_Condition):
    """simpy.AllOf without its value: triggered once every one of `events` is processed."""

    def _met(self) -> bool:
        self._left -= 1
        return self._left == 0


class AnyOf(_Condition):
    """simpy.AnyOf without its value: triggered once one of `events` is processed. (SimPy's
    also takes its check off the others' callbacks when processed; left there, it returns at
    once when they are processed, as SimPy's would between the trigger and that step.)"""

    def _met(self) -> bool:
        return True


class Environment(simpy.Environment):
    """simpy.Environment with the lighter conditions and `run_until`."""

    def __init__(self) -> None:
        super().__init__()
        # SimPy binds its event classes to the environment once (BoundClass.bind_early) so
        # that `env.timeout` is not a descriptor call each time, but only those in the
        # instance's own class: a subclass's are bound here
        for name, attr in vars(simpy.Environment).items():
            if type(attr) is BoundClass:
                setattr(self, name, getattr(self, name))
        # (and env.event, env.timeout: the lighter ones above)
        self.event = types.MethodType(Event, self)  # type: ignore[method-assign]
        self.timeout = types.MethodType(Timeout, self)  # type: ignore[method-assign]

    def all_of(self, events: Sequence[simpy.Event]) -> AllOf:  # type: ignore[override]
        return AllOf(self, events)

    def any_of(self, events: Sequence[simpy.Event]) -> AnyOf:  # type: ignore[override]
        return AnyOf(self, events)

    def run_until(self, until: simpy.Event) -> None:
        """`run(until=until)`: process events until `until` has been. RuntimeError (as
        SimPy's) when none is left before it; a failed event nothing defused raises its
        exception, as SimPy's step does."""
        if until.callbacks is None:
            return
        queue = self._queue
        while True:
            try:
                self._now, _, _, event = heappop(queue)
            except IndexError:
                raise RuntimeError(f'No scheduled events left but "until" event was not '
                                   f'triggered: {until}') from None
            callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
            for callback in callbacks:
                callback(event)
            if not event._ok and not hasattr(event, "_defused"):
                exc = type(event._value)(*event._value.args)
                exc.__cause__ = event._value
                raise exc
            if event is until:
                return
