"""Where the host's time went while an iteration was issued: the process's own CPU time (all
its threads: the autograd engine issues backward from a thread of its own), its involuntary
context switches, the machine's steal time, and the core's speed just before it
(vsim.record.hostprobe.speed_probe_us).

Why: on the lent machines the same plan's host-bound iterations take 40 ms in one second and
100 ms the next, in one process (validation/host/README.md, "Host speed is noisy"). If the
process's CPU time follows the wall time, the CPU itself ran slower (its clock, or neighbours on
its caches); if it stays while the wall time grows, the process was off the CPU (descheduled,
or a hypervisor's steal). Measured on the H100 machine: never off the CPU, the core at one of
two speeds 2x apart, host-bound iterations following it (validation/host/noise/host-use/).
Only the measurement is recorded here: nothing is scaled by it.
"""

from __future__ import annotations

import os
import time
from typing import Any

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

from ..record.hostprobe import speed_probe_us


def _steal_ticks() -> int | None:
    """The machine's steal time so far, in clock ticks summed over its CPUs (Linux's
    /proc/stat: cpu user nice system idle iowait irq softirq steal ...); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if fields and fields[0] == "cpu" else None
    except (OSError, IndexError, ValueError):
        return None


def _switches() -> int | None:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw if resource is not None else None


class HostUse:
    """`start()` before an iteration's step (the speed probe first), `issued()` when the step
    returns (before the final sync, whose wait would count as CPU time where the driver
    spins), `keep()` for a measured one; their figures accumulate in `cpu_us`, `speed_us` and
    `switches`, and `steal_us()` gives the machine's steal per CPU since it was made
    (just before the first iteration)."""

    def __init__(self) -> None:
        self.cpu_us: list[float] = []
        self.switches: list[int] = []
        self.speed_us: list[float] = []
        self._speed = self._cpu0 = self._cpu = 0.0
        self._sw: int | None = None
        self._sw0: int | None = None
        self._steal0 = _steal_ticks()

    def start(self) -> None:
        self._speed = speed_probe_us()
        self._sw0 = _switches()
        self._cpu0 = time.process_time()

    def issued(self) -> None:
        self._cpu = round((time.process_time() - self._cpu0) * 1e6, 1)
        sw = _switches()
        self._sw = None if sw is None or self._sw0 is None else sw - self._sw0

    def keep(self) -> None:
        """The iteration just issued is a measured one: its figures join the lists."""
        self.cpu_us.append(self._cpu)
        self.speed_us.append(self._speed)
        if self._sw is not None:
            self.switches.append(self._sw)

    def steal_us(self) -> float | None:
        now = _steal_ticks()
        if now is None or self._steal0 is None:
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        return round((now - self._steal0) / hz * 1e6 / (os.cpu_count() or 1), 1)

    def summary(self) -> dict[str, Any]:
        return {"issue_cpu_us": self.cpu_us, "speed_probe_us": self.speed_us,
                "involuntary_switches": self.switches or None,
                "steal_us_per_cpu": self.steal_us()}
