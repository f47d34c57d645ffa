"""The native op tracker: the iteration's dispatcher calls counted in C++ (counter.cpp), with
calls back into Python only where the executor acts.

Why: the Python tracker (vsim.runtime.tracker, a TorchDispatchMode) costs ~40 us of host time
per aten call, which slowed host-bound models by +28% to +102% under any plan (issue 13); a
C++ fallback on a dispatch key costs 1.2-3.6 us per call on the lent hosts (0.4 on the
development CPU; validation/host/waits/), and VSIM_NATIVE_COUNTER=fast counts the common
operators' calls with unboxed kernels instead (counter.cpp's Fast; docs/design.md, "The
native tracker" and "The hooks only where armed").

How a run finds its places without a Python mode: the first iteration of an Executor under a
given set of determinism flags runs the Python tracker with the counter calibrating beside it
(`Calibration`): for every aten call k the Python mode sees, the counter's value when it saw it
(`before[k]`) and when its function returned (`after[k]`), and for every counted call its
operator name and the count at its return. Counts are deterministic for the same step, so later
iterations run under the counter alone, armed to call back:
- before the counted call `before[k] - 1` (the latest call started when the mode saw k) for a
  call k that starts an op with actions: that call starts after call k-1 returned (checked:
  `before[k] > after[k-1]`) and before k, as the Python tracker acts;
- after that call returns, with its outputs, for a call k whose outputs the plan acts on: the
  counted call must be k's own function (the same outputs) and no earlier callback may fire
  while it runs.
- after a frame (counted.cpp: a call made above autograd inside a counted call, which is what a
  Python dispatch mode sees) with its arguments, for a call k the plan records for replay, a
  constant it keeps or an in-place update a recomputation must know of; before it too where
  the call is random (its RNG state). The frame must be k's own operator, one frame per call,
  and a framed counted call must make as many frames as in calibration (else the run
  diverged).
Where a check fails, the calibration says why and the executor keeps the Python tracker.

The extension is compiled on first use with torch.utils.cpp_extension (a C++ compiler and
ninja; the build is cached by torch outside the repository). `VSIM_NATIVE_TRACKER=0` turns it
off. Where it cannot be built, `available()` says why and the Python tracker runs.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

# counter.cpp: the tracker and the saved-tensor hooks; actions.cpp: the executor's offload and
# prefetch as one call each; core.cpp: the executor's whole plan but recomputation (actions.h:
# their shared helpers); views.cpp: the replay's views of recorded arguments; replay.cpp: the
# compiled replay of recomputations
SOURCES = tuple(Path(__file__).with_name(f)
                for f in ("counter.cpp", "actions.cpp", "core.cpp", "views.cpp", "replay.cpp"))
HEADERS = (Path(__file__).with_name("actions.h"),)
# the newest parts, left out (with their -D flags) where the whole does not build
_OPTIONAL = {"views.cpp": "-DVSIM_NO_VIEWS", "replay.cpp": "-DVSIM_NO_REPLAY"}

_MODULE: Any = None
_ERROR: str | None = None        # why load() gave None
_BUILD_ERROR: str | None = None  # why the extension could not be built
_VIEWS_ERROR: str | None = None  # why it was built without views.cpp and replay.cpp


def load() -> Any:
    """The compiled counter, or None (then `error()` says why)."""
    if os.environ.get("VSIM_NATIVE_TRACKER", "1") == "0":
        global _ERROR
        _ERROR = "turned off (VSIM_NATIVE_TRACKER=0)"
        return None
    return _build()


def actions() -> Any:
    """The compiled module for the executor's offload, prefetch and waits (actions.cpp), or
    None where it cannot be built or `VSIM_NATIVE_ACTIONS=0` keeps them in Python."""
    if os.environ.get("VSIM_NATIVE_ACTIONS", "1") == "0":
        return None
    return _build()


def _build() -> Any:
    """The extension from SOURCES; where that fails, without the newest parts (views.cpp and
    replay.cpp, compiled out by VSIM_NO_VIEWS and VSIM_NO_REPLAY: the replay then runs and
    makes its views in Python), so that a build problem there (a torch whose headers differ)
    does not cost the tracker and the actions. `views_error()` says why they are missing."""
    global _MODULE, _ERROR, _BUILD_ERROR, _VIEWS_ERROR
    if _MODULE is not None or _BUILD_ERROR is not None:
        if _BUILD_ERROR is not None:
            _ERROR = _BUILD_ERROR
        return _MODULE
    try:
        import torch
        from torch.utils.cpp_extension import load as build
    except Exception as exc:  # noqa: BLE001  (a torch without the extension tools)
        _ERROR = _BUILD_ERROR = _why(exc)
        return None
    text = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    tag = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:12]
    try:
        _MODULE = build(name=f"vsim_native_tracker_{tag}", sources=[str(p) for p in SOURCES],
                        extra_cflags=["-O2"], verbose=False)
        return _MODULE
    except Exception as exc:  # noqa: BLE001  (a missing compiler or ninja, other headers)
        _VIEWS_ERROR = _why(exc)
    core = [p for p in SOURCES if p.name not in _OPTIONAL]
    try:
        _MODULE = build(name=f"vsim_native_tracker_core_{tag}", sources=[str(p) for p in core],
                        extra_cflags=["-O2", *_OPTIONAL.values()], verbose=False)
    except Exception as exc:  # noqa: BLE001
        _ERROR = _BUILD_ERROR = _why(exc)
        _MODULE = None
    return _MODULE


def _why(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def views_error() -> str | None:
    """Why the extension was built without the replay's views and compiled replay, or None."""
    return _VIEWS_ERROR


def error() -> str | None:
    return _ERROR


def python_name(cpp_name: str) -> str:
    """'aten::add.Tensor' -> 'aten.add.Tensor' (str() of the OpOverload)."""
    return cpp_name.replace("::", ".", 1)


@dataclass
class Calibration:
    """One iteration seen by the Python tracker and the counter together (module docstring).
    `before[k]`: the count when Python call k was seen; `inside[k]`: whether it ran inside a
    counted call (then `before[k] - 1`; some of autograd's own calls run outside every counted
    call, after `before[k] - 1` returned); `names[c]`: counted call c's operator;
    `outputs[c]`: (index among c's flattened outputs, storage address) of its tensor outputs;
    `registered[t]`: the storage address of trace tensor t where the Python tracker found it;
    `call_op[k]`, `funcs[k]`, `views[k]`: Python call k's trace op, function name and whether
    it is a view (no kernel)."""

    before: list[int]
    inside: list[bool]
    names: list[str]
    outputs: dict[int, list[tuple[int, int]]]
    registered: dict[int, int]
    call_op: list[int]
    funcs: list[str]
    views: list[bool]
    packs: list[tuple[int, int]] = field(default_factory=list)  # (count, storage) per save
    # frames (counter.cpp): (count, number, operator, parent) each; the frame each Python call
    # ran in ((-1, -1): none); the Python calls a native iteration must call back at, with their
    # function and whether they are random
    frames: list[tuple[int, int, str, int]] = field(default_factory=list)
    frame_of: list[tuple[int, int]] = field(default_factory=list)
    flagged: dict[int, tuple[Any, bool]] = field(default_factory=dict)
    # backward's nodes (counter.cpp's Gate), in walk order from its root: each one's (first
    # count, count after), -1 where it did not run; backward's first count and the first count
    # after it (-1: no backward seen), and how many more backwards the step made
    node_spans: list[tuple[int, int]] = field(default_factory=list)
    backward_at: int = -1
    after_backward: int = -1
    backwards: int = 0

    @property
    def total(self) -> int:
        return len(self.names)

    @cached_property
    def frame_names(self) -> dict[tuple[int, int], str]:
        """(count, number) -> the frame's operator."""
        return {(c, j): n for c, j, n, _ in self.frames}

    def op_at(self, count: int) -> int:
        """The trace op of the last Python call seen within counted calls up to `count`."""
        from bisect import bisect_right

        k = bisect_right(self.before, count + 1) - 1
        return self.call_op[k] if 0 <= k < len(self.call_op) else -1


@dataclass
class Targets:
    """Where an armed counter calls back: `flags` per count (1 before, 2 after, 4 frames, 8 the
    saved-tensor hooks on from its start to the next counted call's, 16 a gated backward
    node's last count with a flag: the tracker off after it), the Python
    call each boundary stands for, the trace tensors each call's outputs are, and the operator
    name each target must have."""

    flags: bytes
    pre: dict[int, int] = field(default_factory=dict)    # count -> Python call k
    after: dict[int, int] = field(default_factory=dict)  # count -> Python call k (at its end)
    post: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # count -> (j, t)
    # frame_key(count, number among the count's saves) -> trace tensor
    packs: dict[int, int] = field(default_factory=dict)
    expect: dict[int, str] = field(default_factory=dict)
    # frames: frame_key(count, number) -> 1 before (RNG state) | 2 after (arguments, outputs)
    # | 32 after (outputs alone: a frame only watched), its operator, the Python call it is;
    # each framed count's number of frames
    frame_flags: dict[int, int] = field(default_factory=dict)
    frame_expect: dict[int, str] = field(default_factory=dict)
    frame_call: dict[int, int] = field(default_factory=dict)
    frame_watch: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # -> (j, t)
    frame_count: dict[int, int] = field(default_factory=dict)
    # backward's gate (counter.cpp's Gate): per node its first count where it holds a count
    # with a flag, else -1; None where backward cannot be gated (`gate_note` says why)
    gate: list[int] | None = None
    # per node, the count its end syncs to where a flagged count follows it outside every
    # node, else -1
    gate_sync: list[int] = field(default_factory=list)
    gate_note: str | None = None
    # forward's module calls to gate (vsim.runtime.fwdgate.choose; None: not asked for)
    forward: Any = None


def frame_key(count: int, number: int) -> int:
    """A frame's key, as counter.cpp's frame_key."""
    return (count << 20) | number


def _base(name: str) -> str:
    """'aten.relu_.default' -> 'aten.relu.default': in-place and out-of-place forms as one."""
    parts = name.split(".")
    if len(parts) > 1 and parts[1].endswith("_"):
        parts[1] = parts[1][:-1]
    return ".".join(parts)


class Unsafe(Exception):
    """The calibration cannot place a callback exactly where the Python tracker acts."""


def _next_counted(cal: Calibration, k: int) -> int | None:
    """The counted call after Python call k (outside every counted call) when the Python calls
    from k up to it are views and the first Python call after k's count is inside it; None
    otherwise."""
    from bisect import bisect_right

    j = bisect_right(cal.before, cal.before[k])
    if j >= len(cal.before) or cal.before[j] != cal.before[k] + 1 or not cal.inside[j]:
        return None
    if not all(cal.views[i] for i in range(k, j)):
        return None
    return cal.before[j] - 1


def targets(cal: Calibration, boundary_calls: list[int],
            watch: dict[int, list[tuple[int, int]]], frames_first: bool = False) -> Targets:
    """Callbacks for the op boundaries at Python calls `boundary_calls` (the executor acts
    before them) and for the trace tensors among the outputs of the calls in `watch`.

    A boundary at a call k inside counted call c is placed before c starts: exact when the
    Python calls c makes before k are views (no kernel launched between c's start and k). A
    boundary at a call outside every counted call is placed before the next counted call when
    the calls from k to it are views (`_next_counted`), else where the last counted call
    returned, exact when the calls between are views. The tensors of a watched call are taken
    from its counted call's outputs, by storage; one the counted call does not return, where
    autograd saves it (the saved-tensor hooks, on around that call), else from its own call's
    frame (`frames_first`: the frame first, the hooks where there is none). Unsafe otherwise."""
    from bisect import bisect_left

    flags = bytearray(cal.total)
    out = Targets(b"")
    for k in boundary_calls:
        c = cal.before[k] - 1
        first = bisect_left(cal.before, cal.before[k])
        # the calls between the callback and k: in c before k, or after c returned
        launching = [j for j in range(first, k)
                     if not cal.views[j] and (cal.inside[k] or not cal.inside[j])]
        if launching:
            j = launching[0]
            raise Unsafe(f"op boundary at aten call {k} ({cal.funcs[k]}) comes after call {j} "
                         f"({cal.funcs[j]}) within counted call {c} "
                         f"({python_name(cal.names[c]) if c >= 0 else 'none'})")
        if c < 0:
            raise Unsafe(f"op boundary at aten call {k} ({cal.funcs[k]}) before any counted call")
        if cal.inside[k]:
            flags[c] |= 1
            out.pre[c] = max(k, out.pre.get(c, k))
        else:
            # Autograd's own calls before a node's first counted call (the detaches that unpack
            # its saved tensors) run outside every counted call. Acting where the last counted
            # call returned holds that call's output (its POST callback's) while the actions
            # run: on VGG-16(256) a recomputation there held 2.3 GiB more than under the
            # Python tracker, which acts at the detach itself. When the calls from k to the
            # next counted call are views, act before that call instead: the same place for
            # every action (no kernel runs in between), that output by then let go.
            c_next = _next_counted(cal, k)
            if c_next is not None:
                c = c_next
                flags[c] |= 1
                out.pre[c] = max(k, out.pre.get(c, k))
            else:
                flags[c] |= 2
                out.after[c] = max(k, out.after.get(c, k))
        out.expect[c] = cal.names[c]
    watched: dict[int, list[tuple[int, int]]] = {}  # call k -> (output index, trace tensor)
    # a save by the count it happened at and its number among that count's saves (counter.cpp's
    # Packs); a save the plan acts on turns the hooks on from the start of the counted call
    # before it (flag 8) until the next starts
    saved: dict[tuple[int, int], int] = {}
    numbered: dict[int, int] = {}
    for count, ptr in cal.packs:
        number = numbered.get(count, 0)
        numbered[count] = number + 1
        saved.setdefault((count, ptr), frame_key(count, number))
    for k, pairs in watch.items():
        c = cal.before[k] - 1
        if not cal.inside[k]:
            raise Unsafe(f"aten call {k} ({cal.funcs[k]}), whose outputs the plan acts on, ran "
                         "outside every counted call")
        where = {p: j for j, p in cal.outputs.get(c, [])}
        for jk, t in pairs:
            ptr = cal.registered.get(t, -1)
            jj = where.get(ptr)
            if jj is not None:
                out.post.setdefault(c, []).append((jj, t))
                flags[c] |= 2
                out.expect[c] = cal.names[c]
                continue
            # not returned by the counted call (max pooling's indices, batch norm's saved
            # statistics): where autograd saves it while that call still runs, or from the
            # frame of its own call, which returns it (one call back into Python with the
            # frame's outputs, where the hooks put every save of the call through Python)
            at = saved.get((cal.before[k], ptr))
            if frames_first and _own_frame(cal, k) is not None:
                watched.setdefault(k, []).append((jk, t))
            elif at is not None:
                out.packs[at] = t
                if cal.before[k] > 0:
                    flags[cal.before[k] - 1] |= 8
            elif _own_frame(cal, k) is not None:
                # an inner call's output (autocast's casts inside linear): from call k's frame
                watched.setdefault(k, []).append((jk, t))
            else:
                raise Unsafe(f"trace tensor {t}, an output of aten call {k} ({cal.funcs[k]}), "
                             f"is neither an output of its counted call "
                             f"{python_name(cal.names[c])} nor saved for backward within it, "
                             "nor an output of a frame of its own")
    _frame_targets(cal, flags, out, watched)
    out.gate, last, out.gate_sync, out.gate_note = gate(cal, bytes(flags))
    for c in last:
        flags[c] |= 16
    out.flags = bytes(flags)
    return out


def gate(cal: Calibration, flags: bytes
         ) -> tuple[list[int] | None, list[int], list[int], str | None]:
    """Backward's nodes to count in (counter.cpp's Gate): those that hold a count with a flag,
    each from its first count, and each one's last flagged count, after which it runs without
    the tracker too (OFF); every other node runs without it. A flagged count outside every
    node (the engine's own gradient sums, which it makes after a node's post hooks, still in
    that node's task) is reached by syncing the count where the node before it ends: per node,
    the count its post hook sets (calibration's count at its end), else -1. (None, [], [],
    why) where no node ends before such a count, or the step's backward is not one walk of
    one graph."""
    if cal.backward_at < 0 or cal.after_backward < 0 or not cal.node_spans:
        return None, [], [], "no backward, or no counted call after it"
    if cal.backwards:
        return None, [], [], f"the step ran {cal.backwards + 1} backwards"
    from bisect import bisect_right

    root_end = cal.node_spans[0][1]
    spans = sorted((a, b, i) for i, (a, b) in enumerate(cal.node_spans) if i > 0 and a >= 0)
    starts = [a for a, _, _ in spans]
    ends = sorted((b, i) for i, (a, b) in enumerate(cal.node_spans) if a >= 0 and b >= 0)
    end_at = [b for b, _ in ends]
    start = [-1] * len(cal.node_spans)
    sync = [-1] * len(cal.node_spans)
    last: dict[int, int] = {}  # gated node -> its last flagged count (counts ascend)
    for c in range(cal.backward_at, cal.after_backward):
        if not flags[c] or c < root_end:
            continue  # backward's root counts on from where the walk began
        j = bisect_right(starts, c) - 1
        if j < 0 or not spans[j][0] <= c < spans[j][1]:
            k = bisect_right(end_at, c) - 1  # the node that ended last before it
            if k < 0:
                return None, [], [], (f"counted call {c} ({python_name(cal.names[c])}), where "
                                      "the executor acts, runs in backward outside every "
                                      "node, before any node ended")
            sync[ends[k][1]] = ends[k][0]
            continue
        start[spans[j][2]] = spans[j][0]
        last[spans[j][2]] = c
    return start, sorted(last.values()), sync, None


def _own_frame(cal: Calibration, k: int) -> tuple[int, int] | None:
    """The frame Python call k ran as (its own operator), or None."""
    if k >= len(cal.frame_of):
        return None
    c, j = cal.frame_of[k]
    name = cal.frame_names.get((c, j))
    if name is None or _base(python_name(name)) != _base(cal.funcs[k]):
        return None
    return c, j


def _frame_targets(cal: Calibration, flags: bytearray, out: Targets,
                   watched: dict[int, list[tuple[int, int]]]) -> None:
    """Frames to call back at for the calls in `cal.flagged`, and for the watched calls whose
    trace tensors only their own frame returns (module docstring)."""
    names = cal.frame_names
    counts: dict[int, int] = {}
    for c, *_ in cal.frames:
        counts[c] = counts.get(c, 0) + 1
    taken: dict[tuple[int, int], int] = {}
    for k in sorted(cal.flagged):
        c, j = cal.frame_of[k]
        if c < 0:
            raise Unsafe(f"aten call {k} ({cal.funcs[k]}), which the plan records or watches "
                         "for in-place updates, ran outside every counted call")
        name = names.get((c, j), "?")
        if _base(python_name(name)) != _base(cal.funcs[k]):
            raise Unsafe(f"aten call {k} ({cal.funcs[k]}), which the plan records or watches "
                         f"for in-place updates, ran inside {python_name(name)}, frame {j} of "
                         f"counted call {c}, not as a frame of its own")
        if (c, j) in taken:
            raise Unsafe(f"aten calls {taken[(c, j)]} and {k} ran in one frame ({name})")
        taken[(c, j)] = k
        key = frame_key(c, j)
        out.frame_flags[key] = 2 | (1 if cal.flagged[k][1] else 0)
        out.frame_expect[key] = name
        out.frame_call[key] = k
        out.frame_count[c] = counts[c]
        flags[c] |= 4
    for k, pairs in watched.items():
        c, j = cal.frame_of[k]
        key = frame_key(c, j)
        # outputs alone (32, counter.cpp's OUTS) unless the frame is a recorded call's too
        f = out.frame_flags.get(key, 0)
        out.frame_flags[key] = f | (2 if f & 2 else 32)
        out.frame_expect[key] = names[(c, j)]
        out.frame_watch[key] = pairs
        out.frame_count[c] = counts[c]
        flags[c] |= 4
