"""What the native tracker's charges in the host model do to the H100 cases' time error, with
the plans held as `vsim validate` plans them (a first-order estimate: adopting other values
moves plans, which must be remeasured first). The profile (hardware/host/h100-sxm.yaml)
charges the costs validation/host/waits/ measured: the counter per counted aten call
(`native_us_per_call`), the saved-tensor hooks per forward op (`pack_us`) and what is left per
recorded call (`record_callback_us`). This reruns each case's plan with other values (by
default the profile's before 2026-11-27's twelfth session: 0, 3.1 and 58.1 us, the tracker
not charged) and prints the MAPE of both over the cases both predict and measure to fit.
Writes nothing.

    PYTHONPATH=tools python tools/tracker_whatif.py [--counter-us 0] [--pack-us 3.1]
        [--left-us 58.1] [--save-us US] [--only-armed]

`--save-us`: the hooks' charge per save for the runs with the hooks armed (the runtime since
2026-11-27T08:30; the profile charges it times each hooked op's saves, `saves_per_op`; default:
the profile's); `--only-armed`: those runs only, the other charges as the profile's. (Before
the per-save charge, `--armed-pack-us 44.1` set a charge per hooked op: waits/ section 7.)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
from pathlib import Path

from host_whatif import HELD_OUT, rerun_with_host

from vsim.host import HostModel
from vsim.validate import load_cases, relative_error


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counter-us", type=float, default=0.0)
    ap.add_argument("--pack-us", type=float, default=3.1)
    ap.add_argument("--left-us", type=float, default=58.1)
    ap.add_argument("--save-us", type=float, default=None)
    ap.add_argument("--only-armed", action="store_true")
    args = ap.parse_args()

    def other(host: HostModel) -> HostModel:
        if host.hooks == "armed" and args.save_us is not None:
            host = dataclasses.replace(host, save_us=args.save_us)
        if args.only_armed:
            return host
        return dataclasses.replace(host, native_us_per_call=args.counter_us,
                                   pack_us=args.pack_us, record_callback_us=args.left_us)

    names = ("profile", "other values")
    rows: dict[str, list[tuple[str, float]]] = {n: [] for n in names}
    for case in load_cases(sorted(glob.glob("validation/cases/*.yaml"))):
        if case.hardware != "h100-sxm":
            continue
        if args.only_armed and not _armed(case.measured):
            continue
        runs = rerun_with_host(case, other)
        if runs is None:
            continue
        m, now, again = runs
        reports = (now, *again)
        if not all(r["fits"] for r in reports):
            continue
        for name, r in zip(names, reports, strict=True):
            err = relative_error(r["iteration_time_us"], m["iteration_time_us"]) or 0.0
            rows[name].append((case.id, err))
    for name, got in rows.items():
        held = [abs(e) for i, e in got if i.startswith(HELD_OUT)]
        mape = 100 * sum(abs(e) for _, e in got) / len(got)
        print(f"{name:12s}: {len(got)} cases, time MAPE {mape:.2f}%, held-out models "
              f"{100 * sum(held) / max(len(held), 1):.2f}% ({len(held)}), over 15%: "
              f"{sum(abs(e) > 0.15 for _, e in got)} (too fast {sum(e < -0.15 for _, e in got)})")


def _armed(measured: str) -> bool:
    """Whether the measured run had the saved-tensor hooks armed."""
    try:
        doc = json.loads(Path(measured).read_text())
    except (OSError, ValueError):
        return False
    return (doc.get("executed") or {}).get("native_hooks") == "armed"


if __name__ == "__main__":
    main()
