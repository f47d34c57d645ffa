"""Sweeps: simulate every configuration of a grid (traces x hardware x capacities x policies x
allocators) on local processes or a Dask cluster, and keep one result row per configuration.

A configuration is identified by its key: (trace path, hardware spec, capacity, policy spec,
allocator spec), specs normalised so that `none` and `none:algo=performance` are the same
configuration. Results are appended to the output one row at a time, each row one write and a
flush, so an interrupted sweep loses nothing; a later sweep with the same output skips the
configurations already in it (resume). Rows are deduplicated by key: a task that a Dask cluster
runs twice (its worker died after the result was computed) is written once.

Outputs: `.csv` (the report flattened, nested keys joined by "."; lists as JSON text) and
`.jsonl` (one JSON object per line). Both keep the key columns first.

Errors in the grid (bad range, unknown policy, unreadable trace) are ConfigError and friends,
raised before anything runs. A configuration whose simulation raises (a bug in a policy) is not
written; it is reported in the summary and retried by the next sweep.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, VsimError, WorkerError
from .hardware import CopyPath, Hardware, LinkDirection, check_bound, load_hardware
from .safeload import read_yaml
from .sweep_output import (  # noqa: F401  (re-exported: vsim.sweep is the API)
    KEY_COLUMNS,
    OUTPUT_SUFFIXES,
    ResultWriter,
    read_rows,
    row_key,
    to_row,
)
from .trace.schema import Trace
from .units import parse_rate, parse_size

# Capacity of the reference run for the slowdown column: no policy with room for anything.
AMPLE_BYTES = 2**50
SWEEP_FILE_KEYS = ("trace", "hw", "memory", "policy", "allocator", "output")
MAX_CONFIGS = 1_000_000
DASK_CONNECT_TIMEOUT_S = 10
# No chunk finished for this long: the chunks still pending are submitted again under new keys.
# A worker killed mid-task can leave its tasks, or the gathering of their results, waiting for
# good (dask/distributed#6074, #7331: `as_completed(with_results=True)` hung so in a test here).
DASK_STALL_S = 120
DASK_RESUBMITS = 3


# ---------------------------------------------------------------- the grid

@dataclass(frozen=True)
class Config:
    """One simulation of a sweep. `memory_bytes` None: the profile's capacity."""

    trace: str
    hw: str
    memory_bytes: int | None
    policy: str
    allocator: str

    def key(self) -> tuple[str, str, str, str, str]:
        memory = "default" if self.memory_bytes is None else str(self.memory_bytes)
        return (self.trace, self.hw, memory, self.policy, self.allocator)


@dataclass(frozen=True)
class Grid:
    """The axes of a sweep, validated and normalised; `configs()` is their product in a fixed
    order (trace, hardware, allocator, policy, capacity)."""

    traces: tuple[str, ...]
    hardware: tuple[str, ...]
    memory: tuple[int | None, ...]
    policies: tuple[str, ...]
    allocators: tuple[str, ...]

    def configs(self) -> list[Config]:
        return [Config(t, h, m, p, a) for t in self.traces for h in self.hardware
                for a in self.allocators for p in self.policies for m in self.memory]

    def __len__(self) -> int:
        return (len(self.traces) * len(self.hardware) * len(self.memory) * len(self.policies)
                * len(self.allocators))


def parse_memory(values: Iterable[Any], where: str) -> list[int | None]:
    """Sizes and ranges `LOW..HIGH/STEP` (HIGH included when a step lands on it) to bytes, in
    order, duplicates removed; `default` is the profile's capacity. ConfigError names `where`."""
    out: list[int | None] = []
    for value in values:
        text = str(value).strip()
        if text == "default":
            out.append(None)
        elif ".." in text:
            out.extend(parse_range(text, where))
        else:
            out.append(_positive_size(text, where))
    if not out:
        raise ConfigError("no capacity given", where)
    return list(dict.fromkeys(out))


def parse_range(text: str, where: str) -> list[int]:
    """'4GiB..24GiB/0.5GiB' -> [4 GiB, 4.5 GiB, ..., 24 GiB] in bytes."""
    low_text, _, rest = text.partition("..")
    high_text, slash, step_text = rest.partition("/")
    if not slash or not low_text or not high_text or not step_text:
        raise ConfigError(f"range {text!r} is not LOW..HIGH/STEP (e.g. 4GiB..24GiB/0.5GiB)",
                          where)
    low = _positive_size(low_text, where)
    high = _positive_size(high_text, where)
    step = _positive_size(step_text, where)
    if high < low:
        raise ConfigError(f"range {text!r} ends below its start", where)
    count = (high - low) // step + 1
    if count > MAX_CONFIGS:
        raise ConfigError(f"range {text!r} has {count} values (at most {MAX_CONFIGS})", where)
    return [low + i * step for i in range(count)]


def _positive_size(text: str, where: str) -> int:
    try:
        size = parse_size(text.strip(), where)
    except VsimError as exc:
        raise ConfigError(exc.message, where) from None
    if size <= 0:
        raise ConfigError(f"size must be above zero, got {text.strip()!r}", where)
    return size


def build_grid(traces: Sequence[str], hardware: Sequence[str], memory: Sequence[Any],
               policies: Sequence[str], allocators: Sequence[str],
               where: Mapping[str, str] | None = None, load: bool = True) -> Grid:
    """Validate every axis (each trace loads, each spec parses) and normalise the specs.
    Errors name the place of the axis: `where[axis]` ("sweep.yaml: memory"), else "--axis"."""
    from .allocator import make_allocator
    from .engine import allocator_spec_string
    from .policies import make_policy

    def at(key: str) -> str:
        return (where or {}).get(key, f"--{key}")

    for name, values in (("trace", traces), ("hw", hardware), ("policy", policies),
                         ("allocator", allocators)):
        if not values:
            raise ConfigError(f"no {name} given", at(name))
    norm_traces = list(dict.fromkeys(os.path.normpath(t) for t in traces))
    if load:
        for t in norm_traces:
            _trace(t)  # TraceError names the file and the JSON path; cached for the workers
    for h in hardware:
        try:
            load_hw_spec(h)
        except VsimError as exc:
            raise ConfigError(str(exc), at("hw")) from None
    norm_policies = [_respec(make_policy, p, at("policy")).spec() for p in policies]
    norm_allocs = [allocator_spec_string(_respec(make_allocator, a, at("allocator")))
                   for a in allocators]
    grid = Grid(tuple(norm_traces), tuple(dict.fromkeys(hardware)),
                tuple(parse_memory(memory, at("memory"))), tuple(dict.fromkeys(norm_policies)),
                tuple(dict.fromkeys(norm_allocs)))
    if len(grid) > MAX_CONFIGS:
        raise ConfigError(f"the grid has {len(grid)} configurations (at most {MAX_CONFIGS})")
    return grid


def _respec(make: Callable[[str], Any], spec: str, where: str) -> Any:
    if not isinstance(spec, str):
        raise ConfigError(f"expected a spec string, got {spec!r}", where)
    try:
        return make(spec)
    except VsimError as exc:
        raise ConfigError(exc.message, where) from None


def load_sweep_file(path: str) -> dict[str, list[Any]]:
    """A YAML sweep file: a mapping with the axes `trace`, `hw`, `memory`, `policy`,
    `allocator` (each one value or a list) and optionally `output`. Trace paths are relative to
    the file's folder. ConfigError names the file and the key."""
    doc = read_yaml(path, ConfigError, "sweep file")
    if not isinstance(doc, dict):
        raise ConfigError("a sweep file is a mapping of axes (trace, hw, memory, policy, "
                          "allocator, output)", path)
    axes: dict[str, list[Any]] = {}
    for key, value in doc.items():
        if key not in SWEEP_FILE_KEYS:
            raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(SWEEP_FILE_KEYS)}",
                              f"{path}: {key}")
        values = value if isinstance(value, list) else [value]
        for v in values:
            if not isinstance(v, (str, int, float)) or isinstance(v, bool) or v == "":
                raise ConfigError(f"expected a string or a list of strings, got {v!r}",
                                  f"{path}: {key}")
        axes[key] = [str(v) for v in values]
    base = Path(path).parent
    if "trace" in axes:
        axes["trace"] = [t if os.path.isabs(t) else os.path.normpath(base / t)
                         for t in axes["trace"]]
    if "output" in axes:
        if len(axes["output"]) != 1:
            raise ConfigError("one output file", f"{path}: output")
        out = axes["output"][0]
        axes["output"] = [out if os.path.isabs(out) else os.path.normpath(base / out)]
    return axes


# ---------------------------------------------------------------- hardware with overrides

_HW_KEYS = ("h2d", "d2h", "link", "duplex")


def load_hw_spec(spec: str) -> Hardware:
    """'h100-sxm' or 'h100-sxm:link=16GB/s,duplex=24GB/s': a profile with hypothetical link
    bandwidths. `h2d`/`d2h`/`link` (both) set the pinned bandwidth of a direction and scale its
    pageable bandwidth in proportion; the duplex limit scales with the sum of the two directions
    unless `duplex` is given. Latencies and size efficiencies are kept."""
    name, _, rest = spec.partition(":")
    hw = load_hardware(name.strip())
    if not rest.strip():
        return hw
    changes: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or key not in _HW_KEYS:
            raise ConfigError(f"hardware {name}: expected key=rate with key one of "
                              f"{', '.join(_HW_KEYS)}, got {part!r}")
        try:
            rate = parse_rate(raw.strip(), f"hardware {name}: {key}")
        except VsimError as exc:
            raise ConfigError(exc.message, f"hardware {name}: {key}") from None
        if rate <= 0:
            raise ConfigError(f"hardware {name}: {key} must be above zero")
        try:  # the profile's own bounds: no Infinity/NaN can come out of a sweep
            check_bound(rate, "bandwidth", f"hardware {name}: {key}={raw.strip()}")
        except VsimError as exc:
            raise ConfigError(exc.message, exc.where) from None
        if key == "link":
            changes["h2d"] = changes["d2h"] = rate
        else:
            changes[key] = rate
    old_sum = hw.h2d.pinned.bandwidth_bytes_per_us + hw.d2h.pinned.bandwidth_bytes_per_us
    h2d = _scaled(hw.h2d, changes.get("h2d"))
    d2h = _scaled(hw.d2h, changes.get("d2h"))
    new_sum = h2d.pinned.bandwidth_bytes_per_us + d2h.pinned.bandwidth_bytes_per_us
    duplex = changes.get("duplex", hw.duplex_bytes_per_us * new_sum / old_sum)
    return hw.with_overrides(name=spec, h2d=h2d, d2h=d2h, duplex_bytes_per_us=duplex)


def _scaled(direction: LinkDirection, pinned_rate: float | None) -> LinkDirection:
    if pinned_rate is None:
        return direction
    ratio = pinned_rate / direction.pinned.bandwidth_bytes_per_us

    def scale(p: CopyPath) -> CopyPath:
        return dataclasses.replace(p, bandwidth_bytes_per_us=p.bandwidth_bytes_per_us * ratio)
    return LinkDirection(pinned=scale(direction.pinned), pageable=scale(direction.pageable))


# ---------------------------------------------------------------- running one configuration

# Per-process caches: a worker loads each trace and profile once, however many configurations
# it runs (a forked local worker inherits what the parent loaded while checking the grid).
_TRACES: dict[str, Trace] = {}
_HARDWARE: dict[str, Hardware] = {}
_BASELINES: dict[tuple[str, str, str], float | None] = {}


def _trace(path: str, file: str | None = None) -> Trace:
    """The trace of key `path`, read from `file` (default: `path`) the first time."""
    if path not in _TRACES:
        from .trace import load_trace
        _TRACES[path] = load_trace(file or path)
    return _TRACES[path]


_RETARGETED: dict[tuple[str, str], Trace] = {}


def _trace_on(cfg: Config, file: str | None = None) -> Trace:
    """The configuration's trace with op times for its GPU: retargeted through the compute
    model when recorded on another one (vsim.retarget, as `vsim run` does), once per worker."""
    key = (cfg.trace, cfg.hw)
    if key not in _RETARGETED:
        from .retarget import for_hardware
        _RETARGETED[key] = for_hardware(_trace(cfg.trace, file), _hardware(cfg.hw))[0]
    return _RETARGETED[key]


def _hardware(spec: str) -> Hardware:
    if spec not in _HARDWARE:
        _HARDWARE[spec] = load_hw_spec(spec)
    return _HARDWARE[spec]


def _baseline_us(cfg: Config) -> float | None:
    """Iteration time with no policy and ample capacity (None: it does not run even then)."""
    key = (cfg.trace, cfg.hw, cfg.allocator)
    if key not in _BASELINES:
        from .allocator import make_allocator
        from .engine import simulate
        from .policies import make_policy
        report = simulate(_trace_on(cfg), _hardware(cfg.hw), make_policy("none"),
                          make_allocator(cfg.allocator), AMPLE_BYTES).report
        _BASELINES[key] = report["iteration_time_us"] if report["fits"] else None
    return _BASELINES[key]


def run_config(cfg: Config, trace_file: str | None = None) -> dict[str, Any]:
    """Simulate one configuration, its trace read from `trace_file` (default: its path).
    Returns {"key": [...], "report": {...}, "baseline_iteration_time_us", "slowdown",
    "sim_seconds", "plan_seconds" (CPU seconds of the policy's planning)}
    (slowdown: iteration time over the no-policy time at ample capacity; None when the run does
    not fit), or {"key", "error"} when the simulation raised."""
    from .allocator import make_allocator
    from .engine import simulate
    from .policies import make_policy

    try:
        trace, hw = _trace_on(cfg, trace_file), _hardware(cfg.hw)
        base = _baseline_us(cfg)
        start = time.perf_counter()
        result = simulate(trace, hw, make_policy(cfg.policy), make_allocator(cfg.allocator),
                          cfg.memory_bytes)
        seconds = time.perf_counter() - start
    except Exception as exc:  # a bug in a policy must not end a thousand-run sweep
        return {"key": list(cfg.key()), "error": f"{type(exc).__name__}: {exc}"}
    report = result.report
    slowdown = (report["iteration_time_us"] / base
                if report["fits"] and base and base > 0 else None)
    out = {"key": list(cfg.key()), "report": report, "baseline_iteration_time_us": base,
           "slowdown": slowdown, "sim_seconds": round(seconds, 4),
           "plan_seconds": result.plan_seconds}  # (not a column: for the summary's note)
    if trace.meta.get("seq_len") is not None:  # sequence models: the axis a sweep may vary
        out["seq_len"] = trace.meta["seq_len"]
    return out


def _run_chunk(cfgs: list[Config], files: list[str] | None = None) -> list[dict[str, Any]]:
    names: list[str | None] = [None] * len(cfgs) if files is None else list(files)
    return [run_config(c, f) for c, f in zip(cfgs, names, strict=True)]


# ---------------------------------------------------------------- running a sweep

@dataclass
class SweepSummary:
    configs: int       # in the grid
    ran: int           # simulated now
    skipped: int       # already in the output
    written: int       # rows appended now
    errors: list[dict[str, Any]]
    seconds: float
    workers: int
    scheduler: str | None
    # policy spec -> (configurations, CPU seconds of planning in all) of those simulated now
    planning: dict[str, tuple[int, float]] = field(default_factory=dict)

    def slow_planning(self) -> dict[str, float]:
        """Policies whose planning took more than SLOW_PLANNING_S CPU seconds per
        configuration on average: their mean, the sweep's note (planning, not simulation,
        then bounds the sweep)."""
        return {spec: seconds / n for spec, (n, seconds) in self.planning.items()
                if n and seconds / n > SLOW_PLANNING_S}

    def to_json(self) -> dict[str, Any]:
        return {"configs": self.configs, "seconds": round(self.seconds, 3), "ran": self.ran,
                "skipped": self.skipped, "written": self.written,
                "configs_per_s": round(self.ran / self.seconds, 1) if self.seconds else None,
                "errors": len(self.errors), "error_examples": self.errors[:5],
                "workers": self.workers, "scheduler": self.scheduler,
                "slow_planning_s_per_config": {k: round(v, 3)
                                               for k, v in self.slow_planning().items()}}


SLOW_PLANNING_S = 0.3  # CPU seconds of planning per configuration worth a note


def run_sweep(grid: Grid, outputs: Sequence[str], workers: int | None = None,
              scheduler: str | None = None,
              progress: Callable[[int, int], None] | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> SweepSummary:
    """Run the configurations not yet in every output; append each result as it arrives.
    `progress(done, total)` after each; `on_result(result)` too (tests use it to kill a
    worker mid-sweep). Local processes by default (`workers`, default the usable CPUs; 1 runs in
    this process), a Dask cluster when `scheduler` is an address."""
    start = time.perf_counter()
    if scheduler:
        scheduler = check_scheduler(scheduler)
    writers: list[ResultWriter] = []
    try:
        for p in outputs:
            writers.append(ResultWriter(p))
    except BaseException:
        for w in writers:
            w.discard()  # an output created for this sweep is not left behind, empty
        raise
    try:
        configs = grid.configs()
        todo = [c for c in configs if any(c.key() not in w.keys for w in writers)]
        # Run in a shuffled (fixed) order: the grid's neighbours cost alike (one policy at
        # every capacity), and a block of slow ones at the end would leave one worker idle.
        random.Random(0).shuffle(todo)
        errors: list[dict[str, Any]] = []
        counts = {"ran": 0, "written": 0}
        planning: dict[str, tuple[int, float]] = {}

        def accept(result: dict[str, Any]) -> None:
            counts["ran"] += 1
            if "error" in result:
                errors.append(result)
            else:
                row = to_row(result)
                counts["written"] += sum(w.write(row) for w in writers)
                spec = row["policy_spec"]
                n, seconds = planning.get(spec, (0, 0.0))
                planning[spec] = (n + 1, seconds + float(result.get("plan_seconds", 0.0)))
            if on_result is not None:
                on_result(result)
            if progress is not None:
                progress(counts["ran"], len(todo))

        if progress is not None:
            progress(0, len(todo))
        if scheduler:
            n = _run_dask(todo, scheduler, accept)
        else:
            n = _run_local(todo, workers, accept, [w.handle.fileno() for w in writers])
    finally:
        for w in writers:
            w.close()
    return SweepSummary(configs=len(configs), ran=counts["ran"], skipped=len(configs) - len(todo),
                        written=counts["written"], errors=errors,
                        seconds=time.perf_counter() - start, workers=n, scheduler=scheduler,
                        planning=planning)


def _chunks(items: list[Config], workers: int) -> list[list[Config]]:
    """Guided chunks: each takes 1/(4 x workers) of what is left, at most 8 configurations,
    so that early tasks amortise their cost (pickling, scheduling) and the last ones are single
    configurations that even out the workers' finishing times (one configuration can take
    seconds while most take milliseconds: recompute:strategy=optimal on vgg16(256))."""
    chunks = []
    i = 0
    while i < len(items):
        size = max(1, min(8, (len(items) - i) // (4 * max(1, workers))))
        chunks.append(items[i:i + size])
        i += size
    return chunks


def _usable_cpus() -> int:
    """CPUs this process may run on (taskset, cgroups' cpusets), not all the machine has."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _run_local(todo: list[Config], workers: int | None,
               accept: Callable[[dict[str, Any]], None], fds: Sequence[int] = ()) -> int:
    """Run on `workers` local processes (forked); `fds`: the outputs' descriptors, which the
    workers close."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    n = workers or _usable_cpus()
    if n == 1 or len(todo) <= 1:
        for cfg in todo:
            accept(run_config(cfg))
        return 1
    methods = multiprocessing.get_all_start_methods()
    # fork: the workers inherit the traces the parent loaded while checking the grid.
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_worker_init,
                             initargs=(os.getpid(), fds)) as pool:
        futures = [pool.submit(_run_chunk, chunk) for chunk in _chunks(todo, n)]
        try:
            for fut in as_completed(futures):
                for result in fut.result():
                    accept(result)
        except BrokenProcessPool:
            raise WorkerError("a local sweep worker died (killed, or out of memory); the rows "
                              "written so far are kept: run the sweep again to resume") from None
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
    return n


def _worker_init(parent_pid: int, fds: Sequence[int]) -> None:
    """In each forked worker: die with the parent (a SIGKILLed sweep must leave no workers
    running), and close the inherited output files, whose flock the workers would otherwise
    keep after the parent is gone (a resumed sweep would find the output locked)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if hasattr(os, "sched_getaffinity"):  # Linux: prctl(PR_SET_PDEATHSIG, SIGKILL)
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


_SCHEMES = ("tcp", "tls", "ucx", "ws", "wss", "inproc")


def check_scheduler(address: str) -> str:
    """A Dask scheduler address, [SCHEME://]HOST:PORT (scheme one of _SCHEMES, port 1-65535),
    stripped; ConfigError naming --scheduler otherwise (checked before any output is opened:
    Dask's own message for a malformed address is a traceback)."""
    where = "--scheduler"
    text = address.strip() if isinstance(address, str) else ""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    if scheme not in _SCHEMES:
        raise ConfigError(f"{address!r}: unknown scheme {scheme!r}; expected "
                          f"{'|'.join(_SCHEMES)}://HOST:PORT", where)
    if scheme == "inproc":
        return text
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 address
    if not colon or not host or any(c.isspace() or c in "/?#@" for c in host) \
            or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{address!r} is not an address SCHEME://HOST:PORT (e.g. "
                          "tcp://10.0.0.5:8786)", where)
    return text


def _run_dask(todo: list[Config], address: str,
              accept: Callable[[dict[str, Any]], None]) -> int:
    try:
        from distributed import Client, wait
    except ImportError:
        raise ConfigError("--scheduler needs Dask: pip install 'vsim[sweep]'") from None
    try:
        client = Client(address, timeout=f"{DASK_CONNECT_TIMEOUT_S}s")
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot reach the Dask scheduler: {exc}", address) from None
    pending: dict[Any, tuple[list[Config], int]] = {}

    def submit(chunk: list[Config], attempt: int) -> None:
        # Keys from the configurations: a chunk resubmitted under the same key is one task;
        # the writer's dedupe covers a result that arrives twice anyway. Absolute trace paths:
        # a worker's folder need not be ours (the files must be there).
        key = f"vsim-sweep-{_digest(chunk)}" + (f"-again{attempt}" if attempt else "")
        fut = client.submit(_run_chunk, chunk, [os.path.abspath(c.trace) for c in chunk],
                            key=key, pure=False)
        pending[fut] = (chunk, attempt)

    def stalled(futures: Iterable[Any]) -> None:
        for fut in futures:
            chunk, attempt = pending.pop(fut)
            if attempt >= DASK_RESUBMITS:
                raise WorkerError(f"Dask: no result for {len(chunk)} configuration(s) after "
                                  f"{attempt + 1} submissions, each waited {DASK_STALL_S} s")
            fut.release()
            submit(chunk, attempt + 1)

    try:
        n = len(client.scheduler_info().get("workers", {}))
        for chunk in _chunks(todo, max(n, 1)):
            submit(chunk, 0)
        while pending:
            try:  # on this client's event loop (wait() takes the process's default client)
                with client.as_current():
                    done = wait(list(pending), timeout=DASK_STALL_S,
                                return_when="FIRST_COMPLETED").done
            except TimeoutError:
                stalled(list(pending))
                continue
            # gathered on this client's loop (a task's own error, KilledWorker too, is raised
            # here): Future.result() on a future whose result was lost with its worker raised
            # "bound to a different event loop" where the process holds another client
            for fut in done:
                results = client.gather(fut)
                pending.pop(fut)
                for result in results:
                    accept(result)
                fut.release()
    finally:
        client.close()
    return n


def _digest(chunk: list[Config]) -> str:
    import hashlib
    text = "\n".join("\0".join(c.key()) for c in chunk)
    return hashlib.sha1(text.encode()).hexdigest()[:16]
