"""Table of the op-tracker runs in validation/runtime/tracker/run*/ (issue 13, item 2): per
model, the iteration with no policy, with each tracker on under an empty plan (the tracker's
own cost), and per plan the iteration and the executor's host time per tracker.

    python validation/runtime/summarize.py [FOLDER]   (default validation/runtime/tracker;
    the JSON files under it, a sub-folder per run)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "validation/runtime/tracker")
    runs: dict[str, list[dict]] = {}
    for f in sorted(root.glob("**/*.json")):
        d = json.loads(f.read_text())
        runs.setdefault(d["id"], []).append(d | {"run": f.parent.name})
    models = sorted({i.split("-none")[0] for i in runs if i.endswith("-none")})
    print("| model | run | no policy ms | native tracker ms (+%) | Python tracker ms (+%) |")
    print("|---|---|---|---|---|")
    for m in models:
        for r in sorted({d["run"] for d in runs.get(f"{m}-none", [])}):
            def ms(suffix: str, r: str = r, m: str = m) -> float | None:
                got = [d for d in runs.get(f"{m}-{suffix}", []) if d["run"] == r]
                return got[0]["iteration_time_us"] / 1e3 if got and got[0]["fits"] else None
            base = ms("none")
            cells = []
            for s in ("none-tracked-native", "none-tracked-python"):
                v = ms(s)
                cells.append("-" if v is None or base is None else f"{v:.2f} ({v / base - 1:+.0%})")
            print(f"| {m} | {r} | {base:.2f} | {cells[0]} | {cells[1]} |")
    print()
    print("| case | run | tracker | iteration ms | executor host ms | host / iteration | "
          "gradients |")
    print("|---|---|---|---|---|---|---|")
    shares = []
    for i, ds in sorted(runs.items()):
        for d in ds:
            ex = d.get("executed") or {}
            if not d["fits"] or "-none" in i or not ex:
                continue
            it, host = d["iteration_time_us"], ex["executor_host_us"]
            check = d.get("check") or {}
            g = ("bitwise" if check.get("bitwise_equal")
                 else f"max rel {check.get('max_rel_grad_diff', float('nan')):.1e}")
            if ex.get("tracker") == "native":
                shares.append(host / it)
            print(f"| {i} | {d['run']} | {ex.get('tracker')} | {it / 1e3:.2f} | {host / 1e3:.2f} "
                  f"| {host / it:.1%} | {g} |")
    if shares:
        print(f"\nnative runs: {len(shares)}, executor host / iteration median "
              f"{statistics.median(shares):.1%}, max {max(shares):.1%}")


if __name__ == "__main__":
    main()
