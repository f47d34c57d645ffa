"""Engine scenarios small enough to work out by hand; the arithmetic is in each comment.

Test hardware: both link directions 1 GB/s = 1000 B/us with no latency, duplex 1.5 GB/s, no
compute/copy interference, so a 10,000 B copy takes 10 us alone.
"""

from dataclasses import dataclass

import pytest
import simpy
from builders import chain, op, tensor, trace

from vsim.allocator import make_allocator
from vsim.engine import PlanError, simulate
from vsim.engine.link import Link
from vsim.hardware import parse_hardware
from vsim.policies.base import Offload, Plan, Policy, Prefetch, Sync
from vsim.trace import load_trace, save_trace


def hardware(**over):
    doc = {
        "name": "test-gpu",
        "provenance": {"source": "test", "date": "2026-11-21", "method": "round numbers"},
        "gpu": {"memory": "1MB", "context": "0B", "cuda_malloc": "0us"},
        "compute": {"peak": {"fp32": "1TFLOP/s"}, "dram_bandwidth": "100GB/s",
                    "launch_latency": "0us", "copy_interference": over.pop("interference", "0%")},
        "link": {"h2d": {"pinned": {"bandwidth": "1GB/s", "latency": "0us"},
                         "pageable": {"bandwidth": "0.5GB/s", "latency": "0us"}},
                 "d2h": {"pinned": {"bandwidth": "1GB/s", "latency": "0us"},
                         "pageable": {"bandwidth": "0.5GB/s", "latency": "0us"}},
                 "duplex": over.pop("duplex", "1.5GB/s")},
        "host": {"pinned_limit": over.pop("pinned_limit", "1GB"),
                 "pinned_alloc_per_GiB": "0us"},
    }
    return parse_hardware(doc, "test")


@dataclass(frozen=True)
class Fixed(Policy):
    """A policy that returns a plan given by the test."""
    name = "fixed"
    actions: tuple = ()

    def plan(self, trace, hw, capacity_bytes):
        return Plan(actions=self.actions)


def run(tr, actions=(), capacity=10**6, hw=None):
    return simulate(tr, hw or hardware(), Fixed(actions=tuple(actions)), make_allocator("exact"),
                    capacity).report


# chain(2): op0 fwd l0 reads t0 writes t1 (0-20us); op1 fwd l1 reads t1 writes t2 (20-40);
#           op2 bwd l1 reads t1,t2 frees t2 (40-70); op3 bwd l0 reads t0,t1 frees t1 (70-100).
TWO = chain(2, act_bytes=10_000, fwd_us=20, bwd_us=30)


def test_no_policy_replays_the_recording():
    r = run(TWO)
    # 20 + 20 + 30 + 30 = 100 us; peak = t0 + t1 + t2 = 30,000 B during op1 and op2.
    assert r["iteration_time_us"] == 100
    assert r["peak_allocated_bytes"] == 30_000
    assert r["stall_time_us"] == 0 and r["fits"] and r["oom"] is None


def test_offload_overlaps_compute():
    # Offload t0 when op0 starts: 10,000 B at 1000 B/us = 0-10 us, inside op0 (0-20). Released
    # at op0's end (20). Prefetch it when op2 starts (40): back by 50, long before op3 at 70.
    # No stall: the iteration still takes 100 us.
    r = run(TWO, [Offload(0, at_op=0), Prefetch(0, at_op=2, needed_by=3)])
    assert r["iteration_time_us"] == 100
    assert r["stall_time_us"] == 0
    assert r["d2h_bytes"] == r["h2d_bytes"] == 10_000
    # t0 is away during op1 (20-40): peak there is t1 + t2 = 20,000; it returns at 40 while t1
    # and t2 are still live: 30,000 again.
    assert r["peak_allocated_bytes"] == 30_000
    assert r["pinned_host_peak_bytes"] == 10_000


def test_stall_waiting_for_a_prefetch():
    # Offload t1 when op1 starts (20-30), released at op1's end (40). op2 reads t1 and fetches it
    # itself when it launches at 40: the copy takes 40-50, so op2 runs 50-80 and op3 80-110.
    r = run(TWO, [Offload(1, at_op=1), Prefetch(1, at_op=2, needed_by=2)])
    assert r["stall_time_us"] == pytest.approx(10)
    assert r["iteration_time_us"] == pytest.approx(110)


def test_sync_waits_for_the_copy():
    # A 40,000 B input offloaded at op0 takes 40 us (0-40) but op0 ends at 20. Sync after op0
    # (vDNN's per-layer synchronisation) holds the compute stream until 40: 20 us stall, and
    # everything after shifts by 20: op1 40-60, op2 60-90 (prefetch of t0 at 60-100), op3 waits
    # for it until 100 (10 more us of stall), runs 100-130.
    big = trace([op(0, 0, 20, reads=(0,), writes=(1,)), op(1, 20, 20, reads=(1,), writes=(2,)),
                 op(2, 40, 30, phase="bwd", reads=(1, 2), frees=(2,)),
                 op(3, 70, 30, phase="bwd", reads=(0, 1), frees=(1,))],
                [tensor(0, 40_000, "input"), tensor(1, 10_000, producer=0),
                 tensor(2, 10_000, producer=1)])
    r = run(big, [Offload(0, at_op=0), Sync(after_op=0), Prefetch(0, at_op=2, needed_by=3)])
    assert r["stall_time_us"] == pytest.approx(20 + 10)
    assert r["iteration_time_us"] == pytest.approx(130)


def test_out_of_memory_is_a_result():
    # Capacity 25,000 B: t0 (10,000) + t1 (10,000) fit; op1 asks for t2 (10,000) with 5,000 free.
    r = run(TWO, capacity=25_000)
    assert r["fits"] is False
    assert r["oom"]["op"] == 1 and r["oom"]["tensor"] == 2
    assert r["oom"]["need_bytes"] == 10_000 and r["oom"]["free_bytes"] == 5_000


def test_offload_makes_it_fit():
    # Same 25,000 B capacity. With t0 away during op1 (released at op0's end, 20 us), op1 has
    # t1 + t2 = 20,000 B; the prefetch at op3's launch (70) finds t2 freed: t0 + t1 = 20,000.
    r = run(TWO, [Offload(0, at_op=0), Prefetch(0, at_op=3, needed_by=3)], capacity=25_000)
    assert r["fits"] is True
    assert r["peak_allocated_bytes"] == 20_000
    # op3 waits for the 10 us prefetch: 70-80 stall, runs 80-110.
    assert r["iteration_time_us"] == pytest.approx(110)


def test_resident_tensors_that_cannot_fit_fail_before_the_first_op():
    r = run(TWO, capacity=5_000)
    assert r["fits"] is False and r["oom"]["op"] is None


def test_reading_an_offloaded_tensor_without_prefetch_is_a_plan_error():
    with pytest.raises(PlanError, match="reads tensor 0"):
        run(TWO, [Offload(0, at_op=0)])


def _copies(hw, *jobs):
    """Run copies (direction, bytes, start_us) on a bare link; return their end times."""
    env = simpy.Environment()
    link = Link(env, hw)
    ends = {}

    def job(name, direction, size, at):
        yield env.timeout(at)
        _, end = yield from link.copy(direction, size)
        ends[name] = end
    for i, (direction, size, at) in enumerate(jobs):
        env.process(job(i, direction, size, at))
    env.run()
    return [ends[i] for i in range(len(jobs))]


def test_duplex_limit_shares_the_link():
    hw = hardware()
    # Alone: 1,500 B at 1000 B/us = 1.5 us.
    assert _copies(hw, ("d2h", 1500, 0)) == [pytest.approx(1.5)]
    # Both ways at once want 2000 B/us; the duplex limit is 1500, so each gets 750 B/us:
    # 1,500 B each take 2.0 us.
    assert _copies(hw, ("d2h", 1500, 0), ("h2d", 1500, 0)) == [pytest.approx(2.0)] * 2
    # Unequal: both at 750 B/us until the h2d copy ends at 2.0 us; the d2h copy has
    # 3,000 - 1,500 = 1,500 B left and runs alone at 1000 B/us: ends at 3.5 us.
    assert _copies(hw, ("d2h", 3000, 0), ("h2d", 1500, 0)) == [pytest.approx(3.5),
                                                               pytest.approx(2.0)]


def test_one_copy_engine_per_direction_serialises():
    # Two D2H copies of 1,000 B: the second waits for the first: ends at 1 and 2 us.
    assert _copies(hardware(), ("d2h", 1000, 0), ("d2h", 1000, 0)) == [pytest.approx(1.0),
                                                                      pytest.approx(2.0)]


def test_copies_slow_compute_by_the_interference_factor():
    # 10% interference: op0 starts while the offload of t0 runs, so it takes 20 * 1.1 = 22 us.
    hw = hardware(interference="10%")
    r = run(TWO, [Offload(0, at_op=0), Prefetch(0, at_op=2, needed_by=3)], hw=hw)
    # op2 also starts with the prefetch running: 30 * 1.1 = 33. Total 22 + 20 + 33 + 30 = 105.
    assert r["iteration_time_us"] == pytest.approx(105)


def test_same_inputs_same_report():
    a = run(TWO, [Offload(0, at_op=0), Prefetch(0, at_op=2, needed_by=3)])
    b = run(TWO, [Offload(0, at_op=0), Prefetch(0, at_op=2, needed_by=3)])
    assert a == b


@dataclass(frozen=True)
class Pageable(Policy):
    """The plan of test_offload_overlaps_compute, staged through pageable host memory."""
    name = "pageable"

    def plan(self, trace, hw, capacity_bytes):
        return Plan(actions=(Offload(0, at_op=0), Prefetch(0, at_op=2, needed_by=3)),
                    pinned=False)


def test_pageable_copies_are_slower_and_block_the_host():
    # Pageable path: 500 B/us, so 10,000 B take 20 us. The D2H copy runs 0-20 with op0; op1
    # cannot launch before it ends (20): no delay since op0 also ends at 20. The prefetch issued
    # at op2's launch (40) blocks that launch until 60: 20 us stall; op2 60-90, op3 90-120.
    r = simulate(TWO, hardware(), Pageable(), make_allocator("exact"), 10**6).report
    assert r["stall_time_us"] == pytest.approx(20)
    assert r["iteration_time_us"] == pytest.approx(120)
    assert r["pinned_host_peak_bytes"] == 0


# ---------------------------------------------------------------- found by tests/test_properties.py

@dataclass(frozen=True)
class WholePlan(Policy):
    """A policy that returns a whole plan (runtime switches included) given by the test."""
    name = "whole-plan"
    plan_: Plan = Plan()

    def plan(self, trace, hw, capacity_bytes):
        return self.plan_


def test_an_op_may_read_what_it_writes():
    # op0 allocates y (2,000 B) and lists it among its reads too (the loader accepts that); it
    # was refused as "reads tensor 1 which is unborn". Now: 0-10 us, peak x + y = 3,000 B.
    tr = trace([op(0, 0, 10, reads=(0, 1), writes=(1,))],
               [tensor(0, 1000, "input"), tensor(1, 2000, producer=0)])
    r = run(tr)
    assert r["iteration_time_us"] == 10 and r["peak_allocated_bytes"] == 3000


def test_a_read_across_streams_waits_for_its_dep_before_the_residency_check():
    # op0 on stream 0 starts at 5 (launch gap) and writes y, 5-15 us; op1 on stream 3 depends
    # on it and reads y. op1 was checked at its launch (0 us), before its dep: "y is unborn".
    # Now it waits for op0: stall 15 us, runs 15-25.
    tr = trace([op(0, 5, 10, writes=(0,)), op(1, 0, 10, stream=3, reads=(0,), deps=(0,))],
               [tensor(0, 1000, producer=0)])
    r = run(tr)
    assert r["iteration_time_us"] == pytest.approx(25)
    assert r["stall_time_us"] == pytest.approx(15)


# x (40,000 B) read by op0 (0-20 us) and op1 (20-50 us). Offloaded at op0 and released after
# op0: the copy takes 0-40 us, so at op1's launch (20) x is still on the GPU, but it leaves at
# 40 while op1 would still read it (until 50).
LEAVING = trace([op(0, 0, 20, reads=(0,)), op(1, 20, 30, reads=(0,))],
                [tensor(0, 40_000, "input")])


def test_a_tensor_being_offloaded_past_its_release_op_is_gone_for_readers():
    # op1 now waits for its prefetch (it used to run at 20 and read x after it left at 40):
    # out 0-40, released at 40, back 40-80, op1 runs 80-110 after a 60 us stall.
    r = run(LEAVING, [Offload(0, at_op=0), Prefetch(0, at_op=1, needed_by=1)])
    assert r["iteration_time_us"] == pytest.approx(110)
    assert r["stall_time_us"] == pytest.approx(60)
    assert r["d2h_bytes"] == r["h2d_bytes"] == 40_000
    # Without the prefetch the plan is wrong, whatever the copy's speed: an error, not a read
    # of memory given back half-way through the op.
    with pytest.raises(PlanError, match="being offloaded and released after op 0"):
        run(LEAVING, [Offload(0, at_op=0)])


def test_waiting_for_memory_never_waits_for_a_release_behind_itself():
    # Capacity 45,000 B. x (30,000) is offloaded at op0 (copy 0-30 us) but released only after
    # op1. op1 (at 20) needs z (10,000) with x + y + z = 50,000: waiting for x's release would
    # wait for op1 itself (it deadlocked in SimPy). Now: out of memory at op1, 5,000 B free.
    tr = trace([op(0, 0, 20, reads=(0,), writes=(1,)), op(1, 20, 20, reads=(1,), writes=(2,))],
               [tensor(0, 30_000, "input"), tensor(1, 10_000, producer=0),
                tensor(2, 10_000, producer=1)])
    plan = Plan(actions=(Offload(0, at_op=0, release_after=1),), wait_for_memory=True)
    r = simulate(tr, hardware(), WholePlan(plan), make_allocator("exact"), 45_000).report
    assert r["fits"] is False
    assert r["oom"]["op"] == 1 and r["oom"]["tensor"] == 2 and r["oom"]["free_bytes"] == 5_000


def test_a_deadlocking_plan_is_a_plan_error():
    # TWO (chain of 2): t0 released only after op2, its prefetch issued at op1, and a sync after
    # op1 waits for that prefetch, which waits for op2: nothing can happen. (It ended in SimPy's
    # "No scheduled events left" RuntimeError.)
    with pytest.raises(PlanError, match="deadlocks: op 1 .* never finishes"):
        run(TWO, [Offload(0, at_op=0, release_after=2), Prefetch(0, at_op=1, needed_by=3),
                  Sync(after_op=1)])


def test_copies_in_flight_at_the_end_belong_to_the_iteration():
    # op0 (0-10 us) writes y (20,000 B), offloaded at op0: the copy runs 0-20 us. The run used
    # to stop at 10 us with the copy lost (d2h 0 B); the iteration ends when the copy does.
    tr = trace([op(0, 0, 10, writes=(0,))], [tensor(0, 20_000, producer=0)])
    r = run(tr, [Offload(0, at_op=0)])
    assert r["iteration_time_us"] == pytest.approx(20)
    assert r["d2h_bytes"] == 20_000


def test_predicted_trace_keeps_deps_pointing_backwards_at_equal_start_times(tmp_path):
    # op0, zero length on stream 3 at 0 us, writes y; op1 on stream 0 depends on it and reads y,
    # also starting at 0. Ordered by (start, stream) op1 came first: its dep was dropped and
    # the timeline did not load ("tensor 0 is produced later"). Ties now keep execution order.
    tr = trace([op(0, 0, 0, stream=3, writes=(0,)), op(1, 0, 10, reads=(0,), deps=(0,))],
               [tensor(0, 1000, producer=0)])
    predicted = simulate(tr, hardware(), Fixed(), make_allocator("exact"), 10**6).predicted
    assert [o.attr("trace_op") for o in predicted.ops] == [0, 1]
    save_trace(predicted, tmp_path / "p.vsim.json.gz")
    assert load_trace(tmp_path / "p.vsim.json.gz") == predicted


def test_a_tensor_freed_while_its_copy_runs_counts_as_pytorch_counts_it():
    # t0 (40,000 B) is offloaded when op0 starts: the copy takes 0-40 us, op0 ends at 20. The
    # program frees t0 at op0's end (free_requested: PyTorch's memory_allocated drops), but the
    # block is held until the copy ends at 40 (free_completed). op1 (20-40) allocates t2 while
    # t0 is held: held = t0 + t1 + t2 = 60,000, allocated = t1 + t2 = 20,000. The prefetch at
    # op3's launch (70, after op2 freed t2) brings allocated back to t0 + t1 = 50,000.
    # Peak allocated 50,000 (at time 0 and at 70), peak held (exact: reserved) 60,000.
    big = trace([op(0, 0, 20, reads=(0,), writes=(1,)), op(1, 20, 20, reads=(1,), writes=(2,)),
                 op(2, 40, 30, phase="bwd", reads=(1, 2), frees=(2,)),
                 op(3, 70, 30, phase="bwd", reads=(0, 1), frees=(1,))],
                [tensor(0, 40_000, "input"), tensor(1, 10_000, producer=0),
                 tensor(2, 10_000, producer=1)])
    plan = [Offload(0, at_op=0), Prefetch(0, at_op=3, needed_by=3)]
    r = run(big, plan)
    assert r["peak_allocated_bytes"] == 50_000
    assert r["peak_reserved_bytes"] == 60_000
    # The 40 us prefetch (70-110) holds op3 back: it runs 110-140.
    assert r["iteration_time_us"] == pytest.approx(140)
    # The capacity check uses what is held: at 55,000 B op1's t2 does not fit (60,000 > 55,000)
    # although PyTorch would report only 20,000 B allocated then.
    r = run(big, plan, capacity=55_000)
    assert r["fits"] is False and r["oom"]["op"] == 1


def test_an_offload_issued_after_its_release_op_frees_at_that_op_like_the_executor():
    # Layrub's offloads: Offload(t1, at_op=1, after=True, release_after=1), issued when op1
    # ends, which is also its release op. The executor frees the storage right then (after
    # record_stream), so memory_allocated drops at op1's end although the 40 us copy runs on;
    # the engine used to keep t1 allocated until the copy ended (Layrub's peaks +87% to +625%
    # on the corpus). Here: t1 (40,000 B) copied 20-60 us, op2 (20-40) allocates t2.
    tr = trace([op(0, 0, 10, writes=(1,)), op(1, 10, 10, reads=(1,), writes=(2,)),
                op(2, 20, 20, reads=(2,), writes=(3,), frees=(2,)),
                op(3, 40, 40, phase="bwd", reads=(1, 3), frees=(1, 3))],
               [tensor(0, 1_000, "input"), tensor(1, 40_000, producer=0),
                tensor(2, 10_000, producer=1), tensor(3, 10_000, producer=2)])
    plan = [Offload(1, at_op=1, after=True, release_after=1),
            Prefetch(1, at_op=3, needed_by=3)]
    r = run(tr, plan)
    # allocated: input + t1 + t2 at op1 and input + t1 + t3 at op3 (51,000), input + t2 + t3
    # at op2 with t1 away (21,000; it was 61,000); held (exact: reserved) keeps t1 until its
    # copy ends at 60: 61,000 at op2.
    assert r["peak_allocated_bytes"] == 51_000
    assert r["peak_reserved_bytes"] == 61_000

def test_caching_allocator_waits_for_blocks_freed_while_their_copy_runs_and_retries():
    """PyTorch's allocator, when a request fails, synchronizes the events of every block the
    program freed while a copy still used it (record_stream), frees them and retries
    (release_cached_blocks): a plan without wait_for_memory then waits instead of running out
    of memory. t1 (30 MiB) is offloaded after op0 and freed at op0's end; its copy runs
    31,457 us at 1 GB/s. op1 (10 MiB) fits beside t0 and t1; op2's 30 MiB does not fit in
    64 MiB until the copy has ended, then it takes t1's segment."""
    mib = 2**20
    tr = trace([op(0, 0, 10, reads=(0,), writes=(1,)), op(1, 10, 10, reads=(0,), writes=(2,)),
                op(2, 20, 10, reads=(2,), writes=(3,)),
                op(3, 30, 10, phase="bwd", reads=(3,), frees=(2, 3)),
                op(4, 40, 10, phase="bwd", reads=(1,), frees=(1,))],
               [tensor(0, 10 * mib, "input"), tensor(1, 30 * mib, producer=0),
                tensor(2, 10 * mib, producer=1), tensor(3, 30 * mib, producer=2)])
    plan = (Offload(1, at_op=0, after=True, release_after=0), Prefetch(1, at_op=4, needed_by=4))
    r = simulate(tr, hardware(), Fixed(actions=plan), make_allocator("caching"), 64 * mib,
                 first_iteration=False).report
    assert r["fits"] is True
    copy_us = 30 * mib / 1000
    # op2 waits for the copy (ends at 10 + 31,457 us), runs 10 us; op4 waits for the prefetch
    assert r["stall_time_us"] >= copy_us - 10
    # cnmem-like (exact) allocators have no such retry: out of memory at op2
    r = simulate(tr, hardware(), Fixed(actions=plan), make_allocator("exact"), 64 * mib).report
    assert r["fits"] is False and r["oom"]["op"] == 2


def test_first_iteration_creates_cublas_workspace_at_first_gemm_and_its_segments_stay():
    """With a first iteration (the caching allocator's default) the allocator first serves a
    training process's first iteration (the 6 MiB unidentified resident block, cuBLAS's
    workspace, created as the first GEMM launches), and the reported iteration starts from the
    segments it left."""
    mib = 2**20
    ops = [op(0, 0, 10, layer_type="conv", writes=(2,)),
           op(1, 10, 10, layer_type="fc", reads=(2,), writes=(3,)),
           op(2, 20, 10, phase="bwd", reads=(2, 3), frees=(2, 3))]
    tr = trace(ops, [tensor(0, 4 * mib, "weight"), tensor(1, 6 * mib, "temporary"),
                     tensor(2, 12 * mib, producer=0, consumers=(1, 2)),
                     tensor(3, 2 * mib, producer=1, consumers=(2,))])
    caching = make_allocator("caching")
    plain = simulate(tr, hardware(), Fixed(), caching, 1 << 30, first_iteration=False).report
    # Everything resident up front: weight and workspace share a 20 MiB segment (10 MiB left),
    # the 12 MiB output needs a segment of its own: 32 MiB.
    assert plain["peak_reserved_bytes"] == 32 * mib
    warm = simulate(tr, hardware(), Fixed(), caching, 1 << 30, first_iteration=True).report
    # First iteration: the output takes 12 of the first segment's 16 free MiB, the workspace at
    # the FC op opens a second 20 MiB segment: 40 MiB, kept for the reported iteration.
    assert warm["peak_reserved_bytes"] == 40 * mib
    assert warm["peak_allocated_bytes"] == plain["peak_allocated_bytes"] == 24 * mib
    assert warm["iteration_time_us"] == plain["iteration_time_us"]
    assert any("first iteration ran before" in n for n in warm["notes"])
    # At 36 MiB the first iteration cannot open that second segment: the run does not fit,
    # though the steady iteration alone would.
    assert simulate(tr, hardware(), Fixed(), caching, 36 * mib, first_iteration=False
                    ).report["fits"]
    short = simulate(tr, hardware(), Fixed(), caching, 36 * mib, first_iteration=True).report
    assert not short["fits"] and short["oom"]["op"] == 1
    assert any("out of memory in the first iteration" in n for n in short["notes"])


def test_workspace_fallback_runs_the_convolution_without_its_workspace():
    """A convolution whose workspace cannot be had runs its workspace-free algorithm (here,
    with no GPU known for the trace, estimated at 1.5x its recorded time) instead of ending the
    run; without the fallback the run is out of memory at that op."""
    mib = 2**20
    conv = op(0, 0, 10, layer_type="conv", name="aten::convolution", reads=(0, 2),
              writes=(1, 2), frees=(2,))
    tr = trace([conv, op(1, 10, 5, reads=(1,), frees=(1,))],
               [tensor(0, 2 * mib, "weight"), tensor(1, 4 * mib, producer=0, consumers=(1,)),
                tensor(2, 30 * mib, "workspace", producer=0, consumers=(0,))])
    exact = make_allocator("exact")
    assert simulate(tr, hardware(), Fixed(), exact, 10 * mib).report["oom"]["op"] == 0
    result = simulate(tr, hardware(), Fixed(), exact, 10 * mib, workspace_fallback=True)
    report = result.report
    assert report["fits"] and report["peak_allocated_bytes"] == 6 * mib
    assert report["iteration_time_us"] == 10 * 1.5 + 5
    assert any("workspace fallback: 1 convolution(s)" in n for n in report["notes"])
    assert result.predicted.ops[0].reads == (0,)  # its workspace was never there to read


def test_a_resident_created_at_first_use_is_created_by_its_first_reader_on_any_stream():
    """Hypothesis found it (test_properties): momentum (optimizer_state, no producer) is placed
    at the first optimizer op, op 0 on stream 3, launched at 2.5 us; op 1 on stream 0 reads it
    at 0 us with no dep on op 0 (a resident needs none). In a first iteration the reader creates
    it as it launches, as PyTorch creates momentum at first touch, instead of finding it unborn
    (PlanError). op 1 runs 0-1 us, op 0 2.5-3.5 us: the iteration takes 3.5 us either way."""
    ops = [op(0, 2.5, 1, phase="opt", stream=3), op(1, 0, 1, phase="opt", reads=(0,))]
    tr = trace(ops, [tensor(0, 1024, "optimizer_state", consumers=(1,))])
    caching = make_allocator("caching")
    warm = simulate(tr, hardware(), Fixed(), caching, 1 << 30, first_iteration=True).report
    plain = simulate(tr, hardware(), Fixed(), caching, 1 << 30, first_iteration=False).report
    assert warm["fits"] and warm["iteration_time_us"] == plain["iteration_time_us"] == 3.5
    assert warm["peak_allocated_bytes"] == plain["peak_allocated_bytes"] == 1024


def test_a_workspace_fallback_leaves_the_plan_index_unchanged():
    """The fallback is the run's own state (Engine.retime): the plan's index, built from the
    plan, says after the run what it said before (no retime, nothing hung on op 0)."""
    from vsim.engine.simulator import Engine
    from vsim.policies.base import Retime

    mib = 2**20
    conv = op(0, 0, 10, layer_type="conv", reads=(0, 2), writes=(1, 2), frees=(2,))
    tr = trace([conv, op(1, 10, 5, reads=(1,), frees=(1,))],
               [tensor(0, 2 * mib, "weight"), tensor(1, 4 * mib, producer=0, consumers=(1,)),
                tensor(2, 30 * mib, "workspace", producer=0, consumers=(0,))])
    free = Retime(0, 15.0, workspace_bytes=0)
    engine = Engine(tr, hardware(), Plan(), make_allocator("exact").build(10 * mib),
                    fallback={0: free})
    out = engine.run()
    assert out.oom is None and engine.fell_back == [0] and engine.retime == {0: free}
    assert engine.index.retime == {} and 0 not in engine.index.acts_before
    assert out.end_us == 15 + 5


def test_pinned_host_memory_beyond_the_profiles_limit_does_not_fit():
    """Offload t0 at op0 (0-10 us) and t1 at op1 (20-30 us), both released at op1's end and
    brought back for op3: 10,000 + 10,000 B pinned at once from 20 us. Under a 20 kB limit that
    fits (peak 20,000 B); under 15 KB pinning t1 would leave 5,000 B: out of pinned host memory
    at op1, the run stopped there, with a note naming the limit."""
    plan = [Offload(0, at_op=0, release_after=1), Offload(1, at_op=1, release_after=1),
            Prefetch(0, at_op=2, needed_by=3), Prefetch(1, at_op=2, needed_by=2)]
    ok = run(TWO, plan, hw=hardware(pinned_limit="20KB"))
    assert ok["fits"] and ok["pinned_host_peak_bytes"] == 20_000
    r = run(TWO, plan, hw=hardware(pinned_limit="15KB"))
    assert r["fits"] is False and r["pinned_host_peak_bytes"] == 10_000
    assert r["oom"] == {"op": 1, "tensor": 1, "need_bytes": 10_000, "free_bytes": 5_000,
                        "largest_free_bytes": 5_000, "memory": "pinned host"}
    assert any("host.pinned_limit (15000 B" in n for n in r["notes"])
    assert r["d2h_bytes"] == 10_000  # only t0 was copied out


def test_a_pinned_pool_beyond_the_limit_does_not_fit_before_the_first_op():
    @dataclass(frozen=True)
    class Pool(Policy):
        name = "pool"

        def plan(self, trace, hw, capacity_bytes):
            return Plan(pinned_pool_bytes=16_000)

    hw = hardware(pinned_limit="15KB")
    r = simulate(TWO, hw, Pool(), make_allocator("exact"), 10**6).report
    assert r["fits"] is False and r["oom"]["op"] is None and r["oom"]["memory"] == "pinned host"
    assert r["oom"]["need_bytes"] == 16_000 and r["oom"]["free_bytes"] == 15_000
    assert r["iteration_time_us"] == 0 and any("the pinned pool" in n for n in r["notes"])


def test_the_timed_iteration_is_the_median_of_the_iterations_a_measurement_times():
    """A measurement reports the median of iterations 4 to 13 (3 warm-up, 10 timed); the
    report's timed_iteration_time_us is the same statistic of the simulated iterations, a
    converged run's last iteration standing for those it would repeat (validate compares it).
    Without a first iteration only one iteration runs."""
    import statistics

    mib = 2**20
    ops = [op(0, 0, 10, layer_type="conv", writes=(2,)),
           op(1, 10, 10, layer_type="fc", reads=(2,), writes=(3,)),
           op(2, 20, 10, phase="bwd", reads=(2, 3), frees=(2, 3))]
    tr = trace(ops, [tensor(0, 4 * mib, "weight"), tensor(2, 12 * mib, producer=0,
                                                           consumers=(1, 2)),
                     tensor(3, 2 * mib, producer=1, consumers=(2,))])
    caching = make_allocator("caching")
    settled = simulate(tr, hardware(), Fixed(), caching, 1 << 30, first_iteration=True)
    assert settled.output.timed_ends_us == [settled.output.end_us] * 10
    assert settled.report["timed_iteration_time_us"] == settled.report["iteration_time_us"]
    once = simulate(tr, hardware(), Fixed(), caching, 1 << 30, first_iteration=False)
    assert once.output.timed_ends_us == []
    assert once.report["timed_iteration_time_us"] == once.report["iteration_time_us"]
    # wide_resnet50_2's hybrid plan at 5.8 GiB hits the cap in most iterations and never
    # settles: 10 timed iterations of different lengths, their median reported
    from pathlib import Path

    from vsim.hardware import load_hardware
    from vsim.policies import make_policy

    root = Path(__file__).resolve().parents[1]
    wide = load_trace(root / "traces/wide_resnet50_2-b64-h100.vsim.json.gz")
    run = simulate(wide, load_hardware("h100-sxm"), make_policy("hybrid"), caching,
                   int(5.8 * 2**30))
    ends = run.output.timed_ends_us
    assert len(ends) == 10 and len(set(ends)) > 1
    assert run.report["timed_iteration_time_us"] == pytest.approx(
        statistics.median(ends) + wide.meta.get("iteration_tail_us", 0.0))


def test_a_run_is_not_settled_while_its_plan_gains_fallbacks():
    """An iteration whose convolutions fell back to their workspace-free algorithms changes the
    next one's plan (PyTorch caches the engine), so an equal layout after it does not make the
    next iteration equal: vgg16(256) under superneurons at its uncapped peak falls back in the
    first steady iteration, and the run goes on until an iteration repeats the one before with
    the same plan."""
    from pathlib import Path

    from vsim.hardware import load_hardware
    from vsim.policies import make_policy

    root = Path(__file__).resolve().parents[1]
    vgg = load_trace(root / "traces/vgg16-b256-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    peak = simulate(vgg, hw, make_policy("none"), make_allocator("exact"),
                    10**15).report["peak_allocated_bytes"]
    run = simulate(vgg, hw, make_policy("superneurons"), make_allocator("caching"), int(peak))
    notes = " ".join(run.report["notes"])
    assert "workspace fallback" in notes
    assert "iteration 4 of the run reported" in notes


def test_a_backward_convolution_first_takes_its_data_gradient_workspace() -> None:
    """run_plan's dgrad_workspace: a block allocated and freed in each backward
    convolution (about its forward's workspace) stays cached in a segment of its own when
    nothing cached fits it: on vgg16-b128 with no policy it opens segments the model did not
    open before (PyTorch's history opens them too: validation/allocator/h100/vgg16-b128)."""
    from pathlib import Path

    from vsim.engine import run_plan
    from vsim.engine.prep import trace_prep
    from vsim.hardware import load_hardware

    t = load_trace(Path(__file__).resolve().parents[1] / "traces" / "vgg16-b128-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    assert len(trace_prep(t).dgrad_workspaces()) == 12  # 13 convolutions, the first has none
    off, on, default = (run_plan(t, hw, Plan(), make_allocator("caching"), None,
                                 dgrad_workspace=flag).report for flag in (False, True, None))
    assert on["peak_reserved_bytes"] > off["peak_reserved_bytes"] + 400 * 2**20
    assert default == on  # on with PyTorch's allocator
    # nothing held: allocated moves only by the blocks' rounding (an unsplit block is whole)
    assert on["peak_allocated_bytes"] == pytest.approx(off["peak_allocated_bytes"], rel=1e-3)
    exact = run_plan(t, hw, Plan(), make_allocator("exact"), None).report
    assert exact == run_plan(t, hw, Plan(), make_allocator("exact"), None,
                             dgrad_workspace=False).report  # off with the others


class _Requests:
    """An allocator spec whose allocators log every request's bytes (in `sizes`)."""

    def __init__(self, spec: object) -> None:
        self.spec, self.sizes = spec, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.spec, name)

    def build(self, capacity_bytes: int) -> object:
        allocator = self.spec.build(capacity_bytes)  # type: ignore[attr-defined]
        malloc = allocator.malloc

        def logged(size_bytes: int, *args: object, **kwargs: object) -> object:
            self.sizes.append(size_bytes)
            return malloc(size_bytes, *args, **kwargs)

        allocator.malloc = logged
        return allocator


def test_the_data_gradient_workspace_comes_after_the_gradients_as_pytorch_asks() -> None:
    """PyTorch's histories (validation/allocator/h100/expandable/) show a backward
    convolution's requests as: its input gradient, then the data-gradient kernel's workspace
    (freed), then the weight-gradient kernel's; a part's where it runs as micro-batches, none
    where it runs its workspace-free algorithm (the squeeze cached that engine)."""
    from pathlib import Path

    from vsim.engine import run_plan
    from vsim.engine.prep import trace_prep
    from vsim.hardware import load_hardware
    from vsim.plan import Retime

    t = load_trace(Path(__file__).resolve().parents[1] / "traces" / "vgg16-b128-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    dgrad = trace_prep(t).dgrad_workspaces()
    op = next(o for o in t.ops if o.id == max(dgrad, key=dgrad.__getitem__))
    size = {x.id: x.size_bytes for x in t.tensors}
    *grads, workspace = (size[w] for w in op.writes)

    def requests(*actions: Retime, before: int = 0, after: int = 2) -> list[int]:
        spec = _Requests(make_allocator("caching"))
        run_plan(t, hw, Plan(actions=actions), spec, None)  # type: ignore[arg-type]
        n = len(grads)
        at = next(i for i in range(len(spec.sizes)) if spec.sizes[i:i + n] == grads)
        return spec.sizes[at - before:at + n + after]

    assert requests() == [*grads, dgrad[op.id], workspace]
    free = requests(Retime(op.id, op.dur_us, 0, "measured"))
    assert free[:len(grads)] == grads and dgrad[op.id] not in free
    # As micro-batches (vsim.runtime.microbatch): a part's results, its two workspaces, the
    # whole batch's results, then (the first part's freed) a later part's, which finds them
    # allocated; the recorded workspace itself asked for by none
    parts = Retime(op.id, op.dur_us, workspace // 4, "micro-batched", parts=4)
    part = [-(-sum(grads) // 4), -(-dgrad[op.id] // 4), -(-workspace // 4)]
    assert requests(parts, before=3, after=3) == [*part, *grads, *part]


def test_a_workspace_free_convolution_takes_the_others_of_its_shape_along() -> None:
    """PyTorch caches one cuDNN engine per shape and pass: squeezing conv 0.24's forward
    gives 0.26's and 0.28's (same sizes) the same workspace-free engine, as the profiled
    VGG-16(256) run showed (validation/runtime/microbatch-21-h100.log). Not with `exact`,
    the paper frameworks' per-call algorithm choice."""
    from pathlib import Path

    from vsim.engine import run_plan
    from vsim.engine.prep import trace_prep
    from vsim.hardware import load_hardware
    from vsim.plan import Retime

    t = load_trace(Path(__file__).resolve().parents[1] / "traces" / "vgg16-b256-h100.vsim.json.gz")
    hw = load_hardware("h100-sxm")
    assert trace_prep(t).same_shape()[24] == (26, 28)
    assert trace_prep(t).same_shape()[49] == (47, 51)  # their backward ones
    plan = Plan(actions=(Retime(24, 6613.0, 0, "measured"),))

    def free(spec: str) -> list[int]:
        run = run_plan(t, hw, plan, make_allocator(spec), None)
        return [e.op.id for e in run.output.executed if e.without_workspace]

    assert free("caching") == [24, 26, 28]
    assert free("exact") == [24]
