"""The measuring suite: `python -m vsim.runtime.measure SUITE.yaml OUT_DIR` (cases from a YAML
file, one Session per model, batch and trace, a result file per case) and `--map` (an op map made
in a process of its own)."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..trace import load_trace
from .opmap import OpMap
from .results import measure_command, summary_line, write_json
from .session import Progress, Session, quiet

# ---------------------------------------------------------------- the suite

MAP_PROCESSES = 6
"""Op maps made at once: each process holds its model on the GPU, and 16 at once ran an H100
out of memory (2026-11-26), after which every session mapped in its own process."""


def map_in_subprocesses(groups: list[tuple[str, int, str]], out_dir: Path, device: str,
                        hardware: str, warmup: int, say: Progress) -> dict[tuple[str, int, str],
                                                                          Path]:
    """Make each group's op map in a process of its own, MAP_PROCESSES at a time, and a map
    that failed once more alone: the map needs the profiler with CUDA activity, and a process
    that has used it may launch kernels more slowly afterwards (Kineto leaves CUPTI initialised
    unless TEARDOWN_CUPTI=1; pytorch#144455), which would slow every host-bound case measured
    after it. A group whose map still failed is mapped in the measuring process (its results
    say so)."""
    import subprocess

    def start(key: tuple[str, int, str]) -> tuple[tuple[str, int, str], Path, Any]:
        model, batch, trace_path = key
        path = out_dir / f"map-{model}-b{batch}.json"
        cmd = [sys.executable, "-m", "vsim.runtime.measure", "--map", model, str(batch),
               trace_path, str(path), "--device", device, "--hw", hardware,
               "--warmup", str(warmup)]
        return key, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True)

    got: dict[tuple[str, int, str], Path] = {}
    failed: dict[tuple[str, int, str], str] = {}
    todo = list(groups)
    running: list[tuple[tuple[str, int, str], Path, Any]] = []
    while todo or running:
        while todo and len(running) < MAP_PROCESSES:
            running.append(start(todo.pop(0)))
        key, path, proc = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode == 0 and path.exists():
            got[key] = path
        else:
            failed[key] = err
    for key in failed:  # once more, alone
        key, path, proc = start(key)
        _, err = proc.communicate()
        if proc.returncode == 0 and path.exists():
            got[key] = path
        else:
            say(f"{key[0]} (batch {key[1]}): mapping failed, mapped in the measuring process "
                f"instead: {err.strip()[-400:]}")
    return got


def run_suite(cases: list[dict[str, Any]], out_dir: str | Path, *, device: str = "cuda",
              hardware: str = "h100-sxm", iters: int = 10, warmup: int = 3,
              progress: Progress | None = None, deadline_s: float | None = None,
              separate_maps: bool = False, profile_last: bool = False,
              isolated: bool = False) -> list[str]:
    """Measure `cases` ({id, model, batch, trace, policy | builtin, memory, warmup; precision,
    optimizer, seq: the step, default the trace's}) in this
    process, one Session per (model, batch, trace), in the order first seen; write
    OUT_DIR/ID.json as each ends. A case that raises is reported (ID.error.txt) and the suite
    goes on. No case starts after `deadline_s` seconds. `separate_maps`: op maps made in
    subprocesses first (map_in_subprocesses). A case whose plan squeezes convolutions
    (workspace-free Retimes) changes cuDNN's engine cache for the rest of the process: it is
    measured after the others, each in a fresh process (measure_alone), unless `isolated` (this
    process is already its own). Returns the ids that failed or were not run."""
    from ..units import parse_size

    start = time.perf_counter()
    say = progress or quiet
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, int, str | None], list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault((c["model"], int(c["batch"]), c.get("trace")), []).append(c)
    maps: dict[Any, Path] = {}
    if separate_maps:
        keys = [k for k in groups if k[2]]
        maps = map_in_subprocesses(keys, out, device, hardware, warmup, say)  # type: ignore[arg-type]
        say(f"op maps made in {time.perf_counter() - start:.1f} s")
    failed: list[str] = []
    alone: list[dict[str, Any]] = []  # cases whose plans squeeze convolutions
    for (model, batch, trace_path), group in groups.items():
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            failed += [c["id"] for c in group]
            say(f"{model} (batch {batch}): not run (deadline)")
            continue
        t0 = time.perf_counter()
        try:
            trace = load_trace(trace_path) if trace_path else None
            if trace is None:
                from ..record.recorder import record_model
                trace = record_model(model, batch, device=device, progress=say)
            recorded_on = trace.meta.get("hardware")
            if recorded_on and recorded_on != hardware:
                # the plan is made for the profile given: an H200 trace measured with the
                # H100's profile runs the H100's plan (seen: resnet50 hybrid at 5 GiB)
                raise ConfigError(f"{trace_path}: recorded on {recorded_on}, measured with "
                                  f"--hw {hardware}: pass --hw {recorded_on}")
            key = (model, batch, trace_path)
            opmap = (OpMap.from_json(json.loads(maps[key].read_text())) if key in maps
                     else None)
            first = group[0]  # the step: the trace's, unless the cases name it
            session = Session(model, batch, trace, device=device, hardware=hardware,
                              trace_path=trace_path, warmup=warmup, progress=say, opmap=opmap,
                              precision=first.get("precision"),
                              optimizer=first.get("optimizer"), seq=first.get("seq"))
        except Exception as exc:  # noqa: BLE001 - a suite reports and goes on
            for c in group:
                failed.append(c["id"])
                (out / f"{c['id']}.error.txt").write_text(
                    f"session: {exc!r}\n\n{traceback.format_exc()}")
            say(f"{model} (batch {batch}): session failed: {exc!r}")
            continue
        say(f"{model} (batch {batch}): session ready in {time.perf_counter() - t0:.1f} s")
        for c in group:
            if deadline_s is not None and time.perf_counter() - start > deadline_s:
                failed.append(c["id"])
                say(f"  {c['id']}: not run (deadline)")
                continue
            t1 = time.perf_counter()
            memory = parse_size(c["memory"], c["id"]) if c.get("memory") else None
            if c.get("policy") and not isolated and session.squeezes(c["policy"], memory):
                alone.append(c)  # after the others, in a process of its own
                say(f"  {c['id']}: runs convolutions squeezed: measured alone at the end")
                continue
            case_warmup = int(c.get("warmup", warmup))
            try:
                if c.get("builtin"):
                    result = session.builtin(c["builtin"], memory, iters=iters,
                                             warmup=case_warmup)
                else:
                    output = f"validation/measured/{c['id']}.json"
                    result = session.run(c["policy"], memory, iters=iters, warmup=case_warmup,
                                         strict=c.get("strict", True),
                                         instrument=c.get("instrument", False),
                                         tracker=c.get("tracker", "auto"),
                                         command=measure_command(model, batch, c["policy"],
                                                                 memory, hardware, trace_path,
                                                                 output),
                                         profile_last=profile_last)
                result["id"] = c["id"]
                if key in maps:
                    result["notes"].append("op map made in a separate process (no profiler "
                                           "in the measuring one)")
                elif separate_maps:
                    result["notes"].append("op map made in the measuring process: its "
                                           "subprocess failed (the profiler ran here, which "
                                           "can slow later launches)")
                write_json(result, out / f"{c['id']}.json")
            except Exception as exc:  # noqa: BLE001
                failed.append(c["id"])
                (out / f"{c['id']}.error.txt").write_text(f"{exc!r}\n\n{traceback.format_exc()}")
                say(f"  {c['id']}: FAILED {exc!r}")
                try:
                    session.recover()
                except Exception as lost:  # noqa: BLE001 - its state is damaged: stop here
                    broken = f"not run: an earlier case of the session damaged it ({lost!r})"
                    say(f"  {model} (batch {batch}): {broken}")
                    for rest in group[group.index(c) + 1:]:
                        failed.append(rest["id"])
                        (out / f"{rest['id']}.error.txt").write_text(broken + "\n")
                    break
                continue
            say(f"  {c['id']}: {summary_line(result)} [{time.perf_counter() - t1:.1f} s]")
        del session
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    for c in alone:
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            failed.append(c["id"])
            say(f"  {c['id']}: not run (deadline)")
            continue
        if not measure_alone(c, out, device=device, hardware=hardware, iters=iters,
                             warmup=warmup, say=say, profile_last=profile_last):
            failed.append(c["id"])
    return failed


def measure_alone(case: dict[str, Any], out: Path, *, device: str, hardware: str, iters: int,
                  warmup: int, say: Progress, profile_last: bool = False) -> bool:
    """Measure one case in a fresh process (its own suite file in OUT): a case whose plan
    squeezes convolutions leaves cuDNN's engine cache changed for the rest of its process.
    `profile_last` as the suite's (before 2026-11-28 such cases went unprofiled)."""
    import subprocess

    import yaml

    suite = out / f"alone-{case['id']}.yaml"
    suite.write_text(yaml.safe_dump({"cases": [case]}, sort_keys=False))
    cmd = [sys.executable, "-m", "vsim.runtime.measure", str(suite), str(out), "--isolated",
           "--device", device, "--hw", hardware, "--iters", str(iters), "--warmup", str(warmup)]
    if profile_last:
        cmd.append("--profile-last")
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    suite.unlink()
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"  {case['id']}:")]
    say(lines[-1] if lines else f"  {case['id']}: FAILED in its own process: "
        f"{proc.stderr.strip()[-400:]}")
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """python -m vsim.runtime.measure SUITE.yaml OUT_DIR [--device cuda] [--only ID,...]
    [--skip ID,...] [--deadline S] [--separate-maps]; or --map MODEL BATCH TRACE OUT.json"""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(prog="python -m vsim.runtime.measure")
    parser.add_argument("suite", nargs="?")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hw", default="h100-sxm")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", help="comma-separated case ids or models")
    parser.add_argument("--skip", help="comma-separated case ids")
    parser.add_argument("--deadline", type=float, help="start no case after this many seconds")
    parser.add_argument("--separate-maps", action="store_true",
                        help="make the op maps in subprocesses first")
    parser.add_argument("--profile-last", action="store_true",
                        help="profile one extra iteration's kernels per case (profile_last)")
    parser.add_argument("--isolated", action="store_true",
                        help="measure squeezing cases here too (a process of their own)")
    parser.add_argument("--map", nargs=4, metavar=("MODEL", "BATCH", "TRACE", "OUT"),
                        help="only write the op map of MODEL at BATCH for TRACE")
    args = parser.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.map:
        model, batch, trace_path, path = args.map
        session = Session(model, int(batch), load_trace(trace_path), device=args.device,
                          hardware=args.hw, trace_path=trace_path, warmup=args.warmup,
                          check=False, progress=say)
        write_json(session.opmap.to_json(), path)
        return 0
    if not args.suite or not args.out_dir:
        parser.error("give SUITE and OUT_DIR, or --map")
    doc = yaml.safe_load(Path(args.suite).read_text())
    cases = doc["cases"] if isinstance(doc, dict) else doc
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c["id"] in keep or c["model"] in keep]
    if args.skip:
        drop = set(args.skip.split(","))
        cases = [c for c in cases if c["id"] not in drop]
    say(f"{len(cases)} cases on {args.device}; torch {torch.__version__}, pid {os.getpid()}")
    failed = run_suite(cases, args.out_dir, device=args.device, hardware=args.hw,
                       iters=args.iters, warmup=args.warmup, progress=say,
                       deadline_s=args.deadline, separate_maps=args.separate_maps,
                       profile_last=args.profile_last, isolated=args.isolated)
    say(f"done: {len(cases) - len(failed)} measured, {len(failed)} failed or not run {failed}")
    return 1 if failed else 0
