"""pdserve.bench.machine: the machine's busy, steal and harness cores during a run."""

import pytest

from pdserve.bench.machine import CpuTimes, MachineMeter, MachineUse, parse_proc_stat

STAT = """cpu  1000 10 300 5000 20 0 40 150 0 0
cpu0 500 5 150 2500 10 0 20 75 0 0
intr 12345
"""


def test_busy_and_steal_come_from_the_aggregate_cpu_line():
    times = parse_proc_stat(STAT, 100)
    # user + nice + system + irq + softirq = 1000 + 10 + 300 + 0 + 40 ticks; steal 150.
    assert times == CpuTimes(13.5, 1.5)
    with pytest.raises(ValueError, match="no aggregate cpu line"):
        parse_proc_stat("cpu0 1 2 3 4\n", 100)


def test_a_run_gets_cores_per_second_of_busy_steal_and_harness():
    reads = iter([CpuTimes(100.0, 10.0), CpuTimes(118.0, 10.5)])
    own = iter([5.0, 5.4])
    clock = iter([50.0, 60.0])
    meter = MachineMeter(read=lambda: next(reads), own=lambda: next(own), clock=lambda: next(clock))
    assert meter.stop() == MachineUse(busy_cores=1.8, steal_cores=0.05, harness_cores=0.04)


def test_no_figures_without_proc_stat():
    meter = MachineMeter(read=lambda: None, own=lambda: 0.0, clock=iter([0.0, 1.0]).__next__)
    assert meter.stop() is None


def test_this_machine_reads_plausible_figures():
    import time

    meter = MachineMeter()
    end = time.monotonic() + 0.2
    while time.monotonic() < end:  # the harness busy on one core
        pass
    use = meter.stop()
    assert use is not None
    assert 0.5 <= use.harness_cores <= 1.2 and use.busy_cores >= use.harness_cores * 0.8
