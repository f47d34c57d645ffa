"""The H200 corpus under each rule for where new segments lie, every plan measured under its own.

`caching:addresses=down` (new segments top-down, as the driver places them) moves 9 of the 98
H200 cases' plans. Those 9 were measured again with plans made under it (a working copy with
the default flipped; validation/runtime/top-down-23-h200.log) and are kept in h200/top-down/.
This runs `vsim validate`'s machinery twice: the H200 cases as they are
(`addresses=up`, the default), and the same cases under `addresses=down` with the 9 moved
cases' runs taken from h200/top-down/ (their repeats, runs of the other plan, dropped). Prints
both summaries, the same two over the cases whose measured run is of `down`'s plan (its
unmoved or remeasured ones), and the moved cases; writes nothing. `--hardware h100-sxm`: the
H100 cases instead, none measured under `down` yet (its moved plans are listed, to measure).

    python validation/allocator/top_down_h200.py [--hardware h100-sxm]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import statistics
import sys
from pathlib import Path

from vsim.validate import load_cases, validate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", default="h200", choices=("h200", "h100-sxm"))
    hardware = ap.parse_args().hardware
    cases = [c for c in load_cases(sorted(glob.glob(str(ROOT / "validation/cases/*.yaml"))))
             if c.hardware == hardware]
    remeasured = ({p.stem: p for p in (HERE / "h200" / "top-down").glob("*.json")}
                  if hardware == "h200" else {})
    down = [dataclasses.replace(c, allocator=f"{c.allocator}:addresses=down",
                                **({"measured": str(remeasured[c.id]), "repeats": ()}
                                   if c.id in remeasured else {}))
            if c.allocator == "caching" else c for c in cases]
    rows = {}
    for label, group in (("addresses=up (default)", cases), ("addresses=down", down)):
        print(f"{label}: {len(group)} cases ...", file=sys.stderr)
        doc = validate(group)
        s = doc["summary"]
        over = sum(1 for r in doc["cases"] if r["error"]["iteration_time"] is not None
                   and abs(r["error"]["iteration_time"]) > 0.15)
        print(f"{label:24s} time MAPE {s['time_mape']:.2%}, peak {s['peak_mape']:.2%}, "
              f"reserved {s['reserved_mape']:.2%}, fits right {s['fits_correct']}/{s['n']}, "
              f"over 15% {over}, plans changed {s['plans_changed']}")
        rows[label] = {r["id"]: r for r in doc["cases"]}
    up, dn = rows.values()
    still = [cid for cid, r in dn.items() if not r.get("plan_changed")]
    for label, rs in rows.items():
        timed = [abs(rs[c]["error"]["iteration_time"]) for c in still
                 if up[c]["error"]["iteration_time"] is not None
                 and dn[c]["error"]["iteration_time"] is not None]
        right = sum(rs[c]["predicted"]["fits"] == rs[c]["measured"]["fits"] for c in still)
        print(f"{label:24s} on the {len(still)} cases measured with down's plan: time MAPE "
              f"{statistics.mean(timed):.2%} ({len(timed)} timed), fits right {right}")
    for cid in sorted(remeasured):
        line = []
        for r in (up[cid], dn[cid]):
            err = r["error"]["iteration_time"]
            line.append(f"predicted {'fits' if r['predicted']['fits'] else 'OOM'}, ran "
                        f"{'to the end' if r['measured']['fits'] else 'out of memory'}"
                        + ("" if err is None else f", time {err:+.1%}"))
        print(f"  {cid}: up: {line[0]}; down: {line[1]}")
    moved = sorted(cid for cid, r in dn.items() if r.get("plan_changed"))
    if moved:
        print(f"moved, to measure under `down`: {','.join(moved)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
