"""The runtime trains what the recorder records: a 2-layer GPT-2 from transformers (random weights,
no download) recorded on the CPU in bf16 autocast with AdamW is measured with that step (taken
from the trace's meta), and every built-in policy's plan gives the loss and gradients of the run
without a policy, bit for bit; a step that differs from the trace's is a clear error."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers not installed (extra 'hf')")

from vsim.cli import main  # noqa: E402
from vsim.errors import ConfigError  # noqa: E402
from vsim.policies import make_policy  # noqa: E402
from vsim.record.recorder import record_model  # noqa: E402
from vsim.record.step import StepConfig, step_config  # noqa: E402
from vsim.runtime.measure import Session  # noqa: E402
from vsim.trace import Trace, save_trace  # noqa: E402

POLICIES = ["vdnn:mode=all", "vdnnpp", "superneurons", "layrub", "accudnn", "hybrid",
            "recompute:strategy=sqrt", "recompute"]


@pytest.fixture(scope="module")
def gpt2() -> tuple[Trace, Session]:
    trace = record_model("gpt2-tiny", 2, device="cpu", warmup=1, iters=2, timing_iters=1,
                         precision="bf16", optimizer="adamw", seq=32)
    return trace, Session(None, None, trace, device="cpu", warmup=1)


def _tight(trace: Trace) -> int:
    resident = sum(t.size_bytes for t in trace.tensors if t.producer is None)
    assert trace.measured is not None
    return int(resident + 0.6 * (trace.measured.peak_allocated_bytes - resident))


def test_the_session_runs_the_traces_step(gpt2) -> None:
    trace, s = gpt2
    assert s.config == StepConfig("gpt2-tiny", 2, "bf16", "adamw", 32)
    assert isinstance(s.opt, torch.optim.AdamW)
    assert s.noise is not None and s.noise["bitwise_equal"]
    # the autocast casts are aten calls of the trace: the map holds bf16 copies
    assert any("_to_copy" in str(f) for f in s.opmap.funcs)


@pytest.mark.parametrize("spec", POLICIES)
def test_every_policy_trains_a_bf16_adamw_gpt2_exactly(gpt2, spec: str) -> None:
    trace, s = gpt2
    capacity = _tight(trace)
    plan = make_policy(spec).plan(trace, s.hw, capacity)
    assert plan.actions, f"{spec} planned nothing at {capacity} B"
    result = s.run(spec, capacity, iters=1, warmup=1)
    assert result["fits"], result["oom"]
    assert result["step"] == {"model": "gpt2-tiny", "batch": 2, "precision": "bf16",
                              "optimizer": "adamw", "seq": 32}
    assert result["check"]["bitwise_equal"], result["check"]
    done = result["executed"]
    assert done["offloads"] + done["drops"] + done["recomputed_calls"] > 0, done
    # natively, also where the plan acts on autocast's casts inside a linear (their frames)
    assert done["tracker"] == "native", done["tracker_note"]


def test_a_step_other_than_the_traces_is_an_error() -> None:
    meta = {"source": "measured", "model": "gpt2", "batch_size": 8, "precision": "bf16",
            "optimizer": "adamw", "seq_len": 1024}
    assert step_config(meta) == StepConfig("gpt2", 8, "bf16", "adamw", 1024)
    assert step_config(meta, "gpt2", 8, "bf16", "adamw", 1024) == step_config(meta)
    for kwargs, flag in (({"precision": "fp32"}, "--precision fp32"),
                         ({"optimizer": "sgd"}, "--optimizer sgd"),
                         ({"seq": 512}, "--seq 512"), ({"batch": 4}, "--batch 4"),
                         ({"model": "gpt2-medium"}, "model gpt2-medium")):
        with pytest.raises(ConfigError, match=flag):
            step_config(meta, **kwargs)
    # traces before issue 17: no precision, the optimizer by its label
    old = {"source": "measured", "model": "vgg16", "batch_size": 64,
           "optimizer": "SGD(lr=0.01, momentum=0.9)",
           "tf32": {"cudnn": True, "matmul": False}}
    assert step_config(old) == StepConfig("vgg16", 64, "fp32", "sgd", None)


def test_measure_command_line_takes_the_step_from_the_trace(gpt2, tmp_path, capsys) -> None:
    trace, _ = gpt2
    path = tmp_path / "t.vsim.json.gz"
    save_trace(trace, path)
    out = tmp_path / "r.json"
    assert main(["measure", "--trace", str(path), "--policy", "vdnn:mode=all", "--device", "cpu",
                 "--warmup", "1", "--iters", "1", "--no-check", "-o", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["step"]["precision"] == "bf16" and got["step"]["optimizer"] == "adamw"
    assert main(["measure", "--trace", str(path), "--policy", "none", "--device", "cpu",
                 "--precision", "fp32", "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "--precision fp32 differs from the trace" in err and "bf16" in err
