"""Fit the allocator's host costs (a base plus a cost per MiB, least squares over the probed
sizes) from probe_alloc.py's two files and write them into a host model's `allocator` section.

    python validation/churn/fit_alloc.py validation/churn/alloc-plain-h100.json \
        validation/churn/alloc-expandable-h100.json hardware/host/h100-sxm.yaml
"""

from __future__ import annotations

import json
import sys

import numpy as np
import yaml

MiB = 1 << 20


def line(doc: dict, key: str) -> dict:
    sizes = np.array([int(k) / MiB for k in doc["sizes"]])
    us = np.array([v[key] for v in doc["sizes"].values()])
    a = np.vstack([np.ones_like(sizes), sizes]).T
    (base, per), *_ = np.linalg.lstsq(a, us, rcond=None)
    return {"base_us": round(float(max(base, 0.0)), 1), "us_per_mib": round(float(per), 4)}


def main() -> int:
    plain_path, exp_path, model_path = sys.argv[1:4]
    plain, exp = (json.load(open(p)) for p in (plain_path, exp_path))
    with open(model_path) as f:
        model = yaml.safe_load(f)
    model["allocator"] = {
        "cuda_malloc": line(plain, "grow_us"), "cuda_free": line(plain, "release_us"),
        "expandable_map": line(exp, "grow_us"), "expandable_unmap": line(exp, "release_us"),
        "device_sync_us": round(float(plain["sync_us"]), 1),
        "provenance": {**plain["provenance"], "command": " ".join(
            ["validation/churn/probe_alloc.py (plain and expandable_segments:True), then "
             "validation/churn/fit_alloc.py", *sys.argv[1:]])}}
    with open(model_path, "w") as f:
        yaml.safe_dump(model, f, sort_keys=False, width=100)
    print(json.dumps(model["allocator"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
