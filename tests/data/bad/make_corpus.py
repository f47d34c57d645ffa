"""Writes the bad-input corpus of tests/data/bad/ and its MANIFEST.yaml.

Every case is one malformed input (a trace, a hardware profile, or an option given with a good
trace) and the `vsim` command that must refuse it with exit code 2 and one line on stderr
containing every fragment in `expect` (the file, the place in it, what is wrong).
tests/test_bad_input.py runs them all and checks that this script reproduces the committed files.

Placeholders in `args` and `expect`: {file} the case's file, {good} good.vsim.json (a valid trace,
1,500 B resident before the first op), {hw} good-hw.yaml (a valid profile), {dir} this folder,
{out} an empty temporary folder that must still be empty afterwards.

Run: python tests/data/bad/make_corpus.py
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent

RUN = ["run", "{file}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz",
       "--plot", "{out}/p.png"]
RUN_HW = ["run", "{good}", "--hw", "{file}", "--timeline", "{out}/t.vsim.json.gz"]
RUN_GOOD = ["run", "{good}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz",
            "--plot", "{out}/p.png"]
INSPECT = ["inspect", "{file}"]


def good_trace() -> dict[str, Any]:
    """Weights w (1,000 B) and input x (500 B) resident; conv forward writes y (1,500 B);
    relu forward writes z and frees nothing; backward reads all, writes dw, frees y and z."""
    def op(i: int, name: str, ts: float, dur: float, phase: str, **args: Any) -> dict[str, Any]:
        a = {"op": i, "layer": name.split(".")[0], "layer_type": "conv", "phase": phase,
             "reads": [], "writes": [], "frees": [], "deps": [],
             "kernels": [[f"k{i}", 7, ts, dur]]}
        a.update(args)
        return {"name": name, "cat": "op", "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 0,
                "args": a}
    return {
        "vsim": {
            "format": "vsim-trace", "version": 1,
            "meta": {"source": "synthetic", "model": "bad-input corpus", "batch_size": 1},
            "measured": {"iteration_time_us": 60.0, "peak_allocated_bytes": 5000,
                         "peak_reserved_bytes": 6144},
            "tensors": [
                {"id": 0, "bytes": 1000, "kind": "weight", "name": "w", "producer": None,
                 "consumers": [0, 2]},
                {"id": 1, "bytes": 500, "kind": "input", "name": "x", "producer": None,
                 "consumers": [0, 2]},
                {"id": 2, "bytes": 1500, "kind": "activation", "name": "y", "producer": 0,
                 "consumers": [1, 2]},
                {"id": 3, "bytes": 1500, "kind": "activation", "name": "z", "producer": 1,
                 "consumers": [2]},
                {"id": 4, "bytes": 1000, "kind": "gradient", "name": "dw", "producer": 2,
                 "consumers": []},
            ],
        },
        "traceEvents": [
            op(0, "conv.forward", 0, 10, "fwd", reads=[0, 1], writes=[2]),
            op(1, "relu.forward", 12, 5, "fwd", reads=[2], writes=[3], deps=[0]),
            op(2, "conv.backward", 20, 30, "bwd", reads=[0, 1, 2, 3], writes=[4], frees=[2, 3],
               deps=[1]),
            {"name": "alloc", "cat": "mem", "ph": "i", "s": "t", "ts": 0, "pid": 1, "tid": 1000,
             "args": {"addr": 4096, "bytes": 1536, "stream": 0, "tensor": 2, "op": 0}},
            {"name": "d2h t0", "cat": "copy", "ph": "X", "ts": 0, "dur": 2, "pid": 1, "tid": 2,
             "args": {"tensor": 0, "direction": "d2h", "bytes": 1000}},
            {"name": "allocated", "ph": "C", "ts": 0, "pid": 1, "args": {"MiB": 0.003}},
        ],
    }


def good_hw() -> dict[str, Any]:
    """A small, valid profile with round numbers (the corpus must not depend on hardware/)."""
    return {
        "name": "corpus-gpu",
        "description": "valid profile that the bad-profile cases break one field of",
        "provenance": {"source": "tests/data/bad/make_corpus.py", "date": "2026-11-21",
                       "method": "round numbers, not measured"},
        "gpu": {"memory": "1MiB", "context": "64KiB", "cuda_malloc": "0us"},
        "compute": {"peak": {"fp32": "1TFLOP/s"}, "dram_bandwidth": "100GB/s",
                    "launch_latency": "0us", "copy_interference": "1%"},
        "link": {
            "h2d": {"pinned": {"bandwidth": "1GB/s", "latency": "1us",
                               "efficiency": [{"size": "1KiB", "fraction": "50%"},
                                              {"size": "1MiB", "fraction": "100%"}]},
                    "pageable": {"bandwidth": "0.5GB/s", "latency": "2us"}},
            "d2h": {"pinned": {"bandwidth": "1GB/s", "latency": "1us"},
                    "pageable": {"bandwidth": "0.5GB/s", "latency": "2us"}},
            "duplex": "1.5GB/s"},
        "host": {"pinned_limit": "1GB", "pinned_alloc_per_GiB": "0us"},
    }


def dumps(doc: Any) -> bytes:
    """Pretty JSON (allow_nan: some cases hold NaN/Infinity literals on purpose)."""
    return (json.dumps(doc, indent=1) + "\n").encode()


def junk(n: int, seed: str) -> bytes:
    """Deterministic bytes that are not UTF-8 text (a PNG signature, then hash output)."""
    out = b"\x89PNG\r\n\x1a\n"
    while len(out) < n:
        out += hashlib.sha256(seed.encode() + out[-32:]).digest()
    return out[:n]


def gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


Mutation = Callable[[dict[str, Any]], Any]


def mutated(base: Callable[[], dict[str, Any]], fn: Mutation) -> dict[str, Any]:
    doc = copy.deepcopy(base())
    fn(doc)
    return doc


def ev(i: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: d["traceEvents"][i]


def args(d: dict[str, Any], i: int) -> dict[str, Any]:
    a: dict[str, Any] = d["traceEvents"][i]["args"]
    return a


def tensor(d: dict[str, Any], i: int) -> dict[str, Any]:
    t: dict[str, Any] = d["vsim"]["tensors"][i]
    return t


def two_streams(free_on_other: bool = False) -> Mutation:
    """Move the relu forward (op 1) to stream 3. Without its dep on op 0 it reads y with
    nothing ordering it after its producer. In the free variant it keeps that dep, but the
    backward (stream 0) depends only on op 0, no longer reads z, and frees y, which the relu
    reads with nothing ordering the free after the read."""
    def fn(d: dict[str, Any]) -> None:
        d["traceEvents"][1]["tid"] = 3
        if free_on_other:
            args(d, 2).update(deps=[0], reads=[0, 1, 2], frees=[2])
            tensor(d, 3)["consumers"] = []
        else:
            args(d, 1)["deps"] = []
    return fn


def build() -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    """(file name -> bytes, manifest cases)."""
    files: dict[str, bytes] = {}
    cases: list[dict[str, Any]] = []
    good = dumps(good_trace())
    files["good.vsim.json"] = good
    files["good-hw.yaml"] = yaml.safe_dump(good_hw(), sort_keys=False).encode()

    def case(file: str | None, data: bytes | None, what: str, expect: list[str],
             cmd: list[str] | None = None, cid: str | None = None) -> None:
        if file is not None and data is not None:
            assert file not in files, file
            files[file] = data
        cases.append({"id": cid or str(file).split(".")[0], "file": file, "what": what,
                      "args": cmd or RUN, "expect": expect})

    def trace_case(file: str, fn: Mutation, what: str, expect: list[str],
                   cmd: list[str] | None = None) -> None:
        case(file, dumps(mutated(good_trace, fn)), what, ["{file}: ", *expect], cmd)

    def hw_case(file: str, fn: Mutation, what: str, expect: list[str]) -> None:
        doc = mutated(good_hw, fn)
        case(file, yaml.safe_dump(doc, sort_keys=False).encode(), what, ["{file}: ", *expect],
             RUN_HW)

    # ---------------------------------------------------------------- the file as a whole
    case("truncated.vsim.json.gz", gz(good)[:60], "gzip stream cut off after 60 bytes",
         ["{file}: ", "corrupt gzip data"])
    bad_crc = bytearray(gz(good))
    bad_crc[-8] ^= 0xFF  # the CRC32 of the trailer
    case("bad-crc.vsim.json.gz", bytes(bad_crc), "gzip trailer checksum does not match",
         ["{file}: ", "corrupt gzip data"])
    case("gzip-of-junk.vsim.json.gz", gz(junk(300, "gz")), "valid gzip around binary data",
         ["{file}: ", "not a text JSON file"])
    case("junk.vsim.json", junk(300, "plain"), "binary data (a PNG header and noise)",
         ["{file}: ", "not a text JSON file"])
    case("empty.vsim.json", b"", "an empty file",
         ["{file}: ", "invalid JSON at line 1 column 1"])
    case("yaml-not-json.vsim.json", b"vsim:\n  format: vsim-trace\n", "YAML, not JSON",
         ["{file}: ", "invalid JSON at line 1 column 1"], INSPECT)
    cut = good[: len(good) // 2]
    cut_lines = cut.count(b"\n") + 1
    case("cut.vsim.json", cut, "JSON text cut off half-way",
         ["{file}: ", f"invalid JSON at line {cut_lines}"])
    case("trailing-garbage.vsim.json", good + b"}\n", "a valid document then a stray brace",
         ["{file}: ", "invalid JSON at line", "Extra data"])
    case("top-level-list.vsim.json", b"[]\n", "a JSON list, not an object",
         ["{file}: ", "top level: expected an object, got list"])
    case("chrome-trace-only.vsim.json", dumps({"traceEvents": []}),
         "a plain Chrome trace without the vsim sidecar",
         ["{file}: ", "missing required field 'vsim'", "vsim import kineto"])

    # ---------------------------------------------------------------- sidecar, versions
    trace_case("wrong-format.vsim.json", lambda d: d["vsim"].update(format="chakra"),
               "another format's name", ["vsim.format is 'chakra'"])
    trace_case("no-version.vsim.json", lambda d: d["vsim"].pop("version"),
               "no version (never guessed from the keys)", ["vsim.version must be an integer"])
    trace_case("version-string.vsim.json", lambda d: d["vsim"].update(version="1"),
               "version as a string", ["vsim.version must be an integer, got '1'"])
    trace_case("newer-version.vsim.json", lambda d: d["vsim"].update(version=2),
               "a newer trace version", ["trace version 2 is newer", "upgrade vsim"], INSPECT)
    trace_case("version-zero.vsim.json", lambda d: d["vsim"].update(version=0),
               "version 0, which never existed", ["vsim.version 0 does not exist"])
    trace_case("no-meta.vsim.json", lambda d: d["vsim"].pop("meta"), "no meta block",
               ["vsim: missing required field 'meta'"])
    trace_case("no-provenance.vsim.json", lambda d: d["vsim"]["meta"].pop("source"),
               "meta without its source (measured, predicted or synthetic)",
               ["vsim.meta: missing required field 'source'"])
    trace_case("bad-source.vsim.json", lambda d: d["vsim"]["meta"].update(source="guessed"),
               "an unknown source", ["vsim.meta.source: 'guessed' is not one of"])
    trace_case("meta-nan.vsim.json", lambda d: d["vsim"]["meta"].update(lr=float("nan")),
               "NaN inside meta (kept and written back: strict JSON cannot hold it)",
               ["vsim.meta.lr: nan is not a finite number"])
    trace_case("meta-tail-with-unit.vsim.json",
               lambda d: d["vsim"]["meta"].update(iteration_tail_us="5us"),
               "iteration_tail_us as a string", ["vsim.meta.iteration_tail_us: expected a "
                                                 "number, got '5us'"])
    trace_case("meta-stream-names-list.vsim.json",
               lambda d: d["vsim"]["meta"].update(stream_names=["compute"]),
               "stream_names as a list", ["vsim.meta.stream_names: expected an object"])
    trace_case("measured-missing-field.vsim.json",
               lambda d: d["vsim"]["measured"].pop("peak_reserved_bytes"),
               "measured without peak_reserved_bytes",
               ["vsim.measured: missing required field 'peak_reserved_bytes'"], INSPECT)
    trace_case("measured-negative-peak.vsim.json",
               lambda d: d["vsim"]["measured"].update(peak_allocated_bytes=-1),
               "a negative measured peak",
               ["vsim.measured.peak_allocated_bytes: must be at least 0, got -1"])
    trace_case("no-tensors.vsim.json", lambda d: d["vsim"].pop("tensors"), "no tensor list",
               ["vsim: missing required field 'tensors'"])
    trace_case("no-events.vsim.json", lambda d: d.pop("traceEvents"), "no traceEvents",
               ["top level: missing required field 'traceEvents'"])
    trace_case("events-not-list.vsim.json", lambda d: d.update(traceEvents={}),
               "traceEvents as an object", ["traceEvents: expected a list, got dict"])
    trace_case("event-not-object.vsim.json", lambda d: d["traceEvents"].insert(1, 7),
               "a number among the events", ["traceEvents[1]: expected an object, got int"])
    trace_case("phase-not-string.vsim.json", lambda d: ev(5)(d).update(ph=3),
               "an event whose ph is a number", ["traceEvents[5].ph: expected a phase string"])
    trace_case("counter-infinity.vsim.json", lambda d: ev(5)(d)["args"].update(MiB=float("inf")),
               "Infinity in a counter (kept for viewing)",
               ["traceEvents[5].args.MiB: inf is not a finite number"])

    # ---------------------------------------------------------------- tensors
    trace_case("tensor-no-bytes.vsim.json", lambda d: tensor(d, 2).pop("bytes"),
               "a tensor without its size", ["vsim.tensors[2]: missing required field 'bytes'"])
    trace_case("tensor-negative-bytes.vsim.json", lambda d: tensor(d, 2).update(bytes=-1500),
               "a negative size", ["vsim.tensors[2].bytes: must be at least 0, got -1500"])
    trace_case("tensor-nan-bytes.vsim.json", lambda d: tensor(d, 2).update(bytes=float("nan")),
               "NaN as a size", ["vsim.tensors[2].bytes: expected an integer, got nan"])
    trace_case("tensor-fractional-bytes.vsim.json", lambda d: tensor(d, 2).update(bytes=1.5),
               "a fractional size", ["vsim.tensors[2].bytes: expected an integer, got 1.5"])
    trace_case("tensor-size-with-unit.vsim.json", lambda d: tensor(d, 2).update(bytes="1.5KB"),
               "a size with a unit (traces hold bytes)",
               ["vsim.tensors[2].bytes: expected an integer, got '1.5KB'"])
    trace_case("tensor-huge-bytes.vsim.json", lambda d: tensor(d, 2).update(bytes=2**60),
               "a size beyond 2^53 bytes", ["vsim.tensors[2].bytes: ", "more than 2^53"])
    trace_case("tensor-bad-kind.vsim.json", lambda d: tensor(d, 2).update(kind="blob"),
               "an unknown tensor kind", ["vsim.tensors[2].kind: 'blob' is not one of"])
    trace_case("tensor-duplicate-id.vsim.json", lambda d: tensor(d, 1).update(id=0),
               "two tensors with id 0", ["vsim.tensors[1].id: duplicate tensor id 0"])
    trace_case("tensor-producer-missing.vsim.json", lambda d: tensor(d, 4).update(producer=99),
               "a producer op that does not exist",
               ["traceEvents[2].args.writes[0]: tensor 4 lists producer 99, not op 2"])
    trace_case("tensor-producer-not-writing.vsim.json",
               lambda d: (args(d, 2).update(writes=[]), tensor(d, 4).update(producer=2)),
               "a producer op that does not list the tensor in writes (it would never be "
               "allocated)", ["vsim.tensors[4].producer: op 2 does not list tensor 4 in its "
                              "writes"])
    trace_case("tensor-consumer-missing.vsim.json",
               lambda d: tensor(d, 4).update(consumers=[42]), "a consumer op that does not exist",
               ["vsim.tensors[4].consumers[0]: op 42 does not exist"], INSPECT)

    # ---------------------------------------------------------------- ops: fields
    trace_case("op-negative-dur.vsim.json", lambda d: ev(1)(d).update(dur=-5),
               "a negative duration",
               ["traceEvents[1].dur: must be finite and not negative, got -5"])
    trace_case("op-nan-dur.vsim.json", lambda d: ev(1)(d).update(dur=float("nan")),
               "NaN as a duration", ["traceEvents[1].dur: must be finite and not negative, "
                                     "got nan"])
    trace_case("op-infinite-ts.vsim.json", lambda d: ev(2)(d).update(ts=float("inf")),
               "Infinity as a start time", ["traceEvents[2].ts: must be finite"])
    trace_case("op-huge-dur.vsim.json", lambda d: ev(2)(d).update(dur=1e300),
               "a duration of 1e300 us (sums would overflow to infinity)",
               ["traceEvents[2].dur: ", "more than 1e15 us"])
    trace_case("op-epoch-ts.vsim.json", lambda d: ev(0)(d).update(ts=1.7e15),
               "an absolute (epoch) timestamp instead of one from the iteration's start",
               ["traceEvents[0].ts: ", "microseconds from the iteration's start"])
    trace_case("op-ts-with-unit.vsim.json", lambda d: ev(1)(d).update(ts="12us"),
               "a start time as a string", ["traceEvents[1].ts: expected a number, got '12us'"])
    trace_case("op-no-args.vsim.json", lambda d: ev(1)(d).pop("args"), "an op without args",
               ["traceEvents[1]: missing required field 'args'"])
    trace_case("op-no-layer.vsim.json", lambda d: args(d, 0).pop("layer"),
               "an op without its layer", ["traceEvents[0].args: missing required field "
                                           "'layer'"])
    trace_case("op-bad-phase.vsim.json", lambda d: args(d, 2).update(phase="sideways"),
               "an unknown phase", ["traceEvents[2].args.phase: 'sideways' is not one of"])
    trace_case("op-stream-string.vsim.json", lambda d: ev(1)(d).update(tid="compute"),
               "a stream given by name", ["traceEvents[1].tid: expected an integer"])
    trace_case("kernel-short.vsim.json", lambda d: args(d, 1)["kernels"][0].pop(),
               "a kernel with three fields", ["traceEvents[1].args.kernels[0]: expected "
                                              "[name, stream, ts, dur]"])
    trace_case("kernel-negative-dur.vsim.json",
               lambda d: args(d, 1)["kernels"][0].__setitem__(3, -1.0),
               "a kernel with a negative duration",
               ["traceEvents[1].args.kernels[0][3]: must be finite and not negative"])
    trace_case("attrs-infinity.vsim.json",
               lambda d: args(d, 0).update(attrs={"workspace_bytes": float("-inf")}),
               "-Infinity in an op's attrs", ["traceEvents[0].args.attrs.workspace_bytes: "
                                              "-inf is not a finite number"])
    trace_case("attrs-memory-algo-string.vsim.json",
               lambda d: args(d, 0).update(attrs={"dur_us_memory_algo": "slow"}),
               "a measured implicit-GEMM time that is not a number",
               ["traceEvents[0].args.attrs.dur_us_memory_algo: expected a number"],
               [*RUN, "--policy", "none:algo=memory"])
    trace_case("copy-bad-direction.vsim.json", lambda d: args(d, 4).update(direction="p2p"),
               "a copy in an unknown direction", ["traceEvents[4].args.direction: 'p2p' is not "
                                                  "one of h2d, d2h"])
    trace_case("mem-bad-action.vsim.json", lambda d: ev(3)(d).update(name="malloc"),
               "an allocator event outside PyTorch's vocabulary",
               ["traceEvents[3].name: 'malloc' is not one of"])

    # ---------------------------------------------------------------- ops: the graph
    trace_case("op-duplicate-id.vsim.json", lambda d: args(d, 1).update(op=0),
               "two ops with id 0", ["traceEvents[1].args.op: duplicate op id 0"])
    trace_case("op-ids-decreasing.vsim.json",
               lambda d: (args(d, 1).update(op=2), tensor(d, 3).update(producer=2),
                          args(d, 2).update(op=1), tensor(d, 4).update(producer=1)),
               "op ids out of trace order (2, then 1)",
               ["traceEvents[2].args.op: op ids must increase in trace order (1 after 2)"])
    trace_case("reads-unknown-tensor.vsim.json", lambda d: args(d, 1)["reads"].append(9),
               "a read of a tensor id that does not exist",
               ["traceEvents[1].args.reads[1]: tensor 9 does not exist"])
    trace_case("writes-unknown-tensor.vsim.json", lambda d: args(d, 1)["writes"].append(9),
               "a write of a tensor id that does not exist",
               ["traceEvents[1].args.writes[1]: tensor 9 does not exist"])
    trace_case("frees-unknown-tensor.vsim.json", lambda d: args(d, 2)["frees"].append(-1),
               "a free of a negative tensor id",
               ["traceEvents[2].args.frees[2]: must be at least 0, got -1"])
    trace_case("dep-cycle.vsim.json", lambda d: args(d, 0).update(deps=[1]),
               "op 0 depends on op 1, which depends on op 0",
               ["traceEvents[0].args.deps[0]: op 1 is not an earlier op", "cycle"])
    trace_case("dep-self.vsim.json", lambda d: args(d, 1).update(deps=[1]),
               "an op that depends on itself", ["traceEvents[1].args.deps[0]: op 1 is not an "
                                                "earlier op"])
    trace_case("dep-unknown.vsim.json", lambda d: args(d, 2).update(deps=[1, 77]),
               "a dependency on an op that does not exist",
               ["traceEvents[2].args.deps[1]: op 77 is not an earlier op"])
    trace_case("reads-freed.vsim.json",
               lambda d: (args(d, 1).update(frees=[2]), args(d, 2).update(frees=[3])),
               "the backward reads y after the relu freed it",
               ["traceEvents[2].args.reads[2]: tensor 2 was freed by op 1"])
    trace_case("frees-twice.vsim.json",
               lambda d: args(d, 1).update(frees=[1]),
               "the input freed by the relu, then read and freed again by the backward",
               ["traceEvents[2].args.reads[1]: tensor 1 was freed by op 1"])
    trace_case("reads-before-produced.vsim.json", lambda d: args(d, 0)["reads"].append(3),
               "the conv forward reads z, which the relu produces later",
               ["traceEvents[0].args.reads[2]: tensor 3 is produced later, by op 1"])
    trace_case("writes-other-producer.vsim.json", lambda d: args(d, 1)["writes"].append(2),
               "the relu writes y, whose producer is the conv",
               ["traceEvents[1].args.writes[1]: tensor 2 lists producer 0, not op 1"])
    trace_case("writes-twice.vsim.json", lambda d: args(d, 0)["writes"].append(2),
               "y listed twice in one op's writes (it would be allocated twice)",
               ["traceEvents[0].args.writes[1]: tensor 2 is listed twice"])
    trace_case("cross-stream-read.vsim.json", two_streams(),
               "the relu on stream 3 reads y (produced on stream 0) with no dependency",
               ["traceEvents[1].args.reads[0]: tensor 2 is produced by op 0 on stream 0 and "
                "used on stream 3 with no dependency"])
    trace_case("cross-stream-free.vsim.json", two_streams(free_on_other=True),
               "the backward (stream 0) frees y while the relu on stream 3 reads it, unordered",
               ["traceEvents[2].args.frees[0]: tensor 2 is freed on stream 0 while op 1 on "
                "stream 3 reads it"])

    # ---------------------------------------------------------------- hardware profiles
    case("hw-junk.yaml", junk(200, "hw"), "binary data as a profile",
         ["{file}: ", "not a text YAML file"], RUN_HW)
    case("hw-invalid-yaml.yaml", b"name: x\ngpu: {memory: 1GiB\n", "an unclosed brace",
         ["{file}: ", "invalid YAML at line"], RUN_HW)
    case("hw-empty.yaml", b"", "an empty profile", ["{file}: ", "top level: expected a mapping"],
         RUN_HW)
    case("hw-list.yaml", b"- gpu\n- link\n", "a YAML list",
         ["{file}: ", "top level: expected a mapping"], RUN_HW)
    hw_case("hw-no-provenance.yaml", lambda h: h.pop("provenance"), "no provenance block",
            ["top level: missing required field 'provenance'"])
    hw_case("hw-provenance-no-date.yaml", lambda h: h["provenance"].pop("date"),
            "provenance without a date", ["provenance: missing 'date'"])
    hw_case("hw-no-name.yaml", lambda h: h.pop("name"), "no name", ["name: missing"])
    hw_case("hw-no-link.yaml", lambda h: h.pop("link"), "no link section",
            ["top level: missing required field 'link'"])
    hw_case("hw-memory-no-unit.yaml", lambda h: h["gpu"].update(memory=1048576),
            "memory as a bare number", ["gpu.memory: expected a size with a unit"])
    hw_case("hw-bandwidth-no-unit.yaml",
            lambda h: h["link"]["d2h"]["pinned"].update(bandwidth="12.8"),
            "a bandwidth without a unit", ["link.d2h.pinned.bandwidth: '12.8' is a bandwidth "
                                           "without a unit"])
    hw_case("hw-unknown-unit.yaml",
            lambda h: h["link"]["h2d"]["pageable"].update(bandwidth="100Gbit/s"),
            "a bandwidth in an unknown unit", ["link.h2d.pageable.bandwidth: ",
                                               "unknown bandwidth unit 'Gbit/s'"])
    hw_case("hw-zero-bandwidth.yaml",
            lambda h: h["link"]["h2d"]["pinned"].update(bandwidth="0GB/s"),
            "a zero bandwidth (copies would never end)",
            ["link.h2d.pinned.bandwidth: must be above zero"])
    hw_case("hw-zero-duplex.yaml", lambda h: h["link"].update(duplex="0GB/s"),
            "a zero duplex limit", ["link.duplex: must be above zero"])
    hw_case("hw-negative-latency.yaml",
            lambda h: h["link"]["d2h"]["pinned"].update(latency="-1us"),
            "a negative latency", ["link.d2h.pinned.latency: ", "must be finite and not "
                                   "negative"])
    hw_case("hw-zero-dram.yaml", lambda h: h["compute"].update(dram_bandwidth="0TB/s"),
            "zero DRAM bandwidth", ["compute.dram_bandwidth: must be above zero"])
    hw_case("hw-no-fp32.yaml", lambda h: h["compute"]["peak"].pop("fp32"),
            "no fp32 peak rate", ["compute.peak: missing required field 'fp32'"])
    hw_case("hw-context-above-memory.yaml", lambda h: h["gpu"].update(context="2MiB"),
            "a CUDA context larger than the card", ["gpu.context (2097152 B) must be below "
                                                    "gpu.memory"])
    hw_case("hw-efficiency-not-list.yaml",
            lambda h: h["link"]["h2d"]["pinned"].update(efficiency=5),
            "an efficiency table given as a number",
            ["link.h2d.pinned.efficiency: expected a list"])
    hw_case("hw-efficiency-zero.yaml",
            lambda h: h["link"]["h2d"]["pinned"]["efficiency"][0].update(fraction="0%"),
            "a 0% efficiency (infinite copy time)",
            ["link.h2d.pinned.efficiency[0].fraction: ", "must be above 0%"])
    hw_case("hw-efficiency-fraction-no-percent.yaml",
            lambda h: h["link"]["h2d"]["pinned"]["efficiency"][1].update(fraction=1.0),
            "an efficiency written as a bare fraction",
            ["link.h2d.pinned.efficiency[1].fraction: ", "expected a percentage"])
    hw_case("hw-efficiency-unsorted.yaml",
            lambda h: h["link"]["h2d"]["pinned"]["efficiency"].reverse(),
            "efficiency sizes in decreasing order",
            ["link.h2d.pinned.efficiency: sizes must strictly increase"])
    case(None, None, "a profile name that does not exist",
         ["unknown hardware 'no-such-gpu'", "known: "],
         ["run", "{good}", "--hw", "no-such-gpu", "--timeline", "{out}/t.vsim.json.gz"],
         cid="hw-unknown-name")

    # ---------------------------------------------------------------- options on a good trace
    def option_case(cid: str, extra: list[str], what: str, expect: list[str],
                    base: list[str] | None = None) -> None:
        cases.append({"id": cid, "file": None, "what": what, "args": [*(base or RUN_GOOD),
                                                                      *extra],
                      "expect": expect})

    option_case("memory-zero", ["--memory", "0GiB"], "a capacity of zero",
                ["--memory: capacity must be above zero"])
    option_case("memory-below-weights", ["--memory", "1KiB"],
                "1,024 B, below the 1,500 B of weights and input resident before the first op",
                ["{good}: ", "--memory 1.00 KiB is below the 1.46 KiB (1500 B)",
                 "before the first op"])
    option_case("memory-no-unit", ["--memory", "12"], "a capacity without a unit",
                ["--memory: '12' is a size without a unit"])
    option_case("memory-negative", ["--memory=-1GiB"], "a negative capacity",
                ["--memory: size '-1GiB' must be finite and not negative"])
    option_case("memory-nan", ["--memory", "nanGiB"], "NaN as a capacity",
                ["--memory: cannot read 'nanGiB' as a size"])
    option_case("memory-infinite", ["--memory", "1e999GiB"], "an infinite capacity",
                ["--memory: size '1e999GiB' must be finite"])
    option_case("memory-value-missing", ["--memory", "-1GiB"],
                "a negative size given as a separate value (vsim's message, not argparse's)",
                ["--memory: size '-1GiB' must be finite and not negative"])
    option_case("option-unknown", ["--colour", "red"], "an option vsim does not have",
                ["unrecognized arguments: --colour red"])
    option_case("verb-unknown", [], "a verb vsim does not have",
                ["argument VERB: invalid choice: 'simulate'"], ["simulate", "{good}"])
    option_case("policy-unknown", ["--policy", "vdnn-turbo"], "a policy that does not exist",
                ["unknown policy 'vdnn-turbo'; known: "])
    option_case("policy-unknown-key", ["--policy", "none:colour=red"], "an unknown policy key",
                ["policy none: unknown key 'colour'; valid keys: algo"])
    option_case("policy-bad-choice", ["--policy", "none:algo=fastest"],
                "a value outside the key's choices",
                ["policy none: algo='fastest' is not one of performance, memory"])
    option_case("policy-no-value", ["--policy", "none:algo"], "a key without =value",
                ["policy none: expected key=value, got 'algo'"])
    option_case("policy-empty", ["--policy", ""], "an empty policy spec",
                ["unknown policy ''"])
    option_case("allocator-unknown", ["--allocator", "magic"], "an allocator that does not exist",
                ["unknown allocator 'magic'; known: "])
    option_case("allocator-unknown-key", ["--allocator", "exact:colour=red"],
                "an unknown allocator key", ["allocator exact: unknown key 'colour'"])
    option_case("timeline-is-folder", [], "--timeline naming an existing folder",
                ["--timeline: '{out}' is a folder"],
                ["run", "{good}", "--hw", "{hw}", "--timeline", "{out}"])
    option_case("plot-folder-missing", [], "--plot into a folder that does not exist",
                ["--plot: folder '{out}/no/such' does not exist"],
                ["run", "{good}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz",
                 "--plot", "{out}/no/such/p.png"])
    option_case("trace-missing", [], "a trace file that does not exist",
                ["{dir}/no-such.vsim.json.gz: cannot read trace"],
                ["run", "{dir}/no-such.vsim.json.gz", "--hw", "{hw}", "--timeline",
                 "{out}/t.vsim.json.gz"])
    option_case("trace-is-folder", [], "a folder given as the trace",
                ["{dir}: cannot read trace"],
                ["run", "{dir}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz"])
    # ---------------------------------------------------------------- allocator histories
    validate = ["validate", "{file}"]
    history = {"meta": {"model": "m", "batch_size": 1},
               "entries": [{"action": "segment_alloc", "addr": 0, "size": 2097152},
                           {"action": "alloc", "addr": 0, "size": 512}],
               "iterations": [{"first_entry": 0, "allocated": 512, "reserved": 2097152}]}

    def history_case(file: str, doc: Any, what: str, expect: list[str]) -> None:
        case(file, gz(json.dumps(doc).encode()), what, ["{file}", *expect], validate)

    case("history-truncated.history.json.gz", gz(json.dumps(history).encode())[:40],
         "an allocator history cut off inside its gzip stream",
         ["{file}: ", "corrupt gzip data"], validate)
    history_case("history-unknown-action.history.json.gz",
                 {**history, "entries": [{"action": "malloc", "addr": 0, "size": 1}]},
                 "an allocator event with an unknown action",
                 [": entries[0]: ", "unknown action 'malloc'"])
    history_case("history-negative-size.history.json.gz",
                 {**history, "entries": [{"action": "alloc", "addr": 0, "size": -512}]},
                 "an allocation of a negative size", [": entries[0]: ", "size at least 0"])
    history_case("history-no-iterations.history.json.gz",
                 {k: v for k, v in history.items() if k != "iterations"},
                 "a history without its per-iteration memory", [": ", "missing key 'iterations'"])
    history_case("history-iteration-outside.history.json.gz",
                 {**history, "iterations": [{"first_entry": 9, "allocated": 0, "reserved": 0}]},
                 "an iteration starting after the last event",
                 [": iterations[0]: ", "first_entry 9 is outside the 2 entries"])
    option_case("inspect-hardware-profile", [], "a hardware profile given to inspect",
                ["{hw}: invalid JSON at line 1"], ["inspect", "{hw}"])
    _sibling("corpus_limits").add(case, trace_case, hw_case, option_case, good, good_hw(), gz,
                                  cases)
    return files, cases


def _sibling(name: str) -> Any:
    """A module of this folder (this script is also loaded by path, not as a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def manifest_text(cases: list[dict[str, Any]]) -> str:
    head = ("# Bad-input corpus: each case must exit 2 with one stderr line `vsim: error: ...`\n"
            "# containing every `expect` fragment, no traceback, and nothing under {out}.\n"
            "# Generated by make_corpus.py (edit that, then run it); placeholders are\n"
            "# explained in its docstring. Checked by tests/test_bad_input.py.\n")
    # A JSON round trip shares nothing (no YAML anchors); default_flow_style=None puts each
    # args and expect list on one line.
    body: str = yaml.safe_dump({"cases": json.loads(json.dumps(cases))}, sort_keys=False,
                               width=100, default_flow_style=None)
    return head + body


def write(folder: Path = HERE) -> None:
    files, cases = build()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "MANIFEST.yaml").write_text(manifest_text(cases))
    print(f"wrote {len(files)} files and {len(cases)} cases to {folder}", file=sys.stderr)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
