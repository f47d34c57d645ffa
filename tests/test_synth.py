"""Synthesis on the meta device against real recordings: tiny models recorded on the CPU here
(same tensors to the byte), shipped H100 recordings (same tensors within the CUDA allocator's
block rounding; workspaces modelled), the workspace rule by hand, and `vsim synth`."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vsim.cli import main  # noqa: E402
from vsim.hardware import load_hardware  # noqa: E402
from vsim.record.recorder import record_model  # noqa: E402
from vsim.record.synth import cudnn9_layout_workspace, synthesize  # noqa: E402
from vsim.synthcheck import compare  # noqa: E402
from vsim.trace import load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H100 = load_hardware("h100-sxm")


@pytest.mark.parametrize("model", ["tiny-cnn", "tiny-mlp", "tiny-resnet"])
def test_synthesis_matches_a_cpu_recording_byte_for_byte(model):
    rec = record_model(model, 2, device="cpu", warmup=1, iters=1, timing_iters=1)
    # as the CPU recorder sees memory: exact sizes, no library blocks, the for-loop optimizer
    syn = synthesize(model, 2, H100, workspace="none", block_bytes=1, library_residents=False,
                     foreach=False)
    c = compare(rec, syn)
    a, b = c["recorded"]["bytes_by_kind"], c["synthesized"]["bytes_by_kind"]
    for kind in ("weight", "optimizer_state", "input", "activation"):
        assert a[kind] == b[kind], kind
    assert abs(a["gradient"] - b["gradient"]) <= 16  # the CPU's 0-dim loss gradient blocks
    assert c["recorded"]["count_by_kind"]["activation"] == \
        c["synthesized"]["count_by_kind"]["activation"]
    # the CPU recording keeps view ops (it times CPU spans); a GPU one, like synthesis, drops
    # ops that launch no kernel and allocate nothing
    dropped = set(c["op_names_only_recorded"])
    assert dropped <= {"aten::flatten", "TBackward0", "ViewBackward0", "AddBackward0",
                       "torch::autograd::AccumulateGrad", "aten::t", "aten::view"}
    assert not c["op_names_only_synthesized"]


@pytest.mark.parametrize("name", ["alexnet-b128", "overfeat-b128"])
def test_synthesis_matches_the_shipped_h100_recording(name):
    rec = load_trace(ROOT / "traces" / f"{name}-h100.vsim.json.gz")
    syn = synthesize(rec.meta["model"], rec.meta["batch_size"], H100)
    c = compare(rec, syn)
    assert c["same_op_sequence"]
    for kind in ("weight", "optimizer_state", "input", "activation", "gradient"):
        # the CUDA allocator sometimes leaves a block unsplit (a few hundred KiB more)
        assert abs(c["error"][f"bytes.{kind}"]) < 0.01, kind
    assert abs(c["error"]["bytes.workspace"]) < 0.15  # cuDNN's workspaces, modelled
    assert abs(c["error"]["peak"]) < 0.01
    assert abs(c["error"]["peak_without_workspace"]) < 0.01


def test_cudnn9_workspace_rule_by_hand():
    # 3x3 conv, N=2, 64 -> 64 channels, 8x8, fp32: X = Y = 2*64*64*4 = 32768 B, W = 64*64*9*4
    info = {"phase": "fwd", "input": [2, 64, 8, 8], "weight": [64, 64, 3, 3],
            "output": [2, 64, 8, 8], "stride": [1, 1]}
    assert cudnn9_layout_workspace(info, 4) == 32768 + 147456 + 32768
    # a 1x1 stride-1 convolution runs as a GEMM: no workspace
    assert cudnn9_layout_workspace({**info, "weight": [64, 64, 1, 1]}, 4) == 0
    # the first layer (3 input channels) at stride 1: plain fp32 kernels, none either
    first = {**info, "input": [2, 3, 8, 8], "weight": [64, 3, 3, 3]}
    assert cudnn9_layout_workspace(first, 4) == 0
    # backward with the input's gradient: dY + W + dX
    assert cudnn9_layout_workspace({**info, "phase": "bwd", "needs_input_grad": True}, 4) == \
        32768 + 147456 + 32768


def test_transformer_takes_the_cuda_kernels():
    syn = synthesize("tiny-transformer", 2, H100)
    names = {o.name for o in syn.ops}
    assert "aten::_scaled_dot_product_efficient_attention" in names
    assert "ScaledDotProductEfficientAttentionBackward0" in names
    assert "NativeDropoutBackward0" in names and "MulBackward0" not in names


def test_synth_command_writes_a_trace_that_runs_elsewhere(tmp_path, capsys):
    out = tmp_path / "cnn.vsim.json.gz"
    assert main(["synth", "tiny-cnn", "--batch", "4", "--hw", "h100-sxm", "-o", str(out)]) == 0
    trace = load_trace(out)
    assert trace.meta["source"] == "synthetic" and trace.meta["hardware"] == "h100-sxm"
    assert all(o.dur_us > 0 for o in trace.ops if o.attr("launches"))
    conv = next(o for o in trace.ops if o.name == "aten::conv2d")
    assert conv.attr("memory_algo") == "model" and conv.attr("out_channels") == 8
    capsys.readouterr()
    assert main(["run", str(out), "--hw", "titan-x-maxwell", "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    assert report["retargeted_from"] == "synthetic (h100-sxm)"
    assert main(["synth", "no-such-net", "--batch", "4", "--hw", "h100-sxm", "-o",
                 str(tmp_path / "x.gz")]) == 2


def test_synth_bf16_adamw_bytes_by_hand():
    """tiny-mlp (64-128-128-10, batch 4) synthesized in bf16 autocast with AdamW, exact sizes:
    weights fp32, AdamW's two states per parameter, and the linear layers' bf16 casts (weights
    and activations at 2 bytes); op times at the fp16 tensor-core rate for the GEMMs."""
    kw = {"block_bytes": 1, "library_residents": False}
    f32 = synthesize("tiny-mlp", 4, H100, precision="fp32", optimizer="adamw", **kw)
    b16 = synthesize("tiny-mlp", 4, H100, precision="bf16", optimizer="adamw", **kw)
    sgd = synthesize("tiny-mlp", 4, H100, **kw)
    params = 4 * (64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10)

    def kind(t, k):
        return sum(x.size_bytes for x in t.tensors if x.kind == k)
    for t in (f32, b16):
        assert kind(t, "weight") == params
        assert sum(x.size_bytes for x in t.tensors if x.kind == "optimizer_state"
                   and x.name.endswith(("exp_avg", "exp_avg_sq"))) == 2 * params
    assert kind(sgd, "optimizer_state") == params  # momentum only
    assert (b16.meta["precision"], b16.meta["optimizer"]) == ("bf16", "adamw")
    # the bf16 copies of the three weight matrices and biases exist only under autocast
    casts = [x for x in b16.tensors if x.size_bytes == 2 * 64 * 128]
    assert casts and not [x for x in f32.tensors if x.size_bytes == 2 * 64 * 128]
    from vsim.compute import op_precision
    gemm = [o for o in b16.ops if o.name == "aten::linear"]
    gemm32 = [o for o in f32.ops if o.name == "aten::linear"]
    assert len(gemm) == len(gemm32) == 3
    assert {op_precision(o, b16.meta) for o in gemm} == {"fp16"}
    assert {op_precision(o, f32.meta) for o in gemm32} == {"fp32"}


def test_synth_hf_gpt2_adamw_state_is_twice_the_weights():
    pytest.importorskip("transformers", reason="transformers not installed (extra 'hf')")
    t = synthesize("gpt2-tiny", 2, H100, precision="bf16", optimizer="adamw", seq=16,
                   library_residents=False)
    w = sum(x.size_bytes for x in t.tensors if x.kind == "weight")
    s = sum(x.size_bytes for x in t.tensors if x.kind == "optimizer_state"
            and x.name.endswith(("exp_avg", "exp_avg_sq")))
    assert s == 2 * w and t.meta["seq_len"] == 16
