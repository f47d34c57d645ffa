"""The lower bound a searched plan is compared with (see vsim/search/__init__.py)."""

from __future__ import annotations

from typing import Any

from ..allocator import make_allocator
from ..engine import run_plan
from ..hardware import Hardware
from ..plan import Plan
from ..policies.layers import TraceView
from ..policies.planning import (
    Usage,
    alive_in_trace,
    apply_releases,
    liveness_releases,
    microbatch_instead,
)
from ..trace.schema import Trace
from ..workspace_free import memory_optimal_retimes

AMPLE = 2**62
SAVED = ("activation", "input")


def least_needs(trace: Trace, hw: Hardware, view: TraceView) -> dict[int, int]:
    """Per convolution with a workspace: what the device must hold while it runs with it in
    any plan: the trace's bytes alive then (tensors freed after their last reader) less every
    saved feature map it does not touch, its workspace included."""
    retimes, _ = memory_optimal_retimes(trace, hw)
    u = Usage(view)
    apply_releases(u, view, liveness_releases(view))
    saved = [t for t in view.saved if view.tensor[t].kind in SAVED]
    out = {}
    for r in retimes:
        op = view.op[r.op]
        if not any(view.tensor[t].kind == "workspace" and view.tensor[t].size_bytes
                   for t in op.writes):
            continue
        slot = view.start(r.op)
        touched = set(op.reads) | set(op.writes)
        movable = sum(view.tensor[t].size_bytes for t in saved
                      if t not in touched and alive_in_trace(view, t, slot))
        out[r.op] = int(u.bytes[slot]) - movable
    return out


def forced_workspace_free(trace: Trace, hw: Hardware, view: TraceView, capacity_bytes: int
                          ) -> set[int]:
    """Convolutions that cannot run with their recorded workspace in any plan: their least
    need (least_needs) exceeds the capacity."""
    return {o for o, need in least_needs(trace, hw, view).items() if need > capacity_bytes}


def lower_bound(trace: Trace, hw: Hardware, capacity_bytes: int) -> dict[str, Any]:
    """The bound of vsim/search/__init__.py: `bound_us` = max(compute_us, link_us) with
    link_us = M / d2h + M / h2d for the `must_leave_bytes` M at op `at_op`; and
    `recompute_bound_us`, which lets recomputation take some of those bytes off instead.
    `can_fit` is False when some op (`least_working_set_op`) needs more than the capacity even
    with every saved map it does not touch away (`least_working_set_bytes`): then no plan vsim
    can express fits. Times in us, sizes in bytes."""
    view = TraceView(trace)
    retimes, _ = memory_optimal_retimes(trace, hw)
    by_op = {r.op: r for r in retimes}
    needs = least_needs(trace, hw, view)
    forced = {o for o, need in needs.items() if need > capacity_bytes}
    # a forced convolution may run as micro-batches instead, where a part's workspace fits
    # and that is faster (vsim search's genome can choose it; the policies' algo=microbatch)
    split = {o: r for o in forced
             if (r := microbatch_instead(view, hw, by_op[o], needs[o], capacity_bytes)).parts > 1}
    # compute: each convolution at its fastest allowed algorithm, nothing moved, ample memory
    fastest = tuple(split.get(r.op, r) for r in retimes
                    if r.op in forced or r.dur_us < view.op[r.op].dur_us)
    run = run_plan(trace, hw, Plan(actions=fastest), make_allocator("exact"), AMPLE).output
    compute_us = run.end_us + float(trace.meta.get("iteration_tail_us", 0.0))
    fastest_us = {o.id: min(o.dur_us, by_op[o.id].dur_us) if o.id in by_op else o.dur_us
                  for o in trace.ops}
    # bytes that must leave: the least the device must hold at each op, over the capacity
    u = Usage(view, retimes)  # no workspace where a workspace-free algorithm exists
    apply_releases(u, view, liveness_releases(view))
    saved = [t for t in view.saved if view.tensor[t].kind in SAVED]
    d2h_bw, h2d_bw = hw.d2h.pinned.bandwidth_bytes_per_us, hw.h2d.pinned.bandwidth_bytes_per_us
    per_byte_link = 1 / d2h_bw + 1 / h2d_bw
    must, worst_op, rc_bound = 0, None, compute_us
    least, least_op = 0, None  # the most any op needs with every saved map it does not touch away
    for i, op in enumerate(view.ops):
        touched = set(op.reads) | set(op.writes)
        movable = [t for t in saved if t not in touched and alive_in_trace(view, t, 2 * i)]
        need = int(u.bytes[2 * i]) - sum(view.tensor[t].size_bytes for t in movable)
        if need > least:
            least, least_op = need, op.id
        excess = int(u.bytes[2 * i]) - capacity_bytes
        if excess <= 0:
            continue
        if excess > must:
            must, worst_op = excess, op.id
        # Recomputation instead of the link: at least the producer's fastest time for the
        # bytes of its outputs that are away (one re-run brings all of them back).
        away: dict[int, int] = {}
        for t in movable:
            producer = view.tensor[t].producer
            if producer is not None:
                away[producer] = away.get(producer, 0) + view.tensor[t].size_bytes
        rates = sorted((fastest_us[p] / b, b) for p, b in away.items() if b)
        rc_bound = max(rc_bound, _least_max(compute_us, excess, rates, per_byte_link))
    link_us = must * per_byte_link
    return {"bound_us": max(compute_us, link_us), "compute_us": compute_us,
            "link_us": link_us, "must_leave_bytes": must, "at_op": worst_op,
            "recompute_bound_us": min(rc_bound, max(compute_us, link_us)),
            "workspace_free_convolutions": sorted(forced - set(split)),
            "micro_batched_convolutions": sorted(split),
            "least_working_set_bytes": least, "least_working_set_op": least_op,
            "can_fit": least <= capacity_bytes}


def _least_max(compute_us: float, must: int, rates: list[tuple[float, int]],
               per_byte_link: float) -> float:
    """min over x (bytes recomputed, cheapest us per byte first) of
    max(compute + recomputation(x), (must - x) x per_byte_link): the first term grows, the
    second falls, so the least is where they cross (or at a piece's end)."""
    best = max(compute_us, must * per_byte_link)
    done, extra = 0.0, 0.0
    for rate, size in rates:
        if done >= must:
            break
        take = min(float(size), must - done)
        a, b = compute_us + extra, (must - done) * per_byte_link
        x = min(take, max(0.0, (b - a) / (rate + per_byte_link)))
        best = min(best, max(a + rate * x, (must - done - x) * per_byte_link))
        done += take
        extra += rate * take
    return min(best, max(compute_us + extra, max(0.0, must - done) * per_byte_link))
