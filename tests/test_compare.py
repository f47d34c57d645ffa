import dataclasses
import gzip
import json

import pytest
from builders import assert_chrome_trace_events, chain

from vsim.allocator import make_allocator
from vsim.cli import main
from vsim.compare import compare, merged_chrome_trace, trace_metrics
from vsim.engine import simulate
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.trace import save_trace
from vsim.trace.schema import Measured

MIB = 2**20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 'measured' 3-layer chain (100 us forward, 200 us backward per layer: 900 us of ops;
    input + 3 activations of 64 MiB: 256 MiB peak) with a measured block of 1000 us and
    300 MiB, and its prediction under vDNN at 1 GiB."""
    folder = tmp_path_factory.mktemp("runs")
    t = chain(3, 64 * MIB, 100.0, 200.0)
    measured = dataclasses.replace(
        t, meta={**t.meta, "source": "measured", "batch_size": 8, "device": "cpu"},
        measured=Measured(iteration_time_us=1000.0, peak_allocated_bytes=300 * MIB,
                          peak_reserved_bytes=320 * MIB))
    predicted = simulate(measured, load_hardware("h100-sxm"), make_policy("vdnn"),
                         make_allocator("exact"), 2**30).predicted
    paths = {"measured": str(folder / "m.vsim.json.gz"), "predicted": str(folder /
                                                                         "p.vsim.json.gz")}
    save_trace(measured, paths["measured"])
    save_trace(predicted, paths["predicted"])
    return measured, predicted, paths


def test_measured_block_wins_for_measured_traces_only(runs):
    measured, predicted, _ = runs
    m, block = trace_metrics(measured)
    assert block == ["iteration_time_us", "peak_allocated_bytes", "peak_reserved_bytes"]
    assert m["iteration_time_us"] == 1000.0 and m["peak_allocated_bytes"] == 300 * MIB
    assert m["compute_time_us"] == 900.0  # from the ops: no measured figure for it
    # The predicted trace carries the measured block of its input, but is scored on itself.
    p, block = trace_metrics(predicted)
    assert block == [] and predicted.measured is not None
    assert p["peak_allocated_bytes"] != 300 * MIB and p["d2h_bytes"] > 0


def test_deltas(runs):
    measured, predicted, _ = runs
    result = compare(measured, predicted, "m", "p")
    d = result["delta"]["iteration_time_us"]
    assert d["a"] == 1000.0 and d["diff"] == pytest.approx(d["b"] - 1000.0)
    assert d["rel"] == pytest.approx(d["diff"] / 1000.0)
    assert result["delta"]["d2h_bytes"]["a"] == 0 and result["delta"]["d2h_bytes"]["rel"] is None
    assert result["a"]["label"].startswith("measured test batch 8")
    assert "policy vdnn" in result["b"]["label"]


def test_merged_file_is_chrome_trace_with_two_processes(runs):
    """What ui.perfetto.dev's JSON importer needs (as tests/test_trace_io.py checks for one
    trace): a traceEvents list, name/ph/pid on every event, numeric ts, X events with dur,
    no overlapping slices within one (pid, tid), strict JSON; here also: the two runs in pids 1
    and 2 with process names saying which is which."""
    measured, predicted, _ = runs
    doc = merged_chrome_trace(measured, predicted, "m.vsim.json.gz", "p.vsim.json.gz")
    events = doc["traceEvents"]
    assert {ev["pid"] for ev in events} == {1, 2}
    names = {ev["pid"]: ev["args"]["name"] for ev in events
             if ev["ph"] == "M" and ev["name"] == "process_name"}
    assert names[1].startswith("A: measured") and "m.vsim.json.gz" in names[1]
    assert names[2].startswith("B: predicted") and "p.vsim.json.gz" in names[2]
    assert_chrome_trace_events(events)
    # Every op of both runs is there: 6 measured ops, 6 predicted ops (+ copies in pid 2).
    ops = [ev for ev in events if ev.get("cat") == "op"]
    assert sum(ev["pid"] == 1 for ev in ops) == len(measured.ops) == 6
    assert sum(ev["pid"] == 2 for ev in ops) == len(predicted.ops)
    assert any(ev.get("cat") == "copy" and ev["pid"] == 2 for ev in events)
    json.dumps(doc, allow_nan=False)


def test_cli_compare_and_merge(runs, tmp_path, capsys):
    _, _, paths = runs
    merged = tmp_path / "both.json.gz"
    assert main(["compare", paths["measured"], paths["predicted"], "--merge",
                 str(merged)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("iteration_time_us*"))
    assert "1.00 ms" in line or "1000" in line
    assert "measured block" in out
    doc = json.loads(gzip.decompress(merged.read_bytes()))
    assert {ev["pid"] for ev in doc["traceEvents"]} == {1, 2}
    assert main(["compare", paths["measured"], paths["predicted"], "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["delta"]["iteration_time_us"]["a"] == 1000.0
    assert main(["compare", paths["measured"], str(tmp_path / "missing.vsim.json")]) == 2
    assert "missing.vsim.json" in capsys.readouterr().err
    assert main(["compare", paths["measured"], paths["predicted"], "--merge",
                 str(tmp_path / "no" / "x.json")]) == 2
