"""Machine CPU accounting (``tandem.core.procs``): the numbers runs and `tandem bench pipeline` report."""

from __future__ import annotations

import os
import time

from tandem.core.procs import CpuTicks, busy_cores, cpu_ticks, steal_fraction


def test_busy_cores_sees_this_process_spinning():
    before = cpu_ticks()
    assert before is not None and 0 <= before.busy <= before.total and 0 <= before.steal <= before.total
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:  # keep one core busy for half a second of CPU time
        pass
    cores = busy_cores(before, cpu_ticks())
    assert cores is not None
    # at least most of the core this loop used (tick granularity), at most every core of the machine
    assert 0.5 <= cores <= (os.cpu_count() or 1) + 1e-9


def test_busy_cores_arithmetic_and_unknowns():
    cpus = os.cpu_count() or 1
    a, b = CpuTicks(100, 10, 1000), CpuTicks(150, 30, 1100)
    assert busy_cores(a, b) == cpus * 0.5
    assert steal_fraction(a, b) == 0.2
    for f in (busy_cores, steal_fraction):
        assert f(None, b) is None and f(a, None) is None
        assert f(a, a) is None  # no time passed: unknown, not a division by zero
