"""Fit and check the per-part cost of a micro-batched convolution
(vsim.workspace_free.MICROBATCH_PART_US) from probe_parts.py's files.

A pass (forward or backward) of a convolution split into p parts is modelled as its recorded
whole-batch time, plus copying the parts' results into place (2 x results / DRAM bandwidth:
vsim.workspace_free.microbatch_retime), plus (p - 1) x c. c is fitted as the median, over
every layer and part count of the FIT models, of (measured - recorded - copies) / (p - 1); the
other models are held out. Prints, per model and part count, the summed split time's error
with c and without it (work linear in the batch alone).

Usage: python validation/microbatch/fit_parts.py [validation/microbatch/h100]
"""

from __future__ import annotations

import glob
import json
import statistics
import sys

from vsim.hardware import load_hardware

FIT = ("vgg16-b256", "resnet50-b64", "alexnet-b128")


def rows(folder: str, dram_bytes_per_us: float) -> list[tuple[str, int, float, float, float]]:
    """(model, parts, recorded whole-batch us, copies us, measured split us) per layer and
    pass."""
    out = []
    for path in sorted(glob.glob(f"{folder}/*.parts.json")):
        name = path.rsplit("/", 1)[-1].removesuffix(".parts.json")
        with open(path) as f:
            doc = json.load(f)
        for layer in doc["layers"]:
            runs, (n, c, h, w) = layer["runs"], layer["input"]
            k = (c // layer["groups"]) * layer["kernel"][0] * layer["kernel"][1]
            y_bytes, x_bytes = 4 * layer["macs"] // k, 4 * n * c * h * w
            copies = {"fwd": 2 * y_bytes / dram_bytes_per_us,
                      "bwd": 2 * x_bytes / dram_bytes_per_us if layer["input_grad"] else 0.0}
            for run in runs[1:]:
                if "error" in run or "error" in runs[0]:
                    continue
                for p in ("fwd", "bwd"):
                    out.append((name, run["parts"], runs[0][p + "_us"], copies[p],
                                run[p + "_us"]))
    return out


def main() -> int:
    folder = sys.argv[1] if len(sys.argv) > 1 else "validation/microbatch/h100"
    table = rows(folder, load_hardware("h100-sxm").dram_bytes_per_us)
    c = statistics.median((m - w - cp) / (p - 1) for name, p, w, cp, m in table if name in FIT)
    print(f"c = {c:.1f} us per extra part per pass (median over {', '.join(FIT)})")
    print("model                 role   parts: error without c / with c")
    for name in sorted({r[0] for r in table}):
        cells = []
        for parts in (2, 4, 8, 16, 32):
            sel = [r for r in table if r[0] == name and r[1] == parts]
            if not sel:
                continue
            measured = sum(r[4] for r in sel)
            linear = sum(r[2] + r[3] for r in sel)
            with_c = linear + len(sel) * (parts - 1) * c
            cells.append(f"{parts}: {100 * (linear / measured - 1):+.0f}% / "
                         f"{100 * (with_c / measured - 1):+.0f}%")
        role = "fit " if name in FIT else "held"
        print(f"{name:20s}  {role}   " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
