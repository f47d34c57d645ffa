"""The bad-input cases of resource limits and non-finite values (issue 18), added to the corpus
by make_corpus.py's build(): alias bombs, gzip bombs, deep nesting, 5000-digit integers,
Infinity in imports, out-of-range profile quantities, non-UTF-8 files, foreign sweep outputs
and malformed scheduler addresses. A case may set `env` (e.g. a lower input-size limit, so that
a gzip bomb of a few kilobytes stands for one of gigabytes).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

import yaml

BOMB = ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, "
        "*c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, "
        "*e, *e, *e, *e]\ng: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\n")
DIGITS = "7" * 5000
LIMIT = {"VSIM_MAX_INPUT_BYTES": "100000"}


def add(case: Callable[..., None], trace_case: Callable[..., None],
        hw_case: Callable[..., None], option_case: Callable[..., None],
        good: bytes, good_hw: dict[str, Any], gz: Callable[[bytes], bytes],
        cases: list[dict[str, Any]]) -> None:
    """Append the cases through make_corpus's helpers (same placeholders and checks)."""
    run_hw = ["run", "{good}", "--hw", "{file}", "--timeline", "{out}/t.vsim.json.gz"]
    run = ["run", "{file}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz"]
    hw_text = yaml.safe_dump(good_hw, sort_keys=False)

    def hw_raw(file: str, text: str | bytes, what: str, expect: list[str]) -> None:
        data = text.encode() if isinstance(text, str) else text
        case(file, data, what, ["{file}: ", *expect], run_hw)

    # ---------------------------------------------------------------- YAML profiles
    hw_raw("hw-billion-laughs.yaml", hw_text + BOMB,
           "seven lines of aliases that expand to 10^7 strings",
           ["YAML aliases expand to more than 1000000 nodes"])
    hw_raw("hw-recursive-alias.yaml", hw_text + "loop: &l [1, *l]\n",
           "an alias inside the node it names", ["refers to a node that contains it"])
    hw_raw("hw-latin1.yaml", hw_text.replace("valid profile", "caf\xe9 profile").encode("latin-1"),
           "a profile in Latin-1 (not UTF-8)", ["not a text YAML file", "not UTF-8 at line 2"])
    hw_raw("hw-5000-digits.yaml", hw_text + f"serial: {DIGITS}\n",
           "a 5000-digit integer (beyond Python's int-string conversion limit)",
           ["invalid YAML: an integer with more than 4300 digits"])
    hw_raw("hw-deep-nesting.yaml", hw_text + "deep: " + "[" * 5000 + "]" * 5000 + "\n",
           "lists nested 5000 deep", ["invalid YAML at line"])

    def rate(direction: str, value: str) -> Callable[[dict[str, Any]], Any]:
        return lambda h: h["link"][direction]["pinned"].update(bandwidth=value)
    hw_case("hw-denormal-bandwidth.yaml", rate("h2d", "1e-320GB/s"),
            "a bandwidth of 1e-320 GB/s (copy times overflow to Infinity)",
            ["link.h2d.pinned.bandwidth: '1e-320GB/s' is out of range: must be between 1MB/s "
             "and 100TB/s"])
    hw_case("hw-huge-bandwidth.yaml", rate("d2h", "1e9TB/s"), "a bandwidth of 10^9 TB/s",
            ["link.d2h.pinned.bandwidth: ", "out of range"])
    hw_case("hw-huge-latency.yaml",
            lambda h: h["link"]["d2h"]["pinned"].update(latency="1e308us"),
            "a latency of 1e308 us (sums overflow to Infinity)",
            ["link.d2h.pinned.latency: '1e308us' is out of range: must be between 0us and 100s"])
    hw_case("hw-huge-dram.yaml", lambda h: h["compute"].update(dram_bandwidth="1e300TB/s"),
            "a DRAM bandwidth of 1e300 TB/s", ["compute.dram_bandwidth: ", "out of range"])
    hw_case("hw-tiny-flops.yaml", lambda h: h["compute"]["peak"].update(fp32="1FLOP/s"),
            "1 FLOP/s", ["compute.peak.fp32: '1FLOP/s' is out of range"])
    hw_case("hw-huge-cuda-malloc.yaml", lambda h: h["gpu"].update(cuda_malloc="1e6s"),
            "a cudaMalloc of 11 days", ["gpu.cuda_malloc: ", "out of range"])
    hw_case("hw-huge-memory.yaml", lambda h: h["gpu"].update(memory="4096TiB"),
            "4 PiB of device memory", ["gpu.memory: '4096TiB' is out of range: must be at most "
                                       "1PiB"])
    hw_case("hw-pinned-beyond-2-53.yaml", lambda h: h["host"].update(pinned_limit="1e20B"),
            "a size beyond 2^53 bytes", ["host.pinned_limit: ", "more than 2^53 bytes"])
    hw_case("hw-efficiency-size-zero.yaml",
            lambda h: h["link"]["h2d"]["pinned"]["efficiency"][0].update(size="0B"),
            "a 0 B size in an efficiency table (interpolated in log(size))",
            ["link.h2d.pinned.efficiency[0].size: must be above 0 B"])
    hw_case("hw-duplex-huge.yaml", lambda h: h["link"].update(duplex="1e30GB/s"),
            "a duplex limit of 1e30 GB/s", ["link.duplex: ", "out of range"])
    option_case("set-denormal-bandwidth", ["--set", "link.h2d.pinned.bandwidth=1e-320GB/s"],
                "--set with a bandwidth of 1e-320 GB/s: the profile's checks apply",
                ["{hw} with --set", "link.h2d.pinned.bandwidth: ", "out of range"],
                ["run", "{good}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz"])
    option_case("set-huge-latency", ["--set", "link.d2h.pinned.latency=1e308us"],
                "--set with a latency of 1e308 us",
                ["link.d2h.pinned.latency: ", "out of range"],
                ["run", "{good}", "--hw", "{hw}", "--timeline", "{out}/t.vsim.json.gz"])

    # ---------------------------------------------------------------- traces
    def raw_trace(file: str, data: bytes, what: str, expect: list[str],
                  env: dict[str, str] | None = None) -> None:
        case(file, data, what, ["{file}: ", *expect], run)
        if env:
            cases[-1]["env"] = env
    doc = json.loads(good)
    nested = json.dumps({**doc, "vsim": {**doc["vsim"], "meta": {
        **doc["vsim"]["meta"], "x": "@"}}}).replace('"@"', "[" * 5000 + "]" * 5000)
    raw_trace("deep-nesting.vsim.json", nested.encode(), "a meta value nested 5,000 deep",
              ["invalid JSON: nested deeper than this reader can follow"])
    raw_trace("digits-5000.vsim.json",
              good.replace(b'"bytes": 1500', b'"bytes": ' + DIGITS.encode(), 1),
              "a tensor size of 5000 digits", ["invalid JSON: an integer with more than 4300 "
                                               "digits"])
    raw_trace("bytes-1e400.vsim.json", good.replace(b'"bytes": 1500', b'"bytes": 1e400', 1),
              "a size of 1e400 (a float that overflows to Infinity)",
              ["vsim.tensors[2].bytes: expected an integer, got inf"])
    raw_trace("dur-1e400.vsim.json", good.replace(b'"dur": 5', b'"dur": 1e400', 1),
              "a duration of 1e400", ["traceEvents[1].dur: must be finite"])
    raw_trace("latin1.vsim.json", good.replace(b"bad-input corpus", b"caf\xe9"),
              "a trace in Latin-1 (not UTF-8)", ["not a text JSON file"])
    padded = good.rstrip(b"\n") + b" " * 4_000_000 + b"\n"
    raw_trace("gzip-bomb.vsim.json.gz", gz(padded),
              "4 MB of text in 4 KB of gzip, read with a 100,000-byte limit (as a 4 GB bomb "
              "would be with the default 1 GiB)",
              ["more than 100000 bytes", "once decompressed", "VSIM_MAX_INPUT_BYTES"], LIMIT)
    raw_trace("plain-too-large.vsim.json", good.rstrip(b"\n") + b" " * 8000 + b"\n",
              "12 KB of plain text read with a 10,000-byte limit",
              ["more than 10000 bytes"], {"VSIM_MAX_INPUT_BYTES": "10000"})

    # ---------------------------------------------------------------- imports
    imp = ["import", "{kind}", "{file}", "-o", "{out}/i.vsim.json.gz"]

    def import_case(file: str, data: bytes, kind: str, what: str, expect: list[str],
                    env: dict[str, str] | None = None) -> None:
        case(file, data, what, ["{file}: ", *expect], [a.replace("{kind}", kind) for a in imp])
        if env:
            cases[-1]["env"] = env
    kineto = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0,
                               "dur": 2.0, "pid": 1, "tid": 1, "args": {}}]}
    text = json.dumps(kineto)
    import_case("kineto-infinity.json", text.replace('"ts": 1.0', '"ts": Infinity').encode(),
                "kineto", "Infinity as a Kineto timestamp",
                ["traceEvents[0].ts: Infinity is not a finite number"])
    import_case("kineto-nan.json", text.replace('"dur": 2.0', '"dur": NaN').encode(),
                "kineto", "NaN as a Kineto duration",
                ["traceEvents[0].dur: NaN is not a finite number"])
    import_case("kineto-deep.json", ('{"traceEvents": ' + "[" * 5000 + "]" * 5000
                                     + "}").encode(), "kineto", "events nested 5,000 deep",
                ["nested deeper than this reader can follow"])
    import_case("kineto-digits.json", text.replace('"tid": 1', '"tid": ' + DIGITS).encode(),
                "kineto", "a 5000-digit thread id", ["an integer with more than 4300 digits"])
    import_case("kineto-gzip-bomb.json.gz", gz(text.encode() + b" " * 4_000_000), "kineto",
                "a Kineto trace of 4 MB in 4 KB of gzip, with a 100,000-byte limit",
                ["more than 100000 bytes"], LIMIT)
    snap = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512,
                                                "stream": 0, "time_us": float("inf")}]]}
    import_case("snapshot-infinity.pickle", pickle.dumps(snap, protocol=4), "torch-snapshot",
                "Infinity as an allocator event's time",
                ["device_traces[0][0].time_us: expected a finite number, got inf"])

    # ---------------------------------------------------------------- sweeps
    sweep = ["sweep", "{file}", "-o", "{out}/r.csv", "--workers", "1"]

    def sweep_case(file: str, data: bytes, what: str, expect: list[str]) -> None:
        case(file, data, what, ["{file}: ", *expect], sweep)
    sweep_case("sweep-billion-laughs.yaml", (BOMB + "trace: *g\n").encode(),
               "a sweep file whose trace axis is an alias bomb",
               ["YAML aliases expand to more than 1000000 nodes"])
    sweep_case("sweep-latin1.yaml", "trace: caf\xe9.vsim.json\n".encode("latin-1"),
               "a sweep file in Latin-1", ["not a text YAML file"])
    sweep_case("sweep-5000-digits.yaml", f"memory: {DIGITS}\n".encode(),
               "a 5000-digit capacity", ["an integer with more than 4300 digits"])
    sweep_case("sweep-recursive.yaml", b"policy: &p [none, *p]\n",
               "a sweep axis that contains itself", ["refers to a node that contains it"])
    grid = ["sweep", "--trace", "{good}", "--hw", "{hw}", "--memory", "1MiB", "--policy",
            "none", "--workers", "1"]
    case("foreign.csv", b"name,score\nalice,3\nbob,4", "a CSV that is not a vsim sweep, "
         "without a final newline (once cut before its header was checked)",
         ["{file}: ", "not a vsim sweep CSV"], [*grid, "-o", "{file}"])
    case("foreign.jsonl", b'{"a": 1}\n{"b": 2}\n{"c"', "a JSON-lines file that is not a vsim "
         "sweep", ["{file}: ", "line 1: not a vsim sweep row"], [*grid, "-o", "{file}"],
         cid="foreign-jsonl")
    case("binary-output.csv", b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
         "a binary file given as the sweep output (once truncated, then a crash)",
         ["{file}: ", "not a vsim sweep output (binary data)"], [*grid, "-o", "{file}"])
    for cid, address in (("scheduler-no-port", "tcp://host"), ("scheduler-port-word",
                                                               "tcp://host:port"),
                         ("scheduler-scheme", "http://h:8786"), ("scheduler-port-0", "h:0")):
        option_case(cid, [], f"--scheduler {address}",
                    ["--scheduler: ", repr(address)], [*grid, "-o", "{out}/r.csv",
                                                       "--scheduler", address])
    option_case("sweep-link-denormal", [], "a sweep hardware with link=1e-320GB/s",
                ["link=1e-320GB/s", "out of range"],
                ["sweep", "--trace", "{good}", "--hw", "{hw}:link=1e-320GB/s", "--memory",
                 "1MiB", "--policy", "none", "-o", "{out}/r.csv"])

    # ---------------------------------------------------------------- validation cases
    validate = ["validate", "{file}"]
    case_head = ("id: c\ntrace: tests/data/bad/good.vsim.json\nhardware: h100-sxm\n"
                 "policy: none\n")
    case("case-billion-laughs.yaml", (case_head + "measured: trace\n" + BOMB).encode(),
         "a validation case with an alias bomb", ["{file}: ", "YAML aliases expand"], validate)
    case("case-latin1.yaml", (case_head + "note: caf\xe9\nmeasured: trace\n").encode("latin-1"),
         "a validation case in Latin-1", ["{file}: ", "not a text YAML file"], validate)
    case("case-tolerance-list.yaml",
         (case_head + "measured: trace\ntolerance: [10%]\n").encode(),
         "tolerances as a list", ["{file}: ", "tolerance: expected a mapping"], validate)
    case("measured-list.json", b"[1, 2]\n", "a JSON list given as a validation case",
         ["{file}: ", "a case must be a mapping"], validate)
    case("case-measured-list.yaml",
         (case_head + "measured: tests/data/bad/measured-list.json\n").encode(),
         "a case whose measured file is a JSON list, not an object",
         ["measured-list.json: top level: expected an object"], [*validate, "--json"])
    case("measured-infinity.json", b'{"iteration_time_us": Infinity, "peak_allocated_bytes": 1,'
         b' "fits": true}\n', "a measured file given as a validation case",
         ["{file}: ", "missing required field 'id'"], validate)
    case("case-measured-infinity.yaml",
         (case_head + "measured: tests/data/bad/measured-infinity.json\n").encode(),
         "a case whose measured file holds Infinity",
         ["measured-infinity.json: iteration_time_us: Infinity is not a finite number"],
         [*validate, "--json"])  # --json: no progress line on stderr
