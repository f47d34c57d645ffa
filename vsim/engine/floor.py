"""A lower bound on the iteration time a simulation reports for a plan, computed without
simulating: planners skip candidates that cannot beat the best plan found (issue 14, planning
time).

The engine runs each stream's ops in trace order; an op starts no earlier than the previous op
of its stream ended plus the recorded launch gap before it, nor before the host has issued it
(HostClock: the host's issue time, plus the host time of every recomputation hung on it or on
an earlier op of its stream, which the host issues first); the recomputations hung on it run
on its stream before it. Every wait the engine adds beyond these (cross-stream dependencies,
copies, memory, allocator driver calls, syncs) only delays. Durations are bounded below by
the op's recorded time or its workspace-free algorithm's, whichever is less (a plan's retime
or the engine's fallback), so the bound holds for every plan that differs only in which
convolutions run without workspace: a profiling loop's plans.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..hardware import Hardware
from ..plan import Plan, PlanIndex
from ..trace.schema import Op, Trace
from .hostclock import HostClock


def iteration_floor(trace: Trace, hw: Hardware, plan: Plan, clock: HostClock | None,
                    workspace_free_us: Mapping[int, float]) -> float:
    """Lower bound on the reported iteration time (iteration_time_us) of `plan`, for a run
    whose host clock is `clock` (None: no host time) and whose convolutions may run at
    `workspace_free_us[op]` instead of their recorded time."""
    index = PlanIndex(plan)
    slow = min(1.0, 1.0 + hw.copy_interference)  # copies in flight only slow compute down
    ops = {op.id: op for op in trace.ops}

    def dur(op: Op) -> float:
        d = op.dur_us
        if op.id in workspace_free_us:
            d = min(d, workspace_free_us[op.id])
        if op.id in index.retime:
            d = min(d, index.retime[op.id].dur_us)
        return d * slow

    end: dict[int, float] = {}  # per stream: when its last op ended, at the earliest
    last: dict[int, float] = {}  # per stream: when its last op ended in the recording
    host: dict[int, float] = {}  # per stream: recomputations' host time issued so far
    floor = 0.0
    for op in trace.ops:
        s = op.stream
        prev = last.get(s, 0.0)
        gap = op.start_us - prev if op.start_us > prev else 0.0
        last[s] = max(prev, op.start_us + op.dur_us)
        t = end.get(s, 0.0) + gap
        extra = host.get(s, 0.0)
        issue = 0.0 if clock is None else clock.issue[op.id]
        t = max(t, issue + extra)
        for rc in index.recompute_before.get(op.id, ()):
            for o in rc.ops:
                if clock is not None:
                    extra += clock.recompute_us(ops[o])
                t = max(t, issue + extra) + dur(ops[o])
        host[s] = extra
        end[s] = max(t, issue + extra) + dur(op)
        floor = max(floor, end[s])
    return floor + float(trace.meta.get("iteration_tail_us", 0.0))
