"""Add the validation corpus's cases to validation/suite.yaml (the index the measuring suite
runs) and, for cases already measured, write validation/cases/ID.yaml.

    python tools/make_corpus.py                 # print what would be added
    python tools/make_corpus.py --write         # append new cases to validation/suite.yaml
    python tools/make_corpus.py --cases         # write case files for measured results

Per model (a trace in traces/ named MODEL-bBATCH-h100): no policy uncapped, and three caps that
bind at 0.8 and 0.6 of the recorded peak allocated bytes (rounded down to 0.1 GiB), each with
policies taken in turn from the built-in list, shifted by three per model so that each policy
meets every cap across the corpus; the measured runs use PyTorch's default allocator (caching).
The Hugging Face models (traces MODEL-bBATCH-sSEQ-bf16-adamw-h100) get the same, eight cases
each: every built-in policy but vdnn:mode=conv once, one uncapped and three at each cap.

    python tools/make_corpus.py --h200 MODEL... [--write]   # the H200 twins (suite-h200.yaml)
    python tools/make_corpus.py --h200 MODEL... --cases     # their case files, once measured

`--h200`: a corpus model recorded on the H200 too (traces/MODEL-bBATCH-h200) gets its H100
cases again there, each policy at the same cap with the id suffixed `-h200`, so that each pair
differs only in the GPU and its host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vsim.trace.io import load_trace  # noqa: E402

MODELS = {  # model: (batch, family)
    "resnet101": (64, "resnet"), "wide_resnet50_2": (64, "resnet"),
    "resnext50_32x4d": (64, "resnet"), "regnet_y_1_6gf": (64, "resnet"),
    "densenet121": (64, "densenet"), "densenet169": (32, "densenet"),
    "mobilenet_v2": (128, "mobile"), "mobilenet_v3_large": (128, "mobile"),
    "efficientnet_b0": (64, "mobile"), "shufflenet_v2_x1_0": (128, "mobile"),
    "squeezenet1_1": (128, "plain-cnn"), "vgg11_bn": (64, "plain-cnn"),
    "convnext_tiny": (64, "convnext"), "vit_b_16": (32, "vision-transformer"),
    "swin_t": (32, "vision-transformer"),
    # added 2026-11-27 (fourteenth session), recorded and measured after every fit of the host
    # and executor models: held out by construction (validation/README.md)
    "mnasnet1_0": (128, "mobile"), "inception_v3": (64, "inception"),
    "densenet201": (32, "densenet"), "maxvit_t": (32, "vision-transformer"),
    # added 2026-11-27 (eighteenth session), after every fit of the host, executor and core
    # models: held out by construction (validation/README.md, "Held-out models")
    "resnet34": (128, "resnet"), "densenet161": (32, "densenet"),
    "mobilenet_v3_small": (256, "mobile"), "swin_v2_t": (32, "vision-transformer"),
}
# Hugging Face models recorded in bf16 autocast with AdamW (traces/record-hf.sh): model ->
# (batch, seq, family). No vdnn:mode=conv (no convolutions); one case per policy per model.
HF_MODELS = {
    "gpt2": (8, 1024, "transformer-lm"), "gpt2-medium": (8, 1024, "transformer-lm"),
    "llama-1b-8l": (4, 1024, "transformer-lm"), "bert-base": (16, 512, "transformer-encoder"),
}
# Users' own models given as MODULE:CALLABLE (recorded in bf16 autocast with AdamW like the
# Hugging Face ones): name -> (MODULE:CALLABLE, batch, seq, family). Added 2026-11-27
# (eighteenth session), held out like the models above.
USER_MODELS = {
    "qwen2-small": ("validation.user_models.qwen2_small:build", 4, 1024, "transformer-lm"),
}
HF_POLICIES = ["vdnn:mode=all", "vdnnpp", "superneurons", "layrub", "accudnn", "hybrid",
               "recompute:strategy=sqrt"]
HF_PER_CAP = {None: 1, 0.8: 3, 0.6: 3}
# recompute (strategy=optimal) is left out until its planner finishes on these models (a 985-op
# DenseNet-121 took 410 s to plan: issue 14).
POLICIES = ["vdnn:mode=all", "vdnn:mode=conv", "vdnnpp", "superneurons", "layrub", "accudnn",
            "hybrid", "recompute:strategy=sqrt"]
PER_CAP = {None: 2, 0.8: 3, 0.6: 3}


def slug(policy: str) -> str:
    return (policy.replace("vdnn:mode=", "vdnn-").replace("recompute:strategy=sqrt",
            "recompute-sqrt").replace(":", "-").replace("=", "-").replace(",", "-"))


def _cap_label(memory: str | None) -> str:
    return "" if memory is None else "-" + memory.replace(".", "p").replace("GiB", "g")


def _model_cases(name: str, trace_path: str, base: dict, policies: list[str],
                 per_cap: dict, shift: int, k: int) -> tuple[list[dict], int]:
    """No policy uncapped, then `per_cap[frac]` policies at each cap (None: no cap; else
    `frac` of the trace's measured peak allocated bytes, rounded down to 0.1 GiB), taken in turn
    from `policies` starting `shift` further on; `k` counts the policies taken so far."""
    trace = load_trace(ROOT / trace_path)
    assert trace.measured is not None
    peak = trace.measured.peak_allocated_bytes
    cases = [{"id": f"{name}-none", **base, "policy": "none"}]
    for frac, n in per_cap.items():
        memory = None if frac is None else f"{int(frac * peak / 2**30 * 10) / 10:.1f}GiB"
        for _ in range(n):
            policy = policies[(k + shift) % len(policies)]
            k += 1
            case = {"id": f"{name}-{slug(policy)}{_cap_label(memory)}", **base,
                    "policy": policy}
            if memory:
                case.update(memory=memory, warmup=2)
            cases.append(case)
    return cases, k


def corpus_cases() -> list[dict]:
    cases = []
    k = 0
    for i, (model, (batch, family)) in enumerate(MODELS.items()):
        trace_path = f"traces/{model}-b{batch}-h100.vsim.json.gz"
        if not (ROOT / trace_path).exists():
            print(f"{model}: no trace {trace_path} yet (vsim record {model} --batch {batch} "
                  f"--device cuda --warmup 3 --iters 10 -o {trace_path})", file=sys.stderr)
            continue
        base = {"model": model, "batch": batch, "trace": trace_path, "family": family}
        got, k = _model_cases(f"{model}-b{batch}", trace_path, base, POLICIES, PER_CAP,
                              3 * i, k)
        cases += got
    return cases


def hf_cases() -> list[dict]:
    """The Hugging Face models' cases: the step (bf16 autocast, AdamW, the sequence length)
    is the trace's, which the measuring session takes from its meta."""
    cases = []
    for i, (model, (batch, seq, family)) in enumerate(HF_MODELS.items()):
        name = f"{model}-b{batch}-s{seq}-bf16-adamw"
        trace_path = f"traces/{name}-h100.vsim.json.gz"
        base = {"model": model, "batch": batch, "trace": trace_path, "family": family}
        got, _ = _model_cases(name, trace_path, base, HF_POLICIES, HF_PER_CAP, 3 * i, 0)
        cases += got
    for i, (label, (spec, batch, seq, family)) in enumerate(USER_MODELS.items(),
                                                             len(HF_MODELS)):
        name = f"{label}-b{batch}-s{seq}-bf16-adamw"
        trace_path = f"traces/{name}-h100.vsim.json.gz"
        if not (ROOT / trace_path).exists():
            print(f"{label}: no trace {trace_path} yet (vsim record {spec} --batch {batch} "
                  f"--precision bf16 --optimizer adamw --device cuda -o {trace_path})",
                  file=sys.stderr)
            continue
        base = {"model": spec, "batch": batch, "trace": trace_path, "family": family}
        got, _ = _model_cases(name, trace_path, base, HF_POLICIES, HF_PER_CAP, 3 * i, 0)
        cases += got
    return cases


def h200_twins(models: list[str], suite: list[dict]) -> list[dict]:
    """The H100 suite's cases of `models` (plain policies, no instrumented or built-in runs)
    on each model's H200 trace."""
    out = []
    for model in models:
        if model not in MODELS:
            raise SystemExit(f"--h200 {model}: not a corpus model ({', '.join(MODELS)})")
        batch = MODELS[model][0]
        trace_path = f"traces/{model}-b{batch}-h200.vsim.json.gz"
        if not (ROOT / trace_path).exists():
            raise SystemExit(f"{trace_path}: no such trace (vsim record {model} --batch "
                             f"{batch} --device cuda --warmup 3 --iters 10 -o {trace_path})")
        for c in suite:
            if c["model"] == model and "policy" in c and not c.get("instrument"):
                out.append({**c, "id": f"{c['id']}-h200", "trace": trace_path})
    return out


def append_or_show(suite_path: Path, new: list[dict], write: bool) -> None:
    """Append `new` cases to the suite file when `write` and there are any, else print them."""
    if write and new:
        with suite_path.open("a") as f:
            f.write(yaml.safe_dump(new, sort_keys=False, width=100))
        print(f"appended {len(new)} cases to {suite_path.relative_to(ROOT)}")
    else:
        print(yaml.safe_dump(new, sort_keys=False, width=100))
        print(f"{len(new)} new cases")


def write_case_files(cases: list[dict], hardware: str, label: str) -> int:
    """validation/cases/ID.yaml for each of `cases` measured and without one yet."""
    n = 0
    for c in cases:
        measured = ROOT / "validation" / "measured" / f"{c['id']}.json"
        case_path = ROOT / "validation" / "cases" / f"{c['id']}.yaml"
        if not measured.exists() or case_path.exists() or "policy" not in c \
                or c.get("instrument"):
            continue
        case = {"id": c["id"], "trace": c["trace"], "hardware": hardware,
                "policy": c["policy"], "allocator": "caching"}
        if c.get("memory"):
            case["memory"] = c["memory"]
        if c.get("family"):
            case["family"] = c["family"]
        case["measured"] = f"validation/measured/{c['id']}.json"
        case["tolerance"] = {"iteration_time": "10%", "peak_allocated": "3%"}
        case_path.write_text(f"# {label}\n" + yaml.safe_dump(case, sort_keys=False))
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--cases", action="store_true")
    ap.add_argument("--h200", nargs="+", metavar="MODEL")
    args = ap.parse_args()
    if args.h200:
        return h200_main(args)
    suite_path = ROOT / "validation" / "suite.yaml"
    doc = yaml.safe_load(suite_path.read_text())
    have = {c["id"] for c in doc["cases"]}
    # A model already in the index keeps its cases: the policies' rotation moves when a model
    # before it gets its trace later (resnet34 came after densenet161 was measured).
    indexed = {c["model"] for c in doc["cases"]}
    new = [c for c in corpus_cases() + hf_cases()
           if c["id"] not in have and c["model"] not in indexed]
    if (args.write and new) or not args.cases:
        append_or_show(suite_path, new, args.write)
    if args.cases:
        n = write_case_files(yaml.safe_load(suite_path.read_text())["cases"], "h100-sxm",
                             "measured on the H100 machine; see validation/README.md (corpus)")
        print(f"wrote {n} case files")
    return 0


def h200_main(args: argparse.Namespace) -> int:
    suite = yaml.safe_load((ROOT / "validation" / "suite.yaml").read_text())["cases"]
    h200_path = ROOT / "validation" / "suite-h200.yaml"
    twins = h200_twins(args.h200, suite)
    if args.cases:
        n = write_case_files(twins, "h200", "measured on the H200 machine with its own trace, "
                             "the H100 case's twin; see validation/README.md (H200 cases)")
        print(f"wrote {n} case files")
        return 0
    have = {c["id"] for c in yaml.safe_load(h200_path.read_text())["cases"]}
    append_or_show(h200_path, [c for c in twins if c["id"] not in have], args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
