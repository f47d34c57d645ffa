"""Timing draws (issue 15): the timing variation measured between a real run's iterations,
drawn into the engine's runs, and the margin a plan needs to fit most draws.

A real run's iterations each run on their own timing: kernels vary by well under 1% from one
iteration to the next, the host's issue time of a step by 3-17% (validation/jitter/). PyTorch's
caching allocator reuses blocks in the order the host allocates against the GPU's progress, so
a plan that fits by a hair in the model's one timeline can run out of memory in a real run.
`run_plan(draw=TimingDraw(...))` runs a plan under one draw; `timing_draws` under several;
`with_margin` (engine.simulate's `draws`) replaces a plan that most draws do not fit by the
policy's plan for a lower budget that most do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..host import load_timing_spread
from ..units import format_size

if TYPE_CHECKING:
    from ..allocator.base import AllocatorSpec
    from ..hardware import Hardware
    from ..plan import Plan, Planner, RunPlan
    from ..trace.schema import Trace
    from . import SimResult


@dataclass(frozen=True)
class TimingDraw:
    """One draw of the timing variation between a real run's iterations (run_plan's `draw`):
    each iteration, every op's duration times exp(N(0, kernel_sigma)) and the host's issue
    times times exp(N(0, host_sigma)), from a generator seeded with `seed`. The spreads are
    measured (vsim.host.load_timing_spread: validation/jitter/): kernels vary by well under 1%,
    the host's issue time of a step by 3-17% from one iteration to the next. Which blocks the
    caching allocator hands out follows the order in which the host allocates and the GPU
    finishes the copies and kernels whose blocks are freed: a plan that fits by a hair in the
    model's one timeline can run out of memory in another (issue 15)."""

    seed: int
    kernel_sigma: float
    host_sigma: float


TIMING_DRAWS = 3
"""Timing draws `timing_draws` runs: a real run is one draw, and the verdict the model gives
for it is what most draws give."""


def timing_draws(trace: Trace, hw: Hardware, plan: Plan, allocator: AllocatorSpec,
                 capacity_bytes: int | None = None, draws: int = TIMING_DRAWS,
                 **options: Any) -> list[SimResult] | None:
    """`plan` run `draws` times (run_plan with `options`), each under its own draw of the timing
    variation measured between real iterations on `hw`'s machine (TimingDraw, seeds 1 to
    `draws`). None where no spread was measured for `hw` (hardware/timing/) or the allocator
    is not PyTorch's (whose block reuse follows the timing: the others' does not)."""
    spread = load_timing_spread(hw.name)
    if spread is None or not allocator.pytorch_runtime:
        return None
    from . import run_plan  # (the engine's entry point, above this module)
    return [run_plan(trace, hw, plan, allocator, capacity_bytes,
                     draw=TimingDraw(seed, spread.kernel_sigma, spread.host_sigma), **options)
            for seed in range(1, draws + 1)]


MARGIN_STEP = 0.03
"""simulate's search for a plan that most timing draws fit: the policy plans for the capacity
less 3%, 6%, ... (at most MARGIN_STEPS steps), each run at the full capacity."""
MARGIN_STEPS = 5


def drawn(res: SimResult, fit: list[SimResult], draws: int, **more: Any) -> SimResult:
    """`res` with its verdict under `draws` timing draws, `fit` those that fit: its report's
    `timing_draws` (how many fit, of how many, their times, `more`), and a note when some ran
    out of memory."""
    n = len(fit)
    res.report["timing_draws"] = {
        "draws": draws, "fit": n, **more,
        "times_us": [round(d.report["timed_iteration_time_us"], 1) for d in fit]}
    if n < draws:
        res.report["notes"].append(
            f"fits the recorded timing, but {n} of {draws} runs under draws of the timing "
            f"variation measured between real iterations do "
            f"({'likely' if 2 * n > draws else 'unlikely'} to fit a real run: near the "
            f"capacity, which blocks the allocator reuses follows the timing)")
    return res


def with_margin(trace: Trace, hw: Hardware, policy: Planner, allocator: AllocatorSpec,
                capacity: int, draws: int, runner: RunPlan, result: SimResult,
                options: dict[str, Any]) -> SimResult:
    """`result` with its timing draws (its report's `timing_draws`: how many fit, of how many);
    when most of them run out of memory, the run of the policy's plan for the first of a few
    lower budgets that most draws fit, if any (it fits by a margin the measured timing
    variation needs; the notes say so). A note says when some draw of the result ran out."""
    from . import run_plan

    def fitting(plan: Plan) -> list[SimResult] | None:
        """The draws of `plan` that fit (None: no draws for this hardware or allocator)."""
        runs = timing_draws(trace, hw, plan, allocator, capacity, draws, **options)
        return None if runs is None else [d for d in runs if d.report["fits"]]

    fit = fitting(result.plan)
    if fit is None:
        return result
    if 2 * len(fit) > draws:
        return drawn(result, fit, draws)
    for step in range(1, MARGIN_STEPS + 1):
        budget = int(capacity * (1 - MARGIN_STEP * step))
        plan = policy.plan_with(trace, hw, budget, runner)
        again = run_plan(trace, hw, plan, allocator, capacity, label=policy.spec(), **options)
        if not again.report["fits"]:
            continue
        got = fitting(plan)
        if got is not None and 2 * len(got) > draws:
            again.report["notes"].append(
                f"planned for {format_size(budget)}, {MARGIN_STEP * step:.0%} below the "
                f"capacity: the plan for the capacity fit the recorded timing but only "
                f"{len(fit)} of {draws} runs under draws of the timing variation measured "
                f"between real iterations did; {len(got)} of {draws} of this one do")
            return drawn(again, got, draws, margin=round(MARGIN_STEP * step, 2))
    return drawn(result, fit, draws)
