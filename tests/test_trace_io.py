import gzip
import json
import shutil
from pathlib import Path

import pytest
from builders import assert_chrome_trace_events

from vsim.errors import TraceError
from vsim.trace import SCHEMA_VERSION, load_trace, save_trace, trace_from_json, trace_to_json

DATA = Path(__file__).parent / "data"
TINY = DATA / "tiny.vsim.json"


def tiny_doc():
    return json.loads(TINY.read_text())


def test_hand_written_trace_loads():
    t = load_trace(TINY)
    assert [op.name for op in t.ops] == ["conv.forward", "conv.backward"]
    assert t.ops[1].frees == (2,) and t.ops[1].deps == (0,)
    assert t.ops[1].kernels[0].name == "wgrad" and t.ops[1].kernels[0].dur_us == 20
    assert t.tensor_by_id()[2].size_bytes == 1500
    assert t.measured.peak_reserved_bytes == 4096
    assert len(t.mem_events) == 1 and t.mem_events[0].tensor == 2
    assert len(t.counters) == 1  # kept for viewing, not interpreted


def test_round_trip_gzip_is_identical_and_deterministic(tmp_path):
    t = load_trace(TINY)
    a, b = tmp_path / "a.vsim.json.gz", tmp_path / "b.vsim.json.gz"
    save_trace(t, a)
    save_trace(load_trace(a), b)
    assert load_trace(a) == t
    assert a.read_bytes() == b.read_bytes()  # gzip mtime fixed: byte-identical files


def test_file_is_chrome_trace_json():
    """What ui.perfetto.dev and chrome://tracing need: a traceEvents list whose events have
    name/ph/ts/pid/tid, X events with dur, all times numbers; slices of one tid never overlap."""
    doc = trace_to_json(load_trace(TINY))
    assert isinstance(doc["traceEvents"], list)
    assert_chrome_trace_events(doc["traceEvents"])
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN or Infinity


def test_perfetto_trace_processor_loads_it(tmp_path):
    """Needs the `perfetto` package and its trace_processor binary, which it downloads on first
    use; skipped offline (docs/design.md)."""
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    out = tmp_path / "t.json"
    out.write_text(json.dumps(trace_to_json(load_trace(TINY))))
    try:
        tp = tp_mod.TraceProcessor(trace=str(out))
    except Exception as exc:  # no binary and no network
        pytest.skip(f"trace_processor unavailable: {exc}")
    rows = list(tp.query("select count(*) as n from slice"))
    assert rows[0].n == 2


def _expect_error(doc, fragment, tmp_path, name="bad.vsim.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    message = str(err.value)
    assert message.startswith(str(path)), message
    assert fragment in message, message
    assert "\n" not in message


def test_newer_version_is_refused(tmp_path):
    doc = tiny_doc()
    doc["vsim"]["version"] = SCHEMA_VERSION + 1
    _expect_error(doc, "newer than this vsim reads", tmp_path)


def test_version_is_never_guessed(tmp_path):
    doc = tiny_doc()
    del doc["vsim"]["version"]
    _expect_error(doc, "vsim.version must be an integer", tmp_path)


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d["vsim"]["tensors"][2].update(bytes=-5), "vsim.tensors[2].bytes"),
    (lambda d: d["vsim"]["tensors"][2].update(kind="blob"), "vsim.tensors[2].kind"),
    (lambda d: d["vsim"]["tensors"][1].update(id=0), "duplicate tensor id"),
    (lambda d: d["traceEvents"][0].update(dur=float("nan")), "traceEvents[0].dur"),
    (lambda d: d["traceEvents"][1]["args"].update(reads=[9]), "traceEvents[1].args.reads[0]"),
    (lambda d: d["traceEvents"][0]["args"].update(deps=[1]), "traceEvents[0].args.deps[0]"),
    (lambda d: d["traceEvents"][1]["args"].update(phase="sideways"), "args.phase"),
    # unhashable where a name is expected: a TypeError escaped the fast readers (issue 18)
    (lambda d: d["traceEvents"][1]["args"].update(phase=["fwd"]), "args.phase"),
    (lambda d: d["vsim"]["tensors"][2].update(kind=["weight"]), "vsim.tensors[2].kind"),
    (lambda d: d["traceEvents"][0]["args"].pop("layer"), "missing required field 'layer'"),
    (lambda d: d["traceEvents"][1]["args"].update(op=0), "duplicate op id"),
    (lambda d: d["traceEvents"][0]["args"].update(writes=[3]), "lists producer 1"),
    (lambda d: d["traceEvents"][0]["args"].update(reads=[3]), "produced later"),
    (lambda d: d["traceEvents"][0]["args"].update(frees=[2]), "was freed by op 0"),
    (lambda d: d["traceEvents"][0]["args"]["kernels"][0].pop(), "[name, stream, ts, dur]"),
    (lambda d: d["vsim"].update(format="chakra"), "vsim.format"),
    (lambda d: d["vsim"]["meta"].update(source="guess"), "vsim.meta.source"),
    (lambda d: d["vsim"]["measured"].pop("peak_reserved_bytes"), "vsim.measured"),
    (lambda d: d.pop("traceEvents"), "traceEvents"),
])
def test_invalid_fields_name_the_json_path(mutate, fragment, tmp_path):
    doc = tiny_doc()
    mutate(doc)
    _expect_error(doc, fragment, tmp_path)


def test_truncated_gzip_and_bad_json(tmp_path):
    good = tmp_path / "good.vsim.json.gz"
    save_trace(load_trace(TINY), good)
    cut = tmp_path / "cut.vsim.json.gz"
    cut.write_bytes(good.read_bytes()[:40])
    with pytest.raises(TraceError, match="corrupt gzip"):
        load_trace(cut)
    broken = tmp_path / "broken.vsim.json"
    broken.write_text('{"vsim": {')
    with pytest.raises(TraceError, match="invalid JSON at line 1"):
        load_trace(broken)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.vsim.json")


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    t = load_trace(TINY)
    target = tmp_path / "out.vsim.json.gz"

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("vsim.trace.io.os.replace", boom)
    with pytest.raises(OSError):
        save_trace(t, target)
    assert list(tmp_path.iterdir()) == []


def test_plain_json_and_gzip_read_alike(tmp_path):
    gz = tmp_path / "t.vsim.json.gz"
    with gzip.open(gz, "wb") as f:
        f.write(TINY.read_bytes())
    plain = tmp_path / "t.vsim.json"
    shutil.copy(TINY, plain)
    assert load_trace(gz) == load_trace(plain) == trace_from_json(tiny_doc())


def test_cross_stream_use_is_ordered_through_deps(tmp_path):
    """Stream 0: op0 writes y. Stream 3: op1 depends on op0 and reads y. Stream 4: op2 depends
    on op1 only (so on op0 transitively) and frees y: ordered after both the write and the
    read, so it loads. Without op2's dep the free could run before op1's read: refused."""
    from vsim.trace import Op, Tensor, Trace

    def build(deps2):
        return trace_to_json(Trace(
            meta={"source": "synthetic"},
            tensors=(Tensor(0, 10, "activation", "y", producer=0, consumers=(1,)),),
            ops=(Op(0, "a", "l", "other", "fwd", 0, 1, stream=0, writes=(0,)),
                 Op(1, "b", "l", "other", "fwd", 1, 1, stream=3, reads=(0,), deps=(0,)),
                 Op(2, "c", "l", "other", "fwd", 2, 1, stream=4, frees=(0,), deps=deps2))))
    assert trace_from_json(build((1,))).ops[2].frees == (0,)
    _expect_error(build((0,)), "traceEvents[2].args.frees[0]: tensor 0 is freed on stream 4 "
                  "while op 1 on stream 3 reads it", tmp_path)


def test_an_op_with_several_problems_is_refused_for_the_first_in_message_order(tmp_path):
    """The graph check tests an op's lists in fast loops and asks _op_problem for the message
    of the first thing wrong: reads, then the writes' ids, then frees, then the writes'
    producers; within a list the lowest index. Each case adds one problem before the last."""
    from vsim.trace import Op, Tensor, Trace

    def build(reads=(0,), writes=(1,), frees=(), producer_of_1=1):
        return trace_to_json(Trace(
            meta={"source": "synthetic"},
            tensors=(Tensor(0, 10, "activation", "x", producer=0, consumers=(1,)),
                     Tensor(1, 10, "activation", "y", producer=producer_of_1),
                     Tensor(2, 10, "weight", "w")),
            ops=(Op(0, "a", "l", "other", "fwd", 0, 1, writes=(0,)),
                 Op(1, "b", "l", "other", "fwd", 1, 1, reads=reads, writes=writes,
                    frees=frees))))
    at = "traceEvents[1].args."
    _expect_error(build(producer_of_1=0, frees=(2,)), at + "writes[0]: tensor 1 lists "
                  "producer 0, not op 1", tmp_path)
    _expect_error(build(producer_of_1=0, frees=(2, 9)), at + "frees[1]: tensor 9 does not "
                  "exist", tmp_path)
    _expect_error(build(producer_of_1=0, frees=(2, 2), writes=(1, 1)), at + "writes[1]: "
                  "tensor 1 is listed twice", tmp_path)
    _expect_error(build(producer_of_1=0, frees=(9,), writes=(1, 8), reads=(0, 2, 7, 6)),
                  at + "reads[2]: tensor 7 does not exist", tmp_path)
    _expect_error(build(producer_of_1=0, frees=(2, 2)), at + "frees[1]: tensor 2 is listed "
                  "twice", tmp_path)


def _chain_doc(n_streams: int, with_deps: bool) -> dict:
    """Op k on stream k reads the tensor op k-1 wrote (on stream k-1) and writes its own;
    with_deps: each op depends on the previous one, which orders every read."""
    from vsim.trace import Op, Tensor, Trace
    tensors = tuple(Tensor(k, 8, "activation", producer=k,
                           consumers=(k + 1,) if k + 1 < n_streams else ())
                    for k in range(n_streams))
    ops = tuple(Op(k, "o", "l", "other", "fwd", float(k), 1.0, stream=k,
                   reads=(k - 1,) if k else (), writes=(k,),
                   deps=(k - 1,) if k and with_deps else ()) for k in range(n_streams))
    return trace_to_json(Trace(meta={"source": "synthetic"}, tensors=tensors, ops=ops))


def test_many_one_op_streams_load_in_linear_memory():
    """20,000 streams of one op each, chained by deps: vector clocks held 2*10^8 entries
    (over 4 GB); the backwards search holds one position per op."""
    import time
    import tracemalloc
    doc = _chain_doc(20_000, with_deps=True)
    tracemalloc.start()
    start = time.perf_counter()
    trace = trace_from_json(doc)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(trace.ops) == 20_000
    assert peak < 100 * 2**20, peak
    assert seconds < 30, seconds


def test_cross_stream_order_through_a_chain_of_deps(tmp_path):
    """Op 3 (stream 3) reads the tensor of op 0 (stream 0): ordered only through 3 -> 2 -> 1
    -> 0, a dep on each previous op on another stream. Dropping any link is refused."""
    from vsim.trace import Op, Tensor, Trace

    def build(deps: dict[int, tuple[int, ...]]) -> dict:
        ops = tuple(Op(k, "o", "l", "other", "fwd", float(k), 1.0, stream=k,
                       reads=(0,) if k == 3 else (), writes=(0,) if k == 0 else (),
                       deps=deps.get(k, ())) for k in range(4))
        return trace_to_json(Trace(meta={"source": "synthetic"},
                                   tensors=(Tensor(0, 8, "activation", producer=0,
                                                   consumers=(3,)),), ops=ops))
    full = {1: (0,), 2: (1,), 3: (2,)}
    assert trace_from_json(build(full)).ops[3].reads == (0,)
    for missing in (1, 2, 3):
        deps = {k: v for k, v in full.items() if k != missing}
        _expect_error(build(deps), "traceEvents[3].args.reads[0]: tensor 0 is produced by op 0 "
                      "on stream 0 and used on stream 3 with no dependency", tmp_path)
    # ordered through the same stream: op 2 on stream 0 after op 0, and op 3 depends on it
    ops = (Op(0, "o", "l", "other", "fwd", 0, 1, stream=0, writes=(0,)),
           Op(1, "o", "l", "other", "fwd", 1, 1, stream=0),
           Op(2, "o", "l", "other", "fwd", 2, 1, stream=5, reads=(0,), deps=(1,)))
    doc = trace_to_json(Trace(meta={"source": "synthetic"}, ops=ops,
                              tensors=(Tensor(0, 8, "activation", producer=0,
                                              consumers=(2,)),)))
    assert trace_from_json(doc).ops[2].deps == (1,)


def test_a_long_write_list_is_checked_in_linear_time():
    from vsim.trace import Op, Tensor, Trace
    n = 50_000
    tensors = tuple(Tensor(k, 8, "activation", producer=0) for k in range(n))
    ops = (Op(0, "o", "l", "other", "fwd", 0, 1, writes=tuple(range(n))),)
    doc = trace_to_json(Trace(meta={"source": "synthetic"}, tensors=tensors, ops=ops))
    import time
    start = time.perf_counter()
    assert len(trace_from_json(doc).ops[0].writes) == n
    assert time.perf_counter() - start < 10
    doc["traceEvents"][0]["args"]["writes"].append(n - 1)
    with pytest.raises(TraceError, match=rf"writes\[{n}\]: tensor {n - 1} is listed twice"):
        trace_from_json(doc)


def test_records_built_by_the_loader_equal_their_dataclass_constructors():
    """The loader builds Op, Kernel and Tensor through slot setters (vsim.trace.io._builder),
    not their frozen __init__: the objects must be the same, field for field, and as frozen."""
    import dataclasses

    from vsim.trace.schema import Kernel, Op, Tensor

    t = load_trace(DATA.parent.parent / "traces" / "alexnet-b128-h100.vsim.json.gz")
    records = [*t.ops, *(k for op in t.ops for k in op.kernels), *t.tensors]
    assert {type(r) for r in records} == {Op, Kernel, Tensor}
    for r in records:
        again = dataclasses.replace(r)  # through the dataclass's own __init__
        assert again == r and repr(again) == repr(r) and hash(again) == hash(r)
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.name = "changed"
    # every field, in order, of a record with all fields set
    from vsim.trace.io import _builder
    fields = dict(id=3, name="n", layer="l", layer_type="conv", phase="bwd", start_us=1.5,
                  dur_us=2.5, stream=1, reads=(1,), writes=(2,), frees=(1,), deps=(0,),
                  kernels=(Kernel("k", 7, 1.5, 2.5),), flops=3.0, dram_bytes=4.0,
                  attrs=(("a", 1),))
    assert _builder(Op)(*fields.values()) == Op(**fields)
