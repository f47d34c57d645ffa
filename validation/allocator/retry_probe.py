"""Where PyTorch's caching allocator retries under a plan and a cap: per iteration, its counters
(allocation retries, OOMs it raised, cudaMalloc/cudaFree calls, device-wide syncs), and every
retry and OOM in the recorded history with the request that caused it.

Why: `tools/retries_check.py` finds real runs that retry several times in every iteration
(wide_resnet50_2 hybrid at 5.8 GiB: 44 retries and 44 device-wide syncs in 10 iterations, 22
cudaMallocs) where the allocator model settles into a layout with none. Whether those retries
are tensors that no longer fit, cuDNN trying a workspace it then gives up (a caught OOM, not
cached: a cached engine that fails is tried again from the heuristics' first), or the
executor's own requests decides what the model lacks.

Usage (on a GPU machine): python validation/allocator/retry_probe.py OUT_DIR CASE.yaml...
Writes OUT_DIR/ID.retries.json per case and the raw history (each entry's action, address,
size, stream, time; the blocks alive when it began) as OUT_DIR/ID.requests.json.gz, which
replay_history.py replays through the allocator model. The summary: provenance (the measured
result's), per iteration
the counters' growth and its time, and the events: per retry or OOM, its iteration, the
request's size, the segments freed before it and whether a new segment followed.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vsim.runtime.session import Session
from vsim.trace import load_trace
from vsim.validate import load_cases

COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
            "num_sync_all_streams")
WARMUP, ITERS = 3, 6


def counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in COUNTERS}


def events(trace: list[dict[str, Any]], starts_us: list[float]) -> list[dict[str, Any]]:
    """Each release of the cache (a run of segment_free) or OOM, with the request after it."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(trace):
        e = trace[i]
        if e["action"] not in ("segment_free", "oom"):
            i += 1
            continue
        freed = []
        while i < len(trace) and trace[i]["action"] == "segment_free":
            freed.append(trace[i]["size"])
            i += 1
        nxt = trace[i] if i < len(trace) else {}
        t = e.get("time_us", 0)
        it = sum(1 for s in starts_us if s <= t) - 1
        row = {"iteration": it, "time_us": t, "freed_segments": len(freed),
               "freed_bytes": sum(freed),
               "then": nxt.get("action"), "size": nxt.get("size"),
               "addr": nxt.get("addr"), "stream": nxt.get("stream")}
        if nxt.get("action") == "segment_alloc" and i + 1 < len(trace):
            row["request"] = trace[i + 1].get("size")
        out.append(row)
        i += 1
    return out


def probe(case_path: str, out_dir: Path) -> None:
    case = load_cases([case_path])[0]
    trace = load_trace(case.trace)
    s = Session(None, None, trace, hardware=case.hardware, trace_path=case.trace,
                warmup=WARMUP, check=False)
    per_iter: list[dict[str, Any]] = []
    starts_us: list[float] = []
    original = s._iteration

    def iteration(ex: Any, notes: Any = None) -> Any:
        before = counters()
        starts_us.append(time.time() * 1e6)
        t0 = time.perf_counter()
        try:
            return original(ex, notes)
        finally:
            after = counters()
            per_iter.append({"us": round((time.perf_counter() - t0) * 1e6, 1),
                             **{k: after[k] - before[k] for k in COUNTERS}})

    s._iteration = iteration  # type: ignore[method-assign]
    # no stack frames: capturing them at every request slows the host, and how far the host
    # runs ahead of the GPU decides which freed blocks are back in time (events)
    torch.cuda.memory._record_memory_history("all", context=None, max_entries=2_000_000)
    start = torch.cuda.memory._snapshot()  # the blocks alive before the history begins
    command = "python validation/allocator/retry_probe.py OUT " + case_path
    result = s.run(case.policy, case.memory_bytes, iters=ITERS, command=command)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    trace_entries = snap["device_traces"][torch.cuda.current_device()]
    doc = {"id": case.id, "policy": case.policy, "memory_bytes": case.memory_bytes,
           "fits": result["fits"], "oom": result["oom"],
           "iteration_time_us": result["iteration_time_us"],
           "allocator_churn": result.get("allocator_churn"),
           "iterations": per_iter, "iteration_starts_us": starts_us,
           "events": events(trace_entries, starts_us),
           "provenance": result["provenance"]}
    (out_dir / f"{case.id}.retries.json").write_text(json.dumps(doc, indent=1))
    # for replaying the real request sequence through the allocator model
    history = {"id": case.id, "memory_bytes": case.memory_bytes,
               "alive_at_start": [[b["address"], b["size"], seg["stream"]]
                                  for seg in start["segments"] for b in seg["blocks"]
                                  if b["state"] == "active_allocated"],
               # the segments those blocks sit in, free parts included (since 2026-11-28:
               # a segment opened before the history and never freed serves requests there)
               "segments_at_start": [[seg["address"], seg["total_size"], seg["stream"],
                                      seg["segment_type"]] for seg in start["segments"]],
               "entries": [[e["action"], e.get("addr", 0), e["size"], e.get("stream", 0),
                            e.get("time_us", 0)]
                           for e in trace_entries],
               "iteration_starts_us": starts_us}
    with gzip.open(out_dir / f"{case.id}.requests.json.gz", "wt") as f:
        json.dump(history, f)
    print(case.id, "retries per iteration",
          [r["num_alloc_retries"] for r in per_iter], "ooms", [r["num_ooms"] for r in per_iter],
          flush=True)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for path in sys.argv[2:]:
        try:
            probe(path, out)
        except Exception as exc:  # noqa: BLE001  (one case's failure is that case's result)
            print(path, "failed:", type(exc).__name__, str(exc)[:300], flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
