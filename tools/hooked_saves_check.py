"""The host model's place for the saved-tensor hooks against what the runs did: for every
measured run with the hooks armed (`executed.native_hooks: armed`), the forward ops the model
charges the hooks on (vsim.engine.hostclock.hooked_ops of the plan `vsim validate` makes for it)
against the saves that went through the hooks (`executed.packs`). Prints one line per run and
the median saves per hooked op (6.88 on 2026-11-27, where the model charged 2.2 saves of 6.4 us
per hooked op: validation/host/waits/ section 7; it now charges each op's saves by name,
validation/host/fit_saves.py). Writes nothing.

    PYTHONPATH=tools python tools/hooked_saves_check.py
"""

from __future__ import annotations

import glob
import json
import statistics
from pathlib import Path

from host_whatif import planned

from vsim.engine.hostclock import hooked_ops
from vsim.plan import PlanIndex, plan_digest
from vsim.validate import load_cases


def main() -> None:
    ratios = []
    mismatched = []
    for case in load_cases(sorted(glob.glob("validation/cases/*.yaml"))):
        if case.measured == "trace":
            continue
        doc = json.loads(Path(case.measured).read_text())
        ex = doc.get("executed") or {}
        if ex.get("native_hooks") != "armed" or not doc.get("fits"):
            continue
        trace, plan = planned(case)
        if plan_digest(plan) != (doc.get("plan") or {}).get("digest"):
            raise SystemExit(f"{case.id}: the plan made here is not the run's")
        hooked = len(hooked_ops(trace, PlanIndex(plan)))
        saves = int(ex.get("packs") or 0)
        print(f"{case.id}: {hooked} hooked ops, {saves} saves through the hooks", flush=True)
        if hooked:
            ratios.append(saves / hooked)
        if (hooked > 0) != (saves > 0):
            mismatched.append(case.id)
    if ratios:
        print(f"saves per hooked op: median {statistics.median(ratios):.2f}, "
              f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} runs")
    print(f"hooks predicted on but none ran, or the reverse: {len(mismatched)} "
          f"{' '.join(mismatched)}")


if __name__ == "__main__":
    main()
