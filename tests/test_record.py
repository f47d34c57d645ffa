"""The recorder on the CPU with tiny models (seconds), the zoo's shapes and sizes on the meta
device, the idle-gap fit and the self-check's replay worked out by hand, calibrate's YAML."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vsim.errors import ConfigError  # noqa: E402
from vsim.record import selfcheck  # noqa: E402
from vsim.record.assemble import align  # noqa: E402
from vsim.record.recorder import Recorder, hardware_guess, record_model, record_step  # noqa: E402
from vsim.record.timing import fit_idle  # noqa: E402
from vsim.record.zoo import build_model, list_models, resnet_stages  # noqa: E402
from vsim.trace import Kernel, Measured, Op, Tensor, Trace, load_trace, save_trace  # noqa: E402

FAST = {"warmup": 1, "iters": 2, "timing_iters": 1}


def _record(name: str, batch: int = 2) -> Trace:
    return record_model(name, batch, device="cpu", warmup=1, iters=2, timing_iters=1)


@pytest.fixture(scope="module")
def cnn() -> Trace:
    return _record("tiny-cnn")


# ---------------------------------------------------------------- zoo

def test_list_models_has_the_issue_models() -> None:
    names = list_models()
    for name in ("alexnet", "overfeat", "googlenet", "vgg16", "vgg116", "vgg416", "resnet50",
                 "resnet152", "resnet1517", "gpt2-encoder", "torchvision:NAME",
                 "MODULE:CALLABLE"):
        assert name in names and names[name]


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown model 'nosuchnet'.*alexnet.*gpt2-encoder"):
        build_model("nosuchnet", 2, "cpu")
    with pytest.raises(ConfigError, match="no VGG-17"):
        build_model("vgg17", 2, "cpu")
    with pytest.raises(ConfigError, match="no ResNet-51"):
        build_model("resnet51", 2, "cpu")
    with pytest.raises(ConfigError, match="batch size"):
        build_model("tiny-mlp", 0, "cpu")


def test_depth_the_zoo_cannot_build_goes_to_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    # resnet18/34 are torchvision's basic-block ResNets, not the zoo's bottleneck depths
    from torch import nn

    from vsim.record import zoo
    built = []
    monkeypatch.setattr(zoo, "_torchvision_has", lambda name: name in ("resnet34", "vgg13_bn"))
    monkeypatch.setattr(zoo, "_torchvision", lambda name, batch, device: (
        built.append(name) or nn.Linear(2, 2), (torch.zeros(batch, 2), torch.zeros(batch)),
        nn.MSELoss()))
    build_model("resnet34", 2, "cpu")
    assert built == ["resnet34"]
    with pytest.raises(ConfigError, match="no ResNet-51"):  # torchvision has no resnet51
        build_model("resnet51", 2, "cpu")


def _params_mib(name: str) -> float:
    with torch.device("meta"):
        model, _, _ = build_model(name, 1, "meta")
    return sum(p.numel() for p in model.parameters()) * 4 / 2**20


def test_weights_match_the_vdnn_paper() -> None:
    # vDNN (MICRO-49) Fig. 4 weights: AlexNet 231 MB, OverFeat 559 MB (MiB, read off the figure)
    assert _params_mib("alexnet") == pytest.approx(231, rel=0.01)
    assert _params_mib("overfeat") == pytest.approx(559, rel=0.01)
    # GPT-2 small: 124.4M parameters with the LM head tied to the embedding
    with torch.device("meta"):
        gpt, (idx, target), _ = build_model("gpt2-encoder", 1, "meta")
    assert sum(p.numel() for p in gpt.parameters()) == pytest.approx(124.4e6, rel=0.01)
    assert gpt.lm_head.weight is gpt.wte.weight and idx.shape == (1, 512)


@pytest.mark.parametrize("name,size", [("alexnet", 224), ("overfeat", 231), ("googlenet", 224),
                                       ("vgg16", 224), ("resnet50", 224)])
def test_zoo_shapes(name: str, size: int) -> None:
    with torch.device("meta"):
        model, (x, y), loss_fn = build_model(name, 2, "meta")
        out = model(x)
    assert x.shape == (2, 3, size, size) and out.shape == (2, 1000)
    assert loss_fn(out, y).shape == ()


def test_deep_vgg_and_resnet_depths() -> None:
    def convs(name: str) -> int:
        with torch.device("meta"):
            model, _, _ = build_model(name, 1, "meta")
        return sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    assert convs("vgg16") == 13 and convs("vgg116") == 113
    assert resnet_stages(50) == (3, 4, 6, 3) and resnet_stages(152) == (3, 8, 36, 3)
    assert resnet_stages(1001) == (3, 8, 319, 3) and resnet_stages(1517) == (3, 8, 491, 3)
    # 3 convs per bottleneck + stem + 4 downsample convs = depth - 2 + 1 + 4 ... counted:
    assert convs("resnet50") == 3 * 16 + 1 + 4


def test_user_model_by_module_and_callable(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        def make(batch):
            model = torch.nn.Linear(4, 3)
            return model, (torch.randn(batch, 4), torch.zeros(batch, dtype=torch.long)), \\
                torch.nn.CrossEntropyLoss()
        def bad(batch):
            return 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model, (x, y), _ = build_model("mymodels:make", 5, "cpu")
    assert isinstance(model, torch.nn.Linear) and x.shape == (5, 4)
    with pytest.raises(ConfigError, match="must return"):
        build_model("mymodels:bad", 5, "cpu")
    with pytest.raises(ConfigError, match="no callable 'nope'"):
        build_model("mymodels:nope", 5, "cpu")
    with pytest.raises(ConfigError, match="cannot import"):
        build_model("no_such_module_here:make", 5, "cpu")


# ---------------------------------------------------------------- the recorder on the CPU

def test_cnn_trace_structure(cnn: Trace, tmp_path: Path) -> None:
    path = tmp_path / "cnn.vsim.json.gz"
    save_trace(cnn, path)
    t = load_trace(path)  # the validating loader accepts it
    assert t.ops == cnn.ops and t.tensors == cnn.tensors
    assert [op.id for op in t.ops] == list(range(len(t.ops)))
    phases = [op.phase for op in t.ops]
    # fwd, then bwd, then opt, each contiguous
    assert phases == sorted(phases, key=["fwd", "bwd", "opt"].index)
    fwd_types = [op.layer_type for op in t.ops if op.phase == "fwd"]
    assert fwd_types[:3] == ["conv", "relu", "pool"] and "fc" in fwd_types and "loss" in fwd_types
    convs = [op for op in t.ops if op.layer_type == "conv" and "AccumulateGrad" not in op.name]
    # each conv layer: one forward op and one backward op with the same module name
    assert sorted((op.layer, op.phase) for op in convs) == [
        ("0", "bwd"), ("0", "fwd"), ("3", "bwd"), ("3", "fwd")]
    # AccumulateGrad ops belong to their parameter's layer
    acc = [op for op in t.ops if op.name.endswith("AccumulateGrad")]
    assert {op.layer for op in acc} <= {"0", "3", "7"}
    kinds = {}
    for x in t.tensors:
        kinds.setdefault(x.kind, []).append(x)
    n_params = 6  # 2 convs and a linear, weight and bias each
    assert len([x for x in kinds["weight"] if x.producer is None]) == n_params
    assert len(kinds["optimizer_state"]) == n_params
    assert sorted(x.name for x in kinds["gradient"] if x.name.startswith("grad ")) == sorted(
        f"grad {n}.{w}" for n in ("0", "3", "7") for w in ("weight", "bias"))
    assert len(kinds["input"]) == 2
    assert all(op.kernels == () and op.stream == 0 for op in t.ops)
    assert t.meta["source"] == "measured" and t.meta["model"] == "tiny-cnn"
    assert t.meta["batch_size"] == 2 and t.meta["device"] == "cpu"
    assert t.meta["recorder"] == "vsim-record 0.1" and t.meta["join"]["structure_only"] == 0
    # the core's speed probe before each measured iteration (validation/host/noise/host-use/)
    probes = t.meta["measured_speed_probe_us"]
    assert len(probes) == len(t.meta["measured_iteration_times_us"]) and min(probes) > 0


def test_cnn_saved_activations_are_read_by_backward(cnn: Trace) -> None:
    ops = {op.id: op for op in cnn.ops}
    conv0 = next(op for op in cnn.ops if op.layer == "0" and op.phase == "fwd")
    out = next(x for x in cnn.tensors if x.producer == conv0.id and x.kind == "activation")
    # the in-place ReLU saves the conv output; its backward (and the pool's) read it
    readers = {(ops[c].layer_type, ops[c].phase) for c in out.consumers}
    assert ("relu", "bwd") in readers and ("relu", "fwd") in readers
    inp = next(x for x in cnn.tensors if x.name == "input 0")
    conv0_bwd = next(op for op in cnn.ops if op.layer == "0" and op.phase == "bwd")
    assert inp.id in conv0_bwd.reads  # the conv saved its input for the weight gradient


def test_cnn_selfcheck_matches_measured(cnn: Trace) -> None:
    c = selfcheck.compare(cnn)
    assert cnn.measured is not None
    assert c["peak_ok"] and c["replay_peak_bytes"] == cnn.measured.peak_allocated_bytes
    # the CPU fit maps the profiled span onto the measured median
    assert c["replay_time_us"] == pytest.approx(cnn.measured.iteration_time_us, rel=0.03)
    assert "self-check" not in selfcheck.describe(cnn)


def test_resnet_residuals_and_batch_norm() -> None:
    t = _record("tiny-resnet")
    types = {op.layer_type for op in t.ops}
    assert {"conv", "bn", "relu", "add", "pool", "fc"} <= types
    adds = [op for op in t.ops if op.layer_type == "add" and op.phase == "fwd"]
    assert len(adds) == 2  # out += identity, once per block
    # the residual reads the block's input, produced two convs earlier
    assert all(len(op.deps) >= 1 for op in adds)
    running = [x for x in t.tensors if x.name.startswith("buffer ")]
    assert running and all(x.kind == "weight" for x in running)


def test_transformer_shared_weights_and_vocabulary() -> None:
    t = _record("tiny-transformer")
    types = {op.layer_type for op in t.ops}
    assert {"embedding", "layernorm", "attention", "gelu", "dropout", "fc", "loss"} <= types
    wte = [x for x in t.tensors if x.name == "wte.weight"]
    assert len(wte) == 1  # tied with lm_head: one storage, one tensor
    assert not [x for x in t.tensors if x.name == "lm_head.weight"]
    consumers = {next(o for o in t.ops if o.id == c).layer for c in wte[0].consumers}
    assert {"wte", "lm_head"} <= consumers


def test_frozen_parameters_and_user_step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 1, 0])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    t = record_step(step, model, opt, inputs=(x, y), device="cpu", **FAST)
    grads = {x.name for x in t.tensors if x.name.startswith("grad ")}
    assert grads == {"grad 2.weight", "grad 2.bias"}
    state = {x.name for x in t.tensors if x.kind == "optimizer_state"}
    assert {"2.weight.exp_avg", "2.weight.exp_avg_sq"} <= state
    assert not any(n.startswith("0.") for n in state)
    assert {"fwd", "bwd", "opt"} <= {op.phase for op in t.ops}


def test_recorder_block_left_early_and_torch_left_clean() -> None:
    model = torch.nn.Linear(2, 2)
    original = torch.autograd.backward
    with pytest.raises(ConfigError, match="step\\(\\) calls early"):
        with Recorder(model, device="cpu", **FAST) as rec:
            for _ in range(5):  # not enough: 1 + 2 + 1 + 2 = 6
                model(torch.randn(1, 2)).sum().backward()
                rec.step()
    assert torch.autograd.backward is original
    assert not model._forward_hooks and not model._forward_pre_hooks
    with pytest.raises(ConfigError, match="not finished"):
        _ = rec.trace


def test_recorder_refuses_bad_schedule_and_device() -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        Recorder(torch.nn.Linear(1, 1), warmup=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            record_model("tiny-mlp", 2, device="cuda")


def test_hardware_guess() -> None:
    assert hardware_guess("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert hardware_guess("NVIDIA H200") == "h200"
    assert hardware_guess("NVIDIA A100-SXM4-40GB") is None


def test_record_command_line(tmp_path: Path) -> None:
    out = tmp_path / "m.vsim.json.gz"
    run = subprocess.run([sys.executable, "-m", "vsim.record", "record", "tiny-mlp", "--batch",
                          "2", "--device", "cpu", "--warmup", "1", "--iters", "2",
                          "--timing-iters", "1", "-o", str(out)],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    assert "self-check: replay" in run.stderr and load_trace(out).meta["model"] == "tiny-mlp"
    bad = subprocess.run([sys.executable, "-m", "vsim.record", "record", "nonet", "--batch", "2",
                          "--device", "cpu", "-o", str(out)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert bad.returncode == 2 and "unknown model 'nonet'" in bad.stderr


def test_without_torch_the_package_says_so() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from vsim.errors import ConfigError\n"
            "try:\n    import vsim.record\n"
            "except ConfigError as e:\n    assert isinstance(e, ImportError); print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0 and "recording needs PyTorch" in run.stdout


# ---------------------------------------------------------------- pure pieces

def test_fit_idle_subtracts_one_constant_from_each_gap() -> None:
    # busy [10,20] [25,30] [60,70]: gaps 10, 5, 30 (45 idle), busy 25. Target 55 -> idle 30:
    # subtract c with (10-c)+(5-c)+(30-c) = 30 -> c = 5: gaps 5, 0, 25.
    warp, info = fit_idle([(10, 20), (25, 30), (60, 70)], 55.0)
    assert info["fit"] == "subtract" and info["subtract_us"] == pytest.approx(5.0)
    assert [warp(t) for t in (10, 20, 25, 30, 60, 70)] == pytest.approx([5, 15, 15, 20, 45, 55])
    # target 27 -> idle 2: c with only the largest gap above it: 30 - c = 2 -> c = 28
    warp, info = fit_idle([(10, 20), (25, 30), (60, 70)], 27.0)
    assert info["subtract_us"] == pytest.approx(28.0) and warp(70) == pytest.approx(27.0)
    # target above the profiled span: gaps scaled by 90/45 = 2
    warp, info = fit_idle([(10, 20), (25, 30), (60, 70)], 115.0)
    assert info["fit"] == "scale" and warp(70) == pytest.approx(115.0)
    assert warp(25) == pytest.approx(20 + 10 + 10)  # 20 + 2 x 5
    # busy above the target: gaps closed, busy kept (GPU), or everything scaled (CPU)
    warp, info = fit_idle([(10, 20), (25, 30)], 12.0)
    assert info["fit"] == "clamp" and warp(30) == pytest.approx(15.0)
    warp, info = fit_idle([(10, 20), (25, 30)], 12.0, scale_busy=True)
    assert info["fit"] == "scale-all" and warp(30) == pytest.approx(12.0)
    warp, info = fit_idle([(10, 20)], None)
    assert info["fit"] == "none" and warp(20) == 20


def test_align_pairs_matches_and_leftovers() -> None:
    assert align(["a", "b", "c"], ["a", "x", "c"]) == [(0, 0), (1, None), (None, 1), (2, 2)]


def test_replay_estimate_by_hand() -> None:
    """Stream 0: op0 [0,10], op1 [12,20] (gap 2), op2 [20,25]. Stream 3: op3 [5,9] needs op1.
    Replay: op0 0..10, op1 12..20, op2 20..25, op3 max(5, 20)=20..24 -> 25 us.
    Memory: w 100 resident; op0 makes a 50 (freed by op2), op1 makes b 30; peak after op1:
    100 + 50 + 30 = 180; op3 makes c 40 after a was freed: 170."""
    tensors = (Tensor(0, 100, "weight"), Tensor(1, 50, "activation", producer=0),
               Tensor(2, 30, "activation", producer=1), Tensor(3, 40, "temporary", producer=3))
    k = (Kernel("k", 7, 0.0, 1.0),)
    ops = (Op(0, "a", "l", "conv", "fwd", 0, 10, writes=(1,), kernels=k),
           Op(1, "b", "l", "conv", "fwd", 12, 8, writes=(2,), reads=(1,), deps=(0,)),
           Op(2, "c", "l", "conv", "fwd", 20, 5, reads=(1,), frees=(1,), deps=(0,)),
           Op(3, "d", "l", "other", "fwd", 5, 4, stream=3, writes=(3,), deps=(1,)))
    trace = Trace({"source": "synthetic"}, tensors, ops, Measured(25.0, 180, 200))
    assert selfcheck.replay_estimate(trace) == (25.0, 180)
    c = selfcheck.compare(trace)
    assert c["time_ok"] and c["peak_ok"] and c["time_error"] == 0.0


def test_calibrate_yaml_loads_as_a_profile(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    from vsim.hardware import load_hardware
    from vsim.record.calibrate import _fit_path, refit_links, write_profile

    doc = yaml.safe_load((Path(__file__).parent.parent / "hardware" / "h100-sxm.yaml")
                         .read_text())
    # 64 B in 10 us, 1 MiB in 30, 16 MiB in 330, 1 GiB in 20010: the line through the two
    # large points has slope 19680 us / 1056964608 B -> 53707 B/us (above the best size/time,
    # 53660); the largest intercept keeping t - latency >= size / bandwidth is the probe's,
    # 10 - 64/53707 = 9.9988 us; each point's efficiency then gives its time back.
    points = [(64, 10.0), (2**20, 30.0), (16 * 2**20, 330.0), (2**30, 20010.0)]
    doc["link"]["h2d"]["pinned"] = _fit_path(points)
    doc["provenance"]["method"] = 'quotes " and colons: and # hashes'
    doc["measurements"] = {"h2d_pinned": [{"size": "64B", "time": "10.00us"}]}
    path = tmp_path / "x.yaml"
    write_profile(doc, path)
    hw = load_hardware(str(path))
    assert hw.h2d.pinned.bandwidth_bytes_per_us == pytest.approx(53707, rel=1e-4)
    assert hw.h2d.pinned.latency_us == pytest.approx(9.9988, abs=0.01)
    for size, t in points:
        assert hw.h2d.copy_time_us(size) == pytest.approx(t, rel=0.002)
    assert hw.provenance["method"] == 'quotes " and colons: and # hashes'
    # refitting from the measurements rows gives the same path
    rows = [{"size": f"{s}B", "time": f"{t}us"} for s, t in points]
    doc["measurements"] = {f"{d}_{k}": rows for d in ("h2d", "d2h")
                           for k in ("pinned", "pageable")}
    assert refit_links(doc)["link"]["d2h"]["pageable"] == doc["link"]["h2d"]["pinned"]


def test_gpu_timing_pass_median_iteration_and_kernel_join() -> None:
    """Timing pass: delimiters at 0, 100, 200, 300 us; iteration 1 is skipped. Spans from each
    delimiter's end (1 us after its start): it2 a [105,115] b [116,124] -> 23 us; it3 a
    [210,220] b [230,240] -> 39; it4 a [305,315] x [316,317] b [318,326] -> 25: the median is
    it4, origin 301: a at 4, x at 15, b at 17. The structure pass saw op 0 launch a and op 1
    launch b and c (c never ran in the timing pass); x, unseen by the structure pass, goes to
    the op of the kernel before it."""
    from vsim.record.assemble import _StructOp, join_kernels
    from vsim.record.timing import timing_kernels
    from vsim.trace.importers import Capture, CpuOp, KernelRec, OpDraft

    def k(name: str, start: float, end: float, op: int | None = None) -> KernelRec:
        return KernelRec(name, 7, int(start * 1000), int(end * 1000), op)

    spin = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    timing = Capture([], [], kernels=[
        k(spin, 0, 1), k("a", 10, 20), k("b", 22, 30),
        k(spin, 100, 101), k("a", 105, 115), k("b", 116, 124),
        k(spin, 200, 201), k("a", 210, 220), k("b", 230, 240),
        k(spin, 300, 301), k("a", 305, 315), k("x", 316, 317), k("b", 318, 326)])
    kernels, info = timing_kernels(timing, None)
    assert info["timing_iterations_us"] == [23.0, 39.0, 25.0]
    assert [(x.name, x.start_us, x.dur_us) for x in kernels] == [
        ("a", 4.0, 10.0), ("x", 15.0, 1.0), ("b", 17.0, 8.0)]
    ops = [CpuOp(0, "aten::conv2d", 1, 0, 10, None, kernels=[k("a", 1, 2, 0)]),
           CpuOp(1, "aten::relu", 1, 20, 30, None, kernels=[k("b", 3, 4, 1), k("c", 5, 6, 1)])]
    sops = [_StructOp(op, OpDraft(op.name), []) for op in ops]
    owners, join = join_kernels(sops, kernels)
    assert owners == [0, 0, 1]
    assert join == {"kernels_structure": 3, "kernels_timing": 3, "kernels_matched": 2}


def test_shipped_traces_replay_to_their_measurements() -> None:
    """Issue 3's acceptance on the recorder's side: every shipped recording replays (no policy)
    within 3% of its measured time and 1% of its measured peak."""
    traces = sorted((Path(__file__).parent.parent / "traces").glob("*-h100.vsim.json.gz"))
    for path in traces:
        c = selfcheck.compare(load_trace(path))
        assert c["time_ok"] and c["peak_ok"], (path.name, c)


# ------------------------------------------------------------------ issue 17: precision, optimizer

def test_training_step_rejects_unknown_choices():
    from vsim.record.step import training_step
    with pytest.raises(ConfigError, match="precision"):
        training_step("tiny-mlp", 2, "cpu", precision="fp8")
    with pytest.raises(ConfigError, match="optimizer"):
        training_step("tiny-mlp", 2, "cpu", optimizer="lion")
    with pytest.raises(ConfigError, match="--seq"):
        build_model("tiny-mlp", 2, "cpu", seq=64)


def test_fp16_step_has_a_grad_scaler_and_sgd_is_the_old_step():
    from vsim.record.step import training_step
    t = training_step("tiny-mlp", 2, "cpu", precision="fp16", optimizer="adam")
    assert t.scaler is not None and t.meta()["grad_scaler"]
    t()  # one scaled step runs
    assert type(t.opt).__name__ == "Adam"
    s = training_step("tiny-mlp", 2, "cpu")
    assert s.scaler is None and type(s.opt).__name__ == "SGD"
    assert s.opt.defaults["momentum"] == 0.9


def test_hf_model_bf16_adamw_recording(tmp_path):
    """A 2-layer GPT-2 from transformers (random weights, no download) recorded in bf16 autocast
    with AdamW on the CPU: meta says so, AdamW's two states are optimizer_state and twice the
    parameters' bytes, autocast's bf16 tensors are there, and the trace validates."""
    pytest.importorskip("transformers", reason="transformers not installed (extra 'hf')")
    trace = record_model("gpt2-tiny", 2, device="cpu", warmup=1, iters=2, timing_iters=1,
                         precision="bf16", optimizer="adamw", seq=16)
    meta = trace.meta
    assert (meta["precision"], meta["optimizer"], meta["autocast"], meta["seq_len"]) == (
        "bf16", "adamw", "bfloat16", 16)
    assert meta["optimizer_config"].startswith("AdamW(")
    assert "--precision bf16 --optimizer adamw" in meta["command"]
    params = sum(t.size_bytes for t in trace.tensors
                 if t.kind == "weight" and not t.name.startswith("buffer"))
    state = [t for t in trace.tensors if t.kind == "optimizer_state"]
    moments = sum(t.size_bytes for t in state if t.name.endswith((".exp_avg", ".exp_avg_sq")))
    assert moments == 2 * params
    # on the CPU Adam's step counters live on the recorded device too (on CUDA: the host)
    assert {t.name.rsplit(".", 1)[1] for t in state} == {"exp_avg", "exp_avg_sq", "step"}
    assert selfcheck.replay_estimate(trace)[1] == trace.measured.peak_allocated_bytes
    path = tmp_path / "gpt2-tiny.vsim.json.gz"
    save_trace(trace, path)
    assert load_trace(path).meta["precision"] == "bf16"  # loading validates the trace
