"""Machine CPU accounting (``tandem.core.procs``): the numbers runs and `tandem bench pipeline` report; and
the start-up heap freeze of long-lived processes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import pytest

from tandem.core.procs import CpuTicks, busy_cores, cpu_ticks, steal_fraction, thread_cpu_s


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


def test_thread_cpu_s_counts_the_threads_own_work_and_nothing_once_it_ended():
    import threading

    release = threading.Event()

    spun_enough = threading.Event()

    def spin() -> None:
        while time.thread_time() < 0.1:  # 0.1 s of its own CPU, however busy the machine is
            pass
        spun_enough.set()
        release.wait(10)  # idle, alive: its clock stops growing

    t = threading.Thread(target=spin)
    assert thread_cpu_s(None) == 0.0 and thread_cpu_s(t) == 0.0  # not started
    t.start()
    assert spun_enough.wait(30)
    time.sleep(0.05)  # let it reach the wait
    spun = thread_cpu_s(t)
    busy = time.thread_time()  # this thread spins meanwhile; the other thread's clock must not count it
    while time.thread_time() < busy + 0.1:
        pass
    assert 0.1 <= spun <= thread_cpu_s(t) < spun + 0.05
    release.set()
    t.join()
    assert thread_cpu_s(t) == 0.0


def test_busy_cores_arithmetic_and_unknowns():
    cpus = os.cpu_count() or 1
    a, b = CpuTicks(100, 10, 1000), CpuTicks(150, 30, 1100)
    assert busy_cores(a, b) == cpus * 0.5
    assert steal_fraction(a, b) == 0.2
    for f in (busy_cores, steal_fraction):
        assert f(None, b) is None and f(a, None) is None
        assert f(a, a) is None  # no time passed: unknown, not a division by zero


_FREEZE_PROBE = """
import gc, json, weakref
from tandem.core.procs import freeze_heap

class Node:
    pass

kept = Node(); kept.me = kept  # start-up state in a cycle: frozen
gone = Node(); gone.me = gone  # start-up garbage in a cycle: collected before the freeze, not frozen
gone_ref = weakref.ref(gone); del gone
frozen = freeze_heap()
later = Node(); later.me = later  # allocated afterwards: the collector still sees and frees it
later_ref = weakref.ref(later); del later
seen_later = any(o is later_ref() for o in gc.get_objects())
gc.collect()
print(json.dumps({
    "returned": frozen, "freeze_count": gc.get_freeze_count(),
    "kept_scanned": any(o is kept for o in gc.get_objects()), "garbage_frozen": gone_ref() is not None,
    "later_seen": seen_later, "later_freed": later_ref() is None,
}))
"""


def _env(freeze: str | None) -> dict[str, str]:
    """This environment with ``TANDEM_GC_FREEZE`` set to ``freeze`` (removed for None: the default)."""
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_GC_FREEZE"}
    if freeze is not None:
        env["TANDEM_GC_FREEZE"] = freeze
    return env


def _probe(env_value: str | None) -> dict:
    env = _env(env_value)
    out = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_freeze_heap_moves_startup_state_out_of_full_collections():
    """In a fresh process (the freeze is process-wide): start-up objects leave the collected generations,
    start-up garbage is collected first instead of frozen, and what is allocated later is collected as
    usual."""
    r = _probe(None)
    assert r["returned"] == r["freeze_count"] > 0
    assert not r["kept_scanned"]  # in the permanent generation: full collections skip it
    assert not r["garbage_frozen"]
    assert r["later_seen"] and r["later_freed"]


def test_freeze_heap_can_be_turned_off():
    r = _probe("0")
    assert r["returned"] == 0 and r["freeze_count"] == 0
    assert r["kept_scanned"]


def test_frozen_heap_is_finalised_at_exit():
    """The heap is thawed at exit, so a frozen cycle's finaliser still runs at shutdown (native bindings
    otherwise report leaked instances when the interpreter exits)."""
    code = (
        "import sys\nfrom tandem.core.procs import freeze_heap\n"
        "class Fin:\n    def __del__(self):\n        sys.stdout.write('finalised\\n')\n"
        "f = Fin(); f.me = f\nassert freeze_heap() > 0\ndel f\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(None), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "finalised\n"


def test_freeze_switch_rejects_nonsense(monkeypatch):
    from tandem.core.procs import freeze_heap

    before = gc.get_freeze_count()  # this process's (an in-process vLLM engine freezes its own heap)
    monkeypatch.setenv("TANDEM_GC_FREEZE", "maybe")
    with pytest.raises(ValueError, match="TANDEM_GC_FREEZE='maybe'.*0 .*or 1"):
        freeze_heap()
    assert gc.get_freeze_count() == before  # refused before anything was frozen
    monkeypatch.setenv("TANDEM_GC_FREEZE", "Off")
    assert freeze_heap() == 0 and gc.get_freeze_count() == before
