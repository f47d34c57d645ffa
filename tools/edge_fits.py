"""The wrong fit verdicts of a `vsim validate --json` output, with what their measured runs show:
per case every run (the case's measured file and its repeats) fit or out of memory, and where
it ran out, the iteration, the op, PyTorch's request and its reserved-but-unallocated bytes
(parsed from the out-of-memory message); where it fit, its peak reserved against the cap and
the allocator's retries over its timed iterations. Then the verdicts by group: uncapped,
capped runs that fit without a retry, capped runs that fit with retries, capped cases where
some run ran out of memory. Writes nothing.

    python -m vsim validate validation/cases/*.yaml --json > OUT.json
    python tools/edge_fits.py OUT.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _from_message(message: str) -> tuple[float | None, float | None]:
    """(the request, reserved but unallocated) in MiB, from PyTorch's out-of-memory message."""
    request = re.search(r"Tried to allocate ([\d.]+) (MiB|GiB)", message)
    pieces = re.search(r"([\d.]+) (MiB|GiB) is reserved by PyTorch but unallocated", message)

    def mib(m: re.Match[str] | None) -> float | None:
        return None if m is None else float(m.group(1)) * (1 if m.group(2) == "MiB" else 1024)
    return mib(request), mib(pieces)


def runs_of(case_id: str) -> tuple[dict, list[dict]]:
    spec = yaml.safe_load((ROOT / "validation" / "cases" / f"{case_id}.yaml").read_text())
    files = [spec["measured"]] + list(spec.get("repeats") or [])
    return spec, [json.loads((ROOT / f).read_text()) for f in files]


def describe(run: dict) -> str:
    cap = run["capacity_bytes"]
    if run["fits"]:
        retries = (run.get("allocator_churn") or {}).get("num_alloc_retries")
        return (f"fit (reserved {max(run['peaks_reserved_bytes']) / cap:.1%} of the cap, "
                f"{retries} retries)")
    oom = run["oom"]
    request, pieces = _from_message(oom.get("message", ""))
    return (f"out of memory in iteration {oom.get('iteration')} at op {oom.get('op')} "
            f"(request {request:.0f} MiB, {pieces:.0f} MiB free in pieces)")


def main(path: str) -> None:
    doc = json.loads(Path(path).read_text())
    groups: dict[str, list[int]] = {}
    for case in doc["cases"]:
        spec, runs = runs_of(case["id"])
        right = case["predicted"]["fits"] == bool(case["measured"]["fits"])
        if not spec.get("memory"):
            group = "uncapped"
        elif any(not r["fits"] for r in runs):
            group = "capped, some run out of memory"
        elif any(((r.get("allocator_churn") or {}).get("num_alloc_retries") or 0) > 0
                 for r in runs):
            group = "capped, fit with retries"
        else:
            group = "capped, fit without a retry"
        tally = groups.setdefault(group, [0, 0])
        tally[0] += 1
        tally[1] += right
        if right:
            continue
        p = case["predicted"]
        draws = (p.get("timing_draws") or {}).get("fit")
        verdict = "fits" if p["fits"] else "out of memory"
        if draws is not None:
            verdict += f", {draws} of 3 draws fit"
        if p["fits"] and p.get("peak_reserved_bytes"):
            verdict += f", peak reserved {p['peak_reserved_bytes'] / runs[0]['capacity_bytes']:.1%}"
        print(f"{case['id']}\n  predicted: {verdict}")
        for run in runs:
            print(f"  measured: {describe(run)}")
    print()
    for group, (n, right) in sorted(groups.items()):
        print(f"{group:34s} {right:3d} of {n:3d} right")


if __name__ == "__main__":
    main(sys.argv[1])
