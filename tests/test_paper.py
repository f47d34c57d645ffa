"""vDNN's baseline semantics worked by hand on a small network, the vDNN-semantics transform, and
the paper check on the shipped synthesized traces (figures without the policy runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import op, tensor, trace

from vsim import paper
from vsim.trace.io import trace_from_json, trace_to_json
from vsim.trace.schema import Tensor

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _net(fork: bool = False):
    # input 10 MiB -> conv (Y 40) -> relu_ in place -> maxpool (Y 10, indices 20) -> fc (Y 1)
    # weights 3 + 5 MiB; backward: relu's dX replaces its dY; SGD momentum for both weights.
    tensors = [tensor(0, 10 * MiB, "input"), tensor(1, 3 * MiB, "weight"),
               tensor(2, 5 * MiB, "weight"), tensor(3, 40 * MiB, "activation", producer=0),
               tensor(4, 10 * MiB, "activation", producer=2),
               tensor(5, 20 * MiB, "activation", producer=2),
               tensor(6, 1 * MiB, "activation", producer=3),
               tensor(7, 1 * MiB, "gradient", producer=4), tensor(8, 40 * MiB, "gradient",
                                                                producer=5),
               tensor(9, 40 * MiB, "gradient", producer=6),
               tensor(10, 3 * MiB, "optimizer_state"),
               Tensor(11, 3 * MiB, "gradient", "grad conv.weight", producer=7)]
    ops = [op(0, 0, 1, layer="conv", layer_type="conv", reads=(0, 1), writes=(3,)),
           op(1, 1, 1, layer="relu", layer_type="relu", reads=(3,)),
           op(2, 2, 1, layer="pool", layer_type="pool", reads=(3,), writes=(4, 5)),
           op(3, 3, 1, layer="fc", layer_type="fc", reads=(4, 2) + ((0,) if fork else ()),
              writes=(6,)),
           op(4, 4, 1, layer="fc", layer_type="fc", phase="bwd", reads=(6, 2), writes=(7,),
              frees=(6,)),
           op(5, 5, 1, layer="pool", layer_type="pool", phase="bwd", reads=(7, 5, 3),
              writes=(8,), frees=(7, 5, 4)),
           op(6, 6, 1, layer="relu", layer_type="relu", phase="bwd", reads=(8, 3),
              writes=(9,), frees=(8,)),
           op(7, 7, 1, layer="conv", layer_type="conv", phase="bwd", reads=(9, 0, 1),
              writes=(11,), frees=(9, 3))]
    return trace(ops, tensors)


def test_vdnn_baseline_by_hand():
    b = paper.vdnn_baseline(_net())
    assert b["weights"] == 8 * MiB
    # input 10 + conv 40 + pool 10 (not its 20 MiB of indices) + fc 1; ReLU in place adds none
    assert b["feature_maps"] == 61 * MiB
    # a chain: two dY/dX buffers of the largest map (40 MiB)
    assert b["gradient_buffers"] == 2 and b["gradient_maps"] == 80 * MiB
    assert b["workspace"] == 0 and b["total"] == 149 * MiB
    # the input also feeding the fc layer is a fork: three buffers
    assert paper.vdnn_baseline(_net(fork=True))["gradient_maps"] == 120 * MiB


def test_vdnn_semantics_transform():
    t = paper.vdnn_semantics(_net())
    size = {x.id: x.size_bytes for x in t.tensors}
    assert size[10] == 0 and size[11] == 0      # momentum and weight gradients
    assert size[5] == 0                          # pooling indices
    assert size[9] == 0 and size[8] == 40 * MiB  # ReLU's dX reuses its dY...
    ops = {o.id: o for o in t.ops}
    assert 8 not in ops[6].frees and 8 in ops[7].frees  # ...which lives until dX's last use
    trace_from_json(trace_to_json(t), "vdnn semantics")


def test_layer_times_group_relu_with_its_layer():
    rows = paper.layer_times(_net())
    assert [r["layer"] for r in rows] == ["CONV1", "FC1"]
    assert rows[0]["fwd_us"] == 2.0 and rows[0]["bwd_us"] == 2.0   # conv + relu each way


def test_paper_figures_on_the_shipped_traces():
    r = paper.check(ROOT / "validation" / "paper" / "vdnn-titanx.yaml", policies=False)
    fig1 = {row["network"]: row for row in r["fig1"]}
    for net in ("vgg16-b64", "vgg16-b128", "vgg16-b256", "googlenet-b128"):
        p, f = fig1[net]["predicted"], fig1[net]["paper_mib"]
        assert p["feature_maps"] / MiB == pytest.approx(f["feature_maps"], rel=0.01)
        assert p["gradient_maps"] / MiB == pytest.approx(f["gradient_maps"], rel=0.01)
    # with Fig. 4's workspace in place of the modelled one, every total is within 2%
    assert all(abs(row["error_with_fig4_workspace"]) < 0.02 for row in r["fig1"])
    assert r["fig6"]["rows_matched"] == 19 and abs(r["fig6"]["error"]) <= 0.15


def test_seed_files_print_every_figure_with_a_cause_for_each_miss():
    for name in ("superneurons-k40", "layrub-k40m", "vdnnpp-titanx", "accudnn"):
        r = paper.check(ROOT / "validation" / "paper" / f"{name}.yaml")
        assert r["figures"], name
        for f in r["figures"]:
            assert f["ok"] or f["cause"], (name, f["id"])
            if f["predicted"] is None:
                assert not f["ok"]
    # an unmeasured compression ratio is a miss that says where it must be measured
    r = paper.check(ROOT / "validation" / "paper" / "vdnnpp-titanx.yaml")
    comp = [f for f in r["figures"] if "compression" in f["id"]][0]
    assert not comp["ok"] and "compression_ratio" in comp["cause"]


def test_vdnn_order_replay_peaks_at_the_first_group():
    from vsim.hardware import load_hardware
    from vsim.paper.vdnn_order import replay

    hw = load_hardware("titan-x-maxwell")
    t = paper.vdnn._trace(ROOT / "validation" / "paper", "vgg16-b128", hw)
    r = replay(t, 2**50, "all", True)
    assert r is not None and r["fits"]
    # three 64x224x224 maps of batch 128 (1568 MiB each) live at once, plus the weights
    assert r["peak_bytes"] > 3 * 1568 * MiB
    assert paper.vdnn.forks(t) is False


def test_a_miss_prints_the_files_cause_beside_the_runs_note(tmp_path):
    # a figure whose run does not fit: the out-of-memory note and the file's cause both print
    import shutil

    import yaml

    folder = tmp_path / "paper"
    (folder / "traces").mkdir(parents=True)
    shutil.copy(ROOT / "validation" / "paper" / "traces" / "vgg16-b256.vsim.json.gz",
                folder / "traces")
    doc = {"kind": "paper", "title": "t", "hardware": "titan-x-maxwell",
           "tolerance": {"memory": "10%", "time": "15%"},
           "figures": [{"id": "f", "metric": "peak_mib", "network": "vgg16-b256",
                        "policy": "none", "allocator": "exact", "kind": "memory",
                        "published": 1000.0, "cause": "the analysed cause"}]}
    path = folder / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    f = paper.check(path)["figures"][0]
    assert not f["ok"] and "out of memory" in f["cause"] and "the analysed cause" in f["cause"]


def test_vdnn_order_frees_a_relu_layers_y_before_the_dx_below():
    # ReLU is a layer of its own in vDNN: its Y (the CONV's) goes before the CONV's dX is
    # allocated, so conv1_2's backward holds three maps of 64x224x224; the re-implementation's
    # fused CONV+ReLU keeps Y through the CONV's backward: four
    from vsim.hardware import load_hardware
    from vsim.paper.vdnn_order import replay

    hw = load_hardware("titan-x-maxwell")
    t = paper.vdnn._trace(ROOT / "validation" / "paper", "vgg16-b128", hw)
    sep, fused = replay(t, 2**50, "all", True), replay(t, 2**50, "all", True, fused_relu=True)
    assert sep is not None and fused is not None
    assert fused["peak_bytes"] > 4 * 1568 * MiB > sep["peak_bytes"]


def _lrn_net():
    # conv (X 100 B) -> LRN as a two-op chain (intermediate I 100, Y 100) -> pool (P 25);
    # backward: loss dP 25, pool dY 100, the LRN chain dI 100 then dX 100, conv.
    tensors = [tensor(0, 100, producer=0), tensor(1, 100, producer=1),
               tensor(2, 100, producer=2), tensor(3, 25, producer=3),
               tensor(4, 25, "gradient", producer=4), tensor(5, 100, "gradient", producer=5),
               tensor(6, 100, "gradient", producer=6), tensor(7, 100, "gradient", producer=7)]
    ops = [op(0, 0, 1, layer="c", layer_type="conv", writes=(0,)),
           op(1, 1, 2, layer="n", layer_type="lrn", reads=(0,), writes=(1,)),
           op(2, 3, 3, layer="n", layer_type="lrn", reads=(1, 0), writes=(2,)),
           op(3, 6, 1, layer="p", layer_type="pool", reads=(2,), writes=(3,)),
           op(4, 7, 1, layer="loss", layer_type="loss", phase="bwd", reads=(3,), writes=(4,),
              frees=(3,)),
           op(5, 8, 1, layer="p", layer_type="pool", phase="bwd", reads=(2, 4), writes=(5,),
              frees=(4, 2)),
           op(6, 9, 4, layer="n", layer_type="lrn", phase="bwd", reads=(1, 5), writes=(6,),
              frees=(5, 1)),
           op(7, 13, 5, layer="n", layer_type="lrn", phase="bwd", reads=(0, 6), writes=(7,),
              frees=(6,)),
           op(8, 18, 1, layer="c", layer_type="conv", phase="bwd", reads=(7,), frees=(7, 0))]
    return trace(ops, tensors)


def test_collapse_lrn_by_hand():
    from vsim.allocator import make_allocator
    from vsim.engine import simulate
    from vsim.hardware import load_hardware
    from vsim.paper.superneurons import collapse_lrn
    from vsim.policies import make_policy

    before, after = _lrn_net(), collapse_lrn(_lrn_net())
    # the chain's intermediate (I) and its gradient (dI) are gone: 650 B of tensors -> 450 B
    assert sum(t.size_bytes for t in before.tensors) == 650
    assert sum(t.size_bytes for t in after.tensors) == 450
    lrn = [o for o in after.ops if o.layer == "n"]
    assert [(o.phase, o.reads, o.writes, o.dur_us) for o in lrn] == [
        ("fwd", (0,), (2,), 5.0), ("bwd", (0, 2, 5), (7,), 9.0)]
    # Y is read by the LRN's backward now, so it is freed there, not at the pool's backward
    assert 2 in lrn[1].frees and 5 in lrn[1].frees
    assert all(2 not in o.frees for o in after.ops if o.layer == "p")
    trace_from_json(trace_to_json(after), "collapsed lrn")
    # peaks by hand: before, X I Y dY and dP at the pool's backward (425 B); after, X Y dY dX
    # at the LRN's backward (400 B)
    hw = load_hardware("k40")
    peaks = [simulate(t, hw, make_policy("none"), make_allocator("exact"))
             .report["peak_allocated_bytes"] for t in (before, after)]
    assert peaks == [425, 400]


def test_superneurons_fig10_accounting():
    # SuperNeurons' AlexNet(200) in its semantics holds its 36 DATA tensors (Fig. 10: 23 layer
    # outputs, 13 backward b_data), plus the trace's loss tensors (log-softmax and gradients)
    from vsim.paper.superneurons import superneurons_semantics
    from vsim.trace import load_trace

    t = superneurons_semantics(load_trace(ROOT / "validation" / "paper" / "traces"
                                          / "alexnet-caffe-b200.vsim.json.gz"))
    sized = [x for x in t.tensors if x.size_bytes >= 2**20]   # the loss's are under 1 MiB
    assert len(sized) == 36 - 2  # fc8's output and softmax's are 0.76 MiB each
    assert not [o for o in t.ops if o.layer_type == "lrn" and o.name.startswith("aten")]
