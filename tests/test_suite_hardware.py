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


def test_op_maps_are_made_a_few_at_a_time_and_a_failed_one_again_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 map processes at once ran an H100 out of memory; at most MAP_PROCESSES run at once,
    and a map that failed is made once more alone before the session maps in-process."""
    import subprocess

    from vsim.runtime import suite

    alive, most, tries = [0], [0], {}

    class FakePopen:
        def __init__(self, cmd, **_):  # type: ignore[no-untyped-def]
            self.model = cmd[cmd.index("--map") + 1]
            self.path = Path(cmd[cmd.index("--map") + 4])
            tries[self.model] = tries.get(self.model, 0) + 1
            alive[0] += 1
            most[0] = max(most[0], alive[0])
            self.returncode = None

        def communicate(self):  # type: ignore[no-untyped-def]
            alive[0] -= 1
            # m3 fails once (out of memory beside the others), m5 always
            ok = not (self.model == "m5" or (self.model == "m3" and tries["m3"] == 1))
            if ok:
                self.path.write_text("{}")
            self.returncode = 0 if ok else 1
            return None, "" if ok else "CUDA out of memory"

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    said: list[str] = []
    groups = [(f"m{i}", 1, f"t{i}") for i in range(10)]
    got = suite.map_in_subprocesses(groups, tmp_path, "cpu", "h100-sxm", 1, said.append)
    assert most[0] == suite.MAP_PROCESSES
    assert sorted(k[0] for k in got) == sorted(f"m{i}" for i in range(10) if i != 5)
    assert tries["m3"] == 2 and tries["m5"] == 2 and tries["m0"] == 1
    assert len(said) == 1 and said[0].startswith("m5 (batch 1): mapping failed, mapped in")
