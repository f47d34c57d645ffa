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
