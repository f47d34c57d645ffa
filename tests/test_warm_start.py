"""The warm start (run_plan's `warm_start`, vsim.engine.warm): a process that ran its plain step
with the whole GPU before it capped itself and emptied its cache, as vsim measure's sessions do,
starts its first capped iteration with its resident tensors where that step put them. Worked by
hand on the caching allocator's rules: a request of 10 MiB or more gets a segment of its own
size (rounded to 2 MiB), best fit, a block split when more than 1 MiB would be left."""

from __future__ import annotations

import dataclasses

from builders import op, tensor, trace
from test_engine import hardware

from vsim.allocator import make_allocator
from vsim.engine import run_plan
from vsim.engine.prep import trace_prep
from vsim.engine.warm import warm_layout
from vsim.plan import Plan
from vsim.trace.schema import MemEvent

MIB = 2**20


def _step():
    """w (10 MiB weight), m (20 MiB momentum, created at the optimizer op in a first
    iteration), a (10 MiB) by op0, b (40 MiB) by op1, c (12 MiB) by op2, which frees a and b;
    op3 frees c; op4, the optimizer, reads w and m."""
    ops = [op(0, 0, 10, writes=(2,)), op(1, 10, 10, reads=(2,), writes=(3,)),
           op(2, 20, 10, phase="bwd", reads=(2, 3), writes=(4,), frees=(2, 3)),
           op(3, 30, 10, phase="bwd", reads=(4,), frees=(4,)),
           op(4, 40, 10, phase="opt", reads=(0, 1))]
    return trace(ops, [tensor(0, 10 * MIB, "weight", consumers=(4,)),
                       tensor(1, 20 * MIB, "optimizer_state", consumers=(4,)),
                       tensor(2, 10 * MIB, producer=0, consumers=(1, 2)),
                       tensor(3, 40 * MIB, producer=1, consumers=(2,)),
                       tensor(4, 12 * MIB, producer=2, consumers=(3,))])


def test_the_warm_layout_is_where_a_plain_step_with_room_left_the_residents():
    """The plain step with room: w takes a 10 MiB segment; a 10, b 40 and c 12 MiB segments of
    their own; a, b, then c freed; m (20 MiB) at the optimizer op takes the best fit, b's 40
    MiB block, and leaves a 20 MiB hole. empty_cache frees a's and c's segments, not b's: 50
    MiB reserved, 30 allocated, one 20 MiB block free."""
    tr = _step()
    memory, resident = warm_layout(tr, hardware(), make_allocator("caching"), 100 * MIB, None)
    assert set(resident) == {0, 1}
    assert memory.capacity_bytes == 100 * MIB
    assert memory.reserved_bytes == 50 * MIB and memory.allocated_bytes == 30 * MIB
    assert [(s.size, [(b.size, b.free) for b in _blocks(s)]) for s in _segments(memory)] == \
        [(10 * MIB, [(10 * MIB, False)]), (40 * MIB, [(20 * MIB, False), (20 * MIB, True)])]
    assert memory.largest_free_bytes() == 50 * MIB  # the cap's 50 MiB of room
    # each run gets its own copy: using it leaves the trace's layout as it was
    memory.free(resident[1])
    again, _ = warm_layout(tr, hardware(), make_allocator("caching"), 100 * MIB, None)
    assert again.allocated_bytes == 30 * MIB
    assert len(trace_prep(tr).warm) == 1


def test_the_warm_layout_follows_the_recorded_allocator_history():
    """Where the trace has PyTorch's allocator history, the plain step is that history in
    program order, not the engine's op-level one: here op2 allocated and freed a 30 MiB
    temporary before c, which the engine's order never sees. Replayed: w 10; a 10, b 40, the
    temporary 30 (segments of their own); c (12 MiB) takes the temporary's freed block and
    splits it; a, b, c freed (the 30 MiB block whole again); m (20 MiB) at op4 takes the best
    fit, that 30 MiB block, leaving 10 MiB. empty_cache frees a's and b's segments: 40 MiB
    reserved (50 in the engine's order, above), 30 allocated."""
    tr = _step()
    ev = [("alloc", 0, 1, 10, 2, 0), ("alloc", 10, 2, 40, 3, 1), ("alloc", 20, 3, 30, None, 2),
          ("free_completed", 21, 3, 30, None, 2), ("alloc", 22, 4, 12, 4, 2),
          ("free_completed", 29, 1, 10, 2, 2), ("free_completed", 29, 2, 40, 3, 2),
          ("free_completed", 39, 4, 12, 4, 3)]
    tr = dataclasses.replace(tr, mem_events=tuple(
        MemEvent(a, t, addr << 40, size * MIB, 0, tensor, o)
        for a, t, addr, size, tensor, o in ev))
    memory, resident = warm_layout(tr, hardware(), make_allocator("caching"), 100 * MIB, None)
    assert memory.reserved_bytes == 40 * MIB and memory.allocated_bytes == 30 * MIB
    assert [(s.size, [(b.size, b.free) for b in _blocks(s)]) for s in _segments(memory)] == \
        [(10 * MIB, [(10 * MIB, False)]), (30 * MIB, [(20 * MIB, False), (10 * MIB, True)])]
    assert resident[1].segment.size == 30 * MIB


def test_the_warm_layout_makes_the_weights_in_the_order_the_model_registered_them():
    """Replaying a recorded step, the process made its model's weights first, at construction,
    in the order the model registered them (the first op reading each stands for it), then its
    inputs: here w1 (read by op0) before w0 (read by op1) before the input, whatever the
    trace's tensor ids say. Each is 10 MiB or more, so each opens a segment, in that order
    (rising addresses)."""
    ops = [op(0, 0, 10, reads=(1, 2), writes=(3,)),
           op(1, 10, 10, reads=(0, 3), frees=(3,))]
    tr = trace(ops, [tensor(0, 12 * MIB, "weight", consumers=(1,)),
                     tensor(1, 14 * MIB, "weight", consumers=(0,)),
                     tensor(2, 16 * MIB, "input", consumers=(0,)),
                     tensor(3, 10 * MIB, producer=0, consumers=(1,))])
    tr = dataclasses.replace(tr, mem_events=(  # (a recorded history: the order replayed)
        MemEvent("alloc", 0, 1 << 40, 10 * MIB, 0, 3, 0),
        MemEvent("free_completed", 19, 1 << 40, 10 * MIB, 0, 3, 1)))
    _, resident = warm_layout(tr, hardware(), make_allocator("caching"), 100 * MIB, None)
    made = sorted(resident, key=lambda t: resident[t].segment.addr)
    assert made == [1, 0, 2]


def test_a_warm_start_runs_out_where_a_fresh_process_fits():
    """At 100 MiB. Fresh process (first use): its first iteration opens 10+10+40+12 = 72 MiB and
    puts m in b's freed 40 MiB block; the next one has a take a's segment, b's 40 MiB release c's
    free segment (112 > 100, then 100), c the 20 MiB hole: it fits. Warm start: from the
    layout above (50 MiB), a takes half of the 20 MiB hole, b opens 40 MiB (90), c's 12 MiB
    finds 10 MiB free, no free segment to release, and 102 > 100: out of memory at op 2 in
    the first iteration."""
    tr, caching = _step(), make_allocator("caching")
    fresh = run_plan(tr, hardware(), Plan(), caching, 100 * MIB).report
    assert fresh["fits"] and fresh["peak_reserved_bytes"] == 100 * MIB
    warm = run_plan(tr, hardware(), Plan(), caching, 100 * MIB, warm_start=True).report
    assert not warm["fits"]
    assert warm["oom"] == {"op": 2, "tensor": 4, "need_bytes": 12 * MIB,
                           "free_bytes": 20 * MIB, "largest_free_bytes": 10 * MIB}
    assert any("out of memory in the first iteration" in n and "whole GPU" in n
               for n in warm["notes"])
    # with room for c's segment (102 MiB) the warm start fits too
    assert run_plan(tr, hardware(), Plan(), caching, 102 * MIB, warm_start=True).report["fits"]


def test_no_warm_start_without_a_first_iteration_or_on_other_allocators():
    """Off without a first iteration; expandable segments (whose empty_cache unmaps pages) and
    the exact bound are run as without it."""
    tr = _step()
    for spec, first in (("caching", False), ("expandable", True), ("exact", False)):
        allocator = make_allocator(spec)
        cold = run_plan(tr, hardware(), Plan(), allocator, 100 * MIB, first_iteration=first)
        warm = run_plan(tr, hardware(), Plan(), allocator, 100 * MIB, first_iteration=first,
                        warm_start=True)
        assert warm.report == cold.report, spec


def _segments(memory):
    return sorted((s for p in memory.pools.values() for s in p.segments), key=lambda s: s.addr)


def _blocks(segment):
    b = segment.head
    while b is not None:
        yield b
        b = b.next


def test_vsim_run_starts_warm_when_asked(capsys):
    """`vsim run --warm-start`: the run starts as vsim measure's processes do (its note says
    so); where the allocator is not the caching one, a note says the run starts cold."""
    import json
    from pathlib import Path

    from vsim.cli import main

    trace = str(Path(__file__).resolve().parents[1] / "traces/alexnet-b128-h100.vsim.json.gz")
    args = ["run", trace, "--hw", "h100-sxm", "--memory", "2GiB", "--policy", "vdnn:mode=all"]
    assert main([*args, "--warm-start", "--json"]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert any(n.startswith("warm start:") for n in warm["notes"])
    assert main([*args, "--json"]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert not any(n.startswith("warm start:") for n in cold["notes"])
    assert main([*args, "--warm-start", "--allocator", "expandable"]) == 0
    assert "--warm-start models the first iteration of PyTorch's caching allocator only" \
        in capsys.readouterr().err


def test_vsim_search_judges_for_a_warm_start_when_asked(capsys):
    """`vsim search --warm-start`: the plan is searched, judged and reported for a process that
    starts warm (the report's note says so, and the result says it was asked)."""
    import json
    from pathlib import Path

    from vsim.cli import main

    trace = str(Path(__file__).resolve().parents[1] / "traces/alexnet-b128-h100.vsim.json.gz")
    args = ["search", trace, "--hw", "h100-sxm", "--memory", "1.4GiB", "--budget", "5",
            "--no-builtins", "--json"]
    assert main([*args, "--warm-start"]) == 0
    got = json.loads(capsys.readouterr().out)["search"]
    assert got["warm_start"] and got["fits"]
    assert any(n.startswith("warm start:") for n in got["report"]["notes"])
