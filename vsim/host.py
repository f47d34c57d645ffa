"""Host (CPU) time of issuing a training step: how long PyTorch's Python, dispatcher and
autograd engine take to launch each op, from a probe of the machine (hardware/host/NAME.yaml,
made by validation/host/fit_host.py from validation/host/probe_host.py's measurements).

A GPU waits for a slow host: an op cannot start before the host has issued it. Recorded traces
carry that wait in their launch gaps, but ops a plan adds (recomputations) or a model never
recorded (synthesized traces) have none; this model gives their host time. Costs are per op
name (an aten op in forward and the optimizer, an autograd node in backward), else the median
of the op's phase; `per_weight_us` is the gradient accumulation autograd runs once per weight
in backward (AccumulateGrad nodes, which traces fold into the op that produces the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .errors import HardwareError
from .trace.schema import Op, Trace

HOST_DIR = Path(__file__).resolve().parents[1] / "hardware" / "host"


@dataclass(frozen=True)
class Linear:
    """A cost of base_us plus us_per_mib per MiB (validation/churn's fits)."""

    base_us: float
    us_per_mib: float

    def us(self, size_bytes: int) -> float:
        return self.base_us + self.us_per_mib * size_bytes / (1 << 20)


@dataclass(frozen=True)
class AllocatorCosts:
    """Host time of the caching allocator's driver calls (validation/churn/README.md): a new
    segment (cudaMalloc, or page maps with expandable segments), a released one (cudaFree or
    unmaps, after the device-wide synchronize of release_cached_blocks)."""

    cuda_malloc: Linear
    cuda_free: Linear
    expandable_map: Linear
    expandable_unmap: Linear
    device_sync_us: float


@dataclass(frozen=True)
class HostModel:
    """Host microseconds per op: `by_name[phase][name]`, else `by_phase[phase]`."""

    name: str
    by_name: dict[str, dict[str, float]]
    by_phase: dict[str, float]
    per_weight_us: float
    allocator: AllocatorCosts | None = None
    # vsim's own executor (vsim.runtime) runs a plan with actions under a Python dispatch mode
    # that sees every aten call (the Tracker): host time per trace op on top of PyTorch's, from
    # the `*-tracked` runs (validation/host/fit_tracker.py). 0: not probed.
    tracker_us_per_op: float = 0.0
    # The executor's own host work per action (validation/host/fit_executor.py): per offload or
    # prefetch issued, per release or drop, per recomputed aten call (its replay, issue
    # included), per aten call recorded in forward for a later recomputation. Like the
    # tracker, costs of vsim's Python runtime, paid only in its runs. A trace op is one aten
    # call or several (`aten::linear` under autocast: a cast, a transpose, addmm, views):
    # `calls_per_op` by op name, from the runtime's op maps (validation/host/calls_per_op.py),
    # `calls_default` for a name not in it. Empty: one call per op (profiles before it).
    copy_us: float = 0.0
    free_us: float = 0.0
    recompute_call_us: float = 0.0
    record_call_us: float = 0.0
    # Outside the executor's timers (fit_executor.py, `unseen`): its saved-tensor hooks, per
    # forward op they are on for (`hooks`: "always", every forward op, the native tracker
    # before 2026-11-27T08:30; "armed", the forward ops with a save the plan acts on,
    # hostclock.hooked_ops; "frames", those ops' saves taken from their frames instead);
    # under the native tracker, the call back into Python with a recorded call's arguments
    # and outputs, per recorded aten call (the Python tracker's own cost per op,
    # tracker_us_per_op, includes both)
    pack_us: float = 0.0
    hooks: str = "armed"
    # With the hooks armed, an armed op puts all it saves through them: `save_us` per tensor
    # it saves for backward, times `saves_per_op` by op name (what its autograd node keeps:
    # batch norm under cuDNN 7, layer norm 5; validation/host/fit_saves.py), `saves_default`
    # for a name not in it. Empty, or the hooks always on: `pack_us` per op
    save_us: float = 0.0
    saves_per_op: dict[str, float] = field(default_factory=dict)
    saves_default: float = 0.0
    record_callback_us: float = 0.0
    # a hooked op's call back at its frame where its saves come from frames (hooks "frames");
    # 0: not measured, charged as a recorded call's (record_callback_us)
    frame_callback_us: float = 0.0
    calls_per_op: dict[str, float] = field(default_factory=dict)
    calls_default: float = 1.0
    # The native tracker (the runtime's default) on its own: its C++ fallback per counted aten
    # call (validation/host/native-cost/), `counted_calls` per trace op by name, every phase
    # (calls_per_op.py --counted), `counted_default` for a name not in it. 0: not charged.
    native_us_per_call: float = 0.0
    # backward gated (VSIM_NATIVE_GATE=nodes, counter.cpp's Gate): a backward op's counted
    # calls are charged only where the plan acts at it; its other nodes run untracked
    gated: bool = False
    # forward gated by module hooks (VSIM_NATIVE_FWD_GATE=modules, vsim.runtime.fwdgate): a
    # forward op inside a module call with no action is not counted; each such call pays
    # `module_hooks_us` (a forward pre-hook and a forward hook, each calling the counter)
    forward_gated: bool = False
    module_hooks_us: float = 0.0
    counted_calls: dict[str, float] = field(default_factory=dict)
    counted_default: float = 1.0
    # The executor's costs where its core carries the plan out in C++ (native/core.cpp; runs
    # under tracker "...-core"): any of copy_us, free_us, recompute_call_us, record_call_us,
    # record_callback_us, frame_callback_us (validation/host/fit_executor.py --core). Empty:
    # the Python runtime's costs above
    core: dict[str, float] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def with_core(self) -> HostModel:
        """This model with the executor's costs of its core (`core`) in place."""
        c = self.core
        return replace(self, **{k: float(c[k]) for k in CORE_COSTS if k in c})  # type: ignore[arg-type]

    def counted(self, op: Op) -> float:
        """Aten calls the native tracker counts for trace op `op`."""
        return self.counted_calls.get(op.name, self.counted_default)

    def hooks_us(self, op: Op) -> float:
        """The saved-tensor hooks' host time on forward op `op`'s saves, when they are on; with
        those saves taken from their call's frame instead ("frames"), that frame's call back
        into Python (`frame_callback_us`, timed in C++; a recorded call's where not
        measured)."""
        if self.hooks == "frames":
            return self.frame_callback_us or self.record_callback_us
        if self.hooks != "armed" or not self.saves_per_op:
            return self.pack_us
        return self.save_us * self.saves_per_op.get(op.name, self.saves_default)

    def calls(self, op: Op) -> float:
        """Aten calls the runtime replays or records for forward op `op`."""
        return self.calls_per_op.get(op.name, self.calls_default)

    def op_us(self, op: Op) -> float:
        phase = op.phase if op.phase in self.by_phase else "fwd"
        return self.by_name.get(phase, {}).get(op.name, self.by_phase[phase])

    def iteration_us(self, trace: Trace) -> float:
        """Host time to issue the whole iteration (no waits for the GPU)."""
        weights = sum(1 for t in trace.tensors if t.kind == "weight")
        return sum(self.op_us(o) for o in trace.ops) + weights * self.per_weight_us


_LOADED: dict[tuple[str, int, int], HostModel] = {}


# the executor's costs its core (native/core.cpp) has its own values of (HostModel.core)
CORE_COSTS = ("copy_us", "free_us", "recompute_call_us", "record_call_us", "record_callback_us",
              "frame_callback_us")


def load_host_model(hw_name: str, directory: Path | None = None) -> HostModel | None:
    """hardware/host/NAME.yaml for a hardware profile's name; None when no probe exists. Read
    once per file version (path, modification time and size): every engine run asks for it,
    and parsing the YAML cost 12-15% of a run (a planner's profiling runs, issue 14)."""
    path = (directory or HOST_DIR) / f"{hw_name}.yaml"
    try:
        st = path.stat()
    except OSError:
        return None
    if not path.is_file():
        return None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _LOADED:
        _LOADED[key] = read_host_model(path)
    return _LOADED[key]


def _mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file that holds one mapping; HardwareError naming the file otherwise."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise HardwareError(f"{path}: cannot read {what}: {exc}") from None
    if not isinstance(doc, dict):
        raise HardwareError(f"{path}: a {what} is a mapping")
    return doc


def read_host_model(path: Path) -> HostModel:
    """HardwareError naming the file and key on a malformed file."""
    doc = _mapping(path, "host model")

    def us(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 <= float(value) < 1e6:
            raise HardwareError(f"{path}: {where} must be microseconds in [0, 1e6), "
                                f"got {value!r}")
        return float(value)

    by_phase_raw = doc.get("by_phase")
    if not isinstance(by_phase_raw, dict) or "fwd" not in by_phase_raw:
        raise HardwareError(f"{path}: by_phase must map phases (fwd, bwd, opt) to us")
    by_phase = {str(k): us(v, f"by_phase.{k}") for k, v in by_phase_raw.items()}
    by_name: dict[str, dict[str, float]] = {}
    for phase, table in (doc.get("by_name") or {}).items():
        if not isinstance(table, dict):
            raise HardwareError(f"{path}: by_name.{phase} must map op names to us")
        by_name[str(phase)] = {str(k): us(v, f"by_name.{phase}.{k}") for k, v in table.items()}
    allocator = None
    alloc = doc.get("allocator")
    if alloc is not None:
        if not isinstance(alloc, dict):
            raise HardwareError(f"{path}: allocator must be a mapping")

        def linear(key: str) -> Linear:
            entry = alloc.get(key)
            if not isinstance(entry, dict):
                raise HardwareError(f"{path}: allocator.{key} needs base_us and us_per_mib")
            return Linear(us(entry.get("base_us"), f"allocator.{key}.base_us"),
                          us(entry.get("us_per_mib"), f"allocator.{key}.us_per_mib"))
        allocator = AllocatorCosts(linear("cuda_malloc"), linear("cuda_free"),
                                   linear("expandable_map"), linear("expandable_unmap"),
                                   us(alloc.get("device_sync_us", 0.0), "allocator.device_sync_us"))
    executor = doc.get("executor") or {}
    if not isinstance(executor, dict):
        raise HardwareError(f"{path}: executor must be a mapping")

    def count(value: Any, where: str, low: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not low <= float(value) < 1e4:
            raise HardwareError(f"{path}: {where} must be a count in "
                                f"{'(0' if low else '[0'}, 1e4), got {value!r}")
        return float(value)

    def counts(key: str, default: float, low: float = 1e-9) -> tuple[dict[str, float], float]:
        """executor.KEY: counts by op name (calls: more than 0; saves: 0 or more), and its
        `default` (`default` where absent)."""
        raw = executor.get(key) or {}
        if not isinstance(raw, dict):
            raise HardwareError(f"{path}: executor.{key} must map op names to counts")
        return ({str(k): count(v, f"executor.{key}.{k}", low) for k, v in raw.items()
                 if k != "default"},
                count(raw.get("default", default), f"executor.{key}.default", low))

    core_raw = executor.get("core") or {}
    if not isinstance(core_raw, dict) or not set(core_raw) <= set(CORE_COSTS):
        raise HardwareError(f"{path}: executor.core must map some of {', '.join(CORE_COSTS)} "
                            "to us")
    core = {str(k): us(v, f"executor.core.{k}") for k, v in core_raw.items()}
    calls, calls_default = counts("calls_per_op", 1.0)
    counted, counted_default = counts("counted_calls", 1.0)
    saves, saves_default = counts("saves_per_op", 0.0, low=0.0)
    return HostModel(name=str(doc.get("name", path.stem)), by_name=by_name, by_phase=by_phase,
                     per_weight_us=us(doc.get("per_weight_us", 0.0), "per_weight_us"),
                     allocator=allocator, provenance=dict(doc.get("provenance") or {}),
                     tracker_us_per_op=us(executor.get("tracker_us_per_op", 0.0),
                                          "executor.tracker_us_per_op"),
                     copy_us=us(executor.get("copy_us", 0.0), "executor.copy_us"),
                     free_us=us(executor.get("free_us", 0.0), "executor.free_us"),
                     recompute_call_us=us(executor.get("recompute_call_us", 0.0),
                                          "executor.recompute_call_us"),
                     record_call_us=us(executor.get("record_call_us", 0.0),
                                       "executor.record_call_us"),
                     pack_us=us(executor.get("pack_us", 0.0), "executor.pack_us"),
                     save_us=us(executor.get("save_us", 0.0), "executor.save_us"),
                     saves_per_op=saves, saves_default=saves_default,
                     record_callback_us=us(executor.get("record_callback_us", 0.0),
                                           "executor.record_callback_us"),
                     frame_callback_us=us(executor.get("frame_callback_us", 0.0),
                                          "executor.frame_callback_us"),
                     calls_per_op=calls, calls_default=calls_default,
                     native_us_per_call=us(executor.get("native_us_per_call", 0.0),
                                           "executor.native_us_per_call"),
                     module_hooks_us=us(executor.get("module_hooks_us", 0.0),
                                        "executor.module_hooks_us"),
                     counted_calls=counted, counted_default=counted_default, core=core)


TIMING_DIR = HOST_DIR.parent / "timing"


@dataclass(frozen=True)
class TimingSpread:
    """How much timing varies from one real training iteration to the next on a machine
    (validation/jitter/probe_kernel_jitter.py): the standard deviation of the log of a kernel's
    duration and of the host's issue time of a step (vsim.engine.TimingDraw)."""

    kernel_sigma: float
    host_sigma: float
    provenance: dict[str, Any] = field(default_factory=dict)


def load_timing_spread(hw_name: str, directory: Path | None = None) -> TimingSpread | None:
    """hardware/timing/NAME.yaml for a hardware profile's name; None when not probed there.
    HardwareError naming the file and key on a malformed one."""
    path = (directory or TIMING_DIR) / f"{hw_name}.yaml"
    if not path.is_file():
        return None
    doc = _mapping(path, "timing spread")

    def sigma(key: str) -> float:
        v = doc.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= float(v) < 1:
            raise HardwareError(f"{path}: {key} must be a standard deviation in [0, 1), "
                                f"got {v!r}")
        return float(v)

    prov = doc.get("provenance") or {}
    return TimingSpread(sigma("kernel_sigma"), sigma("host_sigma"),
                        prov if isinstance(prov, dict) else {})
