"""Process and machine helpers shared by the layers that own OS resources (sandboxes, store locks) and by
the code that measures runs.

Invariants: ``pid_alive`` never signals the process (signal 0 only checks existence and permission).
``cpu_ticks`` reads the machine-wide counters of ``/proc/stat`` (every process of the host, not only
tandem's); busy time is user, nice, system, irq and softirq, so idle, I/O wait and the time a VM host stole
count as not busy (the stolen share is ``steal_fraction``). Where ``/proc/stat`` cannot be read, the
readings and everything computed from them are None instead of raising. ``lower_thread_priority`` changes
only the calling thread (Linux thread ids), never the process, and never raises where it is not permitted.
``freeze_heap`` only moves objects between the cyclic collector's generations: nothing is freed or kept
alive by it beyond cycles among the frozen objects themselves.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import sys
import threading
import time
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


IDLE_WEIGHT = 3
"""CFS weight of a ``SCHED_IDLE`` thread (a nice-0 thread weighs 1024, and each nice level is 1.25x less)."""


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds ``thread`` has used so far, from its own CPU clock; 0.0 when it is None, not started or no
    longer alive (also when it ends between the check and the read)."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:
        return 0.0


def _cfs_weight(nice: int) -> float:
    return 1024 / 1.25**nice


def lower_priority_plan(base: int, nice: int) -> tuple[str, int]:
    """How to make a thread ``nice`` levels less favoured than a process at niceness ``base``:
    ``("nice", n)`` (set the thread's niceness to ``n``) or ``("idle", 19)`` (``SCHED_IDLE``).

    The niceness range ends at 19, so a process that already runs niced (Ray starts its worker processes,
    and so every engine actor, at 15) has fewer levels left than asked for: at base 15, nice 19 is only
    2.4x below the engine instead of the 9.3x of 10 levels. Then the plan takes whichever of nice 19 and
    ``SCHED_IDLE`` (weight 3: 12x below a nice-15 thread) comes closer, in CPU share, to the ratio asked
    for."""
    if nice <= 0 or base + nice <= 19:
        return "nice", min(19, base + max(nice, 0))
    want = _cfs_weight(base) / _cfs_weight(base + nice)
    at_19 = _cfs_weight(base) / _cfs_weight(19)
    idle = _cfs_weight(base) / IDLE_WEIGHT
    return ("idle", 19) if abs(math.log(idle / want)) < abs(math.log(at_19 / want)) else ("nice", 19)


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` levels less favoured than the process (threads it starts inherit),
    as far as the kernel allows (see ``lower_priority_plan``). Linux applies ``setpriority`` and
    ``sched_setscheduler`` to a single thread when given its thread id; elsewhere this does nothing."""
    if nice <= 0 or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        how, level = lower_priority_plan(os.getpriority(os.PRIO_PROCESS, os.getpid()), nice)
        os.setpriority(os.PRIO_PROCESS, tid, level)
        if how == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # not permitted here: keep what could be set
        pass


def boost_thread_priority(tid: int, levels: int) -> int:
    """Set thread ``tid`` (a native id of this process) ``levels`` niceness levels more favoured than its
    process (down to -20; 0 gives it the process's niceness back), where the kernel allows it (root,
    ``CAP_SYS_NICE``, or ``RLIMIT_NICE``; making a thread less favoured is always allowed). Returns the
    thread's niceness after (unchanged when not permitted). Linux only: elsewhere nothing changes and the
    process's niceness is returned."""
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if not hasattr(threading, "get_native_id") or sys.platform != "linux":
        return base
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(-20, base - max(0, levels)))
    except OSError:  # not permitted: the thread keeps its niceness
        pass
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # the thread has ended
        return base


GC_FREEZE_ENV = "TANDEM_GC_FREEZE"
"""Set to ``0`` (or ``false``, ``off``, ``no``) to keep ``freeze_heap`` from freezing (for debugging a
process's memory); ``1``, ``true``, ``on``, ``yes`` or unset: freeze."""

_OFF, _ON = {"0", "false", "off", "no"}, {"1", "true", "on", "yes", ""}


def gc_freeze_enabled() -> bool:
    """Whether ``TANDEM_GC_FREEZE`` asks for the freeze; a ``ValueError`` naming it for any other value (entry
    points call this before they start anything, so a typo is refused up front)."""
    raw = os.environ.get(GC_FREEZE_ENV, "1")
    value = raw.strip().lower()
    if value not in _OFF | _ON:
        raise ValueError(
            f"{GC_FREEZE_ENV}={raw!r} is not understood; set it to 0 (do not freeze the heap) or 1 "
            "(the default)"
        )
    return value in _ON


def freeze_heap() -> int:
    """Collect once, then move every object the cyclic garbage collector tracks into its permanent
    generation (``gc.freeze``), so that later full collections scan only what the process allocates after
    this call. Returns the number of frozen objects (0 when ``TANDEM_GC_FREEZE=0``).

    For long-lived processes, once they have built their long-lived state (an engine with its model, a
    trainer, a relay): an engine process tracks about 400-500 thousand objects (Python modules, torch,
    transformers), and a full collection over them took 0.3-0.6 s here, holding the GIL, so the engine's
    decode loop stopped for it whenever a full collection fell due (``docs/results.md``, GC pauses). Frozen
    objects are still freed by reference counting; only garbage cycles among them are never collected,
    which is why this is for start-up state that lives as long as the process; the heap is thawed at exit,
    so shutdown finalises it as usual (frozen, native bindings such as triton's reported leaks at exit).
    vLLM's engine core freezes its start-up heap the same way."""
    if not gc_freeze_enabled():
        return 0
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)  # at exit the collector sees everything again and finalises it cleanly
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Undo ``freeze_heap`` (``gc.unfreeze``: the frozen objects rejoin the oldest generation), for code
    that froze a process it does not own, such as a benchmark run as a library call in a test process."""
    gc.unfreeze()
