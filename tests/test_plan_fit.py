"""Planners that fit (issue 14): plans the engine accepts, judged as the engine judges them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from netbuilder import torch_net

from vsim.allocator import make_allocator
from vsim.engine import simulate
from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.trace import load_trace
from vsim.units import parse_size

TRACES = Path(__file__).resolve().parents[1] / "traces"


@pytest.mark.parametrize("spec,memory", [("vdnnpp", "5.6GiB"), ("layrub", "4.2GiB"),
                                         ("vdnn:mode=all", "5.6GiB")])
def test_prefetch_on_a_side_stream_is_anchored(spec: str, memory: str) -> None:
    """ResNeXt-50 runs layer4.0.conv2's backward on a side stream (stream 4): a prefetch hung
    on that op was issued at its launch, before the offload of tensor 693 had begun, and the
    engine refused the plan (PlanError: reads tensor 693 which is host, and no prefetch brings
    it back). Found measuring on the H100; the planners anchor prefetches on the offload's
    stream."""
    trace = load_trace(TRACES / "resnext50_32x4d-b64-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    report = simulate(trace, hw, make_policy(spec), make_allocator("caching"),
                      parse_size(memory)).report
    assert report["iteration_time_us"] > 0


@pytest.mark.parametrize("spec", ["vdnn:mode=conv", "vdnnpp"])
def test_a_prefetch_is_not_anchored_before_the_release(spec: str) -> None:
    """RegNetY-1.6GF runs one forward convolution (op 11) alone on a side stream: anchoring the
    prefetch of the tensor it offloads (and releases at its end) on the last op of that stream
    put it at op 11 itself, before the release, where it did nothing (PlanError: op 944 reads
    tensor 1008 which is host). The prefetch must come after the release or stay put."""
    trace = load_trace(TRACES / "regnet_y_1_6gf-b64-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    report = simulate(trace, hw, make_policy(spec), make_allocator("caching"), None).report
    assert report["fits"] and report["iteration_time_us"] > 0


# ---------------------------------------------------------------- random networks

M = 10**6
HW = load_hardware("h100-sxm")
CACHING = make_allocator("caching")


@st.composite
def networks(draw):
    """Random networks with PyTorch's semantics (tests/netbuilder.py), 2..10 layers: chains,
    and residual connections (an add of the input of a layer up to four places back, whose
    gradients are summed in backward)."""
    layers: list[tuple[str, int]] = []
    for _ in range(draw(st.integers(2, 10))):
        ty = draw(st.sampled_from(["conv", "conv", "pool", "fc"]))
        layers.append((ty, draw(st.integers(1, 50)) * M))
        skips = [k for k in range(1, min(4, len(layers)) + 1)
                 if layers[len(layers) - k][0] in ("conv", "fc", "pool", "add")]
        if skips and draw(st.booleans()):
            layers.append(("add", draw(st.sampled_from(skips))))
        if ty != "pool" and draw(st.booleans()):
            layers.append(("relu", 0))
    layers.append(("loss", 0))
    us = {ty: float(draw(st.integers(100, 5_000)))
          for ty in ("conv", "fc", "pool", "relu", "loss", "add")}
    return torch_net(layers, draw(st.integers(1, 50)) * M, fwd_us=us,
                     weight_bytes=draw(st.integers(0, 5)) * M,
                     workspace_bytes=draw(st.integers(0, 20)) * M)


def _run(net, spec: str, cap: int) -> dict:
    return simulate(net, HW, make_policy(spec), CACHING, cap).report


def _peak(net) -> int:
    return int(_run(net, "none", 10**12)["peak_reserved_bytes"])


@settings(max_examples=20, deadline=None)
@given(net=networks(), frac=st.floats(0.3, 1.0))
def test_optimal_fits_whenever_sqrt_or_every_k_fits_and_is_no_slower(net, frac):
    cap = max(1, int(_peak(net) * frac))
    resident = sum(t.size_bytes for t in net.tensors if t.producer is None)
    assume(cap > resident)
    opt = _run(net, "recompute", cap)
    for spec in ["recompute:strategy=sqrt", *(f"recompute:strategy=every-k,k={k}"
                                              for k in range(1, 6))]:
        other = _run(net, spec, cap)
        if other["fits"]:
            assert opt["fits"], spec
            assert opt["iteration_time_us"] <= other["iteration_time_us"] * (1 + 1e-9), spec


@settings(max_examples=40, deadline=None)
@given(net=networks(), lo=st.floats(0.3, 0.9),
       spec=st.sampled_from(["recompute", "superneurons", "hybrid", "accudnn", "vdnnpp",
                             "layrub", "vdnn:mode=dyn"]))
def test_capacity_aware_policies_fit_when_they_fit_with_less(net, lo, spec):
    """Monotone in capacity: a policy that fits at some capacity fits at a larger one. Found
    broken for superneurons (it fitted at 0.5 of a random net's peak and not at 0.6, and on
    gpt2-medium (80 GiB) at 8192 tokens but not 4096: its plan for budget 0 ran out of memory
    (the caching allocator's pieces at the loss) and the escalation gave up, while plans for
    budgets between fit; fitted.ESCALATION_LADDER); checked for every capacity-aware policy."""
    peak = _peak(net)
    small, large = max(1, int(peak * lo)), max(1, int(peak * min(1.0, lo + 0.1)))
    resident = sum(t.size_bytes for t in net.tensors if t.producer is None)
    assume(small > resident)
    if _run(net, spec, small)["fits"]:
        assert _run(net, spec, large)["fits"]


@settings(max_examples=8, deadline=None)
@given(net=networks(), frac=st.floats(0.3, 0.9))
def test_search_fits_whenever_a_builtin_fits_and_is_no_slower(net, frac, tmp_path_factory):
    """vsim search (a short budget) against every built-in on random networks: it fits
    whenever one of them fits, is no slower than the fastest that fits, and reports how far
    it is from its lower bound (never below it)."""
    from vsim.search.run import run_search
    from vsim.trace import save_trace

    cap = max(1, int(_peak(net) * frac))
    resident = sum(t.size_bytes for t in net.tensors if t.producer is None)
    assume(cap > resident)
    path = tmp_path_factory.mktemp("net") / "net.vsim.json.gz"
    save_trace(net, path)
    out = run_search(net, str(path), HW, cap, CACHING, budget_s=1, kicks=1)
    best, found = out["best_builtin"], out["search"]
    if best is not None:
        assert found["fits"]
        assert found["iteration_time_us"] <= best["iteration_time_us"] * (1 + 1e-9)
        assert found["bound_gap"] is not None and found["bound_gap"] >= -1e-9


@pytest.mark.parametrize("name,fractions", [("vgg16-b128-h100", (0.6, 0.7, 0.8, 0.9)),
                                            ("vgg16-b256-h100", (0.5, 0.6, 0.7))])
def test_recompute_is_no_slower_with_more_capacity(name, fractions):
    """Issue 18: a wider card picked a slower plan. recompute (optimal) returned the plan
    without recomputation as soon as it fit, even with convolutions run without their
    workspaces (vgg16(128): 150.1 ms at 0.6 of its peak, 211.6 ms at 0.7), and its profiling
    loop from a larger capacity missed the DP's plan for a budget the smaller one found
    (vgg16(256): 345.0 ms at 0.5, 402.1 ms at 0.6). Fractions of the uncapped peak reserved,
    caching allocator, as vsim run."""
    trace, hw = load_trace(TRACES / f"{name}.vsim.json.gz"), load_hardware("h100-sxm")
    caching = make_allocator("caching")
    peak = simulate(trace, hw, make_policy("none"), caching, 10**15).report[
        "peak_reserved_bytes"]
    times = []
    for f in fractions:
        report = simulate(trace, hw, make_policy("recompute"), caching, int(peak * f)).report
        assert report["fits"], f
        times.append(report["iteration_time_us"])
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:], strict=False)), times


@pytest.mark.parametrize("seq,memory,spec", [(2048, "24GiB", "recompute"),
                                             (4096, "80GiB", "superneurons")])
def test_escalation_finds_a_budget_that_fits_when_budget_0_does_not(seq, memory, spec):
    """gpt2-medium (batch 8, bf16, AdamW, synthesized): recompute optimal fitted 1536 and 3072
    tokens at 24 GiB but not 2048, superneurons 8192 at 80 GiB but not 4096. Each time the
    plan for budget 0 ran out of memory at the loss (the caching allocator's free memory in
    pieces; the DP falls back to sqrt there) and the escalation gave up, though plans for
    budgets between fit (issue 14). The escalation now tries a ladder of budgets."""
    trace = load_trace(TRACES / f"gpt2-medium-b8-s{seq}-bf16-adamw-synthetic.vsim.json.gz")
    report = simulate(trace, HW, make_policy(spec), CACHING, parse_size(memory)).report
    assert report["fits"], report["oom"]


def test_a_policy_that_cannot_fit_says_why_its_most_eviction_did_not():
    """gpt2-medium (batch 8, 16384 tokens, synthesized) at 46.99 GiB: SuperNeurons cannot fit
    by its own rules. The note said "nor those for 15 budgets between it and 1 B" (all 15 of
    them 0 B) and not why the plan with the most eviction failed; the full plan's failure (the
    pinned host limit) is another."""
    trace = load_trace(TRACES / "gpt2-medium-b8-s16384-bf16-adamw-synthetic.vsim.json.gz")
    report = simulate(trace, HW, make_policy("superneurons"), CACHING,
                      parse_size("46.99GiB")).report
    note = next(n for n in report["notes"] if "by its own rules" in n)
    assert "(planned for 0 B; out of device memory at op" in note, note
    assert "budgets between" not in note and "(none left to try)" in note, note
