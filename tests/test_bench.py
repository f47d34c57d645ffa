"""`vsim bench` reports every figure issue 8 names (its values are machine-dependent: the
command shows them, tests only check they are there and sane)."""

import json
from pathlib import Path

from vsim.cli import main

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"simpy_events_per_s", "vsim_events_per_s", "event_rate_ratio", "vgg16_256_vdnn_ms",
        "resnet1001_s", "sweep_configs_per_s", "sim_over_measured"}


def test_bench_json_has_every_figure(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["bench", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert KEYS <= set(result)
    assert all(result[k] is not None and result[k] > 0 for k in KEYS)
    assert result["event_rate_ratio"] == result["vsim_events_per_s"] / result["simpy_events_per_s"]
    assert result["sweep"]["configs"] == 9 * 3 * 3  # 8..24 GiB by 2, three policies, three traces


def test_simulated_events_count_what_the_run_did():
    """Every op start and end, every copy start and end, every allocator event: a vdnn run with
    copies counts its copies too, and more events than SimPy schedules for it."""
    from vsim.bench import count_events
    from vsim.trace import load_trace

    trace = load_trace(ROOT / "traces" / "vgg16-b64-h100.vsim.json.gz")
    plain, _ = count_events(trace, "h100-sxm", "none", None)
    # 80 ops, each at least a start and an end, plus an alloc per tensor it holds
    assert plain >= 2 * len(trace.ops) + len(trace.tensors)
    offloading, simpy_events = count_events(trace, "h100-sxm", "vdnn:mode=all", None)
    assert offloading > plain
    assert offloading > simpy_events
