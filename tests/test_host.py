"""The host-time model: per-op costs by name, phase fallback, per-weight accumulation, and
clear errors for malformed files."""

from pathlib import Path
from typing import Any

import pytest

from vsim.errors import HardwareError
from vsim.host import HostModel, load_host_model, read_host_model
from vsim.trace.schema import Op, Tensor, Trace


def _op(i: int, name: str, phase: str) -> Op:
    return Op(id=i, name=name, layer=f"l{i}", layer_type="conv", phase=phase, start_us=float(i),
              dur_us=1.0, stream=0, reads=(), writes=(), frees=())


def _flat_model(tmp_path: Path, executor: str) -> HostModel:
    """A host model of 10 us per forward and backward op, with the `executor` costs given (a
    YAML mapping)."""
    f = tmp_path / "m.yaml"
    f.write_text(f"by_phase: {{fwd: 10.0, bwd: 10.0}}\nexecutor: {executor}\n")
    return read_host_model(f)


def _recorded(ops: tuple[Op, ...]) -> Trace:
    """A recorded trace of `ops`: their issue times are bounded by their recorded starts."""
    return Trace(meta={"source": "measured"}, tensors=(), ops=ops)


def test_costs_by_name_then_phase_plus_weights(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("by_phase: {fwd: 10.0, bwd: 20.0}\nby_name: {fwd: {'aten::conv2d': 50.0}}\n"
                 "per_weight_us: 3.0\n")
    m = read_host_model(f)
    trace = Trace(meta={}, tensors=(Tensor(0, 4, "weight", "w", None, ()),
                                    Tensor(1, 4, "weight", "w2", None, ())),
                  ops=(_op(0, "aten::conv2d", "fwd"), _op(1, "aten::relu", "fwd"),
                       _op(2, "ReluBackward0", "bwd"), _op(3, "aten::_foreach_add_", "opt")))
    # 50 (by name) + 10 (fwd default) + 20 (bwd default) + 10 (opt: no default, fwd's) + 2 x 3
    assert m.iteration_us(trace) == pytest.approx(96.0)


@pytest.mark.parametrize("text, where", [
    ("[1, 2]", "mapping"),
    ("by_phase: {bwd: 1.0}", "by_phase"),
    ("by_phase: {fwd: -1.0}", "by_phase.fwd"),
    ("by_phase: {fwd: .inf}", "by_phase.fwd"),
    ("by_phase: {fwd: 1.0}\nby_name: {fwd: {'aten::x': 'fast'}}", "by_name.fwd.aten::x"),
    ("by_phase: {fwd: 1.0}\nallocator: {cuda_malloc: 3}", "allocator.cuda_malloc"),
    ("by_phase: {fwd: 1.0}\nexecutor: {calls_per_op: [1, 2]}", "executor.calls_per_op"),
    ("by_phase: {fwd: 1.0}\nexecutor: {calls_per_op: {'aten::linear': 0}}",
     "executor.calls_per_op"),
])
def test_malformed_files_name_the_file_and_key(tmp_path: Path, text: str, where: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(HardwareError, match=f"bad.yaml.*{where.split('.')[0]}"):
        read_host_model(f)


def test_the_shipped_h100_probe_loads() -> None:
    m = load_host_model("h100-sxm")
    assert m is not None and m.by_phase["fwd"] > 0 and m.provenance.get("device")
    assert m.allocator is not None
    # mapping pages of an expandable segment costs more per MiB than a cudaMalloc (the probe)
    assert m.allocator.expandable_map.us(1 << 30) > m.allocator.cuda_malloc.us(1 << 30)
    assert load_host_model("no-such-gpu") is None


def test_the_executors_tracker_adds_its_cost_per_op_on_top_of_the_bounded_issue(
        tmp_path: Path) -> None:
    """vsim's executor runs a plan under its op tracker: HostClock(tracked=True) adds
    executor.tracker_us_per_op per op, cumulatively, on top of the issue times bounded by the
    recording (ops recorded at 0, 1, 2, 3 us, each costing 10 us of host: issued at 0..3)."""
    from vsim.engine.hostclock import HostClock

    m = _flat_model(tmp_path, "{tracker_us_per_op: 5.0}")
    assert m.tracker_us_per_op == 5.0
    trace = _recorded(tuple(_op(i, "aten::relu", "fwd") for i in range(4)))
    assert [HostClock(trace, m).ready_us(i) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert [HostClock(trace, m, tracked=True).ready_us(i) for i in range(4)] == \
        [5.0, 11.0, 17.0, 23.0]
    assert load_host_model("h100-sxm").tracker_us_per_op > 0  # type: ignore[union-attr]


def test_the_native_trackers_cost_is_per_counted_call_and_only_its_own(tmp_path: Path) -> None:
    """executor.native_us_per_call times each op's counted calls (`counted_calls` by name,
    `default` otherwise) adds up in a tracked run only; a bad count names the file."""
    from vsim.engine.hostclock import HostClock

    m = _flat_model(tmp_path, "{native_us_per_call: 2.0, "
                              "counted_calls: {default: 3, aten::linear: 6}}")
    trace = _recorded((_op(0, "aten::linear", "fwd"), _op(1, "aten::relu", "fwd"),
                       _op(2, "AddmmBackward0", "bwd")))
    assert [m.counted(o) for o in trace.ops] == [6.0, 3.0, 3.0]
    # 12 us before op 0, 6 more before op 1 and op 2, on top of recorded starts 0, 1, 2
    assert [HostClock(trace, m, tracked=True).ready_us(i) for i in range(3)] == \
        [12.0, 19.0, 26.0]
    assert [HostClock(trace, m).ready_us(i) for i in range(3)] == [0.0, 1.0, 2.0]
    f = tmp_path / "bad.yaml"
    f.write_text("by_phase: {fwd: 1.0}\nexecutor: {counted_calls: {aten::relu: -1}}\n")
    with pytest.raises(HardwareError, match="bad.yaml: executor.counted_calls.aten::relu"):
        read_host_model(f)


def test_armed_hooks_cost_each_save_their_op_makes(tmp_path: Path) -> None:
    """With the hooks armed, an armed op puts every tensor it saves through them: save_us per
    save, times its saves by name (batch norm's 7); with the hooks always on, and where no
    table is given, pack_us per forward op (the average op's saves)."""
    import dataclasses

    m = _flat_model(tmp_path, "{pack_us: 14, save_us: 6.0, "
                              "saves_per_op: {aten::batch_norm: 7, aten::relu_: 0}}")
    bn, relu, conv = (_op(0, "aten::batch_norm", "fwd"), _op(1, "aten::relu_", "fwd"),
                      _op(2, "aten::conv2d", "fwd"))
    assert [m.hooks_us(o) for o in (bn, relu, conv)] == [42.0, 0.0, 0.0]  # default 0
    always = dataclasses.replace(m, hooks="always")
    assert [always.hooks_us(o) for o in (bn, relu, conv)] == [14.0] * 3
    assert _flat_model(tmp_path, "{pack_us: 14}").hooks_us(bn) == 14.0
    f = tmp_path / "bad.yaml"
    f.write_text("by_phase: {fwd: 1.0}\nexecutor: {saves_per_op: {aten::relu_: -1}}\n")
    with pytest.raises(HardwareError, match="bad.yaml: executor.saves_per_op.aten::relu_"):
        read_host_model(f)


def test_the_executors_action_costs_land_where_the_actions_hang(tmp_path: Path) -> None:
    """executor.copy_us per offload/prefetch (before the op for those at it, after it for
    offloads after it) and free_us per release/drop (after the op) delay the host's issue of
    the ops that follow, only in a tracked run (vsim's runtime; an ideal runtime pays none); a
    recomputed op costs recompute_call_us instead of its forward host cost when tracked."""
    from vsim.engine.hostclock import HostClock
    from vsim.plan import Drop, Offload, Plan, PlanIndex, Prefetch, Release

    m = _flat_model(tmp_path, "{copy_us: 100.0, free_us: 7.0, recompute_call_us: 3.0}")
    assert (m.copy_us, m.free_us, m.recompute_call_us) == (100.0, 7.0, 3.0)
    trace = _recorded(tuple(_op(i, "aten::relu", "fwd") for i in range(4)))
    index = PlanIndex(Plan(actions=(Offload(tensor=1, at_op=1, after=True),
                                    Release(tensor=2, after_op=1), Drop(tensor=3, after_op=1),
                                    Prefetch(tensor=1, at_op=3, needed_by=3))))
    assert [HostClock(trace, m, False, index).ready_us(i) for i in range(4)] == \
        [0.0, 1.0, 2.0, 3.0]
    clock = HostClock(trace, m, True, index)
    assert [clock.ready_us(i) for i in range(4)] == [0.0, 1.0, 116.0, 217.0]
    clock.recompute(trace.ops[0])
    assert clock.ready_us(3) == 220.0
    untracked = HostClock(trace, m, False, index)
    untracked.recompute(trace.ops[0])
    assert untracked.ready_us(3) == 13.0


def test_recording_and_replay_are_charged_per_aten_call_of_the_recomputed_ops(
        tmp_path: Path) -> None:
    """A forward op some Recompute re-runs is recorded after it runs, at record_call_us per
    aten call, and replayed at recompute_call_us per call; an op's calls come from
    calls_per_op by name (else its default): here linear makes 4 calls, relu the default 2."""
    from vsim.engine.hostclock import HostClock
    from vsim.plan import Drop, Plan, PlanIndex, Recompute

    m = _flat_model(tmp_path, "{recompute_call_us: 3.0, record_call_us: 5.0, "
                              "calls_per_op: {default: 2, 'aten::linear': 4}}")
    trace = _recorded((_op(0, "aten::linear", "fwd"), _op(1, "aten::relu", "fwd"),
                       _op(2, "aten::relu", "fwd"), _op(3, "ReluBackward0", "bwd")))
    index = PlanIndex(Plan(actions=(Drop(tensor=1, after_op=1),
                                    Recompute(ops=(0, 1), before_op=3, tensors=(1,)))))
    assert index.recomputed_ops == {0, 1}
    clock = HostClock(trace, m, True, index)
    # recorded after ops 0 (4 calls x 5 us) and 1 (2 x 5): op 2 issues 30 us later
    assert [clock.ready_us(i) for i in range(4)] == [0.0, 21.0, 32.0, 33.0]
    clock.recompute(trace.ops[0])
    clock.recompute(trace.ops[1])
    assert clock.ready_us(3) == 33.0 + 3.0 * (4 + 2)
    assert HostClock(trace, m, False, index).ready_us(3) == 3.0  # an ideal runtime: none


def test_in_place_updates_of_what_a_chain_touched_are_noted(tmp_path: Path) -> None:
    """The runtime notes (calls back and records) an in-place update (`aten::*_`: its first
    read, or its `mutates`) of a tensor a recomputed chain or an earlier noted update touched,
    up to the op before which the last Recompute runs: record_call_us + record_callback_us
    after it. Not an update of an untouched tensor, not one after that op, none without a
    Recompute."""
    import dataclasses

    from vsim.engine.hostclock import HostClock, noted_ops
    from vsim.plan import Drop, Plan, PlanIndex, Recompute

    m = _flat_model(tmp_path, "{record_call_us: 5.0, record_callback_us: 20.0, "
                              "calls_per_op: {default: 1}}")

    def op(i: int, name: str, phase: str, reads: tuple[int, ...] = (),
           writes: tuple[int, ...] = (), **attrs: object) -> Op:
        return dataclasses.replace(_op(i, name, phase), reads=reads, writes=writes,
                                   attrs=tuple(attrs.items()))

    trace = Trace(meta={"source": "measured"}, tensors=(), ops=(
        op(0, "aten::conv2d", "fwd", writes=(1,)),
        op(1, "aten::relu_", "fwd", reads=(1,)),          # updates 1: noted
        op(2, "aten::add_", "fwd", reads=(5, 1)),         # updates 5, untouched: not noted
        op(3, "aten::add_", "fwd", reads=(5, 1), mutates=(1,)),  # updates 1: noted
        op(4, "ReluBackward0", "bwd", reads=(1,)),
        op(5, "aten::relu_", "fwd", reads=(1,))))         # after op 4: not noted
    plan = Plan(actions=(Drop(tensor=1, after_op=0),
                         Recompute(ops=(0,), before_op=4, tensors=(1,))))
    assert noted_ops(trace, PlanIndex(plan)) == {1, 3}
    clock = HostClock(trace, m, True, PlanIndex(plan))
    # recorded after op 0 (25 us), noted after ops 1 and 3 (25 each)
    assert [clock.ready_us(i) for i in range(6)] == [0.0, 26.0, 52.0, 53.0, 79.0, 80.0]
    assert noted_ops(trace, PlanIndex(Plan(actions=(plan.actions[0],)))) == frozenset()


def test_runtime_cost_can_be_switched_off() -> None:
    """`simulate(runtime_cost=False)` (vsim run/validate --no-runtime-cost) predicts an ideal
    runtime: none of vsim's runtime's host costs, its recomputations issued as PyTorch issues
    the forward ops. Against it, the Python runtime's costs make a host-bound model's plan full
    of actions >10% slower; the executor's core (the default) costs less than the Python
    runtime, and can beat the ideal one: its compiled replay re-runs a chain's aten calls
    without the modules' Python."""
    import time

    from vsim.allocator import make_allocator
    from vsim.engine import simulate
    from vsim.hardware import load_hardware
    from vsim.policies import make_policy
    from vsim.trace import load_trace

    t0 = time.perf_counter()
    root = Path(__file__).resolve().parents[1]
    trace = load_trace(root / "traces/shufflenet_v2_x1_0-b128-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    runs = {(cost, tracker): simulate(trace, hw, make_policy("superneurons"),
                                      make_allocator("caching"), 6 << 30, runtime_cost=cost,
                                      tracker=tracker).report["iteration_time_us"]
            for cost in (None, False) for tracker in (None, "native-frames-gated")}
    assert runs[False, None] == runs[False, "native-frames-gated"]
    # 33 ms against 29 ms (the native tracker, backward gated, saves from their frames; 36 ms
    # when it counted every call and hooked the saves); the core 28 ms
    assert runs[None, "native-frames-gated"] > runs[False, None] * 1.10
    assert runs[None, None] < runs[None, "native-frames-gated"]
    assert time.perf_counter() - t0 < 30


def _fast_link(hw: Any) -> Any:
    """`hw` with a link 100x as fast: vDNN's copies then hide nothing of the host's time (on
    the recorded traces, the link bounds vDNN's iteration, and the host's costs would show
    only on a trace recorded on a slow host)."""
    import dataclasses

    def path(p: Any) -> Any:
        return dataclasses.replace(p, bandwidth_bytes_per_us=p.bandwidth_bytes_per_us * 100)

    def way(d: Any) -> Any:
        return dataclasses.replace(d, pinned=path(d.pinned), pageable=path(d.pageable))
    return hw.with_overrides(h2d=way(hw.h2d), d2h=way(hw.d2h),
                             duplex_bytes_per_us=hw.duplex_bytes_per_us * 100)


def test_the_python_tracker_costs_host_time_the_native_one_does_not() -> None:
    """run_plan(tracker=): vsim's runtime runs plans under its C++ op counter by default (no
    per-op tracker cost), the Python tracker costs tracker_us_per_op per op; validate passes
    the measured run's own tracker."""
    from vsim.allocator import make_allocator
    from vsim.engine import run_plan
    from vsim.hardware import load_hardware
    from vsim.policies import make_policy
    from vsim.trace import load_trace
    from vsim.validate import measured_tracker, planned_tracker

    root = Path(__file__).resolve().parents[1]
    trace = load_trace(root / "traces/shufflenet_v2_x1_0-b128-h100.vsim.json.gz")
    hw = _fast_link(load_hardware("h100-sxm"))
    plan = make_policy("vdnn:mode=all").plan(trace, hw, hw.capacity_bytes)
    time = {t: run_plan(trace, hw, plan, make_allocator("exact"), tracker=t,
                        first_iteration=False).report["iteration_time_us"]
            for t in (None, "native-frames-gated-core", "native", "python")}
    assert time[None] == time["native-frames-gated-core"]
    assert time["native"] < time["python"]
    # the native tracker's saved-tensor hooks: on every forward op before 2026-11-27T08:30,
    # where a save is armed since (the run says so)
    assert measured_tracker({"executed": {"tracker": "native"}}) == "native-always"
    assert measured_tracker({"executed": {"tracker": "native",
                                          "native_hooks": "armed"}}) == "native"
    assert planned_tracker({"provenance": {"date": "2026-11-26"}}) == "native-always"
    assert planned_tracker({"provenance": {"plan_tracker": "native"}}) == "native"
    assert measured_tracker({"executed": {"offloads": 3}}) == "python"  # measured before it
    # gated as configured where the run stopped out of memory before its backward
    stopped = {"fits": False, "executed": {"tracker": "native", "native_hooks": "armed",
                                           "native_saved": "frames", "native_gate": "nodes",
                                           "gated": False, "gate_note": None}}
    assert measured_tracker(stopped) == "native-frames-gated"
    assert measured_tracker({**stopped, "fits": True}) == "native-frames"
    # the plan carried out by the executor's core in C++
    cored = {**stopped, "executed": {**stopped["executed"], "executor_core": "native"}}
    assert measured_tracker(cored) == "native-frames-gated-core"
    assert measured_tracker({"executed": None}) is None
    # stopped out of memory in the iteration that calibrates the native tracker (run under the
    # Python one): the runtime would have gone on natively, as its plan was made for
    calibrating = {"fits": False, "executed": {"tracker": "python", "iterations": 1},
                   "notes": ["instrumented: the native op tracker counts aten calls in C++"]}
    assert measured_tracker(calibrating) is None
    assert measured_tracker({**calibrating, "notes": []}) == "python"


def test_the_executors_core_is_charged_its_own_costs(tmp_path: Path) -> None:
    """A run whose plan the executor's core carried out in C++ (tracker "...-core") pays the
    profile's `executor.core` costs in place of the Python runtime's; a profile without them
    charges the same either way; a core section with another key is refused."""
    from vsim.allocator import make_allocator
    from vsim.engine import run_plan
    from vsim.hardware import load_hardware
    from vsim.policies import make_policy
    from vsim.trace import load_trace

    m = load_host_model("h100-sxm")
    assert m is not None and m.core and m.with_core().copy_us == m.core["copy_us"]
    assert m.with_core().native_us_per_call == m.native_us_per_call  # the counter's own
    root = Path(__file__).resolve().parents[1]
    trace = load_trace(root / "traces/shufflenet_v2_x1_0-b128-h100.vsim.json.gz")
    hw = _fast_link(load_hardware("h100-sxm"))
    plan = make_policy("vdnn:mode=all").plan(trace, hw, hw.capacity_bytes)

    def issue(tracker: str) -> float:
        got = run_plan(trace, hw, plan, make_allocator("exact"), tracker=tracker,
                       first_iteration=False).report
        return float(got["host"]["issue_us"]) if "host" in got else \
            float(got["iteration_time_us"])
    # vDNN-all's offloads and prefetches at the core's copy_us, a fraction of Python's
    assert m.core["copy_us"] < m.copy_us
    assert issue("native-frames-gated-core") < issue("native-frames-gated")
    bad = tmp_path / "bad.yaml"
    bad.write_text("by_phase: {fwd: 1.0}\nexecutor: {core: {tracker_us_per_op: 3}}")
    with pytest.raises(HardwareError, match="bad.yaml.*executor.core"):
        read_host_model(bad)


def test_the_native_trackers_hooks_are_charged_where_they_are_on() -> None:
    """The saved-tensor hooks cost pack_us per forward op they are on for: every one under the
    tracker before ("native-always"); under "native" only the ops with an output the plan acts
    on other than their first (batch norm's saved statistics), which the runtime finds where
    autograd saves it."""
    from vsim.allocator import make_allocator
    from vsim.engine import run_plan
    from vsim.engine.hostclock import hooked_ops
    from vsim.hardware import load_hardware
    from vsim.plan import PlanIndex
    from vsim.policies import make_policy
    from vsim.trace import load_trace

    root = Path(__file__).resolve().parents[1]
    trace = load_trace(root / "traces/densenet121-b64-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    plan = make_policy("superneurons").plan(trace, hw, int(4.7 * 2**30))
    index = PlanIndex(plan)
    hooked = hooked_ops(trace, index)
    acted = index.tensors_acted_on()
    forward = [op for op in trace.ops if op.phase == "fwd"]
    assert 0 < len(hooked) < len(forward)
    for op in forward:
        assert (op.id in hooked) == any(t in acted for t in op.writes[1:])
    time = {t: run_plan(trace, hw, plan, make_allocator("exact"), tracker=t,
                        first_iteration=False).report["iteration_time_us"]
            for t in ("native", "native-always")}
    assert time["native"] < time["native-always"]


def test_a_gated_forward_charges_no_calls_inside_module_calls_without_actions() -> None:
    """Tracker "...-modules" (VSIM_NATIVE_FWD_GATE=modules): the forward ops of the outermost
    module calls (runs of ops under one layer-name prefix) where the plan acts at no op are
    not counted, and each such call pays its hooks; a run measured under it says so."""
    from vsim.allocator import make_allocator
    from vsim.engine import run_plan
    from vsim.engine.hostclock import forward_gated
    from vsim.hardware import load_hardware
    from vsim.plan import PlanIndex
    from vsim.policies import make_policy
    from vsim.trace import load_trace
    from vsim.validate import measured_tracker

    root = Path(__file__).resolve().parents[1]
    trace = load_trace(root / "traces/swin_t-b32-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    plan = make_policy("hybrid").plan(trace, hw, int(2.8 * 2**30))
    index = PlanIndex(plan)
    quiet, firsts = forward_gated(trace, index)
    acted = index.acts_before | index.acts_after | set(index.recomputed_ops)
    assert quiet and firsts and set(firsts) <= quiet
    assert not quiet & acted  # no op the plan acts at is ever untracked
    assert all(trace.ops[o].phase == "fwd" for o in quiet)
    time = {t: run_plan(trace, hw, plan, make_allocator("exact"), tracker=t,
                        first_iteration=False).report["iteration_time_us"]
            for t in ("native-frames-gated", "native-frames-gated-modules")}
    # swin_t is host-bound: the counted calls kept off the key outweigh the gated calls' hooks
    assert time["native-frames-gated-modules"] < time["native-frames-gated"]
    assert measured_tracker({"executed": {"tracker": "native", "native_hooks": "armed",
                                          "native_saved": "frames", "gated": True,
                                          "fwd_gated": 12}}) == "native-frames-gated-modules"


def test_the_host_model_is_read_once_per_file_version(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine run asks for the host model: it is parsed once (issue 14, planning time),
    and again only when the file changes."""
    import os

    import vsim.host as host
    f = tmp_path / "gpu.yaml"
    f.write_text("by_phase: {fwd: 10, bwd: 20}\n")
    reads: list[Path] = []
    real = host.read_host_model

    def counting(path: Path) -> host.HostModel:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(host, "read_host_model", counting)
    first = host.load_host_model("gpu", tmp_path)
    assert first is not None and host.load_host_model("gpu", tmp_path) is first
    assert len(reads) == 1
    f.write_text("by_phase: {fwd: 30, bwd: 20}\n")
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    changed = host.load_host_model("gpu", tmp_path)
    assert len(reads) == 2 and changed is not None and changed.by_phase["fwd"] == 30
    assert host.load_host_model("missing", tmp_path) is None


def test_plans_do_not_depend_on_how_sum_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12's sum() of floats compensates its rounding (3.11's does not): planners that
    compared such sums made different plans on the lent machines (3.12) than here, in the last
    bit of a threshold. The float sums that planning reads are math.fsum (correctly rounded
    on every version): the same plan under either sum()."""
    import builtins

    from vsim.hardware import load_hardware
    from vsim.plan import plan_digest
    from vsim.policies import make_policy
    from vsim.trace import load_trace

    root = Path(__file__).resolve().parents[1]
    hw = load_hardware("h100-sxm")

    def plans() -> list[str]:  # a trace of its own each time: planners memoise per trace
        trace = load_trace(root / "traces/resnet101-b64-h100.vsim.json.gz")
        return [plan_digest(make_policy(p).plan(trace, hw, int(gib * (1 << 30))))
                for p, gib in (("hybrid", 4.8), ("superneurons", 6.4))]

    naive = plans()
    plain_sum = builtins.sum

    def compensated(items, start=0):  # type: ignore[no-untyped-def]
        items = list(items)
        if not items or not all(isinstance(x, float) for x in items):
            return plain_sum(items, start)
        total, lost = float(start), 0.0
        for x in items:
            t = total + x
            lost += (total - t) + x if abs(total) >= abs(x) else (x - t) + total
            total = t
        return total + lost

    monkeypatch.setattr(builtins, "sum", compensated)
    assert plans() == naive
