"""Retargeting op times to another GPU (worked by hand on a two-op trace), hypothetical GPUs from
--set overrides, and `vsim run` on a trace recorded on another GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import op, trace

from vsim import retarget
from vsim.cli import main
from vsim.compute import ClassEfficiency, Efficiencies
from vsim.errors import ConfigError, HardwareError
from vsim.hardware import load_hardware
from vsim.trace.io import trace_from_json, trace_to_json
from vsim.trace.schema import Kernel, Measured

ROOT = Path(__file__).resolve().parent.parent
VGG = str(ROOT / "traces" / "vgg16-b64-h100.vsim.json.gz")

# No overheads, so every op's time is proportional to its work.
EFF = Efficiencies(name="t", implicit_gemm=0.25, classes={
    "gemm": ClassEfficiency(compute=0.5, dram=1.0, overhead_us=0.0),
    "elementwise": ClassEfficiency(compute=1.0, dram=0.5, overhead_us=0.0)})


def _two_ops():
    # op0: a GEMM, compute only, 1000 us busy; op1: elementwise, 90 us after op0, spanning
    # 500 us of which 400 us are its two kernels (100 us idle between them).
    gemm = op(0, 10.0, 1000.0, layer_type="fc", name="aten::linear", flops=1e9,
              kernels=(Kernel("sgemm", 7, 10.0, 1000.0),))
    relu = op(1, 1100.0, 500.0, layer_type="relu", name="aten::relu_", dram_bytes=1e8,
              kernels=(Kernel("a", 7, 1100.0, 200.0), Kernel("b", 7, 1400.0, 200.0)))
    t = trace([gemm, relu], [], device="GPU A", hardware="h100-sxm", dtype="float32")
    return t.__class__(**{**t.__dict__, "measured": Measured(1600.0, 0, 0)})


def test_twice_the_flops_halves_compute_bound_ops_and_keeps_gaps():
    src = load_hardware("h100-sxm")
    fast = retarget.hardware_with_overrides("h100-sxm", ["compute.peak.fp32=134TFLOP/s"])
    out = retarget.retarget(_two_ops(), fast, source=src, eff=EFF, source_eff=EFF)
    gemm, relu = out.ops
    # op0: 1000 us x (67 / 134) = 500 us, still starting at 10 us
    assert (gemm.start_us, gemm.dur_us) == (10.0, 500.0)
    assert gemm.kernels[0].dur_us == 500.0
    # op1: memory-bound, unchanged; its 90 us launch gap kept: 10 + 500 + 90 = 600
    assert (relu.start_us, relu.dur_us) == (600.0, 500.0)


def test_twice_the_dram_bandwidth_speeds_memory_bound_kernels_not_idle_time():
    src = load_hardware("h100-sxm")
    wide = retarget.hardware_with_overrides("h100-sxm", ["compute.dram_bandwidth=6.7TB/s"])
    out = retarget.retarget(_two_ops(), wide, source=src, eff=EFF, source_eff=EFF)
    gemm, relu = out.ops
    assert gemm.dur_us == 1000.0
    # op1: 400 us of kernels -> 200 us, plus its 100 us idle: 300 us, starting 1010 + 90
    assert (relu.start_us, relu.dur_us) == (1100.0, 300.0)
    # kernels keep their order and scale: offsets 0 and 300 -> 0 and 150 us, 200 -> 100 us
    assert [(k.start_us, k.dur_us) for k in relu.kernels] == [(1100.0, 100.0), (1250.0, 100.0)]


def test_retargeted_trace_says_where_it_comes_from_and_drops_the_measurement():
    src = load_hardware("h100-sxm")
    out = retarget.retarget(_two_ops(), load_hardware("h200"), source=src, eff=EFF,
                            source_eff=EFF)
    assert out.meta["retargeted_from"] == "GPU A (h100-sxm)"
    assert out.meta["hardware"] == "h200" and out.measured is None
    assert out.meta["measured_on_recording"]["iteration_time_us"] == 1600.0
    trace_from_json(trace_to_json(out), "retargeted")  # still a valid trace


def test_when_to_retarget():
    t = _two_ops()
    assert retarget.needs_retarget(t, load_hardware("h100-sxm"))[0] is False
    assert retarget.needs_retarget(t, load_hardware("h200"))[0] is True
    # only the memory changes: the compute model sees the same GPU
    bigger = retarget.hardware_with_overrides("h100-sxm", ["gpu.memory=160GiB"])
    assert retarget.needs_retarget(t, bigger)[0] is False
    anonymous = trace(list(t.ops), [])
    assert retarget.needs_retarget(anonymous, load_hardware("h200"))[0] is False
    with pytest.raises(ConfigError, match="meta.hardware"):
        retarget.retarget(anonymous, load_hardware("h200"))


def test_overrides_are_unit_checked_and_named():
    hw = retarget.hardware_with_overrides("h100-sxm", ["gpu.memory=24GiB",
                                                      "link.h2d.pinned.bandwidth=32GB/s"])
    assert hw.memory_bytes == 24 * 2**30 and hw.h2d.pinned.bandwidth_bytes_per_us == 32e3
    assert hw.name == "h100-sxm+gpu.memory=24GiB,link.h2d.pinned.bandwidth=32GB/s"
    base = load_hardware("h100-sxm")
    # link.bandwidth: both directions' pinned rate; pageable and duplex scale in proportion
    slow = retarget.hardware_with_overrides("h100-sxm", ["link.bandwidth=16GB/s"])
    assert slow.h2d.pinned.bandwidth_bytes_per_us == pytest.approx(16e3)
    ratio = 16e3 / base.h2d.pinned.bandwidth_bytes_per_us
    assert slow.h2d.pageable.bandwidth_bytes_per_us == pytest.approx(
        base.h2d.pageable.bandwidth_bytes_per_us * ratio, rel=1e-5)
    base_sum = base.h2d.pinned.bandwidth_bytes_per_us + base.d2h.pinned.bandwidth_bytes_per_us
    assert slow.duplex_bytes_per_us == pytest.approx(base.duplex_bytes_per_us * 32e3 / base_sum,
                                                     rel=1e-5)
    with pytest.raises(ConfigError, match="unknown key.*gpu.memory"):
        retarget.hardware_with_overrides("h100-sxm", ["gpu.memroy=1GiB"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        retarget.hardware_with_overrides("h100-sxm", ["gpu.memory"])
    with pytest.raises(HardwareError, match="gpu.memory.*without a unit"):
        retarget.hardware_with_overrides("h100-sxm", ["gpu.memory=24"])


def test_run_retargets_a_trace_from_another_gpu(capsys):
    assert main(["run", VGG, "--hw", "h200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["retargeted_from"] == "NVIDIA H100 80GB HBM3 (h100-sxm)"
    assert report["measured"] is None  # the H100's measurement is not the H200's
    assert main(["run", VGG, "--hw", "h200", "--json", "--no-retarget"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["retargeted_from"] is None
    assert report["iteration_time_us"] < kept["iteration_time_us"]  # more DRAM bandwidth


def test_convolutions_get_a_memory_optimal_time_on_the_new_gpu():
    """Measured workspace-free times (the shipped H100 traces have them) are carried over,
    scaled as the model scales them; without them the model gives one."""
    import dataclasses

    from vsim.trace import load_trace
    trace = load_trace(VGG)
    names = ("aten::conv2d", "ConvolutionBackward0")
    assert all(o.attr("memory_algo") == "measured" for o in trace.ops if o.name in names)
    out = retarget.retarget(trace, load_hardware("titan-x-maxwell"))
    convs = [o for o in out.ops if o.name in names]
    assert convs and all(o.attr("memory_algo") == "recorded, retargeted" for o in convs)
    bare = dataclasses.replace(trace, ops=tuple(
        dataclasses.replace(o, attrs=tuple(kv for kv in o.attrs if "memory_algo" not in kv[0]))
        for o in trace.ops))
    out = retarget.retarget(bare, load_hardware("titan-x-maxwell"))
    convs = [o for o in out.ops if o.name in names]
    assert convs and all(o.attr("memory_algo") == "model" for o in convs)
    assert all(o.attr("dur_us_memory_algo") >= o.dur_us for o in convs)


def test_validate_and_sweep_retarget_too():
    from vsim.sweep import Config, run_config
    from vsim.validate import load_cases, run_case
    case = next(c for c in load_cases([str(ROOT / "validation" / "cross-gpu")])
                if c.id == "vgg16-b64-h100-on-h200")
    row = run_case(case)
    # the H100 recording lasted 53.46 ms; on the H200 the model takes some DRAM time off
    assert row["predicted"]["iteration_time_us"] < 53460
    cfg = Config(trace=VGG, hw="h200", memory_bytes=None, policy="none", allocator="exact")
    assert run_config(cfg)["report"]["retargeted_from"] == "NVIDIA H100 80GB HBM3 (h100-sxm)"


def test_unknown_or_overridden_recording_profiles():
    t = _two_ops()
    odd = t.__class__(**{**t.__dict__, "meta": {**t.meta, "hardware": "no-such-gpu"}})
    assert retarget.needs_retarget(odd, load_hardware("h200"))[0] is False
    set_name = t.__class__(**{**t.__dict__, "meta": {**t.meta,
                                                     "hardware": "h100-sxm+gpu.memory=24GiB"}})
    assert retarget.recording_hardware(set_name).name == "h100-sxm"
