"""Whether a faster or slower host moves the fit verdicts: every H100 caching case is planned as
`vsim validate` plans it, then that plan is run again with every host cost times each FACTOR
(plans held). A host that runs further ahead of the GPU sees blocks freed under record_stream
come back later (caching's events=host), so near the cap its plans fit less often. Prints, per
model, the verdicts right against the measured runs and the two kinds of wrong. Writes nothing.

    python tools/host_scale_verdicts.py [FACTOR...]   (default 0.45 0.615 0.8)

On 2026-11-26 (seventh session): as validate plans, 204 of 227 right (21 predicted to fit that
ran out of memory, 2 the other way); x0.45, x0.615 and x0.8 each 203 right (12-16 and 8-12): a
host further ahead flips as many verdicts wrongly as rightly, so host lead is not what makes the
verdicts optimistic.
"""

from __future__ import annotations

import functools
import glob
import sys

from host_probe_whatif import scaled
from host_whatif import rerun_with_host

from vsim.validate import load_cases


def main() -> None:
    factors = [float(a) for a in sys.argv[1:]] or [0.45, 0.615, 0.8]
    cases = [c for c in load_cases(sorted(glob.glob("validation/cases/*.yaml")))
             if c.hardware == "h100-sxm" and c.allocator == "caching" and c.measured != "trace"]
    tally: dict[str, list[tuple[bool, bool]]] = {}  # (predicted fits, measured fits)
    for case in cases:
        runs = rerun_with_host(case, *(functools.partial(scaled, s=f) for f in factors),
                               fitted_only=False)
        assert runs is not None
        m, planned, again = runs
        for name, report in (("as planned", planned),
                             *((f"host x{f:g}", r) for f, r in zip(factors, again, strict=True))):
            tally.setdefault(name, []).append((bool(report["fits"]), bool(m["fits"])))
    for name, rows in tally.items():
        print(f"{name}: {sum(p == f for p, f in rows)} of {len(rows)} right, predicted to fit "
              f"but ran out of memory {sum(p and not f for p, f in rows)}, the other way "
              f"{sum(f and not p for p, f in rows)}")

if __name__ == "__main__":
    main()
