import dataclasses
import json
import os
import signal
import threading

import pytest
from builders import chain

import vsim.sweep as sweep_mod
from vsim.cli import main
from vsim.errors import ConfigError
from vsim.plots import (
    _series,
    largest_batch,
    plot_sweep,
    slowdown_at_largest,
    slowdown_panels,
)
from vsim.sweep import (
    KEY_COLUMNS,
    ResultWriter,
    build_grid,
    load_hw_spec,
    parse_memory,
    parse_range,
    read_rows,
    row_key,
    run_sweep,
)
from vsim.trace import save_trace

GIB = 2**30
MIB = 2**20


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """One model at three batch sizes: a 4-layer chain whose activations are batch x 64 MiB.
    Input + 4 activations live at the end of the forward pass: peak = 5 x batch x 64 MiB
    (320 MiB at batch 1, 640 MiB at 2, 1280 MiB at 4) with the exact allocator and no policy."""
    folder = tmp_path_factory.mktemp("traces")
    paths = {}
    for batch in (1, 2, 4):
        t = chain(4, batch * 64 * MIB, 100.0 * batch, 200.0 * batch)
        t = dataclasses.replace(t, meta={**t.meta, "model": "chain4", "batch_size": batch})
        paths[batch] = str(folder / f"chain4-b{batch}.vsim.json.gz")
        save_trace(t, paths[batch])
    return paths


def sweep_json(capsys, *args):
    assert main(["sweep", *args, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


# ------------------------------------------------------------------ grid parsing

def test_range_includes_high_when_a_step_lands_on_it():
    values = parse_range("4GiB..24GiB/0.5GiB", "--memory")
    assert len(values) == 41 and values[0] == 4 * GIB and values[-1] == 24 * GIB
    assert values[1] - values[0] == GIB // 2
    # 1, 1.3, 1.6, 1.9 GiB: 2.2 would pass HIGH
    assert len(parse_range("1GiB..2GiB/0.3GiB", "x")) == 4
    assert parse_memory(["1GiB", "1GiB..2GiB/1GiB", "default"], "x") == [GIB, 2 * GIB, None]


@pytest.mark.parametrize("text, fragment", [
    ("4GiB..2GiB/1GiB", "ends below its start"),
    ("4GiB..8GiB", "LOW..HIGH/STEP"),
    ("4GiB..8GiB/0GiB", "above zero"),
    ("4..8GiB/1GiB", "without a unit"),
    ("1B..1TiB/1B", "at most"),
])
def test_bad_ranges_name_the_place(text, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        parse_memory([text], "sweep.yaml: memory")
    assert str(err.value).startswith("sweep.yaml: memory: ")


def test_grid_normalises_specs_and_dedupes(traces):
    grid = build_grid([traces[1]], ["h100-sxm"], ["1GiB", "1GiB"],
                      ["none", "none:algo=performance", "vdnn"], ["exact"])
    assert grid.policies == ("none:algo=performance", "vdnn:mode=all,algo=performance")
    assert len(grid) == len(grid.configs()) == 2


def test_hypothetical_link(tmp_path):
    base = load_hw_spec("h100-sxm")
    slow = load_hw_spec("h100-sxm:link=16GB/s")
    assert slow.name == "h100-sxm:link=16GB/s"
    assert slow.h2d.pinned.bandwidth_bytes_per_us == pytest.approx(16e3)  # bytes per us
    assert slow.d2h.pinned.bandwidth_bytes_per_us == pytest.approx(16e3)
    # The pageable path and the duplex limit keep their ratio to the pinned bandwidth.
    ratio = 16e3 / base.h2d.pinned.bandwidth_bytes_per_us
    assert slow.h2d.pageable.bandwidth_bytes_per_us == pytest.approx(
        base.h2d.pageable.bandwidth_bytes_per_us * ratio)
    assert slow.copy_interference == base.copy_interference
    assert load_hw_spec("h100-sxm:duplex=20GB/s").duplex_bytes_per_us == pytest.approx(20e3)
    with pytest.raises(ConfigError, match="h2d, d2h, link, duplex"):
        load_hw_spec("h100-sxm:pcie=3GB/s")


# ------------------------------------------------------------------ command line, local

def test_sweep_runs_the_grid_and_resumes(traces, tmp_path, capsys):
    out = tmp_path / "r.csv"
    args = ["--trace", traces[1], traces[2], "--hw", "h100-sxm", "--memory",
            "256MiB..1GiB/256MiB", "--policy", "none", "vdnn", "-o", str(out),
            "-o", str(tmp_path / "r.jsonl")]
    summary, err = sweep_json(capsys, *args)
    assert summary["configs"] == summary["ran"] == 2 * 4 * 2
    assert summary["skipped"] == 0 and summary["errors"] == 0 and summary["seconds"] > 0
    assert "16/16 configurations" in err  # the progress bar
    rows = read_rows(str(out))
    assert len(rows) == 16 and list(rows[0])[:len(KEY_COLUMNS)] == list(KEY_COLUMNS)
    assert {row_key(r) for r in rows} == {row_key(r) for r in read_rows(str(tmp_path /
                                                                         "r.jsonl"))}
    # batch 1 peaks at 320 MiB (fixture): no policy does not fit 256 MiB, fits 512 MiB
    none_b1 = {r["capacity_bytes"]: r for r in rows
               if r["trace.batch_size"] == 1 and r["policy"].startswith("none")}
    assert none_b1[256 * MIB]["fits"] is False and none_b1[256 * MIB]["slowdown"] is None
    assert none_b1[512 * MIB]["fits"] is True and none_b1[512 * MIB]["slowdown"] == 1.0
    assert none_b1[512 * MIB]["peak_allocated_bytes"] == 320 * MIB
    assert none_b1[256 * MIB]["oom.need_bytes"] == 64 * MIB
    # Resume: the same grid spelled differently runs nothing.
    again, _ = sweep_json(capsys, *[a if a != "vdnn" else "vdnn:mode=all" for a in args])
    assert again["ran"] == 0 and again["skipped"] == 16
    assert len(read_rows(str(out))) == 16


def test_row_is_the_run_report(traces, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    sweep_json(capsys, "--trace", traces[2], "--hw", "h100-sxm", "--memory", "700MiB",
               "--policy", "vdnn", "-o", str(out))
    (row,) = read_rows(str(out))
    assert main(["run", traces[2], "--hw", "h100-sxm", "--memory", "700MiB", "--policy",
                 "vdnn", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("iteration_time_us", "stall_time_us", "peak_allocated_bytes", "d2h_bytes",
                "fits", "policy"):
        assert row[key] == report[key]
    assert row["slowdown"] == pytest.approx(report["iteration_time_us"] /
                                            row["baseline_iteration_time_us"])


def test_interrupted_output_loses_nothing(traces, tmp_path, capsys):
    out = tmp_path / "r.csv"
    args = ["--trace", traces[1], "--hw", "h100-sxm", "--memory", "256MiB..1GiB/256MiB",
            "--policy", "none", "-o", str(out), "--workers", "1"]
    sweep_json(capsys, *args)
    full = {row_key(r): {**r, "sim_seconds": 0} for r in read_rows(str(out))}
    lines = out.read_text().splitlines(keepends=True)
    # Killed while writing the fourth row: three complete rows and half a line.
    out.write_text("".join(lines[:4]) + lines[4][:20])
    summary, _ = sweep_json(capsys, *args)
    assert summary["ran"] == 1 and summary["skipped"] == 3
    rows = read_rows(str(out))
    assert len(rows) == 4 and out.read_text().count("\n") == 5  # header + 4 rows, no fragment
    assert {row_key(r): {**r, "sim_seconds": 0} for r in rows} == full


def test_writer_dedupes_and_widens(tmp_path):
    path = tmp_path / "w.csv"
    w = ResultWriter(str(path))
    base = dict(zip(KEY_COLUMNS, ("t", "h", "1", "p", "a"), strict=True))
    assert w.write({**base, "fits": True, "oom": None}) is True
    assert w.write({**base, "fits": True, "oom": None}) is False
    assert w.write({**base, "memory": "2", "fits": False, "oom.op": 3}) is True  # widens
    with pytest.raises(ConfigError, match="another sweep is writing"):
        ResultWriter(str(path))
    assert w.write({**base, "memory": "3", "fits": True}) is True  # into the rewritten file
    w.close()
    rows = read_rows(str(path))
    assert [r["fits"] for r in rows] == [True, False, True]
    assert rows[0]["oom.op"] is None and rows[1]["oom.op"] == 3
    assert ResultWriter(str(path)).keys == {row_key(r) for r in rows}
    with pytest.raises(ConfigError, match="must end in"):
        ResultWriter(str(tmp_path / "w.txt"))


def test_sweep_file_and_its_errors(traces, tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"trace: [{traces[1]}]\nhw: h100-sxm\nmemory: [512MiB, 1GiB]\n"
                     "policy: [none, vdnn]\noutput: out.jsonl\n")
    summary, _ = sweep_json(capsys, str(sweep))
    assert summary["configs"] == 4 and (tmp_path / "out.jsonl").exists()
    head = f"trace: [{traces[1]}]\nhw: h100-sxm\n"
    for text, where in [(head + "memroy: 1GiB\n", "memroy: unknown key 'memroy'"),
                        (head + "memory: 2GiB..1GiB/1GiB\n", "memory: range"),
                        (head + "policy: [vdnn:moed=all]\n", "policy: policy vdnn: unknown key"),
                        (head + "hw: [h100-sxm:link=fast]\n", "hw: hardware h100-sxm: link"),
                        ("hw: h100-sxm\n", "no trace: give it here or as --trace"),
                        ("trace: [1, [2]]\n", "trace: expected a string"),
                        ("- just a list\n", "a sweep file is a mapping"),
                        ("trace: [\n", "invalid YAML")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert main(["sweep", str(bad), "-o", str(tmp_path / "x.csv")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{bad}" in err and where in err, err
    assert not (tmp_path / "x.csv").exists()


def test_bad_flags_exit_2_with_one_line(traces, tmp_path, capsys):
    for args in (["--memory", "4GiB..2GiB/1GiB"], ["--policy", "nope"], ["--hw", "nope"],
                 ["--allocator", "caching:x=1"], ["--workers", "0"],
                 ["--trace", str(tmp_path / "missing.vsim.json")]):
        assert main(["sweep", "--trace", traces[1], "--hw", "h100-sxm", *args,
                     "-o", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "plots")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vsim: error: ") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert main(["sweep", "--trace", traces[1], "--hw", "h100-sxm"]) == 2
    assert "-o" in capsys.readouterr().err


# ------------------------------------------------------------------ plots

def test_largest_batch_and_plots(traces, tmp_path, capsys):
    out = tmp_path / "r.csv"
    sweep_json(capsys, "--trace", *traces.values(), "--hw", "h100-sxm", "--memory",
               "512MiB", "1GiB", "2GiB", "--policy", "none", "vdnn", "-o", str(out),
               "--plot", str(tmp_path / "plots"))
    rows = read_rows(str(out))
    table = largest_batch(rows)
    # Peaks with no policy: 320, 640, 1280 MiB at batches 1, 2, 4 (fixture).
    assert table["none:algo=performance"] == {512 * MIB: 1, GIB: 2, 2 * GIB: 4}
    assert all(table["vdnn:mode=all,algo=performance"][c] >= b
               for c, b in table["none:algo=performance"].items())
    # Series keep one order (so one colour in every panel) whatever order rows arrive in.
    assert list(_series(rows)) == list(_series(rows[::-1])) == [
        "none:algo=performance", "vdnn:mode=all,algo=performance"]
    (tmp_path / "again").mkdir()
    written = plot_sweep(rows, str(tmp_path / "again"))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["max-batch-chain4-h100-sxm.png", "slowdown-chain4-h100-sxm.png"]
    assert slowdown_panels(rows) == [(1, None), (2, None), (4, None)]
    for p in written + [str(tmp_path / "plots" / n) for n in names]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ Dask

def test_dask_cluster_with_a_worker_killed_mid_sweep(traces, tmp_path):
    """A LocalCluster of two worker processes on loopback; after the first result one worker
    that is running a task is killed. Dask reruns its tasks on the other (and on the worker
    its nanny restarts): every configuration is written once, with the same figures as a
    local run."""
    distributed = pytest.importorskip("distributed")
    grid = build_grid([traces[1], traces[2]], ["h100-sxm", "h100-sxm:link=16GB/s"],
                      ["256MiB..2GiB/256MiB"], ["none", "vdnn"], ["exact", "caching"])
    local_out = str(tmp_path / "local.csv")
    run_sweep(grid, [local_out], workers=1)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        killed: list[int] = []
        lock = threading.Lock()

        def kill_one(result):
            with lock:
                if killed:
                    return
                busy = {a: len(t) for a, t in client.processing().items()}
                addr = max(busy, key=busy.__getitem__)
                pid = client.run(os.getpid, workers=[addr])[addr]
                os.kill(pid, signal.SIGKILL)
                killed.append(busy[addr])

        out = str(tmp_path / "dask.csv")
        summary = run_sweep(grid, [out], scheduler=cluster.scheduler_address,
                            on_result=kill_one)
    assert killed and killed[0] > 0  # the killed worker had work in flight
    rows = read_rows(out)
    keys = [row_key(r) for r in rows]
    assert len(keys) == len(set(keys)) == len(grid) == summary.written
    local = {row_key(r): r for r in read_rows(local_out)}
    assert set(local) == set(keys)
    for r in rows:  # determinism: same figures wherever it ran (but the wall time)
        assert {**r, "sim_seconds": 0} == {**local[row_key(r)], "sim_seconds": 0}


_HANG: dict = {}
_REAL_RUN_CHUNK = sweep_mod._run_chunk


def _first_call_hangs(chunk, paths):
    """vsim.sweep._run_chunk whose first call waits (in-process Dask workers: picklable by
    reference, the state in this module)."""
    _HANG["calls"].append(len(chunk))
    if len(_HANG["calls"]) == 1:
        _HANG["release"].wait(30)
    return _REAL_RUN_CHUNK(chunk, paths)


def test_dask_chunk_that_stalls_is_submitted_again(traces, tmp_path, monkeypatch):
    """A chunk whose task never finishes (as a task lost with a killed worker can stay
    'processing': dask/distributed#6074) is submitted again after DASK_STALL_S without a
    result, under a new key; the sweep completes with every configuration once."""
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(sweep_mod, "DASK_STALL_S", 1)
    monkeypatch.setattr(sweep_mod, "_run_chunk", _first_call_hangs)
    _HANG["calls"] = []
    release = _HANG["release"] = threading.Event()
    grid = build_grid([traces[1]], ["h100-sxm"], ["256MiB", "1GiB"], ["none"], ["exact"])
    out = str(tmp_path / "dask.csv")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=4, processes=False,
                                  dashboard_address=None) as cluster:
        try:
            summary = run_sweep(grid, [out], scheduler=cluster.scheduler_address)
        finally:
            release.set()  # before the cluster closes: it waits for its threads
    keys = [row_key(r) for r in read_rows(out)]
    assert len(keys) == len(set(keys)) == len(grid) == summary.written
    assert len(_HANG["calls"]) >= 2  # the hanging chunk ran again


def test_unreachable_scheduler_is_a_config_error(traces, tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr("vsim.sweep.DASK_CONNECT_TIMEOUT_S", 1)
    grid = build_grid([traces[1]], ["h100-sxm"], ["1GiB"], ["none"], ["exact"])
    with pytest.raises(ConfigError, match="cannot reach the Dask scheduler"):
        run_sweep(grid, [str(tmp_path / "r.csv")], scheduler="tcp://127.0.0.1:1")


def test_longest_sequence_plot(tmp_path, capsys):
    """Traces of one model at one batch and three sequence lengths (meta.seq_len): rows carry
    trace.seq_len, the table gives the longest that fits, and a max-seq plot is drawn."""
    paths = []
    for seq in (512, 1024, 2048):
        t = chain(4, seq // 512 * 64 * MIB, 100.0, 200.0)
        t = dataclasses.replace(t, meta={**t.meta, "model": "chain4s", "batch_size": 2,
                                         "seq_len": seq})
        paths.append(str(tmp_path / f"chain4s-{seq}.vsim.json.gz"))
        save_trace(t, paths[-1])
    out = tmp_path / "r.csv"
    sweep_json(capsys, "--trace", *paths, "--hw", "h100-sxm", "--memory", "512MiB", "1GiB",
               "2GiB", "--policy", "none", "-o", str(out), "--plot", str(tmp_path / "p"))
    rows = read_rows(str(out))
    assert {r["trace.seq_len"] for r in rows} == {512, 1024, 2048}
    # peaks with no policy 320, 640, 1280 MiB as in the batch fixture
    assert largest_batch(rows, axis="trace.seq_len")["none:algo=performance"] == {
        512 * MIB: 512, GIB: 1024, 2 * GIB: 2048}
    assert sorted(os.listdir(tmp_path / "p")) == ["max-seq-chain4s-h100-sxm.png",
                                                  "slowdown-chain4s-h100-sxm.png"]
    # one slowdown panel per trace (a panel per batch alone mixed the three sequences' rows
    # into one line per policy, zigzagging between traces at each capacity)
    assert slowdown_panels(rows) == [(2, 512), (2, 1024), (2, 2048)]
    # the slowdown at the longest that fits, per capacity (the bar labels of the max-seq plot)
    assert slowdown_at_largest(rows, axis="trace.seq_len")["none:algo=performance"] == {
        512 * MIB: pytest.approx(1.0), GIB: pytest.approx(1.0), 2 * GIB: pytest.approx(1.0)}
    # 256 MiB: nothing fits, so no slowdown
    sweep_json(capsys, "--trace", *paths, "--hw", "h100-sxm", "--memory", "256MiB",
               "--policy", "none", "-o", str(out))
    rows = read_rows(str(out))
    assert slowdown_at_largest(rows, axis="trace.seq_len")["none:algo=performance"][
        256 * MIB] is None
    (tmp_path / "q").mkdir()
    assert len(plot_sweep(rows, str(tmp_path / "q"))) == 2


# ------------------------------------------------------------------ outputs, workers, addresses

@pytest.mark.parametrize("name,content", [
    ("foreign.csv", b"name,score\nalice,3\nbob,4"),           # no newline at the end
    ("foreign.jsonl", b'{"a": 1}\n{"b": 2}\n{"c": 3'),
    ("binary.csv", bytes(range(256)) * 4),
    ("binary.jsonl", b"\x89PNG\r\n\x1a\n" + bytes(range(200))),
    ("list.jsonl", b"[1, 2]\n"),
])
def test_foreign_output_is_refused_untouched(traces, tmp_path, name, content):
    grid = build_grid([traces[1]], ["h100-sxm"], ["1GiB"], ["none"], ["exact"])
    out = tmp_path / name
    out.write_bytes(content)
    fresh = tmp_path / "fresh.csv"
    with pytest.raises(ConfigError, match="not a vsim sweep") as info:
        run_sweep(grid, [str(fresh), str(out)], workers=1)
    assert str(out) in str(info.value)
    assert out.read_bytes() == content  # not cut, not appended to
    assert not fresh.exists()  # the first output, created for this sweep, is removed again


def test_a_killed_local_worker_is_a_one_line_error(traces, tmp_path):
    import multiprocessing

    from vsim.errors import WorkerError
    # enough configurations that chunks are still running when the first result comes
    grid = build_grid([traces[1], traces[2]], ["h100-sxm"], ["64MiB..4GiB/64MiB"],
                      ["none", "vdnn"], ["exact"])
    out = tmp_path / "r.csv"
    # a child of this process from before the sweep (another test's) is not one of its workers:
    # killing it instead made the test pass or fail by the children's order
    before = {c.pid for c in multiprocessing.active_children()}

    def kill_a_worker(result):
        for child in multiprocessing.active_children():
            if child.pid in before:
                continue
            try:  # a worker listed here may have exited already (the pool replaces it)
                os.kill(child.pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                continue

    with pytest.raises(WorkerError, match="worker died.*run the sweep again"):
        run_sweep(grid, [str(out)], workers=2, on_result=kill_a_worker)
    rows = read_rows(str(out))
    assert 0 < len(rows) < len(grid)  # the rows before the death are kept
    summary = run_sweep(grid, [str(out)], workers=1)  # and the sweep resumes
    assert summary.skipped == len(rows) and len(read_rows(str(out))) == len(grid)


def test_sigkilled_sweep_leaves_no_workers_and_no_lock(traces, tmp_path):
    """The parent of a local pool is SIGKILLed mid-sweep: its workers die with it (they would
    otherwise keep the output's flock) and a resumed sweep opens the output."""
    import subprocess
    import sys
    import time
    out = tmp_path / "r.csv"
    code = (
        "import os, sys, time\n"
        "from vsim.sweep import build_grid, run_sweep\n"
        f"grid = build_grid([{traces[1]!r}, {traces[2]!r}, {traces[4]!r}], ['h100-sxm'], "
        "['64MiB..8GiB/64MiB'], ['none', 'vdnn', 'vdnnpp'], ['exact'])\n"
        "def slow(result):\n"
        "    print('pid', os.getpid(), flush=True)\n"
        "    time.sleep(60)\n"
        f"run_sweep(grid, [{str(out)!r}], workers=2, on_result=slow)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("pid")
        children = [int(p) for p in
                    subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                   text=True).stdout.split()]
        assert children
        proc.kill()
        proc.wait()
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(p) for p in children):
            time.sleep(0.05)
        assert not any(_alive(p) for p in children)
        ResultWriter(str(out)).close()  # not "another sweep is writing to this file"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.parametrize("address", ["tcp://", "tcp://host", "tcp://host:port", "tcp://h:0",
                                     "tcp://h:70000", "http://h:8786", "h o s t:1", ":8786",
                                     "tcp://a/b:1"])
def test_malformed_scheduler_address_is_a_config_error(traces, tmp_path, address):
    grid = build_grid([traces[1]], ["h100-sxm"], ["1GiB"], ["none"], ["exact"])
    with pytest.raises(ConfigError, match="--scheduler") as info:
        run_sweep(grid, [str(tmp_path / "r.csv")], scheduler=address)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "r.csv").exists()


def test_well_formed_scheduler_addresses_pass():
    from vsim.sweep import check_scheduler
    for address in ("tcp://10.0.0.5:8786", "127.0.0.1:8786", "tls://[::1]:8786",
                    " tcp://node-3.cluster:1 ", "inproc://1.2.3/4/5"):
        assert check_scheduler(address) == address.strip()


def test_max_batch_plot_lines_for_many_capacities(tmp_path):
    """More than BAR_CAPACITIES capacities: one step line per policy (the bars are for a few
    cards); both forms write a PNG."""
    from vsim.plots import BAR_CAPACITIES, plot_max_batch
    rows = [{"capacity_bytes": c * GIB, "fits": b * 2 <= c, "trace.batch_size": b,
             "policy": "none", "allocator": "caching", "hardware": "h100-sxm",
             "trace.model": "m", "slowdown": 1.0}
            for c in range(1, BAR_CAPACITIES + 3) for b in (1, 2, 4)]
    for n, caps in (("lines", BAR_CAPACITIES + 2), ("bars", 2)):
        path = tmp_path / f"{n}.png"
        plot_max_batch([r for r in rows if r["capacity_bytes"] <= caps * GIB], str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slow_planning_gets_a_note(traces, tmp_path, capsys, monkeypatch):
    """A policy whose planning averages more than SLOW_PLANNING_S CPU seconds per configuration
    is named in a one-line note (issue 18: recompute's planning cost 0.75 s per configuration
    without a word); the planning time is no column of the results."""
    import vsim.sweep

    out = tmp_path / "p.csv"
    args = ["sweep", "--trace", traces[1], "--hw", "h100-sxm", "--memory", "256MiB", "1GiB",
            "--policy", "none", "vdnn", "-o", str(out), "--workers", "1"]
    assert main(args) == 0
    assert "note:" not in capsys.readouterr().out  # these plan in milliseconds
    assert not any(k.startswith("plan") for k in read_rows(str(out))[0])
    monkeypatch.setattr(vsim.sweep, "SLOW_PLANNING_S", -1.0)  # every policy is "slow" now
    out.unlink()
    assert main(args) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert sorted(n.split(":")[1].strip() for n in notes) == ["none", "vdnn"]  # (spec names)
    assert all("of planning per configuration on average (2 simulated here)" in n
               for n in notes)
    out.unlink()
    summary, _ = sweep_json(capsys, *args[1:])
    assert sorted(s.split(":")[0] for s in summary["slow_planning_s_per_config"]) == \
        ["none", "vdnn"]
