"""Fit vsim's host-time model (vsim/host.py) to probe_host.py's measurements and check it on
models left out of the fit.

    python validation/host/fit_host.py PROBE.json --fit resnet50,densenet121,vgg16,vit_b_16,gpt2 \
        -o hardware/host/h100-sxm.yaml

Per (phase, op name): the mean CPU span over the fit models' top-level ops (means, since the
model sums them); per phase: the mean over all of them; AccumulateGrad nodes become
`per_weight_us`. Spans are taken under the profiler, which inflates them; one factor, the fit
models' unprofiled host issue time over their summed spans, scales every cost (a constant fitted
over all fit models together, never per model). The check predicts each model's host issue time
(without the profiler) from its own op list and reports the error, separately for fit and held-
out models.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict

import yaml

BWD = "autograd::engine::evaluate_function: "
ACC = "torch::autograd::AccumulateGrad"


def classify(name: str, thread_is_bwd: bool) -> tuple[str, str] | None:
    """(phase, trace op name) of a probe op, ('acc', '') for gradient accumulation, None for
    what the trace has no op for (profiler bookkeeping)."""
    if name.startswith(BWD):
        node = name[len(BWD):]
        return ("acc", "") if node == ACC else ("bwd", node)
    if name.startswith("Optimizer.step"):
        return ("opt", "optimizer.step")
    if name.startswith("aten::"):
        return ("bwd" if thread_is_bwd else "fwd", name)
    return None


def per_op(model: dict) -> list[tuple[str, str, float]]:
    threads = sorted({o["thread"] for o in model["ops"]})
    main = min(threads, key=lambda t: min(i for i, o in enumerate(model["ops"])
                                          if o["thread"] == t))
    out = []
    for o in model["ops"]:
        c = classify(o["name"], o["thread"] != main)
        if c is not None:
            out.append((c[0], c[1], float(o["cpu_us"])))
    return out


def fit(probe: dict, names: list[str]) -> dict:
    spans: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    acc: list[float] = []
    summed = issued = 0.0
    for m in names:
        model = probe["models"][m]
        ops = per_op(model)
        for phase, name, us in ops:
            if phase == "acc":
                acc.append(us)
            else:
                spans[phase][name].append(us)
        summed += sum(us for _, _, us in ops)
        issued += model["host_issue_us"]
    scale = issued / summed
    by_name = {ph: {n: round(statistics.fmean(v) * scale, 2) for n, v in sorted(t.items())}
               for ph, t in sorted(spans.items())}
    by_phase = {ph: round(statistics.fmean([u for v in t.values() for u in v]) * scale, 2)
                for ph, t in sorted(spans.items())}
    return {"by_phase": by_phase, "by_name": by_name,
            "per_weight_us": round(statistics.fmean(acc) * scale if acc else 0.0, 2),
            "profiler_scale": round(scale, 4)}


def predict(model_doc: dict, probe_model: dict) -> float:
    total = 0.0
    for phase, name, _ in per_op(probe_model):
        if phase == "acc":
            total += model_doc["per_weight_us"]
        elif phase in model_doc["by_name"] and name in model_doc["by_name"][phase]:
            total += model_doc["by_name"][phase][name]
        else:
            total += model_doc["by_phase"].get(phase, model_doc["by_phase"]["fwd"])
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("--fit", required=True)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--name", default="h100-sxm")
    args = ap.parse_args()
    opener = gzip.open if args.probe.endswith(".gz") else open
    with opener(args.probe, "rt") as f:
        probe = json.load(f)
    names = args.fit.split(",")
    doc = fit(probe, names)
    rows = []
    for m, pm in probe["models"].items():
        if "error" in pm:
            continue
        pred = predict(doc, pm)
        rows.append({"model": m, "fit": m in names, "measured_us": round(pm["host_issue_us"]),
                     "predicted_us": round(pred),
                     "error_pct": round(100 * (pred - pm["host_issue_us"]) / pm["host_issue_us"],
                                        1)})
    out = {"name": args.name, "provenance": {
        **probe["provenance"],
        "fitted_by": " ".join(["validation/host/fit_host.py", *sys.argv[1:]]),
        "fit_models": names, "profiler_scale": doc.pop("profiler_scale"),
        "check": rows}, **doc}
    with open(args.output, "w") as f:
        yaml.safe_dump(out, f, sort_keys=False, width=100)
    for r in rows:
        print(f"{r['model']:16s} {'fit ' if r['fit'] else 'held'} measured {r['measured_us']:7d} "
              f"us  predicted {r['predicted_us']:7d} us  {r['error_pct']:+6.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
