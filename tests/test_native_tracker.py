"""The native op tracker (vsim.runtime.native): where its callbacks are placed from a
calibration (hand-made calibrations, no compiler needed), and a tiny CNN trained under offload
plans with it, gradients bitwise equal to the run without a policy."""

from __future__ import annotations

import pytest

from vsim.errors import ConfigError
from vsim.runtime.native import Calibration, Unsafe, frame_key, targets


def _cal(before: list[int], inside: list[bool], views: list[bool], names: list[str],
         outputs: dict[int, list[tuple[int, int]]] | None = None,
         registered: dict[int, int] | None = None,
         packs: list[tuple[int, int]] | None = None) -> Calibration:
    n = len(before)
    return Calibration(before, inside, names, outputs or {}, registered or {},
                       call_op=list(range(n)), funcs=[f"aten.f{k}.default" for k in range(n)],
                       views=views, packs=packs or [])


def test_a_boundary_goes_before_its_counted_call_when_only_views_precede_it() -> None:
    # counted calls: 0 (Python call 0), 1 (Python calls 1: a view, 2), 2 (Python call 3)
    cal = _cal(before=[1, 2, 2, 3], inside=[True] * 4, views=[False, True, False, False],
               names=["aten::a", "aten::linear", "aten::c"])
    tg = targets(cal, boundary_calls=[2, 3], watch={})
    assert tg.pre == {1: 2, 2: 3}
    assert tg.flags == bytes([0, 1, 1])
    assert tg.expect == {1: "aten::linear", 2: "aten::c"}


def test_a_boundary_after_a_launching_call_in_the_same_counted_call_is_unsafe() -> None:
    cal = _cal(before=[1, 1], inside=[True, True], views=[False, False], names=["aten::bn"])
    with pytest.raises(Unsafe, match="comes after call 0"):
        targets(cal, boundary_calls=[1], watch={})


def test_a_boundary_at_a_call_outside_every_counted_call_fires_where_the_last_one_ended() -> None:
    # Python call 1 runs after counted call 0 returned (autograd's own detach, say)
    cal = _cal(before=[1, 1], inside=[True, False], views=[False, False], names=["aten::a"])
    tg = targets(cal, boundary_calls=[1], watch={})
    assert tg.after == {0: 1} and tg.pre == {} and tg.flags == bytes([2])


def test_a_boundary_outside_counted_calls_before_the_next_one_goes_before_it() -> None:
    """Autograd's detaches before a node's first counted call: acting before that call, not
    where the last one returned (whose output its callback would hold while the actions run);
    only when the calls up to it are views."""
    # counted calls: 0 (Python call 0), then Python call 1 outside (a view), 1 (Python call 2)
    cal = _cal(before=[1, 1, 2], inside=[True, False, True], views=[False, True, False],
               names=["aten::threshold_backward", "aten::convolution_backward"])
    tg = targets(cal, boundary_calls=[1], watch={})
    assert tg.pre == {1: 1} and tg.after == {} and tg.flags == bytes([0, 1])
    assert tg.expect == {1: "aten::convolution_backward"}
    launching = _cal(before=[1, 1, 2], inside=[True, False, True], views=[False, False, False],
                     names=["aten::a", "aten::b"])
    tg = targets(launching, boundary_calls=[1], watch={})
    assert tg.after == {0: 1} and tg.pre == {}

def test_watched_outputs_are_found_by_storage_or_where_autograd_saves_them() -> None:
    cal = _cal(before=[1, 2], inside=[True, True], views=[False, False],
               names=["aten::conv2d", "aten::max_pool2d"],
               outputs={0: [(0, 1000)], 1: [(0, 2000)]},
               registered={7: 1000, 8: 2000, 9: 3000},
               packs=[(2, 3000)])  # indices saved while counted call 1 ran
    tg = targets(cal, boundary_calls=[], watch={0: [(0, 7)], 1: [(0, 8), (1, 9)]})
    assert tg.post == {0: [(0, 7)], 1: [(0, 8)]}
    assert tg.packs == {frame_key(2, 0): 9}  # the first save at count 2
    assert tg.flags[1] & 8  # the hooks on from counted call 1's start
    unsaved = _cal(before=[1], inside=[True], views=[False], names=["aten::bn"],
                   outputs={0: [(0, 1000)]}, registered={9: 3000})
    with pytest.raises(Unsafe, match="neither an output"):
        targets(unsaved, boundary_calls=[], watch={0: [(1, 9)]})


def test_a_watched_output_no_counted_call_returns_comes_from_its_own_frame() -> None:
    """Autocast's cast of a weight inside a linear: not the counted call's output, not saved
    within it; the cast's own frame returns it."""
    cal = _cal(before=[1, 1], inside=[True, True], views=[False, False],
               names=["aten::linear.default"], outputs={0: [(0, 1000)]}, registered={7: 2000})
    cal.funcs = ["aten._to_copy.default", "aten.addmm.default"]
    cal.frames = [(0, 0, "aten::linear.default", -1), (0, 1, "aten::_to_copy.default", 0),
                  (0, 2, "aten::addmm.default", 0)]
    cal.frame_of = [(0, 1), (0, 2)]
    tg = targets(cal, boundary_calls=[], watch={0: [(0, 7)]})
    # called back with its outputs alone (32): the frame is no recorded call
    assert tg.frame_watch == {1: [(0, 7)]} and tg.frame_flags == {1: 32}
    assert tg.flags == bytes([4]) and tg.frame_count == {0: 3}
    cal.frame_of = [(0, 0), (0, 2)]  # seen inside linear's frame, not its own
    with pytest.raises(Unsafe, match="nor an output of a frame of its own"):
        targets(cal, boundary_calls=[], watch={0: [(0, 7)]})


torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def cnn():
    from vsim.record.recorder import record_model
    from vsim.runtime import native
    from vsim.runtime.measure import Session

    if native.load() is None:
        pytest.fail(f"the native tracker could not be built: {native.error()}")
    trace = record_model("tiny-cnn", 4, device="cpu", warmup=1, iters=2, timing_iters=1)
    return trace, Session("tiny-cnn", 4, trace, device="cpu", warmup=1)


def _cap(trace) -> int:
    """A capacity that binds: the residents and 0.6 of what the iteration adds to them."""
    resident = sum(t.size_bytes for t in trace.tensors if t.producer is None)
    return int(resident + 0.6 * (trace.measured.peak_allocated_bytes - resident))


def _native(*runs: dict) -> None:
    for run in runs:
        assert run["executed"]["tracker"] == "native", run["executed"]["tracker_note"]


def _ab(monkeypatch, s, policy: str, cap: int | None, variable: str, a: str, b: str
        ) -> tuple[dict, dict]:
    """The case run with the environment's `variable` at `a`, then at `b`; both native."""
    runs = []
    for value in (a, b):
        monkeypatch.setenv(variable, value)
        runs.append(s.run(policy, cap, iters=2, warmup=1))
    _native(*runs)
    return runs[0], runs[1]


@pytest.mark.parametrize("policy", ["vdnn:mode=all", "layrub"])
def test_offload_plans_run_natively_with_the_same_gradients(cnn, monkeypatch,
                                                           policy: str) -> None:
    trace, s = cnn
    monkeypatch.setenv("VSIM_NATIVE_SAVED", "hooks")  # the saves' hooks (frames: below)
    cap = _cap(trace)
    got = s.run(policy, cap, iters=2, warmup=1)
    ref = s.run(policy, cap, iters=2, warmup=1, tracker="python")
    assert got["executed"]["tracker"] == "native", got["executed"]["tracker_note"]
    assert ref["executed"]["tracker"] == "python"
    assert got["check"]["bitwise_equal"]
    assert got["d2h_bytes"] == ref["d2h_bytes"] > 0
    assert got["executed"]["offloads"] == ref["executed"]["offloads"]
    # the C++ saved-tensor hooks are on only around the calls with a save the plan acts on:
    # under layrub two (max pooling's indices, whose tensors the plan offloads), under vDNN
    # none; the Python one sees every save
    assert ref["executed"]["packs"] > got["executed"]["packs"]
    assert (got["executed"]["packs"] > 0) == (policy == "layrub")
    assert got["executed"]["skipped"] == ref["executed"]["skipped"]


@pytest.mark.parametrize("policy", ["vdnn:mode=all", "vdnnpp"])
def test_native_actions_move_the_same_bytes_as_the_python_ones(cnn, monkeypatch,
                                                               policy: str) -> None:
    """Offload and prefetch as one C++ call each (actions.cpp) against the Python actions
    (VSIM_NATIVE_ACTIONS=0): the same bytes each way, gradients bitwise equal to the run
    without a plan; vDNN++'s plan takes its host buffers from the pinned pool."""
    from vsim.runtime.executor import Executor

    trace, s = cnn
    _pol, plan = s._plan(policy, None)
    assert Executor(plan, s.opmap, trace, s.device, s.flat_inputs).act is not None
    got = s.run(policy, iters=2, warmup=1)
    monkeypatch.setenv("VSIM_NATIVE_ACTIONS", "0")
    assert Executor(plan, s.opmap, trace, s.device, s.flat_inputs).act is None
    ref = s.run(policy, iters=2, warmup=1)
    assert got["check"]["bitwise_equal"] and ref["check"]["bitwise_equal"]
    assert got["d2h_bytes"] == ref["d2h_bytes"] > 0
    assert got["h2d_bytes"] == ref["h2d_bytes"] > 0
    for k in ("offloads", "prefetches", "releases", "skipped"):
        assert got["executed"][k] == ref["executed"][k], k


@pytest.mark.parametrize("policy", ["vdnn:mode=all", "vdnnpp", "layrub", "superneurons",
                                    "hybrid", "recompute:strategy=sqrt"])
def test_the_plan_run_by_the_core_acts_as_the_python_methods(cnn, monkeypatch,
                                                             policy: str) -> None:
    """The plan carried out in C++ (native/core.cpp: the op boundaries, the tensors' state,
    the pinned pool, the outputs registered at the counter's counts) against the Python
    methods it follows (VSIM_NATIVE_CORE=0), under a cap that binds: the same actions, bytes
    and skips, gradients bitwise equal to the run without a plan either way, and the
    counter's call backs made without entering Python."""
    from vsim.runtime.executor import Executor

    trace, s = cnn
    cap = _cap(trace)
    _pol, plan = s._plan(policy, cap)
    assert Executor(plan, s.opmap, trace, s.device, s.flat_inputs).core is not None
    got = s.run(policy, cap, iters=2, warmup=1)
    monkeypatch.setenv("VSIM_NATIVE_CORE", "0")
    assert Executor(plan, s.opmap, trace, s.device, s.flat_inputs).core is None
    ref = s.run(policy, cap, iters=2, warmup=1)
    _native(got, ref)
    assert got["fits"] and ref["fits"]
    assert got["check"]["bitwise_equal"] and ref["check"]["bitwise_equal"]
    assert (got["d2h_bytes"], got["h2d_bytes"]) == (ref["d2h_bytes"], ref["h2d_bytes"])
    g, r = got["executed"], ref["executed"]
    for k in ("offloads", "prefetches", "drops", "releases", "syncs", "recomputed_calls",
              "skipped", "callbacks"):
        assert g[k] == r[k], k
    assert g["offloads"] + g["drops"] + g["releases"] > 0
    if g["callbacks"]:
        assert g["executor_callback_py_us"] == 0 < r["executor_callback_py_us"]
    assert g["executor_host_us"] > 0


def test_an_executor_with_a_core_is_freed_with_its_last_reference(cnn) -> None:
    """The core holds the executor's hook weakly: no cycle through C++ keeps the executor
    (and its host buffers) alive."""
    import gc
    import weakref

    from vsim.runtime.executor import Executor

    trace, s = cnn
    _pol, plan = s._plan("superneurons", None)
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    assert ex.core is not None
    ref = weakref.ref(ex)
    del ex
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("policy", ["superneurons", "recompute:strategy=sqrt"])
def test_replayed_views_made_natively_give_the_same_gradients(cnn, monkeypatch,
                                                              policy: str) -> None:
    """The replay's argument views checked and made in C++ (views.cpp) against the Python
    ones (VSIM_NATIVE_ACTIONS=0): the same calls replayed, gradients bitwise equal to the run
    without a plan either way."""
    got = cnn[1].run(policy, iters=2, warmup=1)
    monkeypatch.setenv("VSIM_NATIVE_ACTIONS", "0")
    ref = cnn[1].run(policy, iters=2, warmup=1)
    assert got["check"]["bitwise_equal"] and ref["check"]["bitwise_equal"]
    assert got["executed"]["recomputed_calls"] == ref["executed"]["recomputed_calls"] > 0


@pytest.mark.parametrize("policy", ["superneurons", "recompute:strategy=sqrt"])
def test_plans_that_recompute_run_natively_with_the_same_gradients(cnn, policy: str) -> None:
    """The calls a chain records come back as frames of their counted calls (with the
    arguments a dispatch mode sees), so recomputation needs no Python tracker after the
    calibrating iteration."""
    trace, s = cnn
    got = s.run(policy, iters=2, warmup=1)
    ref = s.run(policy, iters=2, warmup=1, tracker="python")
    assert got["executed"]["tracker"] == "native", got["executed"]["tracker_note"]
    assert ref["executed"]["tracker"] == "python"
    assert got["check"]["bitwise_equal"], got["check"]
    assert got["executed"]["recomputed_calls"] == ref["executed"]["recomputed_calls"] > 0


@pytest.mark.parametrize("policy", ["vdnn:mode=all", "superneurons"])
def test_native_iterations_hook_only_the_calls_with_an_armed_save(cnn, monkeypatch,
                                                                  policy: str) -> None:
    """The saved-tensor hooks are on only around the calls whose saves the plan acts on
    (superneurons' plan here acts on max pooling's indices, found at their save; vDNN's on
    none); gradients, the bytes moved and the recomputed calls stay those of the tracker before
    (the hooks on throughout)."""
    trace, s = cnn
    cap = _cap(trace)
    monkeypatch.setenv("VSIM_NATIVE_SAVED", "hooks")
    monkeypatch.setenv("VSIM_NATIVE_HOOKS", "always")
    ref = s.run(policy, cap, iters=2, warmup=1)
    monkeypatch.setenv("VSIM_NATIVE_HOOKS", "armed")
    got = s.run(policy, cap, iters=2, warmup=1)
    _native(ref, got)
    assert got["executed"]["native_hooks"] == "armed"
    assert got["check"]["bitwise_equal"], got["check"]
    assert got["d2h_bytes"] == ref["d2h_bytes"]
    assert got["executed"]["recomputed_calls"] == ref["executed"]["recomputed_calls"]
    assert ref["executed"]["packs"] > 0
    assert (got["executed"]["packs"] > 0) == (policy == "superneurons")
    assert got["executed"]["packs"] < ref["executed"]["packs"]


@pytest.mark.parametrize("policy", ["superneurons", "layrub"])
def test_saved_tensors_from_their_frames_act_as_from_the_hooks(cnn, monkeypatch,
                                                               policy: str) -> None:
    """VSIM_NATIVE_SAVED=frames (the default): a tensor the plan acts on that its counted call
    does not return (max pooling's indices here) comes from the frame of its own call, not
    from the saved-tensor hooks (VSIM_NATIVE_SAVED=hooks): none armed, the same actions,
    gradients bitwise equal."""
    trace, s = cnn
    ref, got = _ab(monkeypatch, s, policy, _cap(trace), "VSIM_NATIVE_SAVED", "hooks", "frames")
    assert got["executed"]["native_saved"] == "frames"
    assert ref["executed"]["packs"] > 0 and got["executed"]["packs"] == 0
    # the frames' call backs, timed in C++
    assert got["executed"]["frame_calls"] > ref["executed"]["frame_calls"]
    assert got["executed"]["executor_frame_us"] > 0
    assert got["check"]["bitwise_equal"], got["check"]
    for key in ("d2h_bytes", "h2d_bytes"):
        assert got[key] == ref[key]
    assert got["executed"]["recomputed_calls"] == ref["executed"]["recomputed_calls"]


@pytest.mark.parametrize("policy", ["layrub", "recompute:strategy=sqrt"])
def test_the_fast_counter_counts_and_acts_as_the_boxed_one(cnn, monkeypatch, policy: str) -> None:
    """VSIM_NATIVE_COUNTER=fast (the common operators' calls counted by unboxed kernels, the
    rest by the boxed fallback): the same calls counted, the same actions, gradients bitwise
    equal."""
    from vsim.runtime import native

    trace, s = cnn
    cap = _cap(trace)
    ref = s.run(policy, cap, iters=2, warmup=1)
    boxed = native.actions().count()
    monkeypatch.setenv("VSIM_NATIVE_COUNTER", "fast")
    got = s.run(policy, cap, iters=2, warmup=1)
    assert got["executed"]["tracker"] == "native", got["executed"]["tracker_note"]
    assert got["executed"]["native_counter"] == "fast"
    assert native.actions().count() == boxed > 0
    assert got["check"]["bitwise_equal"], got["check"]
    for key in ("d2h_bytes", "h2d_bytes"):
        assert got[key] == ref[key]
    assert got["executed"]["recomputed_calls"] == ref["executed"]["recomputed_calls"]


def _fewer_calls_same_actions(ref: dict, got: dict) -> None:
    """`got` put fewer calls through the tracker's key than `ref` and acted the same: the same
    actions and bytes moved, gradients bitwise equal."""
    ex, rx = got["executed"], ref["executed"]
    assert ex["calls_through_tracker"] < rx["calls_through_tracker"]
    assert got["check"]["bitwise_equal"], got["check"]
    for key in ("d2h_bytes", "h2d_bytes"):
        assert got[key] == ref[key]
    for key in ("offloads", "prefetches", "drops", "recomputed_calls"):
        assert ex[key] == rx[key]


@pytest.mark.parametrize("policy", ["vdnn:mode=all", "layrub", "superneurons",
                                    "recompute:strategy=sqrt", "hybrid"])
def test_a_gated_backward_counts_only_its_acting_nodes_and_acts_the_same(
        cnn, monkeypatch, policy: str) -> None:
    """VSIM_NATIVE_GATE=nodes (counter.cpp's Gate): backward's nodes without a call the plan
    acts at run without the tracker, so fewer calls pass its key; the same actions and bytes,
    the count after backward resumed where calibration had it (else the iteration would
    diverge and leave the native tracker), gradients bitwise equal."""
    trace, s = cnn
    ref, got = _ab(monkeypatch, s, policy, _cap(trace), "VSIM_NATIVE_GATE", "off", "nodes")
    ex, rx = got["executed"], ref["executed"]
    assert ex["native_gate"] == "nodes" and rx["gated"] is False
    assert ex["gated"], ex["gate_note"]
    _fewer_calls_same_actions(ref, got)


@pytest.fixture(scope="module")
def transformer():
    from vsim.record.recorder import record_model
    from vsim.runtime.measure import Session

    trace = record_model("tiny-transformer", 4, device="cpu", warmup=1, iters=2, timing_iters=1)
    return trace, Session("tiny-transformer", 4, trace, device="cpu", warmup=1)


@pytest.mark.parametrize("policy", ["layrub", "superneurons"])
def test_a_gated_backward_reaches_a_flagged_count_between_its_nodes(
        transformer, monkeypatch, policy: str) -> None:
    """The tiny transformer's plans act at a gradient sum the autograd engine makes between
    nodes (its residual stream's): the node before it syncs the count at its end (counter.cpp's
    GateSync), so backward is gated all the same, with the same actions and bitwise gradients
    as counting every call."""
    trace, s = transformer
    ref, got = _ab(monkeypatch, s, policy, None, "VSIM_NATIVE_GATE", "off", "nodes")
    ex = got["executed"]
    assert ex["gated"], ex["gate_note"]
    _fewer_calls_same_actions(ref, got)


@pytest.mark.parametrize("policy", ["hybrid", "layrub", "superneurons",
                                    "recompute:strategy=sqrt", "vdnn:mode=all"])
def test_a_gated_forward_skips_module_calls_without_actions_and_acts_the_same(
        transformer, monkeypatch, policy: str) -> None:
    """VSIM_NATIVE_FWD_GATE=modules (vsim.runtime.fwdgate): forward's module calls in which the
    plan acts at no count run without the tracker, their count resynchronised by module hooks;
    fewer calls pass its key, the same actions and bytes, gradients bitwise equal, and the
    hooks come off the model with the case."""
    trace, s = transformer
    ref, got = _ab(monkeypatch, s, policy, _cap(trace), "VSIM_NATIVE_FWD_GATE", "off",
                   "modules")
    ex, rx = got["executed"], ref["executed"]
    assert rx["fwd_gated"] is None and ex["native_fwd_gate"] == "modules"
    assert ex["fwd_gated"] > 0
    _fewer_calls_same_actions(ref, got)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in s.net.modules())


def test_the_forward_gate_chooses_the_outermost_calls_without_an_action() -> None:
    from vsim.runtime.fwdgate import choose

    a, b, c = object(), object(), object()
    # block a (counts 0-10) holds b twice (0-4, 4-8) and c once (8-10); count 6 is acted at
    calls = [(1, a, 0, 10), (2, b, 0, 4), (2, b, 4, 8), (3, c, 8, 10)]
    got = choose(calls, {6})
    assert got == {2: (b, [(0, 4), None]), 3: (c, [(8, 10)])}
    # nothing acted at: the block alone, its parts not hooked
    assert choose(calls, set()) == {1: (a, [(0, 10)])}
    # a call with no counts, or one that started inside a counted call (-1), is not gated
    assert choose([(1, a, 3, 3), (2, b, -1, 5)], set()) == {}


def test_a_flagged_count_between_backward_nodes_is_reached_from_the_node_before() -> None:
    """A count the executor acts at that runs in backward outside every node (the engine's
    own gradient sums, made after a node's post hooks) is reached by syncing the count where
    the node that ended last before it ends; a second backward leaves the whole counted."""
    from vsim.runtime.native import gate

    cal = _cal(before=list(range(1, 9)), inside=[True] * 8, views=[False] * 8,
               names=[f"aten::c{c}" for c in range(8)])
    cal.backward_at, cal.after_backward = 2, 7
    cal.node_spans = [(2, 3), (3, 4), (5, 6), (-1, -1)]  # count 4 runs between nodes
    flags = bytearray(8)
    flags[5] = 1
    assert gate(cal, bytes(flags)) == ([-1, -1, 5, -1], [5], [-1] * 4, None)
    flags[4] = 2
    # node 1 ends at count 4: its end syncs the count there (and turns the key on)
    assert gate(cal, bytes(flags)) == ([-1, -1, 5, -1], [5], [-1, 4, -1, -1], None)
    cal.node_spans = [(-1, -1), (3, 4), (5, 6), (-1, -1)]
    flags = bytearray(8)
    flags[2] = 2  # before any node ended
    starts, last, sync, why = gate(cal, bytes(flags))
    assert starts is None and last == [] and "counted call 2 (aten.c2)" in why
    cal.backwards = 1
    assert gate(cal, bytes(8))[0] is None


def test_a_bad_hooks_choice_is_an_error(cnn, monkeypatch) -> None:
    trace, s = cnn
    monkeypatch.setenv("VSIM_NATIVE_HOOKS", "never")
    with pytest.raises(ConfigError, match="VSIM_NATIVE_HOOKS='never'"):
        s.run("vdnn:mode=all", None, iters=1, warmup=0)


def test_a_recorded_call_must_run_as_a_frame_of_its_own() -> None:
    """A call the plan records that ran inside another operator's frame (not as one of its
    own) cannot be called back at with its arguments: unsafe, the Python tracker runs."""
    cal = _cal(before=[1, 2], inside=[True, True], views=[False, False],
               names=["aten::conv2d.default", "aten::relu_.default"])
    cal.frames = [(0, 0, "aten::conv2d.default", -1), (0, 1, "aten::convolution.default", 0),
                  (1, 0, "aten::relu_.default", -1)]
    cal.funcs = ["aten.convolution.default", "aten.relu_.default"]
    cal.frame_of = [(0, 1), (1, 0)]
    cal.flagged = {0: (None, False), 1: (None, True)}
    tg = targets(cal, boundary_calls=[], watch={})
    assert tg.frame_call == {1: 0, (1 << 20): 1}
    assert tg.frame_flags == {1: 2, (1 << 20): 3}  # the random one is called back before too
    assert tg.frame_count == {0: 2, 1: 1}
    assert tg.flags == bytes([4, 4])
    cal.frame_of = [(0, 0), (1, 0)]  # convolution seen inside conv2d's frame, not its own
    with pytest.raises(Unsafe, match="not as a frame of its own"):
        targets(cal, boundary_calls=[], watch={})
    cal.frame_of = [(-1, -1), (1, 0)]
    with pytest.raises(Unsafe, match="outside every counted call"):
        targets(cal, boundary_calls=[], watch={})


def test_a_native_divergence_falls_back_to_the_python_tracker(cnn) -> None:
    """A native iteration whose calls are not its calibration's raises NativeDivergence;
    the executor runs later iterations under the Python tracker, and a measurement runs the
    lost iteration again (Session._iteration)."""
    from vsim.runtime.executor import Executor
    from vsim.runtime.nativerun import NativeDivergence, determinism_key

    trace, s = cnn
    _pol, plan = s._plan("vdnn:mode=all", None)
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    ex.run(s.step)  # calibrates
    assert ex.run(s.step).tracker == "native"
    cal, tg = ex._cal[determinism_key()]
    tg.expect = {c: "aten::not_this_one.default" for c in tg.expect}  # as if calls moved
    with pytest.raises(NativeDivergence, match="diverged from its calibration"):
        ex.run(s.step)
    assert ex.run(s.step).tracker == "python"
    assert "diverged from its calibration" in ex.tracker_note
    notes: list[str] = []
    fresh = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    fresh.run(s.step)
    fresh._cal[determinism_key()][1].expect = dict(tg.expect)
    stats = s._iteration(fresh, notes)
    assert stats.tracker == "python" and stats.offloads > 0
    assert notes and "ran again under the Python tracker" in notes[0]
    s.restore()


def test_a_native_iteration_out_of_memory_runs_again_under_the_python_tracker(cnn) -> None:
    """Under "auto", a native iteration that runs out of memory after its calibrating one fit
    runs again under the Python tracker (and so does every later one): the tracker, not the
    plan, must not decide that a plan does not fit. A tracker asked for by name keeps the
    error."""
    from vsim.runtime.executor import Executor

    trace, s = cnn
    _pol, plan = s._plan("superneurons", None)

    def failing_once(ex: Executor):
        real, failed = ex._run_native, []

        def run_native(step):  # type: ignore[no-untyped-def]
            if not failed:
                failed.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory (as if)")
            return real(step)
        ex._run_native = run_native  # type: ignore[method-assign]

    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    ex.run(s.step)  # calibrates under the Python tracker
    failing_once(ex)
    notes: list[str] = []
    stats = s._iteration(ex, notes)
    assert stats.tracker == "python" and stats.recomputed_calls > 0
    assert "out of memory in a native iteration" in ex.tracker_note
    assert notes and "ran again under the Python tracker" in notes[0]
    assert s._iteration(ex).tracker == "python"
    late = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    late.run(s.step)
    assert late.run(s.step).tracker == "native"
    failing_once(late)  # after a native iteration ran to the end: the plan's, kept
    with pytest.raises(torch.OutOfMemoryError):
        s._iteration(late)
    named = Executor(plan, s.opmap, trace, s.device, s.flat_inputs, tracker="native")
    named.run(s.step)
    failing_once(named)
    with pytest.raises(torch.OutOfMemoryError):
        s._iteration(named)
    s.restore()


def test_swap_storages_exchanges_two_storages_memory_without_a_copy() -> None:
    """The native swap a recomputation rebuilds a dropped tensor with where PyTorch has no
    UntypedStorage._swap_data_ptr_ (torch 2.11 on the H100 machine)."""
    from vsim.runtime import native

    mod = native.load()
    if mod is None:
        pytest.fail(f"the native tracker could not be built: {native.error()}")
    dropped = torch.arange(6, dtype=torch.float32)
    view = dropped[2:]  # a view, as autograd's saved tensors are, of the dropped storage
    st = dropped.untyped_storage()
    st.resize_(0)
    rebuilt = torch.arange(6, dtype=torch.float32) * 10
    ptr = rebuilt.untyped_storage().data_ptr()
    mod.swap_storages(st, rebuilt.untyped_storage())
    assert st.nbytes() == 24 and st.data_ptr() == ptr
    assert rebuilt.untyped_storage().nbytes() == 0
    assert view.tolist() == [20.0, 30.0, 40.0, 50.0]
    with pytest.raises(ValueError, match="UntypedStorages"):
        mod.swap_storages(st, rebuilt)


@pytest.mark.parametrize("swap", [True, False])
def test_a_recomputing_plan_rebuilds_tensors_with_the_native_swap(monkeypatch, swap) -> None:
    """Where PyTorch lacks _swap_data_ptr_ the native swap rebuilds dropped tensors in place
    (before, torch 2.11 copied every one: an allocation and a device copy each), gradients
    bitwise equal; without any swap each is copied into place, and counted."""
    from vsim.record.recorder import record_model
    from vsim.runtime import native, recompute
    from vsim.runtime.measure import Session

    mod = native.load()
    if mod is None:
        pytest.fail(f"the native tracker could not be built: {native.error()}")
    monkeypatch.setattr(recompute, "_SWAP", [mod.swap_storages if swap else None])
    trace = record_model("inplacemodels:bottlenecks", 4, device="cpu", warmup=1, iters=2,
                         timing_iters=1)
    s = Session(None, None, trace, device="cpu", warmup=1)
    resident = sum(t.size_bytes for t in trace.tensors if t.producer is None)
    cap = int(resident + 0.3 * (trace.measured.peak_allocated_bytes - resident))
    got = s.run("superneurons", cap, iters=1, warmup=1)
    assert got["executed"]["recomputed_calls"] > 0 and got["check"]["bitwise_equal"], got["check"]
    copied = got["executed"]["skipped"].get("recomputed tensor copied into place", 0)
    assert (copied == 0) if swap else (copied > 0)


def test_the_reference_noise_is_the_widest_of_several_repeats_when_kernels_vary() -> None:
    """One repeat of the reference understates the spread of nondeterministic kernels: where it
    is not bitwise equal, NOISE_REPEATS repeats run and the largest differences are kept; a
    deterministic reference costs one."""
    from types import SimpleNamespace

    from vsim.runtime.session import NOISE_REPEATS, Session

    ref = {"loss": torch.tensor(1.0), "grads": [torch.zeros(3)]}
    runs = iter([0.1, 0.4, 0.2] + [0.0] * NOISE_REPEATS)

    def gradients(_ex: object) -> dict:
        return {"loss": torch.tensor(1.0), "grads": [torch.full((3,), next(runs))]}

    noise = Session._repeat_noise(SimpleNamespace(reference=ref, gradients=gradients))
    assert noise["repeats"] == NOISE_REPEATS > 2
    assert abs(noise["max_abs_grad_diff"] - 0.4) < 1e-6  # the widest, not the first (0.1)
    same = Session._repeat_noise(SimpleNamespace(
        reference=ref, gradients=lambda _ex: {"loss": torch.tensor(1.0),
                                              "grads": [torch.zeros(3)]}))
    assert same["repeats"] == 1 and same["bitwise_equal"]


def test_a_native_prefetch_that_cannot_allocate_raises_as_resize_does() -> None:
    """The C++ prefetch allocates what `resize_` would; a failed allocation raises PyTorch's
    own Python exception (on the GPU under a cap, torch.OutOfMemoryError, which a measurement
    reports as out of memory) and leaves the storage released."""
    from vsim.runtime import native

    act = native.actions()
    st = torch.empty(4, dtype=torch.uint8).untyped_storage()
    st.resize_(0)
    host = torch.empty(4, dtype=torch.uint8)
    with pytest.raises(Exception) as native_exc:
        act.prefetch(st, 1 << 60, host, 0, None, None, None, False)
    assert st.nbytes() == 0
    with pytest.raises(Exception) as python_exc:
        st.resize_(1 << 60)
    assert type(native_exc.value) is type(python_exc.value)
    with pytest.raises(RuntimeError, match="not released"):  # a storage that holds bytes
        act.prefetch(torch.empty(4, dtype=torch.uint8).untyped_storage(), 4, host, 0, None,
                     None, None, False)
    with pytest.raises(RuntimeError, match=r"offset \+ n bytes"):  # past the host buffer
        act.prefetch(st, 4, host, 2, None, None, None, False)
    assert st.nbytes() == 0  # released again


def test_native_actions_copy_at_an_offset_of_the_host_buffer() -> None:
    """The C++ offload and prefetch take the host buffer and an offset (a pinned pool's slot)
    and copy exactly the storage's bytes there and back."""
    from vsim.runtime import native

    act = native.actions()
    src = torch.arange(6, dtype=torch.uint8)
    st = src.untyped_storage()
    buf = torch.zeros(16, dtype=torch.uint8)
    done, _, _ = act.offload(st, buf, 5, None, None, False)
    assert done is None and buf.tolist() == [0] * 5 + list(range(6)) + [0] * 5
    st.resize_(0)
    act.prefetch(st, 6, buf, 5, None, None, None, False)
    assert src.tolist() == list(range(6))
