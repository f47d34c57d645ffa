"""Carry out a policy's plan for real inside PyTorch training iterations (`vsim measure`).

`Tracker`, a TorchDispatchMode, counts the iteration's aten calls and checks each against the
OpMap (vsim.runtime.opmap: which trace op each call belongs to, which trace tensor each output
is), so a run that diverges from the trace stops with OpSequenceError; at each op boundary the
`Executor` carries out the plan's actions.

How the actions are carried out (`Executor`): a tensor of the trace is a storage (one allocation
of the caching allocator), so actions work on storages, which every reference to the tensor
shares -- autograd's saved variables, views, the model's own Python locals:
- Offload: at its op, the D2H stream waits for the compute stream (an event recorded there), then
  copies the storage's bytes into a host buffer (pinned unless the plan stages through pageable
  memory; a slot of one pinned pool when the plan has `pinned_pool_bytes`); `record_stream` marks
  the block as used by the D2H stream. Release: when op `release_after` has ended (in launch
  order), the storage is resized to 0 bytes, which frees the block; the caching allocator does not
  hand it out again before the copy's work on the D2H stream is done.
- Prefetch: the storage is resized back (allocated on the compute stream, so the allocator's
  stream order protects earlier users of the memory), the H2D stream waits for the compute stream
  and for the tensor's D2H copy, copies the bytes back, and records an event that op `needed_by`
  makes the compute stream wait for.
- Sync: the compute stream waits for everything issued so far on both copy streams.
- Drop and Release: the storage is resized to 0 bytes (no copy).
- Recompute: the aten calls of the chain's ops are recorded (function, arguments as storage
  references, RNG state for random ops) while the forward pass runs them; before op `before_op`
  they are called again, outside autograd, with the in-place updates other calls made to the
  storages they allocate, each argument in the state its call read (writes are numbered per
  storage). A dropped tensor gets its bytes back by swapping the recomputed storage's memory
  into it (`UntypedStorage._swap_data_ptr_`, or the native extension's `swap_storages` where
  PyTorch lacks it, as torch 2.11 does; no copy; a copy where neither is there, counted in
  `executed.skipped`); intermediates live only while the chain runs. Arguments that the
  original call mutated but that the chain does not produce (batch-norm running statistics)
  get copies, so that the recomputation has no side effect.
- Retime to a workspace-free convolution: PyTorch offers no per-call choice of cuDNN engine, but
  it falls back, when the engine it cached cannot get its workspace, to the heuristics' first
  engine that can, and caches that one. So in the executor's first iteration each such op runs
  squeezed: the process is capped at what it holds plus the op's results and SQUEEZE_MARGIN,
  after giving back cached segments and filling the free blocks of the segments still in use
  (but those its results would take: plug_free_blocks), and restored when the op ends. The
  engine PyTorch then caches for the shape serves every later iteration. Whether the squeeze
  took (the op allocated no more than its results and the margin) is counted per op
  (`squeezed`, `squeeze_missed`). The cached engines outlive the executor: a later case in the same
  process with the same shapes gets them too, so measure.py runs such a case alone.
  Other Retimes (durations only) are not executed.
Where the native extension is built, the whole plan but recomputation and squeezes runs in C++
(vsim/runtime/native/core.cpp, the executor's `core`): the op-boundary loop, every offload,
prefetch, wait, drop, release and sync, the tensors' state, the pinned pool, and -- under the
native tracker -- registering the outputs the plan acts on, without a call into Python; the
core calls `_core_hook` for what stays in Python. `VSIM_NATIVE_CORE=0` keeps the Python methods
below, which are its reference (tests hold the two to the same actions and gradients), with
offload, prefetch and the waits one C++ call each (actions.cpp; `VSIM_NATIVE_ACTIONS=0`: all in
Python). Each recomputation from the second native iteration on runs in C++ too: the first
one's Python replay compiles to a program that replay.cpp runs (recompute.py's `_ProgramLog`;
`VSIM_NATIVE_REPLAY=0`: the Python replay every iteration).
On the CPU (tests) copies are synchronous and there are no streams or events.

In parts: the dispatch mode in tracker.py, recording and recomputation in recompute.py (a mixin
of Executor), the pinned pool in hostmem.py; here the plan's index and the actions on storages.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import Offload, Plan, PlanIndex, Retime
from ..trace.schema import Trace
from .hostmem import PinnedPool
from .native import actions as native_actions
from .nativerun import NativeRuns
from .opmap import OpMap, OpSequenceError
from .recompute import CONSTANT_FUNCS, ExecutorError, Recomputation, RecordedCall, _leaves

SQUEEZE_MARGIN = 32 * 2**20  # what a workspace-free convolution may still allocate beyond its
# results (validation/workspace-free used the same margin to time these engines)

__all__ = ["SQUEEZE_MARGIN", "Executor", "ExecutorError", "IterationStats", "PinnedPool",
           "core_available"]


def _same(t: Any) -> Any:
    return t


def core_available() -> bool:
    """Whether executors carry their plans out in C++ (native/core.cpp): the native extension
    built with it, and not turned off by VSIM_NATIVE_CORE=0."""
    act = native_actions()
    return act is not None and hasattr(act, "Core") and \
        os.environ.get("VSIM_NATIVE_CORE", "1") != "0"


@dataclass
class IterationStats:
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    offloads: int = 0
    prefetches: int = 0
    drops: int = 0
    releases: int = 0
    recomputed_calls: int = 0
    syncs: int = 0
    inplace_rerun: int = 0
    inplace_missed: int = 0
    host_us: float = 0.0  # host time spent carrying out actions (not counting the tracker)
    # parts of host_us spent in calls that can wait for the GPU or the link (what any runtime
    # of the same plan on PyTorch's allocator waits for): bringing a prefetched tensor's block
    # back (an allocation, which under a cap can free cached blocks and synchronize), issuing
    # copies (synchronous from pageable memory), waiting for a pinned-pool slot; and replaying
    # recomputed calls (the recomputation's own launches)
    alloc_us: float = 0.0
    copy_us: float = 0.0
    pool_wait_us: float = 0.0
    # the native actions' CUDA calls around the copies (events recorded and waited for, stream
    # switches, record_stream), which a C++ runtime of the plan makes as well
    event_us: float = 0.0
    # giving a released or dropped tensor's block back to the allocator (storage resize to 0:
    # the caching allocator's free, with an event per stream that used the block), the
    # counterpart of alloc_us; timed from 2026-11-27
    free_us: float = 0.0
    recompute_us: float = 0.0
    # part of recompute_us: inside the replayed aten calls themselves (their dispatch, launch
    # and allocations, which any runtime recomputing through PyTorch pays); the rest of it is
    # the replay's own bookkeeping (finding each argument's storage, RNG state, outputs)
    replay_call_us: float = 0.0
    # recording the calls chains replay, keeping constants, noting in-place updates (forward;
    # part of host_us: the runtime's own work, which a C++ runtime would do in C++)
    record_us: float = 0.0
    recorded_calls: int = 0
    # the saved-tensor hook (a Python call per tensor autograd saves; not part of host_us)
    pack_us: float = 0.0
    packs: int = 0
    # the native tracker's call backs at frames (arguments made Python objects, the Python
    # call; counter.cpp's frame_call_back), timed in C++; part of host_us where the Python
    # side is timed
    frame_us: float = 0.0
    frame_calls: int = 0
    # the native tracker's call backs at counts (from 2026-11-27): their number, their time
    # timed in C++ around each (the crossing into Python and the executor's work inside), and
    # that work timed in Python: callback_us - callback_py_us is what the crossings alone
    # cost, outside host_us and every other timer
    callbacks: int = 0
    callback_us: float = 0.0
    callback_py_us: float = 0.0
    # the part of host_us spent inside those call backs (their advance): callback_us less it
    # is all their cost outside host_us, the crossings and the Python around advance
    # (registering outputs, the lookups)
    callback_timed_us: float = 0.0
    tracker: str = "python"  # the op tracker of this iteration (vsim.runtime.nativerun)
    # convolution calls run as micro-batches, replayed ones included (vsim.runtime.microbatch)
    split_calls: int = 0
    host_peak_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class Executor(Recomputation, NativeRuns):
    """Carries out `plan` during iterations of a step whose aten calls `opmap` maps to `trace`.

    Use: `ex.run(step)` runs one iteration under the tracker (see the module docstring for what
    each action does). `inputs`: the step's flattened input tensors (resident across
    iterations; an offloaded input is brought back at the end of the iteration if the plan did
    not). `pool`: a PinnedPool to reuse (plans with pinned_pool_bytes). `strict`: a Recompute
    re-runs the in-place updates that ops outside its chain made to the tensors it rebuilds,
    and reads each argument in the state its call saw (vsim.runtime.recompute); when it cannot
    (their other inputs are gone, or only a later state is left), strict raises ExecutorError,
    otherwise the chain runs on what is there (wrong values, counted in `inplace_missed`).
    `tracker`: which op tracker finds the places to act (vsim.runtime.nativerun: "auto",
    "native" or "python")."""

    def __init__(self, plan: Plan, opmap: OpMap, trace: Trace, device: torch.device,
                 inputs: list[torch.Tensor], pool: PinnedPool | None = None,
                 strict: bool = True, memory_fraction: float = 1.0,
                 tracker: str = "auto") -> None:
        self.plan = plan
        self.memory_fraction = memory_fraction  # the case's cap, restored after a squeeze
        self.strict = strict
        self.map = opmap
        self.trace = trace
        self.device = device
        self.gpu = device.type == "cuda"
        self.inputs = inputs
        self.n_ops = len(trace.ops)
        index = PlanIndex(plan)
        self.offload_at = index.offload_at
        self.offload_after = index.offload_after
        self.prefetch_at = index.prefetch_at
        self.needs = index.needs
        self.sync_after = index.sync_after
        self.drop_after = index.drop_after
        self.release_after = index.release_after
        self.recompute_before = index.recompute_before
        self.retimed: list[Retime] = list(index.retime.values())
        self.touched = touched = index.tensors_acted_on()
        self.squeeze_ops = {a.op for a in self.retimed if a.workspace_bytes == 0}
        # convolutions run as micro-batches (vsim.runtime.microbatch): the Python tracker
        # replaces their calls; the native one cannot
        self.split_parts = {a.op: a.parts for a in self.retimed if a.parts > 1}
        self.tensor_by_id = trace.tensor_by_id()
        self.squeezing: tuple[int, int] | None = None  # (op, allocated bytes when it started)
        self.squeezed: list[int] = []        # ops whose squeezed run allocated no workspace
        self.squeeze_missed: list[int] = []  # ... and those that still allocated one
        self._plugs: list[torch.Tensor] = []  # the free blocks a squeeze fills (plug_free_blocks)
        self.watch = {k: [(j, t) for j, t in outs if t in touched]
                      for k, outs in opmap.outputs.items()}
        self.watch = {k: v for k, v in self.watch.items() if v}
        self.input_of = {t: i for t, i in opmap.inputs.items() if t in touched}
        located = {t for v in self.watch.values() for _, t in v} | set(self.input_of)
        self.unlocated = sorted(touched - located)
        self._unlocated = set(self.unlocated)
        self.recorded_ops = {o for rcs in self.recompute_before.values() for rc in rcs
                             for o in rc.ops}
        # in-place updates matter to recomputations until the last one has run
        self.track_until = index.track_until()
        # calls that make constants a recomputation may read (recompute.CONSTANT_FUNCS)
        self.constant_calls: frozenset[int] = frozenset(
            k for k, f in enumerate(opmap.funcs) if str(f) in CONSTANT_FUNCS) \
            if self.recorded_ops else frozenset()
        # (shape, dtype, device) -> a buffer replayed batch norms update their running
        # statistics into (vsim.runtime.recompute's _protect_mutated); kept across iterations
        self.scratch: dict[tuple[Any, ...], torch.Tensor] = {}
        self.pool = pool
        self.host: dict[int, torch.Tensor] = {}   # per-tensor host buffers, reused
        self.host_allocated = 0
        self.pool_overflow = 0
        self.d2h: Any = None
        self.h2d: Any = None
        if self.gpu:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        # offload, prefetch and waits as one C++ call each where the native extension is built
        # (vsim.runtime.native; VSIM_NATIVE_ACTIONS=0 keeps them in Python)
        self.act: Any = native_actions()
        self.core: Any = self._make_core(index)
        self.paused = False
        self.native_iterations = 0  # iterations that ran to the end under the native tracker
        self.iterations = 0
        self.inputs_pending = False  # abort could not bring an offloaded input back
        releases = {o.release_after if o.release_after is not None else o.at_op
                    for o in plan.actions if isinstance(o, Offload)}
        if self.split_parts and tracker != "python":
            if tracker == "native":
                raise ExecutorError("a plan with micro-batched convolutions runs under the "
                                    "Python tracker only (the native one cannot replace a call)")
            tracker = "python"
        self._init_tracking(
            tracker,
            plan_start_ops=(set(self.prefetch_at) | set(self.needs) | set(self.recompute_before)
                            | set(self.offload_at) | self.squeeze_ops),
            plan_end_ops=(set(self.offload_after) | releases | set(self.drop_after)
                          | set(self.release_after) | set(self.sync_after) | self.squeeze_ops))
        self._begin()

    def _make_core(self, index: PlanIndex) -> Any:
        """The plan in C++ (native/core.cpp), or None where the extension is not built or
        `VSIM_NATIVE_CORE=0`. Actions are added in the order the Python methods take them."""
        if not core_available():
            return None
        ref = weakref.ref(self)  # the core holds the hook: no cycle through C++

        def hook(op: int, phase: int) -> None:
            ex = ref()
            if ex is not None:
                ex._core_hook(op, phase)

        n_tensors = max((t.id for t in self.trace.tensors), default=-1) + 1
        core = self.act.Core(n_tensors, self.n_ops, self.gpu, self.plan.pinned, hook)
        for op, pres in index.prefetch_at.items():
            for pre in pres:
                core.add(op, "prefetch", pre.tensor, -1)
        for op, ts in index.needs.items():
            for t in ts:
                core.add(op, "needs", t, -1)
        for op in index.recompute_before:
            core.add(op, "recompute", -1, -1)
        for where, offs in (("offload_at", index.offload_at),
                            ("offload_after", index.offload_after)):
            for op, offs_at in offs.items():
                for off in offs_at:
                    rel = off.release_after if off.release_after is not None else off.at_op
                    core.add(op, where, off.tensor, rel)
        for op in self.squeeze_ops:
            core.add(op, "squeeze", -1, -1)
        for what, by_op in (("drop", index.drop_after), ("release", index.release_after)):
            for op, ts in by_op.items():
                for t in ts:
                    core.add(op, what, t, -1)
        for op in index.sync_after:
            core.add(op, "sync", -1, -1)
        for t in self.input_of:
            core.set_input(t)
        for t in self.unlocated:
            core.set_unlocated(t)
        if self.pool is not None:
            core.set_pool(self.pool.buffer)
        return core

    def _core_hook(self, op: int, phase: int) -> None:
        """What the core leaves to Python at op `op` (core.cpp's Phase): its recomputations
        (1), its squeeze once its start's actions are done (2), the squeeze's end (4)."""
        try:
            if phase == 1:
                self._recompute_before(op)
            elif phase == 2:
                self._squeeze_at(op)
            else:
                self._unsqueeze_at(op)
        except BaseException as exc:
            if self.tracker_used == "native":
                self._native_exc = exc  # raised again where the step returns (nativerun)
            raise

    def _merge_core(self) -> None:
        """The core's counters and timers of the iteration into `stats`."""
        got = self.core.stats()
        s = self.stats
        for k in ("offloads", "prefetches", "drops", "releases", "syncs", "d2h_bytes",
                  "h2d_bytes", "recomputed_calls", "inplace_rerun"):
            setattr(s, k, getattr(s, k) + got[k])
        s.host_peak_bytes = max(s.host_peak_bytes, got["host_peak_bytes"])
        for k in ("host", "alloc", "copy", "event", "free", "pool_wait", "callback_timed",
                  "recompute", "replay_call"):
            setattr(s, f"{k}_us", getattr(s, f"{k}_us") + got[f"{k}_ns"] / 1e3)
        for why, n in got["skipped"].items():
            s.skipped[why] += n
        self.host_allocated = self.core.host_allocated
        self.pool_overflow = self.core.pool_overflow

    @property
    def cur(self) -> int:
        """The op the iteration is at (its start's actions carried out)."""
        return int(self.core.cur) if self.core is not None else self._cur

    @cur.setter
    def cur(self, op: int) -> None:
        if self.core is not None:
            self.core.cur = op
        else:
            self._cur = op

    # ------------------------------------------------------------ iteration

    def _begin(self) -> None:
        self.calls = 0
        self._cur = -1
        # the step's stream, looked up once: torch.cuda.current_stream() costs ~10 us of host
        # time a call (device-index checks), and actions used it seven times per tensor
        self.cs: Any = torch.cuda.current_stream(self.device) if self.gpu else None
        self.storage: dict[int, Any] = {}
        self.nbytes: dict[int, int] = {}
        self.state: dict[int, str] = {}
        self.out_ev: dict[int, Any] = {}
        self.in_ev: dict[int, Any] = {}
        self.slot: dict[int, tuple[int, int]] = {}
        self.pending_release: dict[int, list[int]] = defaultdict(list)
        self.recording: dict[int, list[RecordedCall]] = {o: [] for o in self.recorded_ops}
        self.keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.key_storage: dict[int, Any] = {}  # storage key -> weakref to the storage
        # storage key -> the calls that wrote it (fresh outputs, in-place updates) in order,
        # and the in-place updates among them (vsim.runtime.recompute's _recompute)
        self.writes: dict[int, list[int]] = defaultdict(list)
        self.mutations: dict[int, list[RecordedCall]] = defaultdict(list)
        self.constants: dict[int, torch.Tensor] = {}
        self.next_key = 0
        self._compiled_iteration = False  # set by a native iteration that runs the programs
        self._logs = None
        self.host_live = 0
        self.stats = IterationStats()
        if self.pool is not None:
            self.pool.reset()
        core = self.core
        if core is not None:
            core.begin(self.cs, self.d2h, self.h2d)
        for t, i in self.input_of.items():
            st = self.inputs[i].untyped_storage()
            if core is not None:
                core.register(t, st)
                continue
            self.storage[t] = weakref.ref(st)
            self.nbytes[t] = st.nbytes()
            self.state[t] = "device"

    def run(self, step: Callable[[], Any]) -> IterationStats:
        """One iteration of `step` with the plan carried out; returns its statistics."""
        self._begin()
        try:
            # Saved-tensor hooks, as in the recorder's structure pass that the OpMap comes
            # from: without hooks autograd saves an op's outputs through an extra aten.detach
            # call, which would shift the call count. The hook detaches too (unseen by the
            # tracker): a saved output kept with its grad_fn would be a reference cycle that
            # only backward breaks, so an iteration stopped in forward (out of memory) would
            # keep its activations for good.
            mode = self._iteration_mode()
            self.stats.tracker = "python" if mode == "calibrate" else mode
            # Native iterations install the same hooks in C++ (vsim.runtime.nativerun).
            if mode == "native":
                self._run_tracked(step, mode)
            else:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, _same):
                    self._run_tracked(step, mode)
            self.finish()
        except BaseException:
            self.abort()
            raise
        finally:
            if self.core is not None:
                self._merge_core()
        self.iterations += 1
        self.native_iterations += self.stats.tracker == "native"
        return self.stats

    def finish(self) -> None:
        if self.tracker_used == "native":
            self._check_native_end()
        if self.calls != self.map.n_calls:
            raise OpSequenceError(f"the iteration ended after {self.calls} aten calls; the trace's "
                                  f"iteration has {self.map.n_calls} (at op {self.cur})")
        self.advance(self.n_ops)
        self._restore_inputs()

    def abort(self) -> None:
        """After an exception: bring offloaded inputs back, forget the iteration. An iteration
        stopped by running out of memory still holds its activations (the exception's frames)
        under the cap, so bringing an input back may not fit yet: then the input's storage is
        kept and `restore_inputs` must be called once memory is free (Session.run does), or
        the next iteration would read an input of 0 bytes (cuDNN: CUDNN_STATUS_BAD_PARAM)."""
        if self.squeezing is not None and self.gpu:
            self.squeezing = None
            self._plugs = []
            torch.cuda.set_per_process_memory_fraction(self.memory_fraction, self.device)
        try:
            self._restore_inputs()
        except torch.OutOfMemoryError:
            self.inputs_pending = True
        finally:
            if self.core is not None:
                self.core.forget(self.inputs_pending)
            self.storage = ({t: r for t, r in self.storage.items() if t in self.input_of}
                            if self.inputs_pending else {})
            self.recording = {}
            self.constants = {}

    def restore_inputs(self) -> None:
        """Bring back inputs that `abort` could not (out of memory): call after the stopped
        iteration's tensors are freed and the cap is lifted."""
        if self.inputs_pending:
            self._restore_inputs()
            self.inputs_pending = False
            self.storage = {}
            if self.core is not None:
                self.core.forget(False)

    def _restore_inputs(self) -> None:
        if self.core is not None:
            try:
                self.core.restore_inputs()
            except RuntimeError as exc:
                if str(exc).startswith("vsim executor:"):
                    raise ExecutorError(str(exc)[len("vsim executor: "):]) from None
                raise
            return
        for t in self.input_of:
            st = self._storage(t)
            if st is None or st.nbytes() == self.nbytes[t]:
                continue
            st.resize_(self.nbytes[t])
            got = self._host_of(t)
            if got is None:
                raise ExecutorError(f"input tensor {t} was released without a host copy")
            buf, at = got
            if self.gpu:
                self.cs.wait_stream(self.d2h)
            self._view(st).copy_(buf[at:at + self.nbytes[t]])
            self.state[t] = "device"
            self.stats.skipped["input restored at the end"] += 1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        paused, self.paused = self.paused, True
        native = self._pause_native(True)
        try:
            self.note_pack(t)  # the native tracker finds some tensors where autograd saves them
            return t.detach()
        finally:
            self.paused = paused
            self._pause_native(native)
            self.stats.packs += 1
            self.stats.pack_us += (time.perf_counter() - t0) * 1e6

    def _framed(self, calls: int, us: float) -> None:
        """A native iteration's frame call backs (counter.cpp's frame_calls)."""
        self.stats.frame_calls += calls
        self.stats.frame_us += us

    def _packed(self, packs: int, us: float) -> None:
        """Saves made through the native hook (counted and timed in C++)."""
        self.stats.packs += packs
        self.stats.pack_us += us

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Aten calls inside are not the step's (capturing gradients for a check)."""
        self.paused = True
        native = self._pause_native(True)
        try:
            yield
        finally:
            self.paused = False
            self._pause_native(native)

    def where(self) -> dict[str, Any]:
        """The op the run is at (for out-of-memory reports)."""
        op = self.cur
        if 0 <= op < self.n_ops:
            o = self.trace.ops[op]
            return {"op": op, "name": o.name, "phase": o.phase, "layer": o.layer}
        return {"op": None if op < 0 else op, "name": None, "phase": None, "layer": None}

    def diverged(self, k: int, func: Any) -> None:
        m = self.map
        op = m.call_op[k] if k < m.n_calls else self.cur
        name = m.op_names[op] if 0 <= op < len(m.op_names) else "-"
        expected = m.funcs[k] if k < m.n_calls else "the end of the iteration"
        raise OpSequenceError(f"aten call {k} of the iteration is {func}, the trace's is "
                              f"{expected} (trace op {op}, {name}): the run diverged from the "
                              "trace")

    # ------------------------------------------------------------ op boundaries

    def advance(self, op: int) -> None:
        """Every op before `op` has been launched: end them, start the ones in between (ops
        without aten calls of their own) and `op`."""
        if self.core is not None:
            self.core.advance(op)  # timed there (stats.host_us when the iteration ends)
            return
        t0 = time.perf_counter()
        starts, ends = self._start_ops, self._end_ops  # ops without actions are passed over
        cur = self.cur
        while cur < op:
            if cur >= 0 and cur in ends:
                self._end(cur)
            cur += 1
            self.cur = cur
            if cur in starts:
                self._start(cur)
        self.stats.host_us += (time.perf_counter() - t0) * 1e6

    def _start(self, op: int) -> None:
        for pre in self.prefetch_at.get(op, ()):
            self._prefetch(pre.tensor)
        for t in self.needs.get(op, ()):
            ev = self.in_ev.pop(t, None)
            if ev is not None:
                if self.act is not None:
                    self.stats.event_us += self.act.wait_event(ev, self.cs) / 1e3
                else:
                    self.cs.wait_event(ev)
        self._recompute_before(op)
        for off in self.offload_at.get(op, ()):
            self._offload(off)
        # Last, once what the op's actions allocate (prefetch targets, recomputed tensors) is
        # held: the cap leaves room for the op's own results only.
        if op in self.squeeze_ops:
            self._squeeze_at(op)

    def _recompute_before(self, op: int) -> None:
        """The recomputations before op `op`, timed as `recompute_us`."""
        for rc in self.recompute_before.get(op, ()):
            t0 = time.perf_counter()
            self._recompute(rc)
            self.stats.recompute_us += (time.perf_counter() - t0) * 1e6

    def _squeeze_at(self, op: int) -> None:
        """Squeeze workspace-free op `op` in the executor's first iteration, on a GPU."""
        if self.iterations == 0 and self.gpu:
            self._squeeze(op)

    def _unsqueeze_at(self, op: int) -> None:
        """The squeeze's end, where op `op` ran squeezed."""
        if self.squeezing is not None and self.squeezing[0] == op:
            self._unsqueeze()

    def _end(self, op: int) -> None:
        self._unsqueeze_at(op)
        for off in self.offload_after.get(op, ()):
            self._offload(off)
        for t in self.pending_release.pop(op, ()):
            self._release_offloaded(t)
        for t in self.drop_after.get(op, ()):
            self._free(t, "dropped")
        for t in self.release_after.get(op, ()):
            self._free(t, "released")
        if op in self.sync_after and self.gpu:
            cs = self.cs
            if self.act is not None:
                self.stats.event_us += (self.act.wait_stream(cs, self.d2h)
                                        + self.act.wait_stream(cs, self.h2d)) / 1e3
            else:
                cs.wait_stream(self.d2h)
                cs.wait_stream(self.h2d)
            self.stats.syncs += 1

    # ------------------------------------------------------------ workspace-free convolutions

    def _results_bytes(self, op: int) -> int:
        from ..allocator.caching import segment_size

        return sum(segment_size(size) for size in self._result_sizes(op))

    def _squeeze(self, op: int) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        results = self._result_sizes(op)
        self._plugs, unserved = plug_free_blocks(self.device, results)
        total = torch.cuda.get_device_properties(self.device).total_memory
        cap = torch.cuda.memory_reserved(self.device) + unserved + SQUEEZE_MARGIN
        torch.cuda.set_per_process_memory_fraction(min(self.memory_fraction, cap / total),
                                                   self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.squeezing = (op, torch.cuda.memory_allocated(self.device))

    def _result_sizes(self, op: int) -> list[int]:
        """The bytes of each result of op `op` (its writes but the workspace)."""
        tensors = self.tensor_by_id
        return [tensors[t].size_bytes for t in self.trace.ops[op].writes
                if tensors[t].kind != "workspace" and tensors[t].size_bytes > 0]

    def _unsqueeze(self) -> None:
        assert self.squeezing is not None
        op, start = self.squeezing
        self.squeezing = None
        self._plugs = []
        torch.cuda.synchronize(self.device)
        torch.cuda.set_per_process_memory_fraction(self.memory_fraction, self.device)
        extra = torch.cuda.max_memory_allocated(self.device) - start - self._results_bytes(op)
        (self.squeezed if extra <= SQUEEZE_MARGIN else self.squeeze_missed).append(op)

    # ------------------------------------------------------------ storages

    def register(self, watch: list[tuple[int, int]], out: Any) -> None:
        leaves = _leaves(out)
        if self.core is not None:
            for j, t in watch:
                self.core.register(t, leaves[j].untyped_storage())
            return
        for j, t in watch:
            x = leaves[j]
            st = x.untyped_storage()
            self.storage[t] = weakref.ref(st)
            self.nbytes[t] = st.nbytes()
            self.state[t] = "device"

    def _storage(self, t: int) -> Any:
        if self.core is not None:
            return self.core.storage(t)  # None counted as "tensor not found" there
        ref = self.storage.get(t)
        st = ref() if ref is not None else None
        if st is None:
            self.stats.skipped["tensor not found"] += 1
        return st

    def _state_of(self, t: int) -> str | None:
        """Tensor t's state ("device", "offloading", "host", "dropped", "released")."""
        return self.core.state(t) if self.core is not None else self.state.get(t)

    def _set_device(self, t: int) -> None:
        """Tensor t is on the device again (a recomputation rebuilt it)."""
        if self.core is not None:
            self.core.set_device(t)
        else:
            self.state[t] = "device"

    def _nbytes_of(self, t: int) -> int:
        """Tensor t's storage size when it was registered."""
        return int(self.core.nbytes(t)) if self.core is not None else self.nbytes[t]

    def _view(self, st: Any) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)

    def _host_buffer(self, t: int, n: int) -> tuple[torch.Tensor, int]:
        """Where tensor t's `n` bytes go on the host: (a uint8 buffer, the offset in it), a
        slot of the pinned pool or the tensor's own buffer (kept for later iterations). Not
        sliced here: the C++ actions take the offset (a slice is a dispatcher call through
        Python, 5-10 us a time)."""
        if self.pool is not None:
            t0 = time.perf_counter()
            got = self.pool.take(n)
            self.stats.pool_wait_us += (time.perf_counter() - t0) * 1e6
            if got is not None:
                self.slot[t] = (got, n)
                return self.pool.buffer, got
            self.pool_overflow += 1
        buf = self.host.get(t)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.uint8,
                              pin_memory=self.gpu and self.plan.pinned)
            self.host[t] = buf
            self.host_allocated += n
        return buf, 0

    def _offload(self, off: Offload) -> None:
        t = off.tensor
        if self.state.get(t) != "device":
            self.stats.skipped["offload of a tensor not on the device"] += 1
            return
        st = self._storage(t)
        if st is None or st.nbytes() == 0:
            return
        n = st.nbytes()
        buf, at = self._host_buffer(t, n)
        if self.act is not None:  # one C++ call (vsim/runtime/native/actions.cpp)
            done, copy_ns, ns = self.act.offload(st, buf, at, self.cs, self.d2h,
                                                 self.plan.pinned)
            self.stats.copy_us += copy_ns / 1e3
            self.stats.event_us += (ns - copy_ns) / 1e3
            if done is not None:
                self.out_ev[t] = done
            self._offloaded(t, n, off)
            return
        host = buf[at:at + n]
        if self.gpu:
            src = self._view(st)
            self.d2h.wait_event(self.cs.record_event())
            self.out_ev[t] = self._copy_on(self.d2h, host, src)
            src.record_stream(self.d2h)
        else:
            host.copy_(self._view(st))
        self._offloaded(t, n, off)

    def _offloaded(self, t: int, n: int, off: Offload) -> None:
        """Tensor t's copy out has been issued: its state, the counts, its release."""
        self.state[t] = "offloading"
        self.stats.offloads += 1
        self.stats.d2h_bytes += n
        self.host_live += n
        self.stats.host_peak_bytes = max(self.stats.host_peak_bytes, self.host_live)
        rel = off.release_after if off.release_after is not None else off.at_op
        if rel < self.cur:
            self._release_offloaded(t)
        else:
            self.pending_release[rel].append(t)

    def _release_offloaded(self, t: int) -> None:
        if self.state.get(t) != "offloading":
            return
        st = self._storage(t)
        if st is not None:
            self._give_back(st)
        self.state[t] = "host"

    def _give_back(self, st: Any) -> None:
        """A storage's block back to the allocator (resized to 0), timed as `free_us`."""
        t0 = time.perf_counter()
        st.resize_(0)
        self.stats.free_us += (time.perf_counter() - t0) * 1e6

    def _prefetch(self, t: int) -> None:
        state = self.state.get(t)
        if state == "offloading":  # still on the device: keep it there
            for lst in self.pending_release.values():
                if t in lst:
                    lst.remove(t)
            self.state[t] = "device"
            self.host_live -= self.nbytes.get(t, 0)
            self._give_slot(t, self.out_ev.get(t))
            self.stats.skipped["prefetch before the release: kept on the device"] += 1
            return
        if state != "host":
            if state not in ("device", None):
                self.stats.skipped[f"prefetch of a {state} tensor"] += 1
            return
        st = self._storage(t)
        if st is None:
            return
        n = self.nbytes[t]
        got = self._host_of(t)
        assert got is not None, t  # a tensor on the host went there through _host_buffer
        buf, at = got
        if self.act is not None:  # one C++ call (vsim/runtime/native/actions.cpp)
            done, alloc_ns, copy_ns, ns = self.act.prefetch(
                st, n, buf, at, self.cs, self.h2d, self.out_ev.get(t), self.plan.pinned)
            self.stats.alloc_us += alloc_ns / 1e3
            self.stats.copy_us += copy_ns / 1e3
            self.stats.event_us += (ns - alloc_ns - copy_ns) / 1e3
            if done is not None:
                self.in_ev[t] = done
            self._prefetched(t, n, done)
            return
        host = buf[at:at + n]
        t0 = time.perf_counter()
        st.resize_(n)
        self.stats.alloc_us += (time.perf_counter() - t0) * 1e6
        dst = self._view(st)
        if self.gpu:
            self.h2d.wait_event(self.cs.record_event())
            if t in self.out_ev:
                self.h2d.wait_event(self.out_ev[t])
            done = self._copy_on(self.h2d, dst, host)
            dst.record_stream(self.h2d)
            self.in_ev[t] = done
        else:
            dst.copy_(host)
            done = None
        self._prefetched(t, n, done)

    def _prefetched(self, t: int, n: int, done: Any) -> None:
        self._give_slot(t, done)
        self.state[t] = "device"
        self.stats.prefetches += 1
        self.stats.h2d_bytes += n
        self.host_live -= n

    def _copy_on(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy `src` into `dst` on `stream` (a copy stream, back to the step's after); the
        event its end records."""
        torch.cuda.set_stream(stream)  # not torch.cuda.stream(): it looks streams up
        try:
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=self.plan.pinned)
            self.stats.copy_us += (time.perf_counter() - t0) * 1e6
            return stream.record_event()
        finally:
            torch.cuda.set_stream(self.cs)

    def _host_of(self, t: int) -> tuple[torch.Tensor, int] | None:
        """Where tensor t's bytes are on the host (`_host_buffer`): this iteration's pool slot
        first (an own buffer can be left from an iteration whose pool overflowed), or None."""
        if t in self.slot:
            return self.pool.buffer, self.slot[t][0]  # type: ignore[union-attr]
        buf = self.host.get(t)
        return None if buf is None else (buf, 0)

    def _give_slot(self, t: int, event: Any) -> None:
        slot = self.slot.pop(t, None)
        if slot is not None and self.pool is not None:
            self.pool.put(slot[0], slot[1], event)

    def _free(self, t: int, how: str) -> None:
        if t in self._unlocated:
            return
        if t in self.input_of:  # the batch is the training loop's, used again next iteration
            self.stats.skipped[f"{how} input kept"] += 1
            return
        state = self.state.get(t)
        if state == "offloading":
            for lst in self.pending_release.values():
                if t in lst:
                    lst.remove(t)
        elif state != "device":
            self.stats.skipped[f"{how} tensor not on the device"] += 1
            return
        st = self._storage(t)
        if st is None:
            return
        self._give_back(st)
        self.state[t] = how
        if how == "dropped":
            self.stats.drops += 1
        else:
            self.stats.releases += 1


def plug_free_blocks(device: Any, results: list[int]) -> tuple[list[torch.Tensor], int]:
    """(tensors that fill the free blocks of the large pool's segments still in use, the
    bytes of `results` that no block left free serves: `blocks_to_plug`). A squeeze caps
    reserved memory, and a workspace served from such a block is not held against the cap:
    PyTorch then keeps the engine with a workspace and the squeeze misses (6 of 273 runs
    before 2026-11-28, e.g. VGG-16(256) recompute at 20 GiB: conv 0.2's backward, whose run
    was 9% slower than predicted; validation/workspace-free/probe_convs.py found the same in
    its probes). Each plug is a tensor of its block's size, which best fit serves from that
    block."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free = [b["size"] for seg in torch.cuda.memory_snapshot()
            if seg["device"] == index and seg["segment_type"] == "large"
            for b in seg["blocks"] if b["state"] == "inactive"]
    plugs, unserved = blocks_to_plug(free, results)
    return [torch.empty(size, dtype=torch.uint8, device=device) for size in plugs], unserved


def blocks_to_plug(free: list[int], results: list[int]) -> tuple[list[int], int]:
    """(the free blocks to fill, the segment bytes the results need beyond those left free):
    for each result, largest first, the smallest free block that holds it is left free, as
    the caching allocator's best fit would serve it."""
    from ..allocator.caching import segment_size

    blocks = sorted(free)
    unserved = 0
    for size in sorted(results, reverse=True):
        fit = next((i for i, b in enumerate(blocks) if b >= size), None)
        if fit is None:
            unserved += segment_size(size)
        else:
            blocks.pop(fit)
    return blocks, unserved
