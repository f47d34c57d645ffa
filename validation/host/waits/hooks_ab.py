"""The native tracker's saved-tensor hooks on every forward op (VSIM_NATIVE_HOOKS=always, the
runtime before 2026-11-27T08:30) against on only around the calls with a save the plan acts on
("armed", the runtime now), on suite cases: the same plan (Session plans once per case), runs
alternating between the two in one process, `--rounds` of each, so that the host's drift
between runs falls on both alike. Per case OUT/ID.json: each run's iteration and host issue
time, saves through the hooks, the executor's own time and the gradient check.

Any other choice of the runtime's environment can be set against another the same way
(`--variable VSIM_NATIVE_SAVED --modes hooks,frames`: the saved tensors the plan acts on taken
where autograd saves them, or from their own call's frame).

    python validation/host/waits/hooks_ab.py SUITE.yaml OUT --only ID,ID,... [--rounds 3]
        [--variable VSIM_NATIVE_HOOKS --modes always,armed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vsim.runtime.opmap import OpMap  # noqa: E402
from vsim.runtime.results import provenance  # noqa: E402
from vsim.runtime.session import Session  # noqa: E402
from vsim.runtime.suite import map_in_subprocesses  # noqa: E402
from vsim.trace import load_trace  # noqa: E402
from vsim.units import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("suite")
    ap.add_argument("out")
    ap.add_argument("--only", required=True, help="case ids, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hw", default="h100-sxm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variable", default="VSIM_NATIVE_HOOKS")
    ap.add_argument("--modes", default="always,armed", help="the variable's two values")
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    if len(modes) != 2:
        raise SystemExit(f"--modes {args.modes!r}: two values, comma-separated")
    wanted = args.only.split(",")
    cases = [c for c in yaml.safe_load(Path(args.suite).read_text())["cases"]
             if c["id"] in wanted]
    missing = set(wanted) - {c["id"] for c in cases}
    if missing:
        raise SystemExit(f"{args.suite}: no case {', '.join(sorted(missing))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, int, str], list[dict]] = {}
    for c in cases:
        groups.setdefault((c["model"], int(c["batch"]), c["trace"]), []).append(c)
    maps = map_in_subprocesses(list(groups), out, args.device, args.hw, 3, print)
    for key, group in groups.items():
        model, batch, trace_path = key
        opmap = OpMap.from_json(json.loads(maps[key].read_text())) if key in maps else None
        s = Session(model, batch, load_trace(trace_path), device=args.device, hardware=args.hw,
                    trace_path=trace_path, opmap=opmap)
        for c in group:
            memory = parse_size(c["memory"], c["id"]) if c.get("memory") else None
            if s.squeezes(c["policy"], memory):  # changes cuDNN's engines for the process
                print(c["id"], "not run: its plan squeezes convolutions", flush=True)
                continue
            runs = []
            for r in range(args.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    os.environ[args.variable] = mode
                    got = s.run(c["policy"], memory, iters=10,
                                warmup=int(c.get("warmup", 3)),
                                instrument=c.get("instrument", False))
                    ex = got.get("executed") or {}
                    runs.append({"mode": mode, "fits": got["fits"],
                                 "iteration_time_us": got.get("iteration_time_us"),
                                 "host_issue_us": got.get("host_issue_us"),
                                 "packs": ex.get("packs"), "native_hooks": ex.get("native_hooks"),
                                 "native_saved": ex.get("native_saved"),
                                 "native_gate": ex.get("native_gate"), "gated": ex.get("gated"),
                                 "gate_note": ex.get("gate_note"),
                                 "calls_through_tracker": ex.get("calls_through_tracker"),
                                 "frame_calls": ex.get("frame_calls"),
                                 "executor_frame_us": ex.get("executor_frame_us"),
                                 "executor_own_us": ex.get("executor_own_us"),
                                 "tracker": ex.get("tracker"),
                                 "bitwise_equal": (got.get("check") or {}).get("bitwise_equal"),
                                 "plan": (got.get("plan") or {}).get("digest")})
            med = {m: statistics.median(x["iteration_time_us"] for x in runs
                                        if x["mode"] == m and x["fits"])
                   for m in modes if all(x["fits"] for x in runs if x["mode"] == m)}
            doc = {"id": c["id"], "variable": args.variable, "runs": runs,
                   "median_iteration_us": med,
                   "provenance": provenance(s.device, " ".join(sys.argv))}
            (out / f"{c['id']}.json").write_text(json.dumps(doc, indent=1))
            print(c["id"], {m: round(v / 1e3, 2) for m, v in med.items()},
                  [x["packs"] for x in runs[:2]], [x["calls_through_tracker"] for x in runs[:2]],
                  [x["bitwise_equal"] for x in runs], flush=True)
        del s


if __name__ == "__main__":
    main()
