"""Digest of 600 simulations (10 traces x 10 policies x 3 capacities x 2 allocators): the check
that a refactoring leaves every report and predicted trace byte-identical.

    python tools/golden_reports.py OUT.json            # write digests
    python tools/golden_reports.py OUT.json --against BEFORE.json   # compare, exit 1 on change

`--no-notes` leaves the reports' notes out of the digests (with the plan's actions digested
instead): for a change that plans the same with fewer profiling runs, which the notes count.

Uses only public entry points (load_trace, load_hardware, make_policy, make_allocator, simulate),
so it runs unchanged across the refactoring it checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ["alexnet-b128-h100", "googlenet-b128-h100", "gpt2-encoder-b8-h100", "overfeat-b128-h100",
          "resnet152-b32-h100", "resnet50-b64-h100", "vgg16-b128-h100", "vgg16-b256-h100",
          "vgg16-b64-h200", "handmade-convnet"]
POLICIES = ["none", "vdnn:mode=all", "vdnn:mode=conv", "vdnn:mode=dyn", "vdnnpp", "superneurons",
            "layrub", "accudnn", "hybrid", "recompute:strategy=sqrt"]
FRACTIONS = [1.0, 0.6, 0.35]
ALLOCATORS = ["exact", "caching"]


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--against")
    ap.add_argument("--no-predicted", action="store_true", help="reports only (faster)")
    ap.add_argument("--no-notes", action="store_true",
                    help="reports without their notes, and the plan's actions")
    args = ap.parse_args()
    from vsim.allocator import make_allocator
    from vsim.engine import simulate
    from vsim.hardware import load_hardware
    from vsim.policies import make_policy
    from vsim.trace.io import load_trace

    results: dict[str, str] = {}
    for name in TRACES:
        trace = load_trace(ROOT / "traces" / f"{name}.vsim.json.gz")
        hw = load_hardware("h200" if name.endswith("h200") else "h100-sxm")
        base = simulate(trace, hw, make_policy("none"), make_allocator("exact"),
                        10**15).report["peak_allocated_bytes"]
        for spec in POLICIES:
            for frac in FRACTIONS:
                for alloc in ALLOCATORS:
                    key = f"{name}|{spec}|{frac}|{alloc}"
                    try:
                        r = simulate(trace, hw, make_policy(spec), make_allocator(alloc),
                                     int(base * frac))
                        if args.no_notes:
                            val = digest({**r.report, "notes": None,
                                          "actions": [repr(a) for a in r.plan.actions]})
                        else:
                            val = digest(r.report)
                        if not args.no_predicted:
                            from vsim.trace.io import trace_to_json
                            val += ":" + digest(trace_to_json(r.predicted))
                    except Exception as e:  # an error is a result too: it must not change
                        val = f"error:{type(e).__name__}:{e}"
                    results[key] = val
        print(name, file=sys.stderr)
    Path(args.out).write_text(json.dumps(results, indent=0, sort_keys=True))
    if args.against:
        before = json.loads(Path(args.against).read_text())
        diff = [k for k in sorted(set(before) | set(results)) if before.get(k) != results.get(k)]
        print(f"{len(results)} runs, {len(diff)} differ")
        for k in diff[:20]:
            print(" ", k, before.get(k), "->", results.get(k))
        return 1 if diff else 0
    print(f"{len(results)} runs written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
