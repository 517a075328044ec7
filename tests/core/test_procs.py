"""Machine CPU accounting (``tandem.core.procs``): the numbers runs and `tandem bench pipeline` report."""

from __future__ import annotations

import os
import time

from tandem.core.procs import busy_cores, cpu_ticks


def test_busy_cores_sees_this_process_spinning():
    before = cpu_ticks()
    assert before is not None and 0 <= before[0] <= before[1]
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:  # keep one core busy for half a second of CPU time
        pass
    cores = busy_cores(before, cpu_ticks())
    assert cores is not None
    # at least most of the core this loop used (tick granularity), at most every core of the machine
    assert 0.5 <= cores <= (os.cpu_count() or 1) + 1e-9


def test_busy_cores_arithmetic_and_unknowns():
    cpus = os.cpu_count() or 1
    assert busy_cores((100, 1000), (150, 1100)) == cpus * 0.5
    assert busy_cores(None, (1, 2)) is None
    assert busy_cores((1, 2), None) is None
    assert busy_cores((5, 10), (5, 10)) is None  # no time passed: unknown, not a division by zero
