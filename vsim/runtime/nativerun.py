"""The Executor's iterations under the native op tracker (vsim.runtime.native), a mixin of
Executor: choosing the tracker, the calibrating iteration, the armed ones and their callbacks.

Which tracker runs an iteration (`Executor(tracker=)`):
- "python": the TorchDispatchMode (vsim.runtime.tracker) on every aten call, as before;
- "native": the C++ counter, calibrated by the first iteration under each set of determinism
  flags (the Python tracker and the counter together); ConfigError where it cannot be built;
- "auto" (default): native where it is built, else Python. An iteration whose callbacks the
  calibration cannot place exactly keeps the Python tracker; `tracker_note` says why. Plans that
  recompute run natively too: the calls their chains record (and the in-place updates and
  constants recomputation needs) are called back at as frames of their counted calls, with
  the arguments a dispatch mode would see (vsim.runtime.native).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError
from . import fwdgate
from . import native as nativemod
from .opmap import OpSequenceError
from .recompute import ExecutorError, describe
from .tracker import Tracker

if TYPE_CHECKING:
    from .opmap import OpMap

TRACKERS = ("auto", "native", "python")


@cache
def _cpp_name(func: Any) -> str:
    """'aten.add.Tensor' (an OpOverload) -> 'aten::add.Tensor', as counter.cpp names it."""
    return str(func).replace(".", "::", 1)


_OPERATORS: dict[str, Any] = {}


def _operator(cpp_name: str) -> Any:
    """The OpOverload counter.cpp names 'aten::add_.Tensor'."""
    got = _OPERATORS.get(cpp_name)
    if got is None:
        ns, rest = cpp_name.split("::", 1)
        packet, _, overload = rest.partition(".")
        got = _OPERATORS[cpp_name] = getattr(getattr(getattr(torch.ops, ns), packet),
                                             overload or "default")
    return got


def _choice(variable: str, choices: tuple[str, ...]) -> str:
    """The environment's choice among `choices` (the first by default)."""
    got = os.environ.get(variable, choices[0])
    if got not in choices:
        raise ConfigError(f"{variable}={got!r}: one of {', '.join(choices)}")
    return got


def native_saved() -> str:
    """Where a saved tensor the plan acts on that its counted call does not return (batch
    norm's saved statistics) is taken: from the frame of its own call ("frames", the default
    from 2026-11-27: one call back, 13.2 us on the H100, where the hooks put a batch norm's 7
    saves through autograd's Python hooks at 6.4 us each), or where autograd saves it
    ("hooks", VSIM_NATIVE_SAVED=hooks; validation/host/waits/ section 8)."""
    return _choice("VSIM_NATIVE_SAVED", ("frames", "hooks"))


def native_fwd_gate() -> str:
    """Whether forward's module calls with no call the plan acts at run without the tracker
    ("modules": vsim.runtime.fwdgate's module hooks; opt-in) or every forward call is counted
    ("off", the default; VSIM_NATIVE_FWD_GATE)."""
    return _choice("VSIM_NATIVE_FWD_GATE", ("off", "modules"))


def native_gate() -> str:
    """Whether backward's nodes with no call the plan acts at run without the tracker ("nodes",
    counter.cpp's Gate) or every call is counted ("off"; VSIM_NATIVE_GATE)."""
    return _choice("VSIM_NATIVE_GATE", ("nodes", "off"))


def _executor_error(message: str) -> str | None:
    """The executor's or its replay's own error in a RuntimeError's message (raised in C++,
    through the dispatcher), or None."""
    for head in ("vsim executor: ", "vsim replay: "):
        i = message.find(head)
        if i >= 0:
            return message[i + len(head):].splitlines()[0] if head == "vsim executor: " \
                else message[i:].splitlines()[0]
    return None


class NativeDivergence(OpSequenceError):
    """A native iteration's counted calls differed from its calibration's (seen once, on
    swin_t: aten::_index_put_impl_ where calibration saw aten::index_put). The iteration is
    lost; the executor runs later ones under the Python tracker. A measurement runs the
    iteration again (Session); a user's loop sees the error once."""


def determinism_key() -> tuple[bool, ...]:
    """Flags under which an iteration's calls can differ (deterministic algorithms take other
    code paths, some of them with other aten calls)."""
    return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark)


class NativeRuns:
    """Tracker choice and native iterations for the Executor (see the module docstring)."""

    map: OpMap
    cur: int
    calls: int
    n_ops: int
    paused: bool
    watch: dict[int, list[tuple[int, int]]]
    storage: dict[int, Any]
    recorded_ops: set[int]
    constant_calls: frozenset[int]
    core: Any  # the executor's plan in C++ (native/core.cpp), or None

    def _init_tracking(self, tracker: str, plan_start_ops: set[int],
                       plan_end_ops: set[int]) -> None:
        if tracker not in TRACKERS:
            raise ConfigError(f"tracker {tracker!r}: one of {', '.join(TRACKERS)}")
        self.tracker = tracker
        self.tracker_used = "python"
        self.tracker_note: str | None = None
        self.calibrating: Any = None       # the counter while a calibrating iteration runs
        self.cal_before: list[int] = []    # see nativemod.Calibration
        self.cal_inside: list[bool] = []
        self.cal_frames: list[tuple[int, int]] = []
        self.cal_flagged: dict[int, tuple[Any, bool]] = {}
        self._frame_rng: Any = None
        self._cal_outputs: dict[int, list[tuple[int, int]]] = {}
        self._cal_registered: dict[int, int] = {}
        self._cal_packs: list[tuple[int, int]] = []
        self._pack_targets: dict[int, int] = {}
        self._native: Any = None
        self._armed: tuple[nativemod.Calibration, nativemod.Targets] | None = None
        self._native_exc: BaseException | None = None
        self._native_count = 0
        self._cal: dict[tuple[bool, ...], Any] = {}  # key -> (Calibration, Targets) or why not
        self._start_ops = plan_start_ops
        self._end_ops = plan_end_ops
        # the compiled replay (recompute.py's _ProgramLog, replay.cpp): per Recompute (by id)
        # its program, targets and in-place re-runs, for the Targets they were compiled under;
        # None before compiling, {} where the replay stays in Python (`replay_note` says why)
        self._programs: dict[int, tuple[Any, list[int], int]] | None = None
        self._programs_tg: Any = None
        self._compiled_flags: dict[int, int] = {}
        self._frame_of_call: dict[int, int] = {}
        self.replay_note: str | None = None
        self.tracker_requested = tracker
        # the native tracker's saved-tensor hooks (counter.cpp's Packs): on only around the
        # calls with a save the plan acts on, or throughout as before (VSIM_NATIVE_HOOKS=always,
        # to measure one against the other)
        self.native_hooks = _choice("VSIM_NATIVE_HOOKS", ("armed", "always"))
        # the counter: the boxed fallback on every outermost call, or the common operators'
        # calls counted by unboxed kernels ("fast", counter.cpp's Fast; opt-in until the host
        # model charges it and the runs it moves are measured)
        self.native_counter = _choice("VSIM_NATIVE_COUNTER", ("boxed", "fast"))
        self.native_saved = native_saved()
        self.native_gate = native_gate()
        self.gated: bool | None = None       # whether the last native iteration gated
        self.calls_through: int | None = None  # its calls through the tracker's key
        self.gate_note: str | None = None      # why the plan's backward is not gated
        self.native_fwd_gate = native_fwd_gate()
        self._fwd_gate: fwdgate.ForwardGate | None = None  # the hooks of _fwd_gate_tg's choice
        self._fwd_gate_tg: Any = None
        self._core_tg: Any = None  # the Targets the executor's core was armed with
        self.fwd_gated: int | None = None  # forward module calls the last iteration gated
        if tracker == "python":
            return
        self._native = nativemod.load()
        if self._native is None:
            if tracker == "native":
                raise ConfigError(f"the native tracker could not be built: {nativemod.error()}")
            self.tracker_note = f"native tracker unavailable: {nativemod.error()}"

    # ------------------------------------------------------------ choosing

    def _iteration_mode(self) -> str:
        """'python', 'calibrate' or 'native' for the next iteration."""
        if self._native is None:
            return "python"
        got = self._cal.get(determinism_key())
        if got is None:
            return "calibrate"
        if isinstance(got, str):
            self.tracker_note = got
            return "python"
        self._armed = got
        return "native"

    def needs_calibration(self) -> bool:
        """Whether the next iteration calibrates the native tracker (runs under the Python
        tracker): a gradient check runs one first, so that the checked one runs natively."""
        return self._native is not None and determinism_key() not in self._cal

    def boundary_calls(self) -> list[int]:
        """The aten calls before which the Python tracker would carry out actions: the first
        call of an op when an op it ends or starts (with the ops between) has actions."""
        calls: list[int] = []
        start, end = self._start_ops, self._end_ops
        prev = -1
        for k, op in enumerate(self.map.call_op):
            if op <= prev:
                continue
            if any(o in end for o in range(max(prev, 0), op)) or \
                    any(o in start for o in range(prev + 1, op + 1)):
                calls.append(k)
            prev = op
        return calls

    # ------------------------------------------------------------ running

    def _run_tracked(self, step: Callable[[], Any], mode: str) -> None:
        self.tracker_used = mode
        if mode == "python":
            with Tracker(self):  # type: ignore[arg-type]
                step()
        elif mode == "calibrate":
            self._calibrate(step)
        else:
            self._run_native(step)

    def _calibrate(self, step: Callable[[], Any]) -> None:
        nat = self._native
        self.cal_before, self.cal_inside, self.cal_frames, self.cal_flagged = [], [], [], {}
        self._cal_outputs, self._cal_registered, self._cal_packs = {}, {}, []
        nat.calibrate(True)
        nat.arm(b"", {}, self._calibration_outputs)
        nat.begin()
        self.calibrating = nat
        # the module calls, where forward is to be gated (its hooks turn the saved-tensor
        # hooks off per call, which needs them armed per call)
        forward = self.native_fwd_gate == "modules" and self.native_hooks == "armed"
        recorder: contextlib.AbstractContextManager[list[Any]] = (
            fwdgate.module_calls(nat) if forward else contextlib.nullcontext([]))
        try:
            with recorder as module_calls, Tracker(self):  # type: ignore[arg-type]
                step()
        finally:
            self.calibrating = None
            nat.end()
            nat.disarm()
            nat.calibrate(False)
        funcs = self.map.funcs
        cal = nativemod.Calibration(
            self.cal_before, self.cal_inside, list(nat.recorded()), self._cal_outputs,
            self._cal_registered, self.map.call_op, [str(f) for f in funcs],
            [bool(getattr(f, "is_view", False)) for f in funcs], self._cal_packs,
            [tuple(f) for f in nat.frames()], self.cal_frames, self.cal_flagged)
        spans, cal.backward_at, cal.after_backward, cal.backwards = nat.nodes()
        cal.node_spans = [tuple(x) for x in spans]
        key = determinism_key()
        if len(cal.before) != self.map.n_calls:
            self._cal[key] = (f"native tracker not used: calibration saw {len(cal.before)} "
                              f"aten calls, the map has {self.map.n_calls}")
            return
        try:
            tg = nativemod.targets(cal, self.boundary_calls(), self.watch,
                                   self.native_saved == "frames")
        except nativemod.Unsafe as exc:
            self._cal[key] = f"native tracker not used: {exc}"
            return
        if forward:
            tg.forward = fwdgate.choose(module_calls, fwdgate.acted_counts(tg))
        self._cal[key] = (cal, tg)

    def _calibration_outputs(self, count: int, out: Any, post: bool) -> None:
        got = []
        for j, x in enumerate(tree_flatten(out)[0]):
            if isinstance(x, torch.Tensor):
                try:
                    got.append((j, x.untyped_storage().data_ptr()))
                except (RuntimeError, NotImplementedError):
                    continue
        self._cal_outputs[count] = got

    def note_pack(self, t: torch.Tensor) -> None:
        """A tensor autograd saves (the Python saved-tensor hook), calibrating: where and what
        it is. Armed iterations save through counter.cpp's hook (`_pack_callback`)."""
        if self.calibrating is not None:
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                ptr = -1
            self._cal_packs.append((self.calibrating.count(), ptr))

    def note_registered(self, watch: list[tuple[int, int]]) -> None:
        """Calibrating: where the Python tracker found the trace tensors of a call."""
        for _, t in watch:
            st = self._storage(t)
            if st is not None:
                self._cal_registered[t] = st.data_ptr()

    def _run_native(self, step: Callable[[], Any]) -> None:
        assert self._armed is not None
        cal, tg = self._armed
        nat = self._native
        self._native_exc = None
        if self._programs is not None and self._programs_tg is not tg:
            self._programs = None  # other determinism flags: other frames
            if self.core is not None:
                self.core.clear_programs()
        compiled = self._compiled_iteration = bool(self._programs)
        if self.core is not None:  # the compiled replays run by the core, without Python
            self.core.use_programs(compiled)
        if self._programs is None and self._can_compile():
            self._logs = {}
            self._frame_of_call = {k: key for key, k in tg.frame_call.items()}
        nat.arm(tg.flags, tg.expect, self._callback)
        nat.arm_frames(self._compiled_flags if compiled else tg.frame_flags, tg.frame_count,
                       tg.frame_expect, self._frame_callback)
        if compiled:
            nat.set_rng_device(self.device)
        # the saved-tensor hooks in C++ (counter.cpp's Packs): Python is called only at the
        # saves where calibration found a tensor the plan acts on. Autograd calls even a C++
        # hook through its Python hook machinery, 4.6-8.6 us per save on the H100
        # (validation/host/waits/), so they are on only around the calls with such a save
        # ("armed"), or throughout as before ("always")
        per_call = self.native_hooks == "armed"
        nat.arm_packs(tg.packs, self._pack_callback,
                      partial(torch._C._autograd._push_saved_tensors_default_hooks, nat.pack,
                              nat.unpack),
                      torch._C._autograd._pop_saved_tensors_default_hooks, per_call)
        hooks = (contextlib.nullcontext() if per_call else
                 torch.autograd.graph.saved_tensors_hooks(nat.pack, nat.unpack))
        nat.set_fast(self.native_counter == "fast")
        if self.native_gate == "nodes":
            self.gate_note = tg.gate_note
            if tg.gate is not None:
                nat.arm_gate(tg.gate, cal.after_backward, tg.gate_sync)
        gate = self._forward_gate(tg)
        if self.core is not None:  # outputs registered and ops advanced in C++ (core.cpp)
            if self._core_tg is not tg:
                call_op = self.map.call_op
                self.core.arm_counts({c: list(p) for c, p in tg.post.items()},
                                     {c: call_op[k] for c, k in tg.after.items() if k >= 0},
                                     {c: call_op[k] for c, k in tg.pre.items()})
                # a frame called back with its outputs alone needs Python only where they are
                # constants to keep (recompute.py's on_call; a frame it records is called back
                # with its arguments, or captured in C++ once compiled)
                self.core.arm_frames({key: list(p) for key, p in tg.frame_watch.items()},
                                     {key for key, k in tg.frame_call.items()
                                      if k in self.constant_calls})
                self._core_tg = tg
            nat.arm_core(self.core)
        nat.begin()
        if gate is not None:
            gate.begin()
        try:
            with hooks:
                step()
            if self._logs is not None:
                self._compile(tg)
        except RuntimeError as exc:
            self.cur = max(self.cur, cal.op_at(nat.count() - 1))
            if self._native_exc is not None:
                # not kept on the executor: its traceback holds the stopped iteration's frames
                # (its activations), in a cycle through this executor that only a full
                # collection breaks (the H100 remeasure started later cases with GiBs held)
                kept, self._native_exc = self._native_exc, None
                raise kept from None
            if nat.diverged():
                raise self._diverged(f"the run diverged from its calibration: "
                                     f"{nat.diverged()}") from None
            why = _executor_error(str(exc))
            if why is not None:  # the core's compiled replay (native/core.cpp) could not run
                raise ExecutorError(why) from None
            raise exc
        except BaseException:
            self.cur = max(self.cur, cal.op_at(nat.count() - 1))
            raise
        finally:
            nat.arm_core(None)
            if gate is not None:
                gate.end()
            self.fwd_gated = gate.gated if gate is not None else None
            self._logs = None
            self._native_count = nat.count()
            self.gated, self.calls_through = nat.gated()
            frames, frame_ns = nat.frame_calls()
            self._framed(frames, frame_ns / 1e3)
            calls, call_ns = nat.callbacks()
            self.stats.callbacks += calls
            self.stats.callback_us += call_ns / 1e3
            nat.end()
            nat.disarm()
            packs, ns = nat.disarm_packs()
            self._packed(packs, ns / 1e3)
            if compiled:
                self._captured(*nat.captured())

    def _forward_gate(self, tg: nativemod.Targets) -> fwdgate.ForwardGate | None:
        """The module hooks of `tg`'s forward gate (made once per calibration), or None."""
        if not tg.forward:
            return None
        if self._fwd_gate_tg is not tg:
            self.close()
            self._fwd_gate, self._fwd_gate_tg = fwdgate.ForwardGate(self._native, tg.forward), tg
        return self._fwd_gate

    def close(self) -> None:
        """Take the forward gate's hooks off the step's modules (call when done with the
        executor; its iterations run without them)."""
        if self._fwd_gate is not None:
            self._fwd_gate.close()
        self._fwd_gate = self._fwd_gate_tg = None

    def _can_compile(self) -> bool:
        """Whether this executor's recomputations can be compiled (replay.cpp built, not
        turned off by VSIM_NATIVE_REPLAY=0, a plan that recomputes)."""
        if not self.recompute_before:
            return False
        if not hasattr(self._native, "program"):
            self._programs = {}
            self.replay_note = f"compiled replay not built: {nativemod.views_error()}"
            return False
        if os.environ.get("VSIM_NATIVE_REPLAY", "1") == "0":
            self._programs, self.replay_note = {}, "turned off (VSIM_NATIVE_REPLAY=0)"
            return False
        return True

    def _compile(self, tg: nativemod.Targets) -> None:
        """After an iteration that logged its replays: their programs, and the frame flags
        that capture what the programs read (no call into Python at a frame only a program
        needs), or the reason the replay stays in Python."""
        logs, self._logs = self._logs, None
        assert logs is not None
        rcs = [rc for rcs in self.recompute_before.values() for rc in rcs]
        why = next((lg.why for lg in logs.values() if lg.why), None)
        if why is None and any(id(rc) not in logs for rc in rcs):
            why = "a recomputation did not run in the iteration that compiles"
        if why is not None:
            self._programs, self.replay_note = {}, f"recomputation replayed in Python: {why}"
            return
        nat = self._native
        self._programs = {id(rc): (nat.program(logs[id(rc)].steps), logs[id(rc)].targets,
                                   logs[id(rc)].extra) for rc in rcs}
        if self.core is not None and hasattr(self.core, "set_programs"):
            for op, at_op in self.recompute_before.items():
                self.core.set_programs(op, [(*self._programs[id(rc)][:1], list(rc.tensors),
                                             *self._programs[id(rc)][1:], describe(rc))
                                            for rc in at_op])
        self._programs_tg = tg
        captured = {st[0]: st[1] for lg in logs.values() for st in lg.steps}
        flags: dict[int, int] = {}
        for key in tg.frame_flags:
            k = tg.frame_call.get(key)
            # the outputs alone (counter.cpp's OUTS): what Python needs of a frame when the
            # programs replay (the watched tensors, the constants kept); arguments are captured
            nf = 32 if key in tg.frame_watch or (k is not None and k in self.constant_calls) \
                else 0
            if key in captured:
                nf |= 8 | (16 if captured[key] else 0)
            if nf:
                flags[key] = nf
        self._compiled_flags = flags
        self.replay_note = None

    def _pack_callback(self, tid: int, t: torch.Tensor) -> None:
        """A save where calibration found trace tensor `tid` (counter.cpp's Packs)."""
        try:
            self.register([(0, tid)], t)
        except BaseException as exc:
            self._native_exc = exc
            raise

    def _callback(self, count: int, out: Any, post: bool) -> None:
        t0 = time.perf_counter()
        timed = self.stats.host_us  # the executor's timed work (advance) inside this call back
        try:
            assert self._armed is not None
            tg = self._armed[1]
            if post:
                pairs = tg.post.get(count)
                if pairs:
                    self.register(pairs, out)
                k = tg.after.get(count, -1)
                if k < 0:
                    return
            else:
                k = tg.pre[count]
            self.calls = k
            op = self.map.call_op[k]
            if op > self.cur:
                self.advance(op)
        except BaseException as exc:
            self._native_exc = exc
            raise
        finally:
            self.stats.callback_py_us += (time.perf_counter() - t0) * 1e6
            self.stats.callback_timed_us += self.stats.host_us - timed

    def _frame_callback(self, count: int, number: int, name: Any, args: Any, kwargs: Any,
                        out: Any, post: bool) -> None:
        """A frame the plan needs has run (post: its operator's name, arguments and outputs)
        or is about to (its RNG state, for a random call a chain records)."""
        try:
            if not post:
                self._frame_rng = self.rng_state()
                return
            assert self._armed is not None
            cal, tg = self._armed
            key = nativemod.frame_key(count, number)
            pairs = tg.frame_watch.get(key)
            if pairs:
                self.register(pairs, out)
            k = tg.frame_call.get(key)
            if k is None:
                return
            if name is None:  # outputs alone (counter.cpp's OUTS): a compiled iteration's
                self.on_call(None, None, None, out, None, k)  # a constant to keep, if any
                return
            func, random = cal.flagged[k]
            if name != _cpp_name(func):
                func = _operator(name)  # ran in its other form: record what ran
            rng, self._frame_rng = (self._frame_rng if random else None), None
            self.on_call(func, args, kwargs, out, rng, k)
        except BaseException as exc:
            self._native_exc = exc
            raise

    def _check_native_end(self) -> None:
        """After a native iteration: it made as many counted calls as its calibration."""
        assert self._armed is not None
        cal = self._armed[0]
        if self._native_count != cal.total:
            raise self._diverged(f"the iteration made {self._native_count} counted calls, its "
                                 f"calibration {cal.total}: the run diverged (at op "
                                 f"{cal.op_at(min(self._native_count, cal.total) - 1)})")
        self.calls = self.map.n_calls

    def _diverged(self, why: str) -> NativeDivergence:
        """A native iteration's calls were not its calibration's: later iterations under these
        flags run under the Python tracker (which stops a step that really differs from the
        trace with OpSequenceError)."""
        self.give_up_native(why)
        return NativeDivergence(why)

    def give_up_native(self, why: str) -> None:
        """Later iterations under these determinism flags run under the Python tracker."""
        self._cal[determinism_key()] = f"native tracker not used: {why}"
        self.tracker_note = f"native tracker given up: {why}"
        self.close()

    def _pause_native(self, on: bool) -> bool:
        return bool(self._native.pause(on)) if self._native is not None else False

    if TYPE_CHECKING:  # provided by Executor
        def register(self, watch: list[tuple[int, int]], out: Any) -> None: ...

        def _packed(self, packs: int, us: float) -> None: ...

        def _framed(self, calls: int, us: float) -> None: ...

        def advance(self, op: int) -> None: ...

        def _storage(self, t: int) -> Any: ...

        def rng_state(self) -> Any: ...

        def _captured(self, frames: int, ns: int) -> None: ...

        stats: Any

        recompute_before: dict[int, list[Any]]
        device: torch.device
        _compiled_iteration: bool
        _logs: dict[int, Any] | None

        def on_call(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Any,
                    k: int) -> bool: ...
