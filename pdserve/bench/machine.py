"""What the machine did besides the measured system while a run was measured.

Two runs of one configuration on this project's 2-core VM differed by 10 points of SLO
attainment (the thirteenth session: an ITL p50 of 40.0 ms in one, 31.7 ms in the other, the
same seeded workload); each run's JSON now says how busy the machine was, how much the
hypervisor stole from it, and how much the harness itself took, in cores (CPU seconds per
second of the run), so that a slow run shows why, or that the reason lies elsewhere."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

# Steal above this many cores during a run is logged: the hypervisor ran another guest on
# this one's CPUs for that share of the run.
STEAL_WARNING_CORES = 0.05


@dataclass(frozen=True, slots=True)
class MachineUse:
    busy_cores: float  # every process: user + nice + system + irq + softirq
    steal_cores: float  # time the hypervisor gave this VM's CPUs to others
    harness_cores: float  # this process (load generator and bookkeeping)


@dataclass(frozen=True, slots=True)
class CpuTimes:
    busy_s: float
    steal_s: float


def parse_proc_stat(text: str, ticks_per_s: float) -> CpuTimes:
    """The machine's busy and steal seconds from /proc/stat's aggregate ``cpu`` line."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]] + [0] * 10
            user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
            return CpuTimes((user + nice + system + irq + softirq) / ticks_per_s, steal / ticks_per_s)
    raise ValueError("no aggregate cpu line in /proc/stat")


def read_cpu_times() -> CpuTimes | None:
    try:
        with open("/proc/stat") as f:
            return parse_proc_stat(f.read(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None  # not Linux: no figures rather than wrong ones


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class MachineMeter:
    """Started at the beginning of a run; ``stop()`` gives its MachineUse (None without
    /proc/stat or for a run of no duration)."""

    def __init__(self, read=read_cpu_times, own=own_cpu_s, clock=time.monotonic) -> None:
        self._read, self._own, self._clock = read, own, clock
        self._start = (read(), own(), clock())

    def stop(self) -> MachineUse | None:
        start, own_start, t0 = self._start
        end, own_end, t1 = self._read(), self._own(), self._clock()
        if start is None or end is None or t1 <= t0:
            return None
        span = t1 - t0
        return MachineUse(round((end.busy_s - start.busy_s) / span, 3),
                          round((end.steal_s - start.steal_s) / span, 3),
                          round((own_end - own_start) / span, 3))
