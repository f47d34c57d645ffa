"""What `vsim measure` writes: the result's parts (provenance, the command, the plan's and the
executor's summaries, the allocator's churn counters, a profiled iteration's kernels, the notes),
the gradient check's comparison, the one-line summary and the JSON file."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..fileio import write_atomic
from ..plan import Offload, Plan, Retime, plan_digest
from ..trace.schema import Trace
from ..units import format_size
from .executor import Executor, IterationStats

FORMAT = "vsim-measured"
VERSION = 1


def compare_gradients(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Loss and gradients of a run against a reference: bitwise equality, the largest absolute
    difference, and the largest relative one per tensor (|a - b|_inf / |a|_inf)."""
    max_abs = max_rel = 0.0
    bitwise = bool(torch.equal(ref["loss"], got["loss"]))
    missing = 0
    for a, b in zip(ref["grads"], got["grads"], strict=True):
        if a is None or b is None:
            missing += (a is None) != (b is None)
            continue
        bitwise = bitwise and bool(torch.equal(a, b))
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        scale = float(a.double().abs().max()) if a.numel() else 0.0
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
    return {"bitwise_equal": bitwise and not missing,
            "loss": float(got["loss"]), "loss_reference": float(ref["loss"]),
            "max_abs_grad_diff": max_abs, "max_rel_grad_diff": max_rel,
            "gradients_missing": missing, "tensors": len(ref["grads"])}


def provenance(device: torch.device, command: str,
               host_probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Device, driver and library versions, date and command (no host name); `host_probe`:
    this machine's host speed (vsim.record.hostprobe), taken when the session began."""
    from ..record.recorder import driver_version

    gpu = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "driver": driver_version() if gpu else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda if gpu else None,
            "cudnn": torch.backends.cudnn.version() if gpu else None,
            "python": platform.python_version(),
            "vsim": __version__,
            "tf32": {"cudnn": bool(torch.backends.cudnn.allow_tf32),
                     "matmul": bool(torch.backends.cuda.matmul.allow_tf32)},
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            or os.environ.get("PYTORCH_ALLOC_CONF"),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command,
            **({"host_probe": host_probe} if host_probe else {})}


def measure_command(model: str, batch: int, policy: str, memory_bytes: int | None,
                    hardware: str, trace_path: str | None, output: str | None,
                    step_flags: str = "") -> str:
    """The `vsim measure` command of a case (`step_flags`: --precision ... where no trace
    says them)."""
    parts = ["vsim measure", model, "--batch", str(batch), "--policy", policy]
    parts += step_flags.split()
    if memory_bytes is not None:
        parts += ["--memory", format_size(memory_bytes).replace(" ", "")]
    parts += ["--hw", hardware]
    if trace_path:
        parts += ["--trace", trace_path]
    if output:
        parts += ["-o", output]
    return " ".join(parts)


def plan_summary(plan: Plan) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for a in plan.actions:
        counts[type(a).__name__] = counts.get(type(a).__name__, 0) + 1
    return {"actions": counts, "digest": plan_digest(plan),
            "pinned_pool_bytes": plan.pinned_pool_bytes,
            "pinned": plan.pinned, "pinned_lazy": plan.pinned_lazy,
            "wait_for_memory": plan.wait_for_memory}


CHURN_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                  "num_sync_all_streams", "num_ooms",
                  # the bytes cudaMalloc'd or mapped, cudaFree'd or unmapped (from 2026-11-28)
                  "reserved_bytes.all.allocated", "reserved_bytes.all.freed")
# num_ooms: out-of-memory errors raised and caught inside the iterations (cuDNN tries engines
# whose workspace cannot be had; each failure empties the cache): a path the model does not
# take (docs/design.md, "Fits at the edge")


def allocator_counters(device: torch.device) -> dict[str, int]:
    """The caching allocator's cumulative counters that show churn: allocation retries (a
    failed cudaMalloc that freed the cache and tried again), cudaMalloc and cudaFree calls (or
    page maps and unmaps with expandable segments), device-wide synchronisations, and the
    out-of-memory errors raised (and caught, where the run went on)."""
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in CHURN_COUNTERS}


def kernel_profiler() -> Any:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    return prof


TIMELINE_MIN_US = 100.0  # the kernels the timeline keeps: those that can move an iteration


def kernel_summary(prof: Any, wall_us: float) -> dict[str, Any]:
    """An extra, profiled iteration: its wall time, the GPU's busy time (the union of kernel and
    copy intervals on all streams), the kernels by name (calls, summed time), and `timeline`:
    every kernel or copy of at least TIMELINE_MIN_US in start order, [name (60 characters),
    start after the first one's, duration] in us, which says which op ran which engine where
    the summary cannot (the kernels of a convolution that fell back sit between its
    neighbours')."""
    spans: list[tuple[float, float]] = []
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    timeline: list[tuple[float, float, str]] = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, dur = e.time_range.start, e.time_range.end - e.time_range.start
        spans.append((start, start + dur))
        by_name[e.name][0] += 1
        by_name[e.name][1] += dur
        if dur >= TIMELINE_MIN_US:
            timeline.append((start, dur, e.name))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    timeline.sort()
    first = timeline[0][0] if timeline else 0.0
    return {"wall_us": round(wall_us, 3), "gpu_busy_us": round(busy, 3),
            "kernel_us": round(sum(v[1] for v in by_name.values()), 3),
            "kernels": [{"name": n[:200], "calls": c, "us": round(us, 3)} for n, (c, us) in top],
            "timeline": [[name[:60], round(start - first, 1), round(dur, 1)]
                         for start, dur, name in timeline]}



def executed_summary(stats: IterationStats | None, ex: Executor | None,
                     measured: list[IterationStats] | None = None) -> dict[str, Any] | None:
    """What the executor did in the last iteration; its host times (`executor_*_us`) are the
    medians over the `measured` iterations where given (one iteration's can hold a collection
    of Python's cyclic collector: 190 ms in one densenet169 iteration)."""
    if stats is None or ex is None:
        return None
    runs = measured or [stats]

    def us(field: str) -> float:
        return round(statistics.median(getattr(s, field) for s in runs), 1)

    def own(s: IterationStats) -> float:
        # the runtime's own host work: all of it but what any runtime of the plan waits for or
        # calls (allocations, copy launches, pinned-pool waits, the actions' event and stream
        # calls, the replayed calls themselves); recording and replay bookkeeping are its own.
        # Per iteration, then the median: the parts' medians come from different iterations
        # where the allocator retries in some (their waits vary by tens of ms)
        return (s.host_us - s.alloc_us - s.copy_us - s.pool_wait_us - s.event_us
                - s.replay_call_us - s.free_us)

    return {"offloads": stats.offloads, "prefetches": stats.prefetches, "drops": stats.drops,
            "releases": stats.releases, "recomputed_calls": stats.recomputed_calls,
            "inplace_rerun": stats.inplace_rerun, "inplace_missed": stats.inplace_missed,
            "syncs": stats.syncs, "skipped": dict(stats.skipped),
            "executor_host_us": us("host_us"),
            # its parts (IterationStats): what can wait for the GPU or link, the recomputation
            "executor_alloc_us": us("alloc_us"),
            "executor_copy_us": us("copy_us"),
            "executor_pool_wait_us": us("pool_wait_us"),
            "executor_event_us": us("event_us"),
            "executor_free_us": us("free_us"),  # from 2026-11-27
            "executor_recompute_us": us("recompute_us"),
            "executor_replay_call_us": us("replay_call_us"),
            "executor_record_us": us("record_us"),
            "recorded_calls": stats.recorded_calls,
            "executor_pack_us": us("pack_us"), "packs": stats.packs,
            # the native tracker's frame call backs, timed in C++ (keys from 2026-11-27)
            "executor_frame_us": us("frame_us"), "frame_calls": stats.frame_calls,
            # the call backs at counts, timed in C++ and their work in Python (keys from
            # 2026-11-27): the difference is the crossings' cost, outside executor_host_us
            "callbacks": stats.callbacks, "executor_callback_us": us("callback_us"),
            "executor_callback_py_us": us("callback_py_us"),
            "executor_callback_timed_us": us("callback_timed_us"),  # host_us inside them
            "executor_own_us": round(statistics.median(own(s) for s in runs), 1),
            "executor_own_includes_replay": True,  # runs before 2026-11-27 03:30 UTC left out
            # the recording and the whole replay (validation/runtime/host_share.py)
            "executor_iterations_timed": len(runs),
            "unlocated_tensors": ex.unlocated, "host_buffers_allocated_bytes": ex.host_allocated,
            "iterations": ex.iterations, "tracker": stats.tracker,
            # the plan carried out in C++ (native/core.cpp) or by the Python methods (key
            # from 2026-11-27, seventeenth session; absent: Python)
            "executor_core": "native" if ex.core is not None else "python",
            "tracker_note": ex.tracker_note,
            # the native tracker's saved-tensor hooks (vsim.runtime.nativerun): runs before
            # 2026-11-27T08:30 have no such key and ran them "always"
            **({"native_hooks": ex.native_hooks, "native_counter": ex.native_counter,
                "native_saved": ex.native_saved,
                # backward's nodes without an action run untracked (counter.cpp's Gate; keys
                # from 2026-11-27): whether the last iteration did, and its calls through the
                # tracker's key
                "native_gate": ex.native_gate, "gated": ex.gated, "gate_note": ex.gate_note,
                "calls_through_tracker": ex.calls_through,
                # forward's module calls gated by module hooks (vsim.runtime.fwdgate, opt-in;
                # keys from 2026-11-27): the choice, and the module calls the last iteration
                # gated (None: not asked for, or nothing to gate)
                "native_fwd_gate": ex.native_fwd_gate, "fwd_gated": ex.fwd_gated}
               if stats.tracker == "native" else {}),
            # the recomputation's replay: run by its compiled programs in C++, or in Python
            "replay": (None if not ex.recompute_before else
                       "compiled" if stats.tracker == "native" and ex._programs else "python"),
            "replay_note": ex.replay_note, "workspace_free_squeezed": ex.squeezed,
            # calls run as micro-batches in the last iteration (vsim.runtime.microbatch)
            "split_calls": stats.split_calls,
            "workspace_free_missed": ex.squeeze_missed}


def case_notes(plan: Plan, ex: Executor | None, stats: IterationStats | None,
               trace: Trace) -> list[str]:
    """What a case's run approximated or skipped (the result's `notes`)."""
    notes: list[str] = []
    retimes = [a for a in plan.actions if isinstance(a, Retime)]
    free = [a.op for a in retimes if a.workspace_bytes == 0]
    split = [a for a in retimes if a.parts > 1]
    other = [a.op for a in retimes if a.workspace_bytes != 0 and a.parts == 1]
    if split:
        notes.append(f"{len(split)} convolution(s) run as micro-batches (ops "
                     + ", ".join(f"{a.op} in {a.parts}" for a in split[:8])
                     + f"): {stats.split_calls if stats is not None else 0} call(s) split in "
                     "the last iteration, under the Python tracker")
    if free and (ex is None or not ex.gpu):
        notes.append(f"not executed: {len(free)} workspace-free Retime action(s) (no cuDNN "
                     "engines to choose here)")
    elif free and ex is not None:
        notes.append(
            f"{len(free)} workspace-free convolution(s) run squeezed in the first "
            f"iteration (PyTorch then caches the engine that fits): {len(ex.squeezed)} "
            f"allocated no workspace, {len(ex.squeeze_missed)} still did (ops "
            f"{', '.join(map(str, ex.squeeze_missed[:8]))})")
    if other:
        notes.append(f"not executed: {len(other)} Retime action(s) that keep a workspace "
                     f"(ops {', '.join(map(str, other[:8]))}): PyTorch offers no per-call "
                     "choice of cuDNN engine")
    if ex is None:
        return notes
    if ex.unlocated:
        names = {t.id: t.name for t in trace.tensors}
        notes.append("not found at run time, their actions skipped: tensors "
                     + ", ".join(f"{t} ({names.get(t, '?')})" for t in ex.unlocated[:8]))
    if stats is not None and stats.inplace_rerun:
        notes.append(f"{stats.inplace_rerun} in-place call(s) outside the planned chains "
                     "re-run with the recomputation (ops that updated a dropped tensor "
                     "after its producer: the trace lists in-place updates as reads)")
    if stats is not None and stats.inplace_missed:
        notes.append(f"WRONG VALUES: {stats.inplace_missed} in-place call(s) that updated "
                     "dropped tensors after their producer could not be re-run (their "
                     "inputs were gone): the plan rebuilds those tensors as its producer's "
                     "output alone (run with strict off; see check)")
    if stats is not None and stats.skipped:
        notes.append("executor: " + ", ".join(f"{k} x{v}" for k, v in
                                               sorted(stats.skipped.items())))
    offloads = any(isinstance(a, Offload) for a in plan.actions)
    if offloads:
        notes.append("an offloaded tensor's device memory is freed at its release op in "
                     "launch order (memory_allocated drops then); the caching allocator "
                     "hands the block out again only after the D2H copy (record_stream)")
        if plan.pinned_pool_bytes:
            notes.append(f"one pinned host pool of {format_size(plan.pinned_pool_bytes)} "
                         "allocated before the timed iterations, handed out in slots")
        elif plan.pinned:
            notes.append("per-copy pinned host buffers allocated at first use (warm-up) "
                         "and reused; pinned_host_peak_bytes is the most host copies held "
                         "at once")
        if not plan.pinned:
            notes.append("pageable host buffers: each copy blocks the host")
        if plan.pinned_lazy:
            notes.append("pinned_lazy not reproduced: PyTorch caches pinned buffers, so "
                         "cudaMallocHost is paid in warm-up only")
        if ex.pool_overflow:
            notes.append(f"pinned pool too small {ex.pool_overflow} time(s): a separate "
                         "pinned buffer was used")
    if plan.wait_for_memory:
        notes.append("wait_for_memory: PyTorch's allocator waits for copies in flight by "
                     "itself (a failed allocation synchronises the events of freed blocks "
                     "and retries)")
    if ex is not None and ex.tracker_used == "native":
        notes.append("instrumented: the native op tracker counts aten calls in C++ and calls "
                     "back into Python only where the plan acts (calibrated by a first "
                     "iteration under the Python one; executed.tracker)")
    else:
        notes.append("instrumented: a Python dispatch mode sees every aten call to find the "
                     "plan's op boundaries (tens of microseconds of host time per call)")
    return notes



def summary_line(result: dict[str, Any]) -> str:
    """One line: time, peak, bytes moved, the check."""
    if not result["fits"]:
        oom = result.get("oom") or {}
        return f"out of memory at op {oom.get('op')} ({oom.get('name')})"
    out = f"{result['iteration_time_us'] / 1e3:.2f} ms"
    if result.get("peak_allocated_bytes"):
        out += f", peak {result['peak_allocated_bytes'] / 2**30:.3f} GiB"
    if result.get("d2h_bytes") or result.get("h2d_bytes"):
        out += (f", d2h {result['d2h_bytes'] / 2**30:.2f} GiB h2d "
                f"{result['h2d_bytes'] / 2**30:.2f} GiB")
    chk = result.get("check") or {}
    if "bitwise_equal" in chk:
        out += (", gradients bitwise equal" if chk["bitwise_equal"] else
                f", gradients differ (max rel {chk['max_rel_grad_diff']:.2e})")
    return out


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Atomically (a temporary file renamed), with a trailing newline."""
    write_atomic(path, json.dumps(result, indent=1, allow_nan=False) + "\n")
