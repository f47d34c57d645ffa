"""The allocator's whole history in a measuring process, from before the model is built to the end
of its case: where the session's warm-up left the resident tensors when the first capped
iteration began.

Why: the engine's warm start (vsim/engine/warm.py) lays the residents out from the recorder's
plain step. On VGG-16(256) recompute at 20 GiB it put fc1's momentum into a 442 MiB hole of a
parameter segment where the real run (retry_probe.py's `segments_at_start`) had it in a segment
of its own, 392 MiB less reserved, which decided whether conv 0.7's backward got its workspace.
retry_probe.py starts its history after the warm-up and builds its Session unlike `vsim
measure`; this one runs `python -m vsim.runtime.measure` itself, in this process, with the
history on from the start, and marks each phase: every training step (`Session.step`: the
warm-up's plain steps, the op map's, the reference's and noise repeats', the case's), the
op map, each case's start.

Usage (on a GPU machine), the measure's own arguments after OUT:
    python validation/allocator/warmup_probe.py OUT SUITE.yaml MEASURE_OUT --only ID [--isolated]
Writes OUT/warmup.history.json.gz: {"entries": [[action, addr, size, stream, time_us], ...],
"marks": [[label, time_us], ...], "provenance"}. An op map made in this process (no
--separate-maps, as a case measured alone) stops the history: then "before_map" holds the
entries up to it, "segments_after_map" the segments when it ended (each with its blocks in use)
and "entries" the history from there.
"""

from __future__ import annotations

import gzip
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vsim.runtime import session as session_mod
from vsim.runtime import suite

marks: list[list[Any]] = []


def mark(label: str) -> None:
    marks.append([label, time.time() * 1e6])


def wrap(cls: Any, name: str, label: str) -> None:
    original = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark(f"{label} start")
        try:
            return original(self, *args, **kwargs)
        finally:
            mark(f"{label} end")

    setattr(cls, name, wrapped)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history("all", context=None, max_entries=4_000_000)
    wrap(session_mod.Session, "step", "step")
    wrap(session_mod.Session, "run", "case")
    wrap(session_mod.Session, "restore", "restore")
    session_mod.map_ops = _map_kept(session_mod.map_ops)
    mark("process")
    rc = suite.main(sys.argv[2:])
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    entries = snap["device_traces"][torch.cuda.current_device()]
    doc = {"entries": [[e["action"], e.get("addr", 0), e["size"], e.get("stream", 0),
                        e.get("time_us", 0)] for e in entries],
           "before_map": before, "segments_after_map": after_map,
           "marks": marks,
           "provenance": {"device": torch.cuda.get_device_name(),
                          "driver": torch.version.cuda, "torch": torch.__version__,
                          "python": platform.python_version(),
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "command": "python validation/allocator/warmup_probe.py "
                                     + " ".join(sys.argv[1:])}}
    with gzip.open(out / "warmup.history.json.gz", "wt") as f:
        json.dump(doc, f)
    print(f"{len(entries)} entries, {len(marks)} marks", file=sys.stderr)
    return rc


def _entries() -> list[list[Any]]:
    snap = torch.cuda.memory._snapshot()
    return [[e["action"], e.get("addr", 0), e["size"], e.get("stream", 0), e.get("time_us", 0)]
            for e in snap["device_traces"][torch.cuda.current_device()]]


def _segments() -> list[list[Any]]:
    """The segments now, each with its blocks in use: (addr, bytes, stream, kind, [[addr,
    bytes], ...])."""
    snap = torch.cuda.memory._snapshot()
    return [[s["address"], s["total_size"], s["stream"], s["segment_type"],
             [[b["address"], b["size"]] for b in s["blocks"] if b["state"] == "active_allocated"]]
            for s in snap["segments"]]


def _map_kept(fn: Any) -> Any:
    """map_ops, which records under the recorder's structure pass: that pass starts its own
    history and stops it, which drops the entries before it. Keep them, and the layout when it
    ends; then record again."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before.extend(_entries())
        mark("op map start")
        try:
            return fn(*args, **kwargs)
        finally:
            mark("op map end")
            after_map.extend(_segments())
            torch.cuda.memory._record_memory_history("all", context=None, max_entries=4_000_000)
    return wrapped


before: list[list[Any]] = []  # the history up to the op map (an in-process map only)
after_map: list[list[Any]] = []  # the segments when the op map ended


if __name__ == "__main__":
    raise SystemExit(main())
