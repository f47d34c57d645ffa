"""Two controls for the host's state that were tried and not adopted (README.md here):

1. The Python-loop probe's ratio, run over recording, against the no-policy runs' time ratio,
   for every H100 trace with the probe and its no-policy run with probes.
2. Each case's time error divided by its model's no-policy run's (measured within 30 minutes):
   the MAPE before and after.

    python validation/host/noise/processes/controls.py [VALIDATE.json]

VALIDATE.json: `vsim validate validation/cases/*.yaml --json` (for 2; 1 reads the repository).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def probe_ratios() -> None:
    from vsim.trace import load_trace

    for f in sorted((ROOT / "traces").glob("*-h100.vsim.json.gz")):
        t = load_trace(f)
        probes = t.meta.get("measured_speed_probe_us")
        run = ROOT / "validation/measured" / f.name.replace("-h100.vsim.json.gz", "-none.json")
        if not probes or not run.exists() or t.measured is None:
            continue
        r = json.loads(run.read_text())
        rp = (r.get("host_use") or {}).get("speed_probe_us")
        if not rp:
            continue
        print(f"{f.name[:-len('-h100.vsim.json.gz')]:34s} time ratio "
              f"{r['iteration_time_us'] / t.measured.iteration_time_us:.2f}, probe ratio "
              f"{statistics.median(rp) / statistics.median(probes):.2f}")


def plain_control(path: str) -> None:
    cases = {c["id"]: c for c in json.loads(Path(path).read_text())["cases"]}

    def when(c: dict) -> datetime.datetime | None:
        s = c["measured"].get("provenance", {}).get("date")
        return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")) if s else None

    rows = []
    for cid, c in cases.items():
        suffix = "-none-h200" if cid.endswith("-none-h200") else "-none"
        e0, t0 = c["error"].get("iteration_time"), when(c)
        if not cid.endswith(suffix) or e0 is None or t0 is None:
            continue
        prefix = cid[:-len(suffix)]
        for oid, o in cases.items():
            e, t = o["error"].get("iteration_time"), when(o)
            if oid == cid or not oid.startswith(prefix + "-") or e is None or t is None \
                    or oid.endswith("-h200") != suffix.endswith("-h200") \
                    or abs((t - t0).total_seconds()) > 1800:
                continue
            rows.append((e0, e))
    mape = statistics.fmean(abs(e) for _, e in rows)
    rel = statistics.fmean(abs((1 + e) / (1 + e0) - 1) for e0, e in rows)
    r = statistics.correlation([e0 for e0, _ in rows], [e for _, e in rows])
    print(f"{len(rows)} cases within 30 minutes of their plain run: r {r:+.2f}, "
          f"MAPE {100 * mape:.2f}% -> {100 * rel:.2f}% relative to the plain run's error")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    probe_ratios()
    if len(sys.argv) > 1:
        plain_control(sys.argv[1])
