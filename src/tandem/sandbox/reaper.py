"""A background thread for the slow part of closing sandboxes.

Invariants: a job handed to :func:`reap_later` runs exactly once, on one daemon thread, in submission order;
a failing job is dropped (cleanup is best effort: the next process's sweep removes what is left);
:func:`drain_reaper` blocks until every job submitted before it has run, and runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable

_reap_queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _reap_loop() -> None:
    while True:
        job = _reap_queue.get()
        try:
            if job is not None:
                job()
        except Exception:  # noqa: BLE001 - cleanup is best effort; the next sweep catches what is left
            pass
        finally:
            _reap_queue.task_done()


def reap_later(job: Callable[[], None]) -> None:
    """Run ``job`` (a cleanup) on the reaper thread."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_loop, name="tandem-sandbox-reaper", daemon=True)
            _reaper.start()
            atexit.register(drain_reaper)
    _reap_queue.put(job)


def drain_reaper() -> None:
    """Block until every cleanup handed to the reaper so far has run (at once in a forked child, whose
    reaper thread did not survive the fork: its parent's jobs are not its own)."""
    if _reaper is not None and _reaper.is_alive():
        _reap_queue.join()
