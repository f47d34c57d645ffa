"""`vsim search` (vsim/search/), plan files (vsim/plan_io.py) and the `plan` policy.

Hand-made traces, sizes in MiB (2**20 B): chain(3) from tests/builders.py, 2 MiB feature maps,
every op 5,000 us:

    op0 fwd l0 reads t0 (input) writes t1      0- 5,000
    op1 fwd l1 reads t1 writes t2          5,000-10,000
    op2 fwd l2 reads t2 writes t3         10,000-15,000
    op3 bwd l2 reads t2,t3 frees t3       15,000-20,000
    op4 bwd l1 reads t1,t2 frees t2       20,000-25,000
    op5 bwd l0 reads t0,t1 frees t1       25,000-30,000

All four maps (8 MiB) are alive during op2 and op3; at 6 MiB one 2 MiB map must be away then,
and only t0 and t1 are not read there. Test GPU: link 1 GB/s each way (1000 B/us, a 2 MiB copy
takes 2,097.152 us), no latency, no copy interference.
"""

from __future__ import annotations

import json

import pytest
import yaml
from builders import chain
from netbuilder import torch_net

from vsim.allocator import make_allocator
from vsim.cli import main
from vsim.engine import run_plan, simulate
from vsim.errors import ConfigError, PolicyError
from vsim.hardware import load_hardware, parse_hardware
from vsim.plan import Drop, Offload, Plan, Prefetch, Recompute, Release, Retime, Sync
from vsim.plan_io import SavedPlan, load_plan, plan_from_json, save_plan, trace_digest
from vsim.policies import make_policy
from vsim.search import Genome, Problem, lower_bound, search
from vsim.search.run import builtin_specs, run_builtins
from vsim.trace import save_trace

MiB = 2**20
CHAIN = chain(3, act_bytes=2 * MiB, fwd_us=5_000, bwd_us=5_000)
CAP = 6 * MiB
EXACT = make_allocator("exact")


def hw_doc(link="1GB/s"):
    return {
        "name": "test-gpu",
        "provenance": {"source": "test", "date": "2026-11-22", "method": "round numbers"},
        "gpu": {"memory": "1GB", "context": "0B", "cuda_malloc": "0us"},
        "compute": {"peak": {"fp32": "1TFLOP/s"}, "dram_bandwidth": "100GB/s",
                    "launch_latency": "0us", "copy_interference": "0%"},
        "link": {"h2d": {"pinned": {"bandwidth": link, "latency": "0us"},
                         "pageable": {"bandwidth": link, "latency": "0us"}},
                 "d2h": {"pinned": {"bandwidth": link, "latency": "0us"},
                         "pageable": {"bandwidth": link, "latency": "0us"}},
                 "duplex": "100GB/s"},
        "host": {"pinned_limit": "1GB", "pinned_alloc_per_GiB": "0us"},
    }


FAST = parse_hardware(hw_doc(), "test")
SLOW = parse_hardware(hw_doc("0.01GB/s"), "test")   # 10 B/us: a 2 MiB copy takes 209,715 us


def test_swap_with_the_prefetch_where_memory_allows_is_the_best_plan():
    # By hand: swapping t1 cannot hide: its prefetch needs 2 MiB before op4, but ops 2 and 3
    # hold t1..t3 = 6 MiB, so it starts at op4 (20,000) and op4 waits 2,097 us. Swapping the
    # input t0 hides: out during op0 (0-2,097), gone from op1 on; prefetched at op4 (t3 freed
    # by then: t1 + t2 + t0 = 6 MiB), back at 22,097, before op5 at 25,000. Dropping t1 costs
    # op0 again (5,000 us). Best: swap t0, fetch at op4: 30,000 us, the compute bound.
    r = search(CHAIN, FAST, CAP, EXACT, seed=0, budget_s=30)
    assert r.outcome.fits
    assert r.outcome.time_us == pytest.approx(30_000)
    assert r.genome.swaps == ((0, 4),) and r.genome.drops == ()
    b = lower_bound(CHAIN, FAST, CAP)
    # 8 MiB at op2 less 6 MiB: 2 MiB out before op2 and back after it: 2 x 2,097.152 us.
    assert b["compute_us"] == pytest.approx(30_000)
    assert b["must_leave_bytes"] == 2 * MiB and b["at_op"] == 2
    assert b["link_us"] == pytest.approx(2 * 2 * MiB / 1000)
    assert b["bound_us"] == pytest.approx(30_000) == b["recompute_bound_us"]


def test_recompute_wins_over_a_slow_link():
    # 10 B/us: any swap stalls for hundreds of ms. Dropping t1 after op1 and re-running op0
    # (it reads t0, still there) before op4 costs 5,000 us: 35,000 us. t0 has no producer and
    # t2, t3 are read during the peak, so that is the only fitting plan without a swap.
    r = search(CHAIN, SLOW, CAP, EXACT, seed=0, budget_s=30)
    assert r.outcome.fits and r.outcome.time_us == pytest.approx(35_000)
    assert r.genome.drops == (1,) and r.genome.swaps == ()
    acts = r.plan.actions
    assert Drop(1, 1) in acts and Recompute((0,), 4, (1,)) in acts
    b = lower_bound(CHAIN, SLOW, CAP)
    # The link-only bound, 2 MiB out and back at 10 B/us = 419,430 us, does not hold for
    # recomputation; with it, the bound is below the plan: 30,000 + part of op0's 5,000 us.
    assert b["bound_us"] == pytest.approx(2 * 2 * MiB / 10)
    assert 30_000 < b["recompute_bound_us"] <= 35_000


def test_a_plan_that_cannot_fit_is_reported_as_such():
    # 4 MiB: op2 itself needs t2 and t3 and t0 or t1 cannot both leave... every map but the two
    # op2 touches can go, 4 MiB is exactly t2 + t3: fits by evicting t0 and t1. 3 MiB cannot.
    assert search(CHAIN, FAST, 4 * MiB, EXACT, budget_s=30).outcome.fits
    r = search(CHAIN, FAST, 3 * MiB, EXACT, budget_s=30)
    assert not r.outcome.fits


M = 1_000_000
NET = torch_net(
    [("conv", 400 * M), ("relu", 0), ("conv", 400 * M), ("relu", 0), ("pool", 100 * M),
     ("conv", 200 * M), ("relu", 0), ("fc", 10 * M), ("loss", 0)],
    100 * M, fwd_us={"conv": 10_000, "relu": 500, "pool": 1_000, "fc": 2_000, "loss": 500},
    weight_bytes=10 * M, workspace_bytes=50 * M, opt_us=1_000)
H100 = load_hardware("h100-sxm")


@pytest.mark.parametrize("capacity_mb", [1300, 1400, 1600])
def test_search_fits_where_a_policy_fits_never_worse_than_its_greedy_start(capacity_mb):
    # tests/test_policies.py's network (peak 1760 MB without a policy).
    capacity = capacity_mb * M
    rows, _ = run_builtins(NET, H100, capacity, EXACT, builtin_specs())
    fitting = [row["iteration_time_us"] for row in rows if row["fits"]]
    assert fitting
    r = search(NET, H100, capacity, EXACT, seed=1, budget_s=60, kicks=1)
    assert r.greedy_outcome.fits and r.outcome.fits
    assert r.outcome.time_us <= r.greedy_outcome.time_us
    report = run_plan(NET, H100, r.plan, EXACT, capacity).report
    assert report["fits"] and report["peak_allocated_bytes"] <= capacity
    # (the search's time is what a measurement reports: the timed iterations' median)
    assert report["timed_iteration_time_us"] == pytest.approx(r.outcome.time_us)
    assert r.outcome.time_us <= min(fitting) + 1e-6
    assert lower_bound(NET, H100, capacity)["recompute_bound_us"] <= r.outcome.time_us


def test_no_plan_fits_where_an_op_alone_needs_more():
    # conv_backward of layer 2 (op 15) reads y0 and the gradient of y2 and writes the gradient
    # of y0 (400 MB each) and its weight gradient, while 4 weights and 3 weight gradients
    # (10 MB each) are held: 1,270 MB whatever is moved. Below that the search finds nothing,
    # and the bound says why.
    b = lower_bound(NET, H100, 1250 * M)
    assert not b["can_fit"] and b["least_working_set_op"] == 15
    assert b["least_working_set_bytes"] == 1270 * M
    assert not search(NET, H100, 1250 * M, EXACT, budget_s=30).outcome.fits
    assert lower_bound(NET, H100, 1270 * M)["can_fit"]
    # At exactly 1,270 MB a plan exists (y0 and the input away during op 15): the search finds
    # it, faster than the built-in policies that fit there too (SuperNeurons').
    r = search(NET, H100, 1270 * M, EXACT, budget_s=30)
    rows, _ = run_builtins(NET, H100, 1270 * M, EXACT, builtin_specs())
    assert r.outcome.fits
    assert r.outcome.time_us <= min(row["iteration_time_us"] for row in rows if row["fits"])


def test_search_is_deterministic_for_a_seed():
    a = search(NET, H100, 1400 * M, EXACT, seed=3, budget_s=60, kicks=1)
    b = search(NET, H100, 1400 * M, EXACT, seed=3, budget_s=60, kicks=1)
    assert a.converged and b.converged
    assert a.genome == b.genome and a.plan == b.plan and a.evaluations == b.evaluations


def test_builtins_are_every_registered_policy_and_its_examples():
    from vsim.policies import registry
    specs = builtin_specs()
    assert {s.split(":")[0] for s in specs} == set(registry()) - {"plan"}
    assert "vdnn:mode=dyn,algo=performance" in specs and len(specs) == len(set(specs))


# ---------------------------------------------------------------- plan files

def test_plan_file_round_trip_keeps_every_action_and_switch(tmp_path):
    plan = Plan(actions=(Offload(3, 1, True, 2), Prefetch(3, 7, 9), Sync(4), Drop(5, 2),
                         Recompute((1, 2), 8, (5,)), Release(6, 3),
                         Retime(2, 12.5, 0, "modelled"), Retime(4, 3.0, None)),
                notes=("a note",), pinned_pool_bytes=1234, pinned_lazy=True, pinned=False,
                wait_for_memory=True)
    saved = SavedPlan(plan=plan, trace_digest=trace_digest(CHAIN), trace_path="t.vsim.json.gz",
                      file_sha256="ab" * 32, hardware="test-gpu", capacity_bytes=CAP,
                      search={"iteration_time_us": 1.0})
    path = tmp_path / "p.json"
    save_plan(saved, path)
    back = load_plan(path)
    assert back.plan == plan
    assert (back.trace_digest, back.trace_path, back.hardware, back.capacity_bytes) == \
        (saved.trace_digest, "t.vsim.json.gz", "test-gpu", CAP)
    assert plan_from_json(json.loads(path.read_text())).plan == plan


def test_plan_policy_runs_the_plan_and_refuses_another_trace(tmp_path):
    r = search(CHAIN, FAST, CAP, EXACT, budget_s=30)
    path = tmp_path / "p.json"
    save_plan(SavedPlan(plan=r.plan, trace_digest=trace_digest(CHAIN)), path)
    policy = make_policy(f"plan:file={path}")
    report = simulate(CHAIN, FAST, policy, EXACT, CAP).report
    assert report["fits"] and report["iteration_time_us"] == pytest.approx(30_000)
    other = chain(3, act_bytes=2 * MiB, fwd_us=5_000, bwd_us=5_001)  # one op time differs
    with pytest.raises(PolicyError, match="plan made for another trace"):
        simulate(other, FAST, policy, EXACT, CAP)
    # Without a file (every registered policy has defaults) the plan is empty.
    assert make_policy("plan").plan(CHAIN, FAST, CAP).actions == ()


_MADE = next(t for t in CHAIN.tensors if t.producer is not None)  # an activation and its op


@pytest.mark.parametrize("action, message", [
    (Offload(_MADE.id, _MADE.producer, after=False, release_after=_MADE.producer),
     rf"plan.actions\[0\] \(Offload\): offloads tensor {_MADE.id} before op "
     rf"{_MADE.producer}, its producer"),
    (Prefetch(_MADE.id, 99, 99), r"plan.actions\[0\] \(Prefetch\): op 99 is not an op"),
    (Drop(777, 2), r"plan.actions\[0\] \(Drop\): tensor 777 is not a tensor"),
])
def test_an_edited_plan_file_that_cannot_apply_is_refused(tmp_path, action, message):
    path = tmp_path / "p.json"
    save_plan(SavedPlan(plan=Plan(actions=(action,)), trace_digest=trace_digest(CHAIN)), path)
    with pytest.raises(PolicyError, match=message):
        make_policy(f"plan:file={path}").plan(CHAIN, FAST, CAP)
    # after the producer has run, the same offload is fine
    fine = Offload(_MADE.id, _MADE.producer, after=True, release_after=_MADE.producer)
    save_plan(SavedPlan(plan=Plan(actions=(fine,)), trace_digest=trace_digest(CHAIN)), path)
    assert make_policy(f"plan:file={path}").plan(CHAIN, FAST, CAP).actions == (fine,)


@pytest.mark.parametrize("doc, message", [
    ({"format": "vsim-trace"}, "format: not a vsim-plan file"),
    ({"format": "vsim-plan", "version": 2}, "version: 2 is newer"),
    ({"format": "vsim-plan", "version": 1, "trace": {"digest": "x"}, "plan": {"actions": []}},
     "trace.digest: not a SHA-256"),
    ({"format": "vsim-plan", "version": 1, "trace": {"digest": "0" * 64},
      "plan": {"actions": [{"action": "offload", "tensor": "3", "at_op": 1}]}},
     r"plan.actions\[0\].tensor: expected an integer"),
    ({"format": "vsim-plan", "version": 1, "trace": {"digest": "0" * 64},
      "plan": {"actions": [{"action": "teleport"}]}}, "unknown action 'teleport'"),
    ({"format": "vsim-plan", "version": 1, "trace": {"digest": "0" * 64},
      "plan": {"actions": [{"action": "drop", "tensor": 1}]}},
     r"plan.actions\[0\].after_op: missing"),
    ({"format": "vsim-plan", "version": 1, "trace": {"digest": "0" * 64},
      "plan": {"actions": [{"action": "retime", "op": 1, "dur_us": 5.0, "parts": 0}]}},
     r"plan.actions\[0\].parts: must be at least 1"),
])
def test_bad_plan_files_name_the_place(doc, message):
    with pytest.raises(ConfigError, match=message):
        plan_from_json(doc, "p.json")


# ---------------------------------------------------------------- command line

@pytest.fixture
def files(tmp_path):
    trace_path = tmp_path / "chain.vsim.json.gz"
    save_trace(CHAIN, trace_path)
    hw_path = tmp_path / "test-gpu.yaml"
    hw_path.write_text(yaml.safe_dump(hw_doc()))
    return str(trace_path), str(hw_path), tmp_path


def test_search_command_saves_a_plan_that_run_executes(files, capsys):
    trace_path, hw_path, tmp = files
    plan = str(tmp / "plan.json")
    assert main(["search", trace_path, "--hw", hw_path, "--memory", "6MiB", "-o", plan,
                 "--json", "--budget", "30", "--allocator", "exact"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["search"]["iteration_time_us"] == pytest.approx(30_000)
    assert out["search"]["report"]["policy"] == f"plan:file={plan}"
    assert out["bound"]["bound_us"] == pytest.approx(30_000)
    assert out["best_builtin"] is not None and out["plan_file"] == plan
    assert out["best_builtin"]["iteration_time_us"] >= out["search"]["iteration_time_us"]
    saved = json.loads((tmp / "plan.json").read_text())
    assert saved["trace"]["path"] == trace_path and saved["capacity_bytes"] == CAP
    assert main(["run", trace_path, "--hw", hw_path, "--memory", "6MiB", "--policy",
                 f"plan:file={plan}", "--json", "--allocator", "exact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["iteration_time_us"] == pytest.approx(30_000)


def test_a_plan_for_another_trace_is_one_line_and_exit_2(files, capsys):
    trace_path, hw_path, tmp = files
    plan = str(tmp / "plan.json")
    assert main(["search", trace_path, "--hw", hw_path, "--memory", "6MiB", "-o", plan,
                 "--no-builtins", "--budget", "30", "--allocator", "exact"]) == 0
    capsys.readouterr()
    other = tmp / "other.vsim.json.gz"
    save_trace(chain(4, act_bytes=2 * MiB, fwd_us=5_000, bwd_us=5_000), other)
    assert main(["run", str(other), "--hw", hw_path, "--memory", "8MiB", "--policy",
                 f"plan:file={plan}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vsim: error: {plan}: plan made for "
                                                   f"{trace_path}")


def test_search_command_bad_input(files, capsys):
    trace_path, hw_path, tmp = files
    assert main(["search", trace_path, "--hw", hw_path, "--budget", "-1"]) == 2
    assert main(["run", trace_path, "--hw", hw_path, "--policy",
                 f"plan:file={tmp / 'missing.json'}"]) == 2
    (tmp / "junk.json").write_text("{")
    assert main(["run", trace_path, "--hw", hw_path, "--policy",
                 f"plan:file={tmp / 'junk.json'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(e.startswith("vsim: error: ") for e in err)
    assert "cannot read plan" in err[1] and "invalid JSON" in err[2]


def test_genome_edits():
    g = Genome().set(3, "swap", 7).set(5, "drop")
    assert g.how(3) == "swap" and g.how(5) == "drop" and g.how(9) == "keep"
    assert g.set(3, "drop").drops == (3, 5) and g.set(3, "drop").swaps == ()
    assert g.toggle_slow(4).toggle_slow(4) == g


def test_local_search_from_a_built_in_plan_is_never_worse_than_that_plan():
    capacity = 1300 * M
    accudnn = make_policy("accudnn").plan(NET, H100, capacity)
    t_accudnn = run_plan(NET, H100, accudnn, EXACT, capacity).report["iteration_time_us"]
    r = search(NET, H100, capacity, EXACT, budget_s=60, kicks=0,
               starts=lambda: [("accudnn", accudnn)])
    assert r.outcome.fits and r.outcome.time_us <= t_accudnn
    assert r.from_greedy is not None and r.outcome.time_us <= r.from_greedy.time_us
    assert r.origin in ("greedy", "accudnn")
    # A plan in the search's terms and back: the same actions.
    p = Problem(NET, H100, capacity, EXACT)
    assert p.plan(p.genome_of(r.plan)) == p.plan(r.genome)


CACHING = make_allocator("caching")


@pytest.mark.parametrize("allocator", [EXACT, CACHING], ids=["exact", "caching"])
def test_search_fits_where_a_built_in_fits_never_slower_and_reports_its_bound_gap(
        allocator, tmp_path):
    # Built-ins are planned and run as `vsim run` does (engine.simulate on the run's
    # allocator), so the best of them is what `vsim run --policy` would report; the search is
    # judged the same way and is never slower.
    from vsim.search.run import run_search
    capacity = 1300 * M
    trace_path = tmp_path / "net.vsim.json.gz"
    save_trace(NET, trace_path)
    out = run_search(NET, str(trace_path), H100, capacity, allocator, budget_s=60, kicks=1)
    best = out["best_builtin"]
    assert best is not None
    ran = simulate(NET, H100, make_policy(best["policy"]), allocator, capacity).report
    assert ran["fits"]
    assert ran["timed_iteration_time_us"] == pytest.approx(best["iteration_time_us"])
    s = out["search"]
    assert s["fits"] and s["report"]["fits"]
    assert s["iteration_time_us"] == pytest.approx(s["report"]["timed_iteration_time_us"])
    assert s["iteration_time_us"] <= best["iteration_time_us"] + 1e-6
    assert s["bound_gap"] == pytest.approx(s["iteration_time_us"] / out["bound"]["bound_us"] - 1)
    assert s["recompute_bound_gap"] == pytest.approx(
        s["iteration_time_us"] / out["bound"]["recompute_bound_us"] - 1)
    assert s["recompute_bound_gap"] >= 0


def test_search_returns_the_best_built_in_plan_when_its_own_does_not_fit(tmp_path):
    # A budget too short for the greedy start to fit, no built-in starts: the plan returned is
    # the fastest fitting built-in's, saved and run as such.
    from vsim.search.run import run_search
    capacity = 1300 * M
    trace_path = tmp_path / "net.vsim.json.gz"
    save_trace(NET, trace_path)
    out = run_search(NET, str(trace_path), H100, capacity, EXACT, budget_s=1e-6, kicks=0,
                     builtin_starts=False, output=str(tmp_path / "plan.json"))
    s, best = out["search"], out["best_builtin"]
    assert s["search_iteration_time_us"] is None
    assert s["origin"] == f"builtin:{best['policy']}"
    assert s["fits"] and s["iteration_time_us"] == pytest.approx(best["iteration_time_us"])
    assert s["report"]["fits"] and s["report"]["policy"].startswith("plan:file=")
    assert s["bound_gap"] is not None
    text = main(["search", str(trace_path), "--hw", "h100-sxm", "--memory", "1300MB",
                 "--budget", "0.000001", "--kicks", "0", "--no-builtin-starts",
                 "--allocator", "exact"])
    assert text == 0
