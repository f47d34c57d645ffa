"""The compiled replay (vsim/runtime/native/replay.cpp, recompute.py's _ProgramLog): the first
native iteration replays in Python and logs where each replayed call's arguments came from;
later native iterations capture the replayed frames' arguments in C++ and run the logged
programs there. Against the Python replay (VSIM_NATIVE_REPLAY=0) on the CPU stand-ins for
torchvision's in-place blocks (tests/inplacemodels.py) and a transformer with dropout: the same
calls re-run, gradients bitwise equal to the run without a plan either way."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from vsim.record.recorder import record_model  # noqa: E402
from vsim.runtime import native  # noqa: E402
from vsim.runtime.measure import Session  # noqa: E402


@functools.cache
def _case(model: str) -> tuple[Session, int]:
    if native.load() is None or not hasattr(native.load(), "program"):
        pytest.fail(f"the compiled replay could not be built: {native.error()} "
                    f"{native.views_error()}")
    trace = record_model(model, 4, device="cpu", warmup=1, iters=2, timing_iters=1)
    resident = sum(t.size_bytes for t in trace.tensors if t.producer is None)
    assert trace.measured is not None
    cap = int(resident + 0.3 * (trace.measured.peak_allocated_bytes - resident))
    return Session(None, None, trace, device="cpu", warmup=1), cap


@pytest.mark.parametrize("model,policy", [
    ("inplacemodels:bottlenecks", "recompute:strategy=sqrt"),  # residual adds after batch norm
    ("inplacemodels:bottlenecks", "superneurons"),
    ("inplacemodels:cnblocks", "recompute:strategy=sqrt"),     # stochastic depth: random calls
    ("inplacemodels:mbconvs", "recompute:strategy=sqrt"),      # in-place activations
    ("tiny-transformer", "recompute:strategy=sqrt"),           # dropout
])
def test_a_compiled_replay_makes_the_python_replays_calls_with_the_same_gradients(
        monkeypatch, model: str, policy: str) -> None:
    s, cap = _case(model)
    got = s.run(policy, cap, iters=2, warmup=1)  # calibrate, compile, run compiled
    monkeypatch.setenv("VSIM_NATIVE_REPLAY", "0")
    ref = s.run(policy, cap, iters=2, warmup=1)
    assert got["executed"]["tracker"] == "native", got["executed"]["tracker_note"]
    assert got["executed"]["replay"] == "compiled", got["executed"]["replay_note"]
    assert ref["executed"]["replay"] == "python"
    assert "VSIM_NATIVE_REPLAY=0" in ref["executed"]["replay_note"]
    assert got["check"]["bitwise_equal"], got["check"]
    assert ref["check"]["bitwise_equal"], ref["check"]
    for k in ("recomputed_calls", "inplace_rerun", "inplace_missed", "skipped"):
        assert got["executed"][k] == ref["executed"][k], k
    assert got["executed"]["recomputed_calls"] > 0


def test_a_replay_the_program_cannot_express_stays_in_python(monkeypatch) -> None:
    """Without a storage swap, a rebuilt tensor is copied into place, which a program does not
    do: the replay stays in Python, says why, and trains the same."""
    from vsim.runtime import recompute

    s, cap = _case("inplacemodels:bottlenecks")
    monkeypatch.setattr(recompute, "_SWAP", [None])
    got = s.run("recompute:strategy=sqrt", cap, iters=2, warmup=1)
    assert got["executed"]["tracker"] == "native", got["executed"]["tracker_note"]
    assert got["executed"]["replay"] == "python"
    assert "copied into place" in got["executed"]["replay_note"]
    assert got["check"]["bitwise_equal"], got["check"]
