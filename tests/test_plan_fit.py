"""Planners that fit (issue 14): plans the engine accepts, judged as the engine judges them."""

from __future__ import annotations

from pathlib import Path

import pytest

from vsim.allocator import make_allocator
from vsim.engine import simulate
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.trace import load_trace
from vsim.units import parse_size

TRACES = Path(__file__).resolve().parents[1] / "traces"


@pytest.mark.parametrize("spec,memory", [("vdnnpp", "5.6GiB"), ("layrub", "4.2GiB"),
                                         ("vdnn:mode=all", "5.6GiB")])
def test_prefetch_on_a_side_stream_is_anchored(spec: str, memory: str) -> None:
    """ResNeXt-50 runs layer4.0.conv2's backward on a side stream (stream 4): a prefetch hung
    on that op was issued at its launch, before the offload of tensor 693 had begun, and the
    engine refused the plan (PlanError: reads tensor 693 which is host, and no prefetch brings
    it back). Found measuring on the H100; the planners anchor prefetches on the offload's
    stream."""
    trace = load_trace(TRACES / "resnext50_32x4d-b64-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    report = simulate(trace, hw, make_policy(spec), make_allocator("caching"),
                      parse_size(memory)).report
    assert report["iteration_time_us"] > 0
