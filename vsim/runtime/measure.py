"""`vsim measure`: train with a policy's plan carried out for real, and record what it cost.

    result = measure("vgg16", 256, "vdnn:mode=all", memory_bytes=12 * 2**30,
                     trace_path="traces/vgg16-b256-h100.vsim.json.gz")

The trace (given, or recorded first by the recorder) is planned with
`make_policy(spec).plan(trace, load_hardware(hw), capacity)`, exactly as `vsim run` plans it,
and vsim.runtime.executor carries the plan out while the model trains with the step the trace
recorded (vsim.record.step.training_step: the trace meta's model, precision -- autocast, grad
scaler --, optimizer and sequence length; synthetic data). A `Session` holds one model, batch
and trace on one device and measures several cases in one process (the suite runs so; `python
-m vsim.runtime.measure SUITE.yaml OUT_DIR`).

Per case: the process is capped with `torch.cuda.set_per_process_memory_fraction` (`--memory`),
the caches are emptied, `warmup` iterations run, then `iters` timed iterations, each
synchronised before and after, its peak memory read after `reset_peak_memory_stats` (as the
recorder measures). Out of memory is a result (fits false, with the op it happened at). Then,
unless told not to, one more iteration with deterministic kernels and no cap checks that the
loss and every parameter gradient equal those of the same iteration without a policy, from the
same weights (the reference is taken twice, to see how far the GPU's own nondeterministic
kernels move it).

The result is a JSON object (`validation/measured/*.json`): iteration_time_us (median),
iteration_times_us, peak_allocated_bytes and peak_reserved_bytes (medians of per-iteration
peaks), pinned_host_peak_bytes, h2d_bytes, d2h_bytes (per iteration), fits, oom, executed (what
the executor did), check, notes (what was approximated), provenance.

In parts: session.py (Session: one case, or PyTorch's built-ins), results.py (the result's
parts, the JSON file), suite.py (the suite and its command line); here `measure`, one case.
"""

from __future__ import annotations

from typing import Any

from ..trace import load_trace
from .results import compare_gradients, measure_command, provenance, summary_line, write_json
from .session import Progress, Session, quiet
from .suite import main, map_in_subprocesses, run_suite

__all__ = ["Session", "compare_gradients", "main", "map_in_subprocesses", "measure",
           "measure_command", "provenance", "run_suite", "summary_line", "write_json"]


def measure(model: str | None, batch: int | None, policy: str, *,
            memory_bytes: int | None = None, hardware: str = "h100-sxm",
            trace_path: str | None = None, device: str = "cuda", warmup: int = 3,
            iters: int = 10, check: bool = True, strict: bool = True,
            progress: Progress | None = None, command: str | None = None,
            precision: str | None = None, optimizer: str | None = None,
            seq: int | None = None) -> dict[str, Any]:
    """Measure one case (see the module docstring). Model, batch and step (`precision`,
    `optimizer`, `seq`): None takes the trace's; one that differs from the trace's is a
    ConfigError. Without `trace_path` the trace is recorded first with the recorder
    (vsim.record.recorder.record_model) on `device`, with the step asked for (default fp32,
    SGD)."""
    say = progress or quiet
    if trace_path is not None:
        trace = load_trace(trace_path)
    else:
        from ..errors import ConfigError
        from ..record.recorder import record_model

        if model is None or batch is None:
            raise ConfigError("give the model and --batch, or --trace")
        say(f"recording {model} (batch {batch}) on {device} first")
        trace = record_model(model, batch, device=device, progress=say,
                             precision=precision or "fp32", optimizer=optimizer or "sgd",
                             seq=seq)
    session = Session(model, batch, trace, device=device, hardware=hardware,
                      trace_path=trace_path, warmup=warmup, check=check, progress=say,
                      precision=precision, optimizer=optimizer, seq=seq)
    result = session.run(policy, memory_bytes, iters=iters, strict=strict, command=command)
    if trace_path is None:
        result["notes"].append("trace recorded by this run (not saved)")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
