"""Engine behaviour the memory policies rely on: recomputation before an op that reads the
recomputed tensor, the recomputed chain's own inputs, and Plan.wait_for_memory.

Test hardware: both link directions 1 GB/s = 1000 B/us with no latency, no interference, so a
10,000 B copy takes 10 us.
"""

from dataclasses import dataclass

import pytest
from builders import chain

from vsim.allocator import make_allocator
from vsim.engine import PlanError, simulate
from vsim.hardware import parse_hardware
from vsim.policies.base import Drop, Offload, Plan, Policy, Prefetch, Recompute


def hardware():
    path = {"pinned": {"bandwidth": "1GB/s", "latency": "0us"},
            "pageable": {"bandwidth": "0.5GB/s", "latency": "0us"}}
    doc = {
        "name": "test-gpu",
        "provenance": {"source": "test", "date": "2026-11-21", "method": "round numbers"},
        "gpu": {"memory": "1MB", "context": "0B", "cuda_malloc": "0us"},
        "compute": {"peak": {"fp32": "1TFLOP/s"}, "dram_bandwidth": "100GB/s",
                    "launch_latency": "0us", "copy_interference": "0%"},
        "link": {"h2d": path, "d2h": path, "duplex": "2GB/s"},
        "host": {"pinned_limit": "1GB", "pinned_alloc_per_GiB": "0us"},
    }
    return parse_hardware(doc, "test")


@dataclass(frozen=True)
class Fixed(Policy):
    name = "fixed-ext"
    actions: tuple = ()
    wait: bool = False

    def plan(self, trace, hw, capacity_bytes):
        return Plan(actions=self.actions, wait_for_memory=self.wait)


def run(tr, actions, capacity=10**6, wait=False):
    return simulate(tr, hardware(), Fixed(tuple(actions), wait), make_allocator("exact"),
                    capacity).report


# chain(3): fwd op0 (0-20) t0->t1, op1 (20-40) t1->t2, op2 (40-60) t2->t3; bwd op3 (60-90) reads
# t2,t3 frees t3; op4 (90-120) reads t1,t2 frees t2; op5 (120-150) reads t0,t1 frees t1.
THREE = chain(3, act_bytes=10_000, fwd_us=20, bwd_us=30)


def test_recompute_before_the_op_that_reads_the_dropped_tensor():
    # t2 dropped after op2, its last forward reader; op1 (20 us) re-runs before op3, which
    # reads t2: op3 starts at 80 instead of 60, the iteration takes 150 + 20 = 170 us.
    r = run(THREE, [Drop(2, after_op=2), Recompute(ops=(1,), before_op=3, tensors=(2,))])
    assert r["fits"]
    assert r["recompute_time_us"] == 20
    assert r["iteration_time_us"] == 170


def test_dropped_tensor_without_recompute_is_a_plan_error():
    with pytest.raises(PlanError):
        run(THREE, [Drop(2, after_op=2)])


def test_recompute_input_must_be_on_the_gpu():
    # The chain (op1) reads t1, which was copied out when op1 ended (40-50) and not brought back.
    actions = [Offload(1, at_op=1, after=True), Drop(2, after_op=2),
               Recompute(ops=(1,), before_op=3, tensors=(2,))]
    with pytest.raises(PlanError, match="recomputation"):
        run(THREE, actions)
    # Prefetched at op3's launch: t1 is copied 60-70 (10,000 B at 1000 B/us), the recompute
    # waits for it (stall 10) and runs 70-90, op3 runs 90-120: 150 + 10 + 20 = 180 us.
    r = run(THREE, [*actions, Prefetch(1, at_op=3, needed_by=3)])
    assert r["fits"] and r["iteration_time_us"] == 180 and r["stall_time_us"] == 10


# chain(2): op0 (0-20) t0->t1, op1 (20-40) t1->t2; op2 (40-70) reads t1,t2 frees t2; op3 (70-100)
# reads t0,t1 frees t1.
TWO = chain(2, act_bytes=10_000, fwd_us=20, bwd_us=30)


def test_wait_for_memory_blocks_until_an_offload_gives_memory_back():
    # Capacity 20,000 B. t0 is copied out when op0 ends (20-30 us). op1 needs t2 at 20 while t0
    # and t1 are live (20,000): without waiting that is out of memory; with wait_for_memory it
    # waits for t0 to leave at 30 (stall 10), runs 30-50, op2 50-80. t0 comes back at op3's
    # launch (t2 freed at 80, so it fits), 80-90: op3 waits 10 more and runs 90-120.
    actions = [Offload(0, at_op=0, after=True), Prefetch(0, at_op=3, needed_by=3)]
    failed = run(TWO, actions, capacity=20_000)
    assert not failed["fits"] and failed["oom"]["op"] == 1
    r = run(TWO, actions, capacity=20_000, wait=True)
    assert r["fits"]
    assert r["iteration_time_us"] == 120
    assert r["stall_time_us"] == 20
    assert r["peak_allocated_bytes"] == 20_000


def test_wait_for_memory_still_reports_oom_when_nothing_is_in_flight():
    r = run(TWO, [], capacity=20_000, wait=True)
    assert not r["fits"] and r["oom"]["op"] == 1


def _host_run(tr, actions, host):
    from vsim.engine.simulator import Engine
    plan = Plan(actions=tuple(actions))
    return Engine(tr, hardware(), plan, make_allocator("exact").build(10**6), host=host).run()


def test_recomputation_costs_its_host_time_where_the_host_has_no_lead():
    """THREE as a recording (bounded host clock), a host taking 50 us per forward op and none
    per backward op: the host issues op0..op2 at 0, 20, 40 (bounded by their recorded starts)
    and op3..op5 at 40. Replayed unchanged nothing moves (150 us). Recomputing op1 before op3:
    the host issues it at 40 + 50 = 90, so the GPU, idle since 60, runs it 90-110; op3 runs
    110-140, op4 140-170, op5 170-200: 30 us more than the 170 without a host model (the host's
    20 us lead hid the rest)."""
    import dataclasses

    from vsim.host import HostModel
    recorded = dataclasses.replace(THREE, meta={**THREE.meta, "source": "measured"})
    host = HostModel("test", by_name={}, by_phase={"fwd": 50.0, "bwd": 0.0}, per_weight_us=0.0)
    assert _host_run(recorded, [], host).end_us == 150
    actions = [Drop(2, after_op=2), Recompute(ops=(1,), before_op=3, tensors=(2,))]
    assert _host_run(recorded, actions, None).end_us == 170
    assert _host_run(recorded, actions, host).end_us == 200
    # A synthesized trace has no recorded start to bound the host: 3 x 50 us of forward issue
    # make op2 start at 150 (not 40), and the whole iteration ends at 150 + 20 + 90 = 260.
    assert _host_run(THREE, [], host).end_us == 260
