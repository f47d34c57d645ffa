"""The suite runner measures a trace with the hardware profile it was recorded on: the plan is
made for the profile given, so an H200 trace run with the H100's profile would run the H100's
plan on the H200 (it happened: validation/README.md)."""

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("torch")

from vsim.runtime.suite import run_suite  # noqa: E402
from vsim.trace import load_trace, save_trace  # noqa: E402

TINY = Path(__file__).parent / "data" / "tiny.vsim.json"


def test_a_trace_from_other_hardware_is_refused_naming_the_flag(tmp_path: Path) -> None:
    trace = load_trace(TINY)
    path = tmp_path / "tiny-h200.vsim.json"
    save_trace(dataclasses.replace(trace, meta={**trace.meta, "hardware": "h200"}), path)
    case = {"id": "tiny-none-h200", "model": "tiny", "batch": 1, "trace": str(path),
            "policy": "none"}
    failed = run_suite([case], tmp_path / "out", device="cpu", hardware="h100-sxm")
    assert failed == ["tiny-none-h200"]
    error = (tmp_path / "out" / "tiny-none-h200.error.txt").read_text()
    assert "recorded on h200, measured with --hw h100-sxm: pass --hw h200" in error
    assert not (tmp_path / "out" / "tiny-none-h200.json").exists()
    # with the trace's own profile the check passes (the made-up model then fails elsewhere)
    run_suite([case], tmp_path / "out2", device="cpu", hardware="h200")
    other = tmp_path / "out2" / "tiny-none-h200.error.txt"
    assert not other.exists() or "recorded on" not in other.read_text()
