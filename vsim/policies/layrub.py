"""`layrub`: Layrub (Jin et al., TACO'18): layer-centric memory reuse and data migration.

Intra-layer memory reuse: inside a layer, memory is reused as soon as a tensor is dead; modelled as
releasing every activation, gradient, workspace and temporary right after its last reader.

Inter-layer data migration: each layer's saved feature maps leave for the host on a separate
stream once the forward pass no longer reads them (after their last forward reader), with no
synchronisation of the compute stream; in backward they come back through a fixed number of
reusable buffers, `buffers` layers in flight: the data of layer k is fetched when the backward of
the layer `buffers - 1` layers above it starts (buffers=1: when its own backward starts), or later
when the device has no room for it by then (the fetch waits for a free buffer). A feature map that
would be fetched back at the op right after it left (the loss's softmax) stays on the device.

The plan is checked by one simulated iteration; where a convolution's workspace could not be
allocated it is planned again with that convolution downgraded (algo=auto), and otherwise with
fetches placed against a lower budget.

Approximated: the buffers are not a separate pool of fixed slots; their bound shows as the
prefetch distance, and a forward allocation that does not fit waits for offloads in flight
(Plan.wait_for_memory), as a layer waits for its buffer to drain.

Convolution algorithms (`algo`: auto, performance, memory): see vsim.workspace_free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from ..spec import choice
from .base import register
from .fitted import Attempt, FittedPolicy
from .planning import liveness_releases


@register
@dataclass(frozen=True)
class Layrub(FittedPolicy):
    name = "layrub"
    description = ("Layrub: release after last use, migrate every layer's feature maps to the host "
                   "after the forward, fetch them back `buffers` layers ahead")
    buffers: int = 2
    algo: str = choice("auto", "performance", "memory", "microbatch")
    examples = ("layrub:buffers=1", "layrub:buffers=4")

    def __post_init__(self) -> None:
        if self.buffers < 1:
            raise ValueError(f"buffers must be at least 1, got {self.buffers}")

    def plan_for(self, a: Attempt) -> Plan:
        view = a.view
        releases = liveness_releases(view)
        ev = a.evictions(a.usage(releases))
        bwd_pos = {lay.first: j for j, lay in enumerate(view.bwd)}
        kept = 0
        ahead_of: dict[int, int] = {}
        for t in view.saved:
            if view.tensor[t].kind != "activation":
                continue
            s = ev.swap(t)
            need_layer = view.layer_of[s.need_op]
            j = bwd_pos.get(need_layer.first, 0)
            ahead = view.bwd[max(0, j - (self.buffers - 1))].first
            if view.pos[ahead] <= view.pos[s.offload_op] + 1:
                kept += 1
                continue
            ahead_of[t] = ahead
            ev.add_swap(t, s, update=False)
        ev.refresh()
        ev.place_prefetches(lambda s: view.start(ahead_of[s.tensor]))
        notes = [f"layrub: {kept} feature map(s) needed again within {self.buffers} layer(s) "
                 f"stay on the device"] if kept else []
        return Plan(actions=(*releases, *ev.actions(), *a.retimes),
                    notes=(*notes, *a.retime_notes),
                    wait_for_memory=True)
