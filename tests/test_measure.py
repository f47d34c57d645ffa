"""vsim measure on the CPU: every policy's plan carried out for real while a tiny CNN trains, with
the loss and every gradient equal to the run without a policy, and the plan's copies, drops and
recomputations seen to happen; the op map against a trace it does not fit; the in-place repair
of recomputed tensors; the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from vsim.cli import main  # noqa: E402
from vsim.policies import make_policy  # noqa: E402
from vsim.policies.base import Drop, Offload, Plan, Prefetch, Recompute  # noqa: E402
from vsim.record.recorder import record_model  # noqa: E402
from vsim.runtime.executor import Executor, ExecutorError  # noqa: E402
from vsim.runtime.measure import Session, compare_gradients  # noqa: E402
from vsim.runtime.opmap import OpSequenceError  # noqa: E402
from vsim.trace import Trace, save_trace  # noqa: E402

BATCH = 4
POLICIES = ["none", "vdnn:mode=all", "vdnn:mode=conv", "vdnnpp", "superneurons", "layrub",
            "accudnn", "recompute", "hybrid"]


def _record(model: str) -> Trace:
    return record_model(model, BATCH, device="cpu", warmup=1, iters=2, timing_iters=1)


def _tight(trace: Trace) -> int:
    """A capacity 60% of the way from the resident bytes to the peak: every policy acts."""
    resident = sum(t.size_bytes for t in trace.tensors if t.producer is None)
    assert trace.measured is not None
    return int(resident + 0.6 * (trace.measured.peak_allocated_bytes - resident))


@pytest.fixture(scope="module")
def cnn() -> tuple[Trace, Session]:
    trace = _record("tiny-cnn")
    return trace, Session("tiny-cnn", BATCH, trace, device="cpu", warmup=1)


@pytest.fixture(scope="module")
def resnet() -> tuple[Trace, Session]:
    trace = _record("tiny-resnet")
    return trace, Session("tiny-resnet", BATCH, trace, device="cpu", warmup=1)


def test_the_reference_is_repeatable_and_the_map_covers_the_trace(cnn) -> None:
    trace, s = cnn
    assert s.noise is not None and s.noise["bitwise_equal"]
    assert s.opmap.op_names == [op.name for op in trace.ops]
    assert len(s.opmap.call_op) == s.opmap.n_calls > len(trace.ops) // 2
    # every saved feature map of the forward pass is an output of some call
    located = {t for outs in s.opmap.outputs.values() for _, t in outs}
    saved = {t.id for t in trace.tensors if t.kind == "activation" and t.producer is not None}
    assert saved <= located
    assert set(s.opmap.inputs.values()) == {0, 1}


@pytest.mark.parametrize("spec", POLICIES)
def test_every_policy_trains_exactly_as_without_it(cnn, spec: str) -> None:
    trace, s = cnn
    capacity = _tight(trace)
    plan = make_policy(spec).plan(trace, s.hw, capacity)
    result = s.run(spec, capacity, iters=2, warmup=1)
    assert result["fits"] and len(result["iteration_times_us"]) == 2
    # the collector's host time, per measured iteration (a gc callback; none if it never ran)
    assert len(result["collector_us"]) == 2 and min(result["collector_us"]) >= 0
    # the process's CPU time while each measured iteration was issued (the CPU step works)
    use = result["host_use"]
    assert len(use["issue_cpu_us"]) == 2 and min(use["issue_cpu_us"]) > 0
    kinds = {type(a) for a in plan.actions}
    if spec != "none":
        assert plan.actions, f"{spec} planned nothing at {capacity} B"
        check = result["check"]
        # offloading moves bytes, it must not change a bit; recomputation re-runs the same
        # kernels (deterministic on the CPU): bitwise too, 1e-6 relative is the contract
        assert check["bitwise_equal"] or (Recompute in kinds
                                          and check["max_rel_grad_diff"] <= 1e-6), check
    done = result["executed"]
    if done is not None:  # host times: medians over the measured iterations, not the last's
        assert done["executor_iterations_timed"] == result["iterations"]["measured"] == 2
        assert done["executor_host_us"] >= done["executor_alloc_us"] >= 0
        assert done["executor_host_us"] >= done["executor_event_us"] >= 0
    n_off = sum(isinstance(a, Offload) for a in plan.actions)
    n_pre = sum(isinstance(a, Prefetch) for a in plan.actions)
    if n_off:
        assert done["offloads"] == n_off and result["d2h_bytes"] > 0
        assert result["pinned_host_peak_bytes"] > 0
    if n_pre:
        assert done["prefetches"] == n_pre and result["h2d_bytes"] > 0
    if Drop in kinds:
        assert done["drops"] > 0 and done["recomputed_calls"] > 0
    if spec == "none":
        assert result["executed"] is None and result["d2h_bytes"] == result["h2d_bytes"] == 0


def test_the_pinned_pool_is_reused_across_iterations(cnn) -> None:
    trace, s = cnn
    result = s.run("vdnnpp", None, iters=3, warmup=1)
    plan = make_policy("vdnnpp").plan(trace, s.hw, s.hw.capacity_bytes)
    assert plan.pinned_pool_bytes > 0
    assert result["pinned_host_peak_bytes"] == plan.pinned_pool_bytes
    assert result["executed"]["host_buffers_allocated_bytes"] == 0  # all from the pool
    assert result["check"]["bitwise_equal"]


def test_a_trace_of_other_ops_is_refused(cnn) -> None:
    trace, s = cnn
    ops = list(trace.ops)
    ops[3] = dataclasses.replace(ops[3], name="aten::gelu")
    other = dataclasses.replace(trace, ops=tuple(ops))
    with pytest.raises(OpSequenceError, match=r"trace op 3 \(aten::gelu"):
        Session("tiny-cnn", BATCH, other, device="cpu", warmup=1, check=False)


def test_a_run_that_diverges_stops(cnn) -> None:
    trace, s = cnn
    opmap = dataclasses.replace(s.opmap, funcs=list(s.opmap.funcs))
    opmap.funcs[5] = torch.ops.aten.gelu.default
    ex = Executor(Plan(), opmap, trace, s.device, s.flat_inputs)
    with pytest.raises(OpSequenceError, match="aten call 5 .* diverged"):
        ex.run(s.step)
    s.restore()


def _bn_then_inplace(trace: Trace, layer: str) -> tuple[int, int, int]:
    """(batch-norm op of `layer`, its output, the drop point): BasicBlock's bn2 output is
    updated in place by `out += x` and the ReLU after it."""
    bn = next(o for o in trace.ops if o.layer == layer and o.name == "aten::batch_norm")
    out = bn.writes[0]
    last_fwd = max(o.id for o in trace.ops if o.phase == "fwd" and out in o.reads)
    return bn.id, out, last_fwd


def test_recomputing_a_tensor_updated_in_place_reruns_the_updates(resnet) -> None:
    trace, s = resnet
    bn, out, last = _bn_then_inplace(trace, "4.bn2")
    first_bwd = min(o.id for o in trace.ops if o.phase == "bwd" and out in o.reads)
    plan = Plan(actions=(Drop(out, last), Recompute((bn,), first_bwd, (out,))))
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    got = compare_gradients(s.reference, s.gradients(ex))
    assert ex.stats.inplace_rerun >= 2 and ex.stats.inplace_missed == 0  # add_ and relu_
    assert got["bitwise_equal"], got


def test_an_in_place_update_that_cannot_be_rerun_is_an_error_unless_asked(resnet) -> None:
    trace, s = resnet
    bn3, out3, last3 = _bn_then_inplace(trace, "3.bn2")
    bn4, out4, last4 = _bn_then_inplace(trace, "4.bn2")
    # block 4's `out += x` reads block 3's output, which is dropped and rebuilt only later
    before4 = min(o.id for o in trace.ops if o.phase == "bwd" and out4 in o.reads)
    before3 = min(o.id for o in trace.ops if o.phase == "bwd" and out3 in o.reads)
    assert before4 < before3
    plan = Plan(actions=(Drop(out3, last3), Drop(out4, last4),
                         Recompute((bn4,), before4, (out4,)),
                         Recompute((bn3,), before3, (out3,))))
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    with pytest.raises(ExecutorError, match="updated a rebuilt tensor in place"):
        s.gradients(ex)
    loose = Executor(plan, s.opmap, trace, s.device, s.flat_inputs, strict=False)
    got = compare_gradients(s.reference, s.gradients(loose))
    assert loose.stats.inplace_missed > 0 and not got["bitwise_equal"]


def test_batch_norm_statistics_are_not_updated_twice_by_a_recomputation(resnet) -> None:
    trace, s = resnet
    plan = make_policy("recompute").plan(trace, s.hw, _tight(trace))
    chains = [o for a in plan.actions if isinstance(a, Recompute) for o in a.ops]
    assert any(trace.ops[o].name == "aten::batch_norm" for o in chains)
    s.restore()
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    ex.run(s.step)
    assert ex.stats.recomputed_calls > 0
    with_plan = [b.clone() for b in s.net.buffers()]
    s.restore()
    s.step()
    plain = [b.clone() for b in s.net.buffers()]
    s.restore()
    assert all(torch.equal(a, b) for a, b in zip(with_plan, plain, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plain, s.snapshot[len(s.params):],
                                                     strict=False))


def test_measure_command_line_writes_the_result(tmp_path, capsys) -> None:
    trace = _record("tiny-cnn")
    path = tmp_path / "cnn.vsim.json.gz"
    save_trace(trace, path)
    out = tmp_path / "m.json"
    code = main(["measure", "tiny-cnn", "--batch", str(BATCH), "--policy", "vdnn:mode=conv",
                 "--device", "cpu", "--trace", str(path), "--warmup", "1", "--iters", "2",
                 "-o", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    for key in ("iteration_time_us", "peak_allocated_bytes", "peak_reserved_bytes",
                "pinned_host_peak_bytes", "h2d_bytes", "d2h_bytes", "fits", "notes",
                "provenance", "iteration_times_us", "check"):
        assert key in doc
    assert doc["fits"] and doc["d2h_bytes"] > 0 and doc["check"]["bitwise_equal"]
    assert doc["provenance"]["command"].startswith("vsim measure tiny-cnn --batch 4")
    assert "wrote" in capsys.readouterr().err


def test_measure_bad_policy_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    code = main(["measure", "tiny-cnn", "--batch", "2", "--policy", "vdnn:mode=bogus",
                 "--device", "cpu", "-o", str(tmp_path / "x.json")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mode" in err[0]
    assert not (tmp_path / "x.json").exists()


def test_out_of_memory_is_a_result_and_frees_the_iteration(cnn) -> None:
    """An iteration stopped in forward must not keep its activations: saved outputs packed
    with their grad_fn would be a C++ reference cycle that only backward breaks."""
    import gc
    import weakref

    trace, s = cnn
    alive: list[weakref.ref] = []
    keep = s.net[0].register_forward_hook(lambda m, i, o: alive.append(weakref.ref(o)))

    def boom(m, i, o):
        raise torch.OutOfMemoryError("simulated")

    stop = s.net[3].register_forward_hook(boom)
    try:
        result = s.run("vdnn:mode=all", None, iters=1, warmup=0)
    finally:
        keep.remove()
        stop.remove()
    gc.collect()
    assert not result["fits"] and result["oom"]["op"] == 3 and result["iteration_time_us"] is None
    assert alive and all(w() is None for w in alive)
    assert s.run("vdnn:mode=all", None, iters=1, warmup=0)["fits"]  # and the session goes on


def test_an_input_that_cannot_come_back_at_the_stop_comes_back_after_it(cnn, monkeypatch) -> None:
    """Out of memory mid-iteration under a cap: bringing the offloaded batch back may not fit
    while the stopped iteration still holds its tensors. The input must come back once they
    are freed, or every later case reads a batch of 0 bytes (on the GPU: cuDNN BAD_PARAM in the
    first convolution of every later case, as the corpus measurement found)."""
    trace, s = cnn
    failing = {"restore": True}
    original = Executor._restore_inputs

    def restore_once(self):
        if failing["restore"]:
            failing["restore"] = False
            raise torch.OutOfMemoryError("simulated: no room to bring the input back")
        original(self)

    def boom(m, i, o):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(Executor, "_restore_inputs", restore_once)
    stop = s.net[3].register_forward_hook(boom)
    try:
        result = s.run("vdnn:mode=all", None, iters=1, warmup=0)
    finally:
        stop.remove()
    assert not result["fits"] and not failing["restore"]
    assert any("inputs were brought back" in n for n in result["notes"])
    assert all(t.untyped_storage().nbytes() > 0 for t in s.flat_inputs)
    again = s.run("vdnn:mode=all", None, iters=1, warmup=0)
    assert again["fits"] and again["check"]["bitwise_equal"]


def test_validation_table_shows_a_measured_out_of_memory_as_a_dash() -> None:
    from vsim.cli import format_validation

    row = {"id": "x", "ok": True,
           "predicted": {"iteration_time_us": 10.0, "peak_allocated_bytes": 2**30, "fits": False},
           "measured": {"iteration_time_us": None, "peak_allocated_bytes": None, "fits": False},
           "error": {"iteration_time": None, "peak_allocated": None, "peak_reserved": None}}
    summary = {"n": 1, "ok": 1, "time_mape": None, "peak_mape": None, "fits_correct": 1}
    line = format_validation({"cases": [row], "summary": summary}).splitlines()[1]
    assert line.split()[1:5] == ["10.0", "us", "-", "-"]


def test_superneurons_on_a_residual_network_trains_exactly(resnet) -> None:
    """SuperNeurons used to drop a batch norm's output that the block's `out += identity` and
    ReLU update in place later; the rebuilt map then missed those updates (wrong gradients)."""
    from vsim.hardware import load_hardware
    from vsim.policies import make_policy

    trace, s = resnet
    hw = load_hardware("h100-sxm")
    capacity = int(0.6 * max(1, trace.measured.peak_allocated_bytes if trace.measured else
                             sum(t.size_bytes for t in trace.tensors)))
    plan = make_policy("superneurons").plan(trace, hw, capacity)
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    got = compare_gradients(s.reference, s.gradients(ex))
    assert ex.stats.inplace_missed == 0
    assert got["bitwise_equal"], got


def test_profile_summary_counts_overlapping_streams_once():
    """GPU busy time is the union of intervals on all streams; kernels are summed by name."""
    from types import SimpleNamespace

    import torch

    from vsim.runtime.results import kernel_summary

    def event(name, start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(events=lambda: [
        event("conv", 1000, 1010), event("Memcpy DtoH", 1005, 1020),    # overlap: busy 0..20
        event("conv", 1030, 1040), event("host op", 1000, 1100, torch.autograd.DeviceType.CPU),
        event("wgrad", 1400, 1600)])
    summary = kernel_summary(prof, wall_us=50.0)
    assert summary["gpu_busy_us"] == 230 and summary["kernel_us"] == 235
    assert summary["kernels"][0] == {"name": "wgrad", "calls": 1, "us": 200}
    assert summary["kernels"][1] == {"name": "conv", "calls": 2, "us": 20}
    assert summary["wall_us"] == 50.0
    # the timeline: the kernels of at least TIMELINE_MIN_US, in start order, from the first
    assert summary["timeline"] == [["wgrad", 0.0, 200.0]]


@pytest.fixture(scope="module")
def constants() -> tuple[Trace, Session]:
    trace = record_model("constmodels:masked_attention", BATCH, device="cpu", warmup=1, iters=2,
                         timing_iters=1, precision="bf16", optimizer="adamw")
    return trace, Session(None, None, trace, device="cpu", warmup=1)


@pytest.mark.parametrize("spec", ["recompute", "recompute:strategy=sqrt"])
def test_recomputation_reads_constants_made_in_forward(constants, spec: str) -> None:
    """torch.tensor(...) inside forward (aten.lift_fresh; GPT-2's attention mask value) makes a
    constant whose storage is gone after forward: a recomputed chain that reads it used to stop
    with 'reads a tensor that is no longer on the GPU'."""
    trace, s = constants
    capacity = _tight(trace)
    plan = make_policy(spec).plan(trace, s.hw, capacity)
    chains = {o for a in plan.actions if isinstance(a, Recompute) for o in a.ops}
    names = {trace.ops[o].name for o in chains}
    assert "aten::where" in names, names  # the chain reads the mask value
    result = s.run(spec, capacity, iters=1, warmup=1)
    assert result["fits"] and result["check"]["bitwise_equal"], result["check"]
    assert result["executed"]["recomputed_calls"] > 0


def test_a_recomputed_lift_fresh_call_reuses_its_constant(constants) -> None:
    """The GPU's case (GPT-2, 'aten.lift_fresh.default of op 238 reads a tensor that is no
    longer on the GPU'): the chain re-runs aten.lift_fresh itself, whose argument was made
    outside the dispatcher and is gone after forward."""
    trace, s = constants
    names = [op.name for op in trace.ops]
    where = names.index("aten::where")  # the first block's masking
    start = max(o for o in range(where) if names[o] == "aten::mul")  # q * k, its inputs saved
    assert names[start:where + 1].count("aten::lift_fresh") == 2
    out = trace.ops[where].writes[0]
    back = next(o for o, op in enumerate(trace.ops) if op.phase == "bwd")
    last = max(o for o, op in enumerate(trace.ops) if out in op.reads and o < back)
    plan = Plan(actions=[Drop(tensor=out, after_op=last),
                         Recompute(tensors=(out,), ops=tuple(range(start, where + 1)),
                                   before_op=back)])
    ex = Executor(plan, s.opmap, trace, s.device, s.flat_inputs)
    got = compare_gradients(s.reference, s.gradients(ex))
    assert got["bitwise_equal"], got
    assert ex.stats.drops == 1 and ex.stats.recomputed_calls >= 5  # mul, 2 lift_fresh, div, where


def test_fused_attention_draws_from_the_rng() -> None:
    # SDPA's fused kernels draw their dropout mask inside: a recomputation must replay them
    # from the RNG state they ran at, as it does dropout (their names say nothing of it)
    from vsim.runtime.tracker import _uses_rng

    aten = torch.ops.aten
    for f in (aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_cudnn_attention.default,
              aten._flash_attention_forward.default, aten.native_dropout.default):
        assert _uses_rng(f), f
    for f in (aten.mm.default, aten.add.Tensor, aten._to_copy.default, aten.empty.memory_format):
        assert not _uses_rng(f), f


def test_micro_batched_convolutions_train_as_the_whole_batch(cnn, tmp_path) -> None:
    """A plan that runs every convolution (forward and backward) as micro-batches
    (Retime.parts): the runtime splits those calls under the Python tracker, each part's
    results assembled in place, and the step trains as with the whole batch (the weight
    gradients summed over the parts in another order: equal to within rounding)."""
    from vsim.plan import Retime
    from vsim.plan_io import SavedPlan, save_plan, trace_digest

    trace, s = cnn
    convs = [op for op in trace.ops if op.layer_type == "conv"
             and op.name in ("aten::conv2d", "ConvolutionBackward0")]
    assert len(convs) >= 2
    plan = Plan(actions=tuple(Retime(op=op.id, dur_us=op.dur_us, workspace_bytes=1, parts=2)
                              for op in convs))
    path = tmp_path / "split.json"
    save_plan(SavedPlan(plan=plan, trace_digest=trace_digest(trace)), path)
    result = s.run(f"plan:file={path}", None, iters=2, warmup=1)
    assert result["fits"]
    done = result["executed"]
    assert done["tracker"] == "python" and done["split_calls"] == len(convs)
    check = result["check"]
    assert check["max_rel_grad_diff"] <= 1e-5, check
    assert any("micro-batches" in n for n in result["notes"])
    # the native tracker cannot replace a call: asked for, it is refused
    with pytest.raises(ExecutorError, match="micro-batched"):
        s.run(f"plan:file={path}", None, iters=1, warmup=0, tracker="native")
    # with sqrt recomputation: the recomputed convolutions are replayed split too
    capacity = _tight(trace)
    rc = make_policy("recompute:strategy=sqrt").plan(trace, s.hw, capacity)
    rerun = {o for a in rc.actions if isinstance(a, Recompute) for o in a.ops}
    assert rerun & {op.id for op in convs}
    both = dataclasses.replace(rc, actions=(*rc.actions, *plan.actions))
    save_plan(SavedPlan(plan=both, trace_digest=trace_digest(trace)), path)
    result = s.run(f"plan:file={path}", capacity, iters=2, warmup=1)
    assert result["fits"] and result["check"]["max_rel_grad_diff"] <= 1e-5
    assert result["executed"]["split_calls"] == \
        len(convs) + sum(op.id in rerun for op in convs)


def test_a_case_measured_alone_is_profiled_when_the_suite_is(tmp_path, monkeypatch):
    """Cases that squeeze convolutions run in a process of their own (measure_alone): the
    suite's --profile-last goes with them (before, they came back without profile_last)."""
    import subprocess

    from vsim.runtime.suite import measure_alone

    calls = []

    def run(cmd, **_kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "  c1: 1.00 ms\n")

    monkeypatch.setattr(subprocess, "run", run)
    case = {"id": "c1", "model": "tiny-cnn", "batch": 2, "trace": "t.json", "policy": "none"}
    said = []
    for profile in (True, False):
        assert measure_alone(case, tmp_path, device="cpu", hardware="h100-sxm", iters=1,
                             warmup=0, say=said.append, profile_last=profile)
    assert "--profile-last" in calls[0] and "--profile-last" not in calls[1]
    assert said == ["  c1: 1.00 ms"] * 2


def test_a_squeeze_fills_the_free_blocks_its_results_would_not_take() -> None:
    """A squeeze caps reserved memory; a free block of a segment in use would serve a
    workspace beyond the cap, so it is filled, but for the block best fit gives each of the
    op's results (largest first); a result no free block holds needs a segment under the
    cap."""
    from vsim.allocator.caching import segment_size
    from vsim.runtime.executor import blocks_to_plug

    mib = 2**20
    free = [300 * mib, 40 * mib, 100 * mib, 120 * mib]
    plugs, unserved = blocks_to_plug(free, [90 * mib, 110 * mib])
    assert sorted(plugs) == [40 * mib, 300 * mib] and unserved == 0  # 120 for 110, 100 for 90
    plugs, unserved = blocks_to_plug(free, [500 * mib, 35 * mib])
    assert sorted(plugs) == [100 * mib, 120 * mib, 300 * mib]
    assert unserved == segment_size(500 * mib)
    assert blocks_to_plug([], [8 * mib]) == ([], segment_size(8 * mib))
