"""Planners and in-place updates (issue 13): a recomputation must read every tensor in the state
it read in forward. An in-place SiLU after a batch norm updates the batch norm's output and
writes autograd's copy of its input; a chain that re-runs the SiLU but keeps the batch norm's
output reads SiLU's result, not its input (efficientnet_b0 and mobilenet_v3_large on the H100:
wrong gradients, then an ExecutorError). Hand-written traces: no torch."""

from __future__ import annotations

import pytest
from builders import op, tensor, trace

from vsim.hardware import load_hardware
from vsim.policies import make_policy
from vsim.policies.base import Recompute, example_specs, registry
from vsim.policies.layers import TraceView
from vsim.policies.planning import inseparable, rebuild_chain, recompute_chain, stale_inputs
from vsim.trace.schema import Trace

MB = 1 << 20


def mbconv_like(blocks: int = 4, marked: bool = True) -> Trace:
    """`blocks` times conv -> batch norm -> silu_ (in place on the norm's output, writing
    autograd's copy of its input), then backward in reverse. `marked`: the recorder's
    `mutates` attribute on each silu_ (traces recorded before it have none)."""
    ops, tensors = [], [tensor(0, MB, "input")]
    saved: list[tuple[str, int]] = []  # (layer, tensor its backward reads)
    x, t, n = 0, 0.0, 0
    for b in range(blocks):
        conv, norm, act = n, n + 1, n + 2
        c_out, n_out, copy = len(tensors), len(tensors) + 1, len(tensors) + 2
        tensors += [tensor(c_out, MB, producer=conv), tensor(n_out, MB, producer=norm),
                    tensor(copy, MB, producer=act)]
        attrs = (("mutates", (n_out,)),) if marked else ()
        ops += [op(conv, t, 10, layer=f"b{b}.conv", layer_type="conv", reads=(x,),
                   writes=(c_out,)),
                op(norm, t + 10, 5, layer=f"b{b}.bn", layer_type="bn", reads=(c_out,),
                   writes=(n_out,)),
                op(act, t + 15, 5, layer=f"b{b}.act", layer_type="relu", name="aten::silu_",
                   reads=(n_out,), writes=(copy,), attrs=attrs)]
        saved += [(f"b{b}.conv", x), (f"b{b}.bn", c_out), (f"b{b}.act", copy)]
        x, t, n = n_out, t + 20, n + 3
    for layer, s in reversed(saved):
        ops.append(op(n, t, 10, layer=layer, phase="bwd", reads=(s,), frees=(s,)))
        t, n = t + 10, n + 1
    ops.append(op(n, t, 1, layer="loss", phase="bwd", reads=(x,), frees=(x,)))
    readers: dict[int, list[int]] = {}
    for o in ops:
        for r in o.reads:
            readers.setdefault(r, []).append(o.id)
    tensors = [tensor(s.id, s.size_bytes, s.kind, s.producer, tuple(readers.get(s.id, ())))
               for s in tensors]
    return trace(ops, tensors)


@pytest.mark.parametrize("marked", [True, False])
def test_a_chain_that_reruns_an_in_place_op_rebuilds_what_it_updates(marked: bool) -> None:
    tr = mbconv_like(marked=marked)
    view = TraceView(tr)
    assert view.mutates[2] == {2} and view.updates(2) == (2,)
    # autograd's copy of silu_'s input: its chain goes back to the batch norm
    assert recompute_chain(view, 3) == (1, 2)
    assert stale_inputs(view, recompute_chain(view, 3)) == set()
    # a segment that starts at silu_ can only re-run it on its own result: stale
    slot = view.before(tr.ops[-2].id)
    assert rebuild_chain(view, [2], [3], slot) == (2,)
    assert stale_inputs(view, (2,)) == {2}
    assert rebuild_chain(view, [1, 2], [3], slot) == (1, 2)
    # no checkpoint between a batch norm and its silu_ (fwd layers: conv, bn, act per block)
    assert inseparable(view) == {1, 4, 7, 10}


def test_an_unmarked_add_updates_its_most_recent_read() -> None:
    """Traces without `mutates`: `out += identity` updates `out` (produced last), not the
    block's input."""
    tr = trace([op(0, 0, 1, writes=(1,)), op(1, 1, 1, reads=(1,), writes=(2,)),
                op(2, 2, 1, name="aten::add_", reads=(1, 2))],
               [tensor(1, MB, producer=0, consumers=(1, 2)),
                tensor(2, MB, producer=1, consumers=(2,))])
    view = TraceView(tr)
    assert view.mutates[2] == {2} and view.updates(1) == ()
    marked = trace([op(0, 0, 1, writes=(1,)), op(1, 1, 1, reads=(1,), writes=(2,)),
                    op(2, 2, 1, name="aten::add_", reads=(1, 2), attrs=(("mutates", [1]),))],
                   list(tr.tensors))
    assert TraceView(marked).mutates[2] == {1}


@pytest.mark.parametrize("marked", [True, False])
def test_no_built_in_policy_plans_a_chain_that_reads_a_stale_state(marked: bool) -> None:
    """Every example spec of every policy, at capacities from ample to tight."""
    tr = mbconv_like(6, marked)
    view = TraceView(tr)
    hw = load_hardware("h100-sxm")
    recomputed = 0
    for name, cls in registry().items():
        if name == "plan":
            continue
        for spec in example_specs(cls):
            for cap in (64 * MB, 16 * MB, 10 * MB, 8 * MB):
                plan = make_policy(spec).plan(tr, hw, cap)
                chains = [a.ops for a in plan.actions if isinstance(a, Recompute)]
                recomputed += len(chains)
                assert not [c for c in chains if stale_inputs(view, c)], (spec, cap)
    assert recomputed > 0
