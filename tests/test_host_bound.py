"""Issue 15's sqrt oddity: recompute:strategy=sqrt gave gpt2-medium (synthesized) the same
iteration time at 512, 768 and 1024 tokens with no stall. The cause is the host clock: a
synthesized trace's ops are issued at the host model's cost per op (no recorded start bounds
it), and a plan with actions runs under vsim's runtime, whose tracker adds
`tracker_us_per_op` per op and whose recomputations cost `recompute_call_us` each; the host
then issues slower than the GPU computes, and the iteration is the host's time whatever the
kernels take. Not a fixed stall or a cap: the report now says so in a note."""

from builders import op, tensor, trace

from vsim.allocator import make_allocator
from vsim.engine import run_plan
from vsim.hardware import load_hardware
from vsim.host import load_host_model
from vsim.plan import Plan
from vsim.policies.base import Offload, Prefetch


def four_ops(dur_us: float):
    # fwd op0, op1; bwd op2, op3; t1 offloaded after op0 and brought back for op3.
    return trace([op(0, 0, dur_us, reads=(0,), writes=(1,)),
                  op(1, dur_us, dur_us, reads=(1,), writes=(2,)),
                  op(2, 2 * dur_us, dur_us, phase="bwd", reads=(2,), frees=(2,)),
                  op(3, 3 * dur_us, dur_us, phase="bwd", reads=(1,), frees=(1,))],
                 [tensor(0, 1 << 20, "input"), tensor(1, 1 << 20, producer=0),
                  tensor(2, 1 << 20, producer=1)])


def test_a_host_bound_iteration_is_the_hosts_time_whatever_the_kernels_take():
    hw = load_hardware("h100-sxm")
    host = load_host_model("h100-sxm")
    assert host is not None
    plan = Plan(actions=(Offload(1, at_op=0, release_after=1), Prefetch(1, at_op=2, needed_by=3)))
    times = {}
    for dur in (1.0, 2.0):
        r = run_plan(four_ops(dur), hw, plan, make_allocator("exact"), host_time=True,
                     tracker="python").report
        times[dur] = r
    # Host per op (no name in the host model: its phase's median): fwd 41.87 us, bwd 56.43 us;
    # tracked: + tracker_us_per_op (48.5) per op and copy_us (150.3) before op0 (offload) and
    # op2 (prefetch); an offload's own release costs nothing more (free_us is per Release or
    # Drop action). op3 is issued at 2 x 41.87 + 2 x 56.43 + 4 x 48.5 + 2 x 150.3 = 691.2 us
    # and runs 1 or 2 us: the GPU's own 4 or 8 us hardly matter.
    issue3 = (2 * host.by_phase["fwd"] + 2 * host.by_phase["bwd"] + 4 * host.tracker_us_per_op
              + 2 * host.copy_us)
    assert times[1.0]["iteration_time_us"] == pytest_approx(issue3 + 1.0)
    assert times[2.0]["iteration_time_us"] == pytest_approx(issue3 + 2.0)
    assert times[1.0]["stall_time_us"] == 0.0
    note = [n for n in times[1.0]["notes"] if n.startswith("host-bound")]
    assert len(note) == 1 and "vsim's runtime's tracker" in note[0]
    # The runtime runs a plan under its native tracker by default: no per-op tracker cost, but
    # its counter on every counted call and its saved-tensor hooks on the forward ops with a
    # save the plan acts on (none here: the plan acts on op0's only output); the tracker
    # before (the hooks always on) on each of the two forward ops. The Python tracker's cost
    # per op includes both.
    assert host.pack_us > 0 and host.native_us_per_call > 0
    # By default backward is gated: of its ops, the first (its root) is counted whole, the
    # others only where the plan acts before them or after the op before them, one call each
    # (op2, the prefetch's, is the root; op3 waits for the prefetch: its first call only).
    ops = four_ops(1.0).ops
    counted = sum(host.counted(o) for o in ops)
    assert host.counted(ops[3]) > 1
    # The default carries the plan out by the executor's core: its own copy cost per offload
    # and prefetch (HostModel.core)
    core_copy = host.with_core().copy_us
    assert core_copy < host.copy_us
    for tracker, hooked, calls, copy in (
            (None, 0, counted - host.counted(ops[3]) + 1, core_copy),
            ("native", 0, counted, host.copy_us), ("native-always", 2, counted, host.copy_us)):
        native = run_plan(four_ops(1.0), hw, plan, make_allocator("exact"), host_time=True,
                          tracker=tracker).report
        assert native["iteration_time_us"] == pytest_approx(
            issue3 - 4 * host.tracker_us_per_op + hooked * host.pack_us
            + host.native_us_per_call * calls + 2 * (copy - host.copy_us) + 1.0)
    # An ideal runtime (tracked=False) issues at PyTorch's own cost: 2 x 41.87 + 2 x 56.43.
    r = run_plan(four_ops(1.0), hw, plan, make_allocator("exact"), host_time=True,
                 tracked=False).report
    untracked = 2 * host.by_phase["fwd"] + 2 * host.by_phase["bwd"]
    assert r["iteration_time_us"] == pytest_approx(untracked + 1.0)


def pytest_approx(x: float):
    import pytest
    return pytest.approx(x, abs=1e-6)
