"""Importers of PyTorch captures (vsim.trace.importers): hand-made Chrome traces and snapshot
pickles whose answers are worked out in the comments, plus captures made by torch itself when it
is installed."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest

from vsim.errors import TraceError
from vsim.trace import load_trace, save_trace
from vsim.trace.importers import (
    AllocDraft,
    OpDraft,
    build_trace,
    import_kineto,
    import_torch_snapshot,
    op_layer_type,
    parse_chrome,
    stream_map,
)

DATA = Path(__file__).parent / "data"


def _x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def _mem(ts, addr, nbytes, total, tid=1, device_type=1):
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1,
            "tid": tid, "ts": ts, "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": total,
                                          "Total Reserved": 1 << 30, "Device Type": device_type,
                                          "Device Id": 0}}


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
            "dur": dur, "args": {"correlation": corr, "stream": stream, "device": 0}}


def _launch(ts, corr, tid=1):
    return _x("cudaLaunchKernel", ts, 2, tid=tid, cat="cuda_runtime", correlation=corr)


def small_capture() -> dict:
    """One training step on a GPU, as torch.profiler would export it (times in us):

    ProfilerStep#3 [1000, 1200]
      aten::conv2d [1010, 1030] seq 5 -> kernel k1 [1040, 1060] on stream 7
          allocates A (0x100, 4096 B) and, inside, a workspace W (0x900, 512 B) freed in it
      aten::relu_  [1032, 1036] seq 6 -> kernel k2 [1062, 1064]
      evaluate_function: ReluBackward0 [1070, 1080] seq 6, thread 2 -> kernel k3 [1090, 1095]
          allocates G (0x200, 4096 B)
      evaluate_function: ConvolutionBackward0 [1082, 1100] seq 5, thread 2 -> k4 on stream 9
          frees A and a block B (0x300, 1024 B) allocated before the capture
      Optimizer.step#SGD.step [1110, 1130] holds aten::_foreach_add_ [1112, 1120] -> k5
    Total Allocated before the first event: 10000 B, so 10000 - 1024 = 8976 B are resident
    and never freed in the capture (one unidentified resident tensor), plus B.
    """
    ev = [
        _x("ProfilerStep#3", 1000, 200, cat="user_annotation"),
        _x("aten::conv2d", 1010, 20, **{"Sequence number": 5}),
        _x("aten::convolution", 1011, 18, **{"Sequence number": 5}),
        _mem(1012, 0x100, 4096, 14096),
        _mem(1013, 0x900, 512, 14608),
        _mem(1020, 0x900, -512, 14096),
        _launch(1025, 1),
        _x("aten::relu_", 1032, 4, **{"Sequence number": 6}),
        _launch(1033, 2),
        _x(BWD + "ReluBackward0", 1070, 10, tid=2, **{"Sequence number": 6}),
        _mem(1071, 0x200, 4096, 18192, tid=2),
        _launch(1072, 3, tid=2),
        _x(BWD + "ConvolutionBackward0", 1082, 18, tid=2, **{"Sequence number": 5}),
        _launch(1083, 4, tid=2),
        _mem(1099, 0x100, -4096, 14096, tid=2),
        _mem(1099.5, 0x300, -1024, 13072, tid=2),
        _x("Optimizer.step#SGD.step", 1110, 20, cat="user_annotation"),
        _x("aten::_foreach_add_", 1112, 8),
        _launch(1113, 5),
        _kernel("k1", 1040, 20, 1),
        _kernel("k2", 1062, 2, 2),
        _kernel("k3", 1090, 5, 3),
        _kernel("k4", 1096, 4, 4, stream=9),
        _kernel("k5", 1131, 3, 5),
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"name": "Test GPU"}], "traceEvents": ev}


BWD = "autograd::engine::evaluate_function: "


def test_parse_chrome_top_level_ops_kernels_memory() -> None:
    cap = parse_chrome(small_capture())
    names = [op.name for op in cap.ops]
    # aten::convolution is nested in aten::conv2d; cudaLaunchKernel is not a cpu op
    assert names == ["aten::conv2d", "aten::relu_", BWD + "ReluBackward0",
                     BWD + "ConvolutionBackward0", "aten::_foreach_add_"]
    conv, relu, rb, cb, opt = cap.ops
    assert [k.name for k in conv.kernels] == ["k1"] and conv.kernels[0].start_ns == 1_040_000
    assert [k.name for k in cb.kernels] == ["k4"] and cb.kernels[0].stream == 9
    assert [m.delta for m in conv.mem] == [4096, 512, -512]
    assert [m.addr for m in cb.mem] == [0x100, 0x300]
    assert conv.seq == 5 and rb.seq == 6 and opt.kernels[0].name == "k5"
    assert cap.device_name == "Test GPU"


def test_import_kineto_small(tmp_path: Path) -> None:
    path = tmp_path / "cap.json"
    path.write_text(json.dumps(small_capture()))
    t = import_kineto(path)
    ops = t.ops
    # ops with kernels or memory effects, in start order, times from ProfilerStep#3's start
    assert [op.name for op in ops] == ["aten::conv2d", "aten::relu_", "ReluBackward0",
                                       "ConvolutionBackward0", "aten::_foreach_add_"]
    assert [op.phase for op in ops] == ["fwd", "fwd", "bwd", "bwd", "opt"]
    # backward nodes take the forward op's type through the sequence number
    assert [op.layer_type for op in ops] == ["conv", "relu", "relu", "conv", "optimizer"]
    assert (ops[0].start_us, ops[0].dur_us) == (40.0, 20.0)
    # stream 7 (4 kernels) is compute = 0; stream 9 becomes 3
    assert ops[3].stream == 3 and ops[0].stream == 0
    by_name = {x.name: x for x in t.tensors}
    resident = [x for x in t.tensors if x.producer is None]
    # B (freed, 1024 B) and the unidentified rest of Total Allocated (10000 - 1024)
    assert sorted(x.size_bytes for x in resident) == [1024, 8976]
    assert sum(x.size_bytes for x in resident) == 10000
    # conv2d: A persists (4096 B); W (512 B) was allocated and freed inside it: peak excursion
    # 4608 B, outputs 4096 B -> a 512 B temporary (not 'conv' workspace? conv2d is a conv op)
    conv_ws = [x for x in t.tensors if x.producer == ops[0].id and x.kind == "workspace"]
    assert [x.size_bytes for x in conv_ws] == [512]
    a = next(x for x in t.tensors if x.producer == ops[0].id and x.kind != "workspace")
    assert a.size_bytes == 4096 and a.id in ops[3].frees
    assert by_name  # names exist
    # the file round-trips through the validating loader
    out = tmp_path / "t.vsim.json.gz"
    save_trace(t, out)
    assert load_trace(out).ops == t.ops


def test_import_kineto_refuses_non_traces(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "x", "cat": "kernel",
                                                "ts": 1, "dur": 1}]}))
    with pytest.raises(TraceError, match="bad.json.*no CPU ops"):
        import_kineto(bad)
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="bad.json.*not a Chrome-trace JSON"):
        import_kineto(bad)
    bad.write_text(json.dumps({"traceEvents": {"a": 1}}))
    with pytest.raises(TraceError, match="traceEvents: expected a list"):
        import_kineto(bad)
    bad.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a",
                                                "ts": "x"}]}))
    with pytest.raises(TraceError, match=r"traceEvents\[0\]"):
        import_kineto(bad)


def test_import_kineto_gzip_and_step_choice(tmp_path: Path) -> None:
    doc = small_capture()
    path = tmp_path / "cap.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert len(import_kineto(path, step=3).ops) == 5
    with pytest.raises(TraceError, match="no ProfilerStep#4"):
        import_kineto(path, step=4)


def _snapshot() -> dict:
    """Allocator history (device 0), times in us:
    t=100 alloc X 0x10 512; t=110 segment_alloc 0x1000 2MiB; t=111 alloc Y 0x1000 1024;
    t=120 free_requested R 0x50 256 (allocated before the history: resident);
    t=121 free_completed R; t=130 free_requested X; t=131 free_completed X.
    segments at the end: Y (active) and Z 0x2000 2048 (active, never in the history: resident).
    Ops: alloc X [0, 11), alloc Y [11, ...) which also frees R and X (frees go to the op before)."""
    e = [
        {"action": "alloc", "addr": 0x10, "size": 512, "stream": 0, "time_us": 100},
        {"action": "segment_alloc", "addr": 0x1000, "size": 2 << 20, "stream": 0,
         "time_us": 110},
        {"action": "alloc", "addr": 0x1000, "size": 1024, "stream": 0, "time_us": 111,
         "frames": [{"name": "forward", "filename": "model.py", "line": 12}]},
        {"action": "free_requested", "addr": 0x50, "size": 256, "stream": 0, "time_us": 120},
        {"action": "free_completed", "addr": 0x50, "size": 256, "stream": 0, "time_us": 121},
        {"action": "free_requested", "addr": 0x10, "size": 512, "stream": 0, "time_us": 130},
        {"action": "free_completed", "addr": 0x10, "size": 512, "stream": 0, "time_us": 131},
    ]
    segments = [{"device": 0, "address": 0x1000, "total_size": 2 << 20, "stream": 0,
                 "blocks": [{"address": 0x1000, "size": 1024, "state": "active_allocated"},
                            {"address": 0x1400, "size": (2 << 20) - 1024, "state": "inactive"}]},
                {"device": 0, "address": 0x2000, "total_size": 2048, "stream": 0,
                 "blocks": [{"address": 0x2000, "size": 2048, "state": "active_allocated"}]}]
    return {"segments": segments, "device_traces": [e]}


def test_import_torch_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    t = import_torch_snapshot(path)
    assert [op.name for op in t.ops] == ["alloc", "alloc"]
    assert [(op.start_us, op.dur_us) for op in t.ops] == [(0.0, 11.0), (11.0, 0.0)]
    assert t.ops[1].layer == "forward (model.py:12)"
    resident = sorted(x.size_bytes for x in t.tensors if x.producer is None)
    assert resident == [256, 2048]  # R (freed in the history) and Z (live, never allocated)
    x_t = next(x for x in t.tensors if x.producer == 0)
    assert x_t.size_bytes == 512 and x_t.id in t.ops[1].frees
    assert [ev.action for ev in t.mem_events] == [
        "alloc", "segment_alloc", "alloc", "free_requested", "free_completed",
        "free_requested", "free_completed"]
    assert t.mem_events[0].tensor == x_t.id and t.mem_events[-1].tensor == x_t.id
    assert t.mem_events[5].op == 1 and t.mem_events[5].time_us == 30.0
    save_trace(t, tmp_path / "s.vsim.json.gz")
    load_trace(tmp_path / "s.vsim.json.gz")


class Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_import_torch_snapshot_refuses(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}))
    with pytest.raises(TraceError, match="snap.pickle.*refusing to load posix.getcwd|"
                                         "snap.pickle.*refusing to load"):
        import_torch_snapshot(path)
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(TraceError, match="snap.pickle: top level: expected a dict"):
        import_torch_snapshot(path)
    snap = _snapshot()
    snap["device_traces"][0][1]["size"] = -5
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(TraceError, match=r"device_traces\[0\]\[1\]\.size"):
        import_torch_snapshot(path)
    snap = _snapshot()
    snap["device_traces"][0][2]["action"] = "explode"
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(TraceError, match=r"device_traces\[0\]\[2\]\.action: unknown"):
        import_torch_snapshot(path)
    path.write_bytes(b"not a pickle")
    with pytest.raises(TraceError, match="not a torch.cuda.memory._dump_snapshot pickle"):
        import_torch_snapshot(path)
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    with pytest.raises(TraceError, match="no allocator history"):
        import_torch_snapshot(path)


@pytest.mark.parametrize("name,kind", [
    ("aten::conv2d", "conv"), (BWD + "ConvolutionBackward0", "conv"),
    ("aten::cudnn_convolution", "conv"), ("AddmmBackward0", "fc"), ("aten::linear", "fc"),
    ("aten::relu_", "relu"), ("ThresholdBackward0", "relu"), ("aten::max_pool2d", "pool"),
    ("MaxPool2DWithIndicesBackward0", "pool"), ("aten::batch_norm", "bn"),
    ("CudnnBatchNormBackward0", "bn"), ("aten::layer_norm", "layernorm"),
    ("NativeLayerNormBackward0", "layernorm"), ("aten::cat", "concat"), ("CatBackward0", "concat"),
    ("aten::add", "add"), ("AddBackward0", "add"), ("aten::gelu", "gelu"),
    ("aten::scaled_dot_product_attention", "attention"),
    ("ScaledDotProductEfficientAttentionBackward0", "attention"),
    ("aten::embedding", "embedding"), ("aten::dropout", "dropout"),
    ("aten::cross_entropy_loss", "loss"), ("NllLossBackward0", "loss"),
    ("aten::softmax", "softmax"), ("aten::_foreach_add_", "optimizer"), ("aten::view", "other"),
    ("aten::scatter_add", "other"),
])
def test_op_layer_type(name: str, kind: str) -> None:
    assert op_layer_type(name) == kind


def test_stream_map_busiest_is_compute() -> None:
    assert stream_map([7, 7, 9, 7, 13, 9]) == {7: 0, 9: 3, 13: 4}


def test_build_trace_workspace_is_the_peak_excursion() -> None:
    """op0 (conv): alloc A 100, alloc W1 50, free W1, alloc W2 80, free W2 -> running sums
    100, 150, 100, 180, 100: excursion E = 180; outputs P = 100 -> one workspace of 80 B.
    op1 (relu): reads A, no memory: dropped (no kernels). op2: frees A."""
    allocs = {i: AllocDraft(i, s) for i, s in enumerate([100, 50, 80])}
    drafts = [OpDraft("aten::conv2d", phase="fwd", layer_type="conv", start_us=0, dur_us=5,
                      events=[(0, 1), (1, 1), (1, -1), (2, 1), (2, -1)]),
              OpDraft("aten::relu_", phase="fwd", reads={0}),
              OpDraft("ConvolutionBackward0", phase="bwd", start_us=6, dur_us=1, reads={0},
                      events=[(0, -1)])]
    b = build_trace(drafts, allocs)
    assert [op.name for op in b.ops] == ["aten::conv2d", "ConvolutionBackward0"]
    assert [(t.size_bytes, t.kind) for t in b.tensors] == [(100, "activation"), (80, "workspace")]
    assert b.ops[0].writes == (0, 1) and b.ops[0].frees == (1,)
    assert b.ops[1].reads == (0,) and b.ops[1].frees == (0,) and b.ops[1].deps == (0,)
    assert b.tensor_of_alloc == {0: 0, 1: 1, 2: 1}


def test_build_trace_refuses_double_allocation() -> None:
    allocs = {0: AllocDraft(0, 8)}
    drafts = [OpDraft("a", events=[(0, 1)]), OpDraft("b", events=[(0, 1)])]
    with pytest.raises(TraceError, match="allocated twice"):
        build_trace(drafts, allocs)


def test_import_kineto_of_a_real_cpu_capture(tmp_path: Path) -> None:
    """torch.profiler's own export of a tiny CPU training step imports and validates."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    step()
    path = tmp_path / "cpu.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))
                                ) as prof:
        for _ in range(2):
            step()
            prof.step()
    t = import_kineto(path)
    assert t.meta["iteration"].startswith("ProfilerStep#")
    phases = {op.phase for op in t.ops}
    assert {"fwd", "bwd", "opt"} <= phases
    assert any(op.layer_type == "fc" and op.phase == "bwd" for op in t.ops)
    assert t.tensors and all(op.kernels == () for op in t.ops)
    save_trace(t, tmp_path / "t.vsim.json.gz")
    load_trace(tmp_path / "t.vsim.json.gz")


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("record-kineto*")))
def test_shipped_kineto_fixtures(name: str) -> None:
    t = import_kineto(DATA / name)
    assert t.ops and {"fwd", "bwd"} <= {op.phase for op in t.ops}


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("record-snapshot*")))
def test_shipped_snapshot_fixtures(name: str) -> None:
    t = import_torch_snapshot(DATA / name)
    assert t.ops and t.mem_events
