"""Process and machine helpers shared by the layers that own OS resources (sandboxes, store locks) and by
the code that measures runs.

Invariants: ``pid_alive`` never signals the process (signal 0 only checks existence and permission).
``cpu_ticks`` reads the machine-wide counters of ``/proc/stat`` (every process of the host, not only
tandem's); busy time is user, nice, system, irq and softirq, so idle, I/O wait and the time a VM host stole
count as not busy. Where ``/proc/stat`` cannot be read both helpers return None instead of raising.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot, from ``/proc/stat``; None when unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, _steal = fields
    return user + nice + system + irq + softirq, sum(fields)


def busy_cores(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Mean number of this machine's cores busy between two ``cpu_ticks`` readings (None if unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (os.cpu_count() or 1) * (after[0] - before[0]) / (after[1] - before[1])
