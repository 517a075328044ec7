"""Process and machine helpers shared by the layers that own OS resources (sandboxes, store locks) and by
the code that measures runs.

Invariants: ``pid_alive`` never signals the process (signal 0 only checks existence and permission).
``cpu_ticks`` reads the machine-wide counters of ``/proc/stat`` (every process of the host, not only
tandem's); busy time is user, nice, system, irq and softirq, so idle, I/O wait and the time a VM host stole
count as not busy (the stolen share is ``steal_fraction``). Where ``/proc/stat`` cannot be read, the
readings and everything computed from them are None instead of raising.
"""

from __future__ import annotations

import os
from typing import NamedTuple


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CpuTicks(NamedTuple):
    """Machine-wide CPU ticks since boot (see module invariants for what counts as busy)."""

    busy: int
    steal: int
    total: int


def cpu_ticks() -> CpuTicks | None:
    """The whole machine's CPU ticks from ``/proc/stat``; None when unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return CpuTicks(user + nice + system + irq + softirq, steal, sum(fields))


def busy_cores(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """Mean number of this machine's cores busy between two ``cpu_ticks`` readings (None if unknown)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (os.cpu_count() or 1) * (after.busy - before.busy) / (after.total - before.total)


def steal_fraction(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """Share of the CPU time between two readings that a VM host took (None if unknown)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
