"""The command line's promises (issue 18): no command writes over one of its inputs, a failed
command leaves none of its outputs, JSON is strict, bad sizes get vsim's own one-line message,
and the defaults and tables answer a first run correctly."""

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest

from vsim.cli import build_parser, main
from vsim.cli.common import check_outputs, strict_json
from vsim.cli.record import _KINETO_LINE, _phase_line
from vsim.errors import ConfigError, VsimError
from vsim.trace import load_trace, save_trace

ROOT = Path(__file__).resolve().parent.parent
TINY = Path(__file__).parent / "data" / "tiny.vsim.json"
EXAMPLE = ROOT / "traces" / "handmade-convnet.vsim.json.gz"
CASE = ROOT / "validation" / "cases" / "alexnet-b128-none.yaml"

# Every flag that names a file a verb writes. A new verb or output flag must get a case below
# (or a reason here): test_every_output_flag_is_covered fails otherwise.
OUTPUT_DESTS = ("output", "timeline", "plot", "merge")
NO_INPUTS = {("calibrate", "-o"): "reads no file: measures this GPU"}


def one_error_line(capsys, fragment=""):
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("vsim: error: "), err
    assert "Traceback" not in err and fragment in err, err
    return err


@pytest.fixture
def files(tmp_path):
    """Copies of every kind of input a verb reads, in a scratch folder."""
    trace = tmp_path / "t.vsim.json"
    shutil.copy(TINY, trace)
    other = tmp_path / "u.vsim.json"
    shutil.copy(TINY, other)
    hw = tmp_path / "hw.yaml"
    shutil.copy(ROOT / "hardware" / "h100-sxm.yaml", hw)
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"trace: {trace}\nhw: h100-sxm\noutput: {tmp_path / 'r.csv'}\n")
    bench = tmp_path / "bench.yaml"
    bench.write_text("kind: benchmarks\nnetworks: []\n")
    capture = tmp_path / "capture.json"
    capture.write_text('{"traceEvents": []}')
    module = tmp_path / "vsim18b_model.py"
    module.write_text("def make():\n    raise SystemExit('must not run')\n")
    case = tmp_path / "case.yaml"
    shutil.copy(CASE, case)
    return {"T": str(trace), "U": str(other), "HW": str(hw), "PLAN": str(plan),
            "SWEEP": str(sweep), "BENCH": str(bench), "CAPTURE": str(capture),
            "MODULE": str(module), "CASE": str(case), "dir": tmp_path}


# (verb, output flag, command line with the output pointed at an input, the input it names)
CLOBBERS = [
    ("run", "--timeline", "run {T} --hw h100-sxm --timeline {T}", "T"),
    ("run", "--plot", "run {T} --hw h100-sxm --plot {T}", "T"),
    ("run", "--timeline", "run {T} --hw {HW} --timeline {HW}", "HW"),
    ("run", "--plot", "run {T} --hw h100-sxm --policy plan:file={PLAN} --plot {PLAN}", "PLAN"),
    ("compare", "--merge", "compare {T} {U} --merge {T}", "T"),
    ("compare", "--merge", "compare {T} {U} --merge {U}", "U"),
    ("import", "-o", "import kineto {CAPTURE} -o {CAPTURE}", "CAPTURE"),
    ("import", "-o", "import torch-snapshot {CAPTURE} --output {CAPTURE}", "CAPTURE"),
    ("search", "-o", "search {T} --hw h100-sxm -o {T}", "T"),
    ("search", "-o", "search {T} --hw {HW} -o {HW}", "HW"),
    ("synth", "-o", "synth vgg16 --batch 1 --hw {HW} -o {HW}", "HW"),
    ("record", "-o", "record vsim18b_model:make --batch 1 -o {MODULE}", "MODULE"),
    ("measure", "-o", "measure vgg16 --batch 1 --policy none --trace {T} -o {T}", "T"),
    ("measure", "-o", "measure vgg16 --batch 1 --policy plan:file={PLAN} -o {PLAN}", "PLAN"),
    ("fit-compute", "-o", "fit-compute {T} --hw h100-sxm -o {T}", "T"),
    ("fit-compute", "-o", "fit-compute --benchmarks {BENCH} --hw h100-sxm -o {BENCH}", "BENCH"),
    ("sweep", "-o", "sweep --trace {T} --hw h100-sxm -o {T}", "T"),
    ("sweep", "-o", "sweep {SWEEP} -o {SWEEP}", "SWEEP"),
    ("sweep", "--plot", "sweep --trace {T} --hw h100-sxm -o {dir}/r.csv --plot {T}", "T"),
    ("validate", "--plot", "validate {CASE} --plot {CASE}", "CASE"),
]


def output_flags():
    """(verb, first option string) of every output flag the parser has."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {(verb, action.option_strings[0]) for verb, parser in sub.choices.items()
            for action in parser._actions if action.dest in OUTPUT_DESTS}


def test_every_output_flag_is_covered():
    covered = {(verb, flag) for verb, flag, _, _ in CLOBBERS} | set(NO_INPUTS)
    assert output_flags() == covered


@pytest.mark.parametrize("verb,flag,line,victim", CLOBBERS,
                         ids=[f"{v}{f}-{x}" for v, f, _, x in CLOBBERS])
def test_no_command_writes_over_its_inputs(files, capsys, monkeypatch, verb, flag, line,
                                           victim):
    monkeypatch.syspath_prepend(str(files["dir"]))  # the record case's module:callable
    path = Path(files[victim])
    before = path.read_bytes()
    argv = line.format(**files).split()
    assert main(argv) == 2
    # refused by the check, before anything is read or computed
    one_error_line(capsys, "give a folder" if (verb, flag) == ("sweep", "--plot")
                   else "one of this command's inputs")
    assert path.read_bytes() == before
    assert sorted(p.name for p in files["dir"].iterdir() if p.name.startswith(".")) == []


def test_the_same_file_by_another_name_is_refused(files, capsys):
    link = files["dir"] / "link.vsim.json"
    link.hardlink_to(files["T"])
    before = Path(files["T"]).read_bytes()
    assert main(["run", files["T"], "--hw", "h100-sxm", "--timeline", str(link)]) == 2
    one_error_line(capsys, "one of this command's inputs")
    # a relative spelling of the input
    rel = Path(files["T"]).relative_to(Path.cwd()) if Path(files["T"]).is_relative_to(
        Path.cwd()) else Path(files["T"]).parent / "." / Path(files["T"]).name
    assert main(["run", files["T"], "--hw", "h100-sxm", "--plot", str(rel)]) == 2
    one_error_line(capsys)
    assert Path(files["T"]).read_bytes() == before


def test_two_outputs_that_are_one_file_are_refused(files, capsys):
    out = str(files["dir"] / "x.vsim.json.gz")
    assert main(["run", files["T"], "--hw", "h100-sxm", "--timeline", out, "--plot", out]) == 2
    one_error_line(capsys, "also the output of --timeline")
    assert not Path(out).exists()


def test_check_outputs_allows_distinct_files(tmp_path):
    check_outputs([("-o", str(tmp_path / "a")), ("--plot", str(tmp_path / "b"))],
                  [str(tmp_path / "c"), None])
    with pytest.raises(ConfigError):
        check_outputs([("-o", str(tmp_path / "a"))], [str(tmp_path / "x" / ".." / "a")])


def test_a_failed_run_leaves_none_of_its_outputs(files, capsys, monkeypatch):
    """--timeline ok --plot that cannot be written: the timeline is not left written."""
    import vsim.plots

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device", "mem.png")

    monkeypatch.setattr(vsim.plots, "plot_run", broken)
    timeline, plot = files["dir"] / "t.vsim.json.gz", files["dir"] / "mem.png"
    assert main(["run", files["T"], "--hw", "h100-sxm", "--timeline", str(timeline),
                 "--plot", str(plot)]) == 2
    one_error_line(capsys, "No space left on device")
    assert not timeline.exists() and not plot.exists()
    assert not [p for p in files["dir"].iterdir() if p.name.startswith(".")]
    # an existing timeline is left as it was
    timeline.write_bytes(b"old")
    assert main(["run", files["T"], "--hw", "h100-sxm", "--timeline", str(timeline),
                 "--plot", str(plot)]) == 2
    capsys.readouterr()
    assert timeline.read_bytes() == b"old"


def test_a_good_run_writes_every_output(files, capsys):
    timeline, plot = files["dir"] / "t.vsim.json.gz", files["dir"] / "mem.png"
    assert main(["run", files["T"], "--hw", "h100-sxm", "--timeline", str(timeline),
                 "--plot", str(plot)]) == 0
    assert load_trace(timeline).meta["source"] == "predicted"
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in files["dir"].iterdir() if p.name.startswith(".")]


def test_strict_json_names_the_non_finite_value():
    assert strict_json({"a": [1, 2.5]}) == '{"a": [1, 2.5]}'
    with pytest.raises(VsimError, match=r"at a\.1\.b"):
        strict_json({"a": [0, {"b": math.inf}]})


def test_run_json_with_a_non_finite_result_fails_instead_of_printing_nan(files, capsys,
                                                                         monkeypatch):
    import vsim.engine

    real = vsim.engine.simulate

    def poisoned(*args, **kwargs):
        result = real(*args, **kwargs)
        result.report["avg_allocated_bytes"] = math.nan
        return result

    monkeypatch.setattr(vsim.engine, "simulate", poisoned)
    assert main(["run", files["T"], "--hw", "h100-sxm", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "avg_allocated_bytes" in captured.err
    assert captured.err.count("\n") == 1


@pytest.mark.parametrize("argv,fragment", [
    (["run", "{T}", "--hw", "h100-sxm", "--memory", "-1GiB"], "--memory: size '-1GiB'"),
    (["run", "{T}", "--hw", "h100-sxm", "--memory", "-.5GiB"], "--memory"),
    (["run", "{T}", "--hw", "h100-sxm", "--memory", "1e400GiB"], "--memory"),
    (["run", "{T}", "--hw", "h100-sxm", "--memory", "twelve"], "--memory"),
    (["sweep", "--trace", "{T}", "--hw", "h100-sxm", "--memory", "-1GiB", "-o", "{dir}/r.csv"],
     "-1GiB"),
    (["search", "{T}", "--hw", "h100-sxm", "--budget", "-5s"], "--budget"),
    (["run", "{T}", "--hw", "h100-sxm:link=-16GB/s"], "link"),
    (["run", "{T}", "--hw", "h100-sxm:colour=red"], "colour"),
    (["run", "{T}", "--hw", "h100-sxm:link=16GB/s", "--set", "gpu.memory=24GiB"], "--set"),
])
def test_bad_sizes_and_hardware_get_vsims_own_message(files, capsys, argv, fragment):
    assert main([a.format(**files) for a in argv]) == 2
    err = one_error_line(capsys, fragment)
    assert "expected one argument" not in err and "expected at least one" not in err


def test_run_takes_hypothetical_links_as_sweep_does(capsys):
    slow = run_report(capsys, str(EXAMPLE), "--hw", "h100-sxm:link=1GB/s",
                      "--policy", "vdnn:mode=all", "--allocator", "exact")
    fast = run_report(capsys, str(EXAMPLE), "--hw", "h100-sxm",
                      "--policy", "vdnn:mode=all", "--allocator", "exact")
    assert slow["hardware"] == "h100-sxm:link=1GB/s" and fast["hardware"] == "h100-sxm"
    assert slow["fits"] and fast["fits"]
    assert slow["iteration_time_us"] > fast["iteration_time_us"]


def run_report(capsys, *args):
    assert main(["run", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_default_allocator_is_pytorchs(capsys):
    report = run_report(capsys, str(TINY), "--hw", "h100-sxm")
    assert report["allocator"].startswith("caching")
    assert not any("expandable" in n for n in report["notes"])
    exact = run_report(capsys, str(TINY), "--hw", "h100-sxm", "--allocator", "exact")
    assert any("expandable_segments:True" in n for n in exact["notes"])  # which one models it
    assert main(["list", "--json"]) == 0
    allocators = {a["name"]: a for a in json.loads(capsys.readouterr().out)["allocators"]}
    assert "expandable_segments:True" in allocators["expandable"]["note"]
    assert "bound" in allocators["exact"]["note"]
    assert "default" in allocators["caching"]["note"]


def test_quick_start_answers_as_pytorch_did(capsys):
    """vDNN++ on VGG-16(256) in 12 GiB: out of memory with PyTorch's default allocator, as
    measured on the H100 (validation/measured/vgg16-b256-vdnnpp-12g.json); it fits with the
    model of expandable segments, as measured too (946 ms: predicted within 10%)."""
    trace = str(ROOT / "traces" / "vgg16-b256-h100.vsim.json.gz")
    measured = json.loads((ROOT / "validation" / "measured" /
                           "vgg16-b256-vdnnpp-12g.json").read_text())
    assert measured["fits"] is False
    default = run_report(capsys, trace, "--hw", "h100-sxm", "--memory", "12GiB", "--policy",
                         "vdnnpp")
    assert default["fits"] is False
    expandable = run_report(capsys, trace, "--hw", "h100-sxm", "--memory", "12GiB", "--policy",
                            "vdnnpp", "--allocator", "expandable")
    measured = json.loads((ROOT / "validation" / "measured" /
                           "vgg16-b256-vdnnpp-12g-expandable.json").read_text())
    assert expandable["fits"] is True and measured["fits"] is True
    assert abs(expandable["iteration_time_us"] / measured["iteration_time_us"] - 1) < 0.10


def test_run_table_fits_100_columns_with_slowdown_and_oom_rows(capsys):
    trace = str(ROOT / "traces" / "vgg16-b256-h100.vsim.json.gz")
    assert main(["run", trace, "--hw", "h100-sxm", "--memory", "12GiB", "--policy",
                 "none", "--policy", "vdnnpp", "--policy",
                 "superneurons:recompute=auto,algo=auto", "--allocator", "exact",
                 "--verbose"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(map(len, out)) <= 100
    none = next(line for line in out if line.startswith("none:"))
    # out of memory: where it stopped, and no time
    assert "out of memory at op" in none and "(layer " in none
    assert " ms " not in none and not none.rstrip().endswith("ms")
    vdnnpp = next(line for line in out if line.startswith("vdnnpp:") and "x " in line)
    assert float(vdnnpp.split()[3].rstrip("x")) > 1  # slowdown against no policy
    assert any(line.startswith("slowdown: ") for line in out)
    assert not any(".py" in line for line in out)  # notes point at no source file


def test_a_cpu_trace_on_a_gpu_profile_says_its_times_are_cpu_times(tmp_path, capsys):
    import dataclasses

    trace = load_trace(TINY)
    cpu = dataclasses.replace(trace, meta={**trace.meta, "source": "measured",
                                           "device": "cpu", "device_type": "cpu",
                                           "hardware": None})
    path = tmp_path / "cpu.vsim.json"
    save_trace(cpu, path)
    report = run_report(capsys, str(path), "--hw", "h100-sxm")
    assert any("CPU times" in n for n in report["notes"])
    gpu = run_report(capsys, str(TINY), "--hw", "h100-sxm")
    assert not any("CPU times" in n for n in gpu["notes"])


def test_validate_writes_nothing_unless_asked(tmp_path, capsys, monkeypatch):
    png = ROOT / "validation" / "predicted-vs-measured.png"
    before = png.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(CASE), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert png.read_bytes() == before and list(tmp_path.iterdir()) == []
    row = result["cases"][0]
    assert row["family"] == "plain-cnn" and row["policy"] == "none"
    assert result["by_family"]["plain-cnn"]["n"] == 1
    assert set(result["by_policy"]) == {"none"}
    assert row["hardware"] == "h100-sxm" and set(result["by_hardware"]) == {"h100-sxm"}
    assert main(["validate", str(CASE), "--plot", "p.png"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "by family" in out and "by policy" in out and "by hardware" in out


def test_record_prints_one_line_per_phase():
    assert _phase_line("structure check: unknown_frees=0", False) is None
    assert _phase_line("timing: profiled span 1 ms", False) is None
    assert _phase_line("trace: 3 ops, 4 tensors; join {'matched': 3}", False) == \
        "trace: 3 ops, 4 tensors"
    assert _phase_line("structure check: x", True) == "structure check: x"
    assert _KINETO_LINE.match(b"USDT:2026-11-24 23:07:26 24513:24513 "
                              b"SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    assert not _KINETO_LINE.match(b"UserWarning: something\n")
