"""Carry plan files over to their trace after its workspace-free times were measured again.

A plan file names the trace it was made for by a digest of its ops and tensors, attributes
included, so new `dur_us_memory_algo` times (validation/workspace-free/apply_to_traces.py) make
`plan:file=` refuse it. Where the trace changed in nothing else, the plan still means the same
actions, and its measured runs stay its runs: this writes the new digest, and refreshes each
workspace-free retime (note "measured") to the trace's new time, with a note saying so.
Anything else changed in the trace (an op, a tensor, another attribute) is refused.

    python tools/restamp_plans.py [--before REV] PLAN.json...   (REV: the git revision whose
    trace the plans were made for; default HEAD)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

from vsim.plan import Plan, Retime
from vsim.plan_io import file_sha256, load_plan, save_plan, trace_digest
from vsim.trace import Trace, load_trace

TIMES = {"dur_us_memory_algo", "memory_algo"}


def _without_times(trace: Trace) -> Trace:
    ops = tuple(dataclasses.replace(o, attrs=tuple(a for a in o.attrs if a[0] not in TIMES))
                for o in trace.ops)
    return dataclasses.replace(trace, ops=ops)


def trace_at(rev: str, path: str) -> Trace:
    data = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True,
                          check=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".vsim.json.gz") as f:
        f.write(data)
        f.flush()
        return load_trace(f.name)


def restamp(path: str, before: str) -> str:
    saved = load_plan(path)
    old, new = trace_at(before, saved.trace_path), load_trace(saved.trace_path)
    if trace_digest(old) != saved.trace_digest:
        raise SystemExit(f"{path}: not made for {saved.trace_path} at {before}")
    if trace_digest(_without_times(old)) != trace_digest(_without_times(new)):
        raise SystemExit(f"{path}: {saved.trace_path} changed in more than its "
                         "workspace-free times")
    times = {o.id: dict(o.attrs).get("dur_us_memory_algo") for o in new.ops}
    actions, moved = [], []
    for a in saved.plan.actions:
        if isinstance(a, Retime) and a.note == "measured" and times.get(a.op) is not None \
                and times[a.op] != a.dur_us:
            moved.append(f"op {a.op} {a.dur_us:.0f} -> {times[a.op]:.0f} us")
            a = dataclasses.replace(a, dur_us=times[a.op])
        actions.append(a)
    today = datetime.date.today().isoformat()
    note = (f"{today}: carried over to {saved.trace_path} with its workspace-free times "
            f"measured again (tools/restamp_plans.py); "
            + (f"retimes refreshed: {', '.join(moved)}" if moved else "no retime moved"))
    plan: Plan = dataclasses.replace(saved.plan, actions=tuple(actions),
                                     notes=(*saved.plan.notes, note))
    save_plan(dataclasses.replace(saved, plan=plan, trace_digest=trace_digest(new),
                                  file_sha256=file_sha256(saved.trace_path)), path)
    return note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+")
    parser.add_argument("--before", default="HEAD")
    args = parser.parse_args()
    for path in args.plans:
        print(f"{Path(path).name}: {restamp(path, args.before)}", file=sys.stdout)


if __name__ == "__main__":
    main()
