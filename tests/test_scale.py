"""Issue 18's 1M-op target: the shortcuts that make large traces cheap keep every result.

Speed itself is shown by tools and docs/performance.md, not timed here; these check that each
shortcut is sound: the same answers as the long way."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from vsim.allocator import make_allocator
from vsim.cli import main
from vsim.engine import simulate
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.sweep import AMPLE_BYTES
from vsim.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "traces" / "handmade-convnet.vsim.json.gz")
GIB = 2**30


def _big_trace_module():
    spec = importlib.util.spec_from_file_location("make_big_trace",
                                                  ROOT / "tools" / "make_big_trace.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("allocator", ["caching", "exact"])
@pytest.mark.parametrize("memory", [None, "20.5GiB", "14GiB", "12GiB"])
def test_run_baseline_is_no_policy_at_ample_memory(capsys, allocator, memory):
    """vsim run reuses its own no-policy row as the ample-memory baseline only when the
    capacity decided nothing there: the baseline is always what a run at ample memory gives."""
    args = ["run", EXAMPLE, "--hw", "h100-sxm", "--allocator", allocator, "--json"]
    if memory:
        args += ["--memory", memory]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    hw = load_hardware("h100-sxm")
    ample = simulate(load_trace(EXAMPLE), hw, make_policy("none"), make_allocator(allocator),
                     AMPLE_BYTES).report
    assert report["baseline_iteration_time_us"] == ample["iteration_time_us"]


def test_capacity_bound_says_when_the_capacity_decided_something():
    trace, hw, none = load_trace(EXAMPLE), load_hardware("h100-sxm"), make_policy("none")

    def bound(allocator: str, capacity: int) -> tuple[bool, bool]:
        r = simulate(trace, hw, none, make_allocator(allocator), capacity)
        return r.report["fits"], r.capacity_bound

    assert bound("caching", AMPLE_BYTES) == (True, False)
    assert bound("exact", AMPLE_BYTES) == (True, False)
    assert bound("exact", 12 * GIB) == (False, True)  # out of memory
    assert bound("cnmem", AMPLE_BYTES)[1] is True  # the pool is the capacity
    # 100 MiB under its peak reserved (20.57 GiB), the caching allocator frees its cache once
    # and the run fits: bound, so not a stand-in for ample memory
    peak = simulate(trace, hw, none, make_allocator("caching"), AMPLE_BYTES).report
    assert bound("caching", peak["peak_reserved_bytes"] - 100 * 2**20) == (True, True)


def test_many_synced_streams_load_and_a_missing_dep_is_still_caught(tmp_path):
    """The cross-stream check searches deps newest first (linear on a chain of all-reduces);
    what it accepts and refuses is unchanged."""
    big = _big_trace_module()
    path = tmp_path / "chain.vsim.json"
    with open(path, "w") as f:
        big.write(f, 4000, 2, reduce_every=8)
    trace = load_trace(path)
    assert len({op.stream for op in trace.ops}) == 2
    doc = json.loads(path.read_text())
    # drop the dep of the last all-reduce on the backward op whose gradient it reads
    reduce_ops = [ev for ev in doc["traceEvents"] if ev.get("cat") == "op"
                  and ev.get("tid") == 1]
    reduce_ops[-1]["args"]["deps"] = []
    bad = tmp_path / "bad.vsim.json.gz"
    with gzip.open(bad, "wt") as f:
        json.dump(doc, f)
    from vsim.errors import TraceError
    with pytest.raises(TraceError, match="no dependency on it"):
        load_trace(bad)
