"""The compute model: op classes, the additive roofline worked by hand, channel inference, the
efficiency files, and a fit that recovers known efficiencies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from builders import op, tensor, trace

from vsim import compute, compute_fit
from vsim.compute import ClassEfficiency, Efficiencies, OpCost
from vsim.errors import HardwareError
from vsim.hardware import load_hardware
from vsim.trace.schema import Kernel

ROOT = Path(__file__).resolve().parent.parent


def _eff(**classes: ClassEfficiency) -> Efficiencies:
    base = {"elementwise": ClassEfficiency(1.0, 0.5, 2.0)}
    return Efficiencies(name="t", classes={**base, **classes}, implicit_gemm=0.5)


def test_op_classes():
    cases = [
        (op(0, 0, 1, layer_type="conv", name="aten::conv2d"), "conv_fwd"),
        (op(1, 0, 1, layer_type="conv", phase="bwd", name="ConvolutionBackward0"), "conv_bwd"),
        (op(2, 0, 1, layer_type="conv", phase="bwd", name="torch::autograd::AccumulateGrad"),
         "elementwise"),
        (op(3, 0, 1, layer_type="fc", name="aten::linear"), "gemm"),
        (op(4, 0, 1, layer_type="other", phase="bwd", name="MmBackward0"), "gemm"),
        (op(5, 0, 1, layer_type="bn", name="aten::batch_norm"), "norm"),
        (op(6, 0, 1, layer_type="pool", name="aten::max_pool2d"), "pool"),
        (op(7, 0, 1, layer_type="optimizer", phase="opt", name="aten::_foreach_add_"),
         "optimizer"),
        (op(8, 0, 1, layer_type="relu", name="aten::relu_"), "elementwise"),
        (op(9, 0, 1, layer_type="attention", name="aten::scaled_dot_product_attention"),
         "attention"),
    ]
    for o, cls in cases:
        assert compute.op_class(o) == cls, o.name


def test_precision_follows_the_tf32_flags():
    conv = op(0, 0, 1, layer_type="conv", name="aten::conv2d")
    fc = op(1, 0, 1, layer_type="fc", name="aten::linear")
    meta = {"dtype": "float32", "tf32": {"cudnn": True, "matmul": False}}
    assert compute.op_precision(conv, meta) == "tf32"
    assert compute.op_precision(fc, meta) == "fp32"
    assert compute.op_precision(conv, {"dtype": "float32"}) == "fp32"
    assert compute.op_precision(fc, {"dtype": "bfloat16"}) == "fp16"
    # a GPU without a tf32 rate runs TF32-allowed ops at its fp32 peak
    titan = load_hardware("titan-x-maxwell")
    assert compute.peak_for(titan, "tf32") == titan.peak_flops_per_us["fp32"] == 7e6


def test_busy_time_is_the_additive_roofline_by_hand():
    hw = load_hardware("h100-sxm")  # fp32 67 TFLOP/s = 67e6 flop/us, DRAM 3.35 TB/s = 3.35e6 B/us
    eff = _eff(gemm=ClassEfficiency(compute=0.5, dram=0.8, overhead_us=3.0))
    cost = OpCost("gemm", flops=67e9, bytes=2.68e9, precision="fp32")
    # 3 us + 67e9 / (67e6 x 0.5) + 2.68e9 / (3.35e6 x 0.8) = 3 + 2000 + 1000 us
    assert compute.busy_time_us(cost, hw, eff) == pytest.approx(3003.0)
    # no work, no time
    assert compute.busy_time_us(OpCost("gemm", 0, 0, "fp32"), hw, eff) == 0.0
    # an unknown class falls back to elementwise: 2 us + 3.35e6 B / (3.35e6 x 0.5) = 4 us
    assert compute.busy_time_us(OpCost("pool", 0, 3.35e6, "fp32"), hw, eff) == pytest.approx(4)


def test_channel_ramp_and_memory_optimal_algorithm():
    hw = load_hardware("titan-x-maxwell")  # 7 TFLOP/s fp32 = 7e6 flop/us, 336 GB/s
    e = ClassEfficiency(compute=0.8, dram=1.0, overhead_us=0.0, ramp_channels=256, ramp_power=1)
    eff = dataclasses.replace(_eff(conv_fwd=e), implicit_gemm=0.4)
    # 64 channels: 0.8 x (64/256) = 0.2 of the peak; 7e9 flops -> 7e9 / (7e6 x 0.2) = 5000 us
    cost = OpCost("conv_fwd", 7e9, 0.0, "fp32", channels=64)
    assert compute.busy_time_us(cost, hw, eff) == pytest.approx(5000)
    # at 512 channels the ramp is saturated: 7e9 / (7e6 x 0.8) = 1250 us
    wide = dataclasses.replace(cost, channels=512)
    assert compute.busy_time_us(wide, hw, eff) == pytest.approx(1250)
    # (m): implicit GEMM at 40% of fp32 with the same ramp: 7e9 / (7e6 x 0.4 x 0.25) = 10000 us
    assert compute.memory_algo_time_us(cost, hw, eff, 5000) == pytest.approx(10000)
    # never faster than the performance-optimal time it replaces
    assert compute.memory_algo_time_us(cost, hw, eff, 20000) == pytest.approx(20000)


def test_conv_channels_from_weight_and_output_sizes():
    # N=2, C=3, K=8, 3x3, 16x16 -> 16x16: W = 8*3*9*4 B, Y = 2*8*256*4 B,
    # flops = 2 N K C R S P Q = 2*2*8*3*9*256 = 221184; K = 2 w y / flops = 2*216*4096/221184 = 8
    w, x, y = tensor(0, 8 * 3 * 9 * 4, "weight"), tensor(1, 2 * 3 * 256 * 4, "input"), \
        tensor(2, 2 * 8 * 256 * 4, "activation", producer=0)
    fwd = op(0, 0, 10, layer="conv1", layer_type="conv", name="aten::conv2d", reads=(0, 1),
             writes=(2,), flops=221184.0)
    bwd = op(1, 10, 20, layer="conv1", layer_type="conv", phase="bwd",
             name="ConvolutionBackward0", reads=(0, 1, 2), flops=442368.0)
    costs = compute.op_costs(trace([fwd, bwd], [w, x, y], dtype="float32"))
    assert costs[0].channels == 8 and costs[1].channels == 8   # backward takes its layer's K
    # no dram_bytes recorded: the bytes of the tensors the op reads and writes
    assert costs[0].bytes == w.size_bytes + x.size_bytes + y.size_bytes


def test_fit_recovers_known_efficiencies():
    hw = load_hardware("h100-sxm")
    truth = ClassEfficiency(compute=0.4, dram=0.5, overhead_us=4.0)
    eff = _eff(gemm=truth)
    ops, tensors = [], []
    for i in range(12):   # small GEMMs (the overhead shows), compute- to memory-bound
        cost = OpCost("gemm", 1e7 * (i + 1) ** 2, 5e5 * (12 - i), "fp32")
        busy = compute.busy_time_us(cost, hw, eff)
        ops.append(op(i, i * 1000.0, busy, layer_type="fc", name="aten::linear",
                      flops=cost.flops, dram_bytes=cost.bytes,
                      kernels=(Kernel("gemm", 0, i * 1000.0, busy),)))
    t = trace(ops, tensors, dtype="float32", tf32={"cudnn": False, "matmul": False})
    fitted, report = compute_fit.fit([("synthetic", t)], hw)
    got = fitted.classes["gemm"]
    assert got.overhead_us == pytest.approx(4.0, abs=0.1)
    assert got.compute == pytest.approx(0.4, rel=0.02) and got.dram == pytest.approx(0.5, rel=0.02)
    assert report["traces"]["synthetic"]["error"] in ("+0.0%", "-0.0%")


def test_shipped_h100_efficiencies_load_with_provenance():
    eff = compute.load_efficiencies(load_hardware("h100-sxm"))
    assert set(compute.CLASSES) <= set(eff.classes)
    assert eff.provenance["source"] and eff.provenance["method"]
    # a profile without a fit of its own uses the default one and says so
    other = compute.load_efficiencies(load_hardware("a100-40gb"))
    assert "a100-40gb" in other.provenance["used_for"]


def test_profile_efficiency_entries_override_the_fit():
    hw = load_hardware("h100-sxm")
    hw = dataclasses.replace(hw, op_efficiency={"conv_fwd": 0.25, "pool_dram": 0.75,
                                                "implicit_gemm": 0.1})
    eff = compute.load_efficiencies(hw)
    assert eff.classes["conv_fwd"].compute == 0.25 and eff.classes["pool"].dram == 0.75
    assert eff.implicit_gemm == 0.1
    bad = dataclasses.replace(hw, op_efficiency={"convolution": 0.5})
    with pytest.raises(HardwareError, match="unknown op class"):
        compute.load_efficiencies(bad)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["classes"]["gemm"].update(compute=0.5), "percentage"),
    (lambda d: d["classes"]["gemm"].update(overhead=3), "without a unit|with a unit"),
    (lambda d: d["classes"].update(convolution={"dram": "50%"}), "unknown op class"),
    (lambda d: d["provenance"].pop("method"), "provenance"),
])
def test_bad_efficiency_files_name_the_key(tmp_path, edit, message):
    doc = yaml.safe_load((ROOT / "hardware" / "efficiency" / "h100-sxm.yaml").read_text())
    edit(doc)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(HardwareError, match=message):
        compute.read_efficiencies(path)


def test_memory_optimal_times_come_from_the_model_when_the_gpu_is_known():
    from vsim.workspace_free import MEMORY_ALGO_SLOWDOWN, memory_optimal_retimes
    h100 = load_hardware("h100-sxm")
    conv = op(0, 0.0, 100.0, layer_type="conv", name="aten::conv2d", flops=0.0)
    # no GPU named: the flat estimate
    retimes, notes = memory_optimal_retimes(trace([conv], []), h100)
    assert retimes[0].dur_us == 100.0 * MEMORY_ALGO_SLOWDOWN and "estimated" in notes[0]
    # on the H100 profile, an fp32 convolution without flops is taken as compute-bound: (p)
    # at the fitted conv_fwd fraction of the fp32 peak, (m) at implicit_gemm's
    eff = compute.load_efficiencies(load_hardware("h100-sxm"))
    retimes, notes = memory_optimal_retimes(trace([conv], [], hardware="h100-sxm"), h100)
    ratio = eff.classes["conv_fwd"].compute / eff.implicit_gemm
    assert retimes[0].dur_us == pytest.approx(100.0 * max(1.0, ratio))
    assert retimes[0].workspace_bytes == 0 and "modelled" in notes[0]
    # a time already in the trace (recorded, or written by retargeting) wins
    timed = dataclasses.replace(conv, attrs=(("dur_us_memory_algo", 250.0),))
    assert memory_optimal_retimes(trace([timed], [], hardware="h100-sxm"), h100)[0][0].dur_us \
        == 250.0
