"""Helpers shared by the run tests."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path


def tandem_debris() -> set[str]:
    """What tandem processes keep in the temp dir and /dev/shm, and the mounts they hold."""
    places = (Path(tempfile.gettempdir()), Path("/dev/shm"))
    found = {str(p) for place in places for p in place.glob("tandem-*")}
    with open("/proc/self/mountinfo") as f:
        found |= {f"mount {line.split()[4]}" for line in f if "tandem-" in line.split()[4]}
    return found


def at_first_step(run_dir: Path, action: Callable[[], None], when: str = "metrics.jsonl") -> threading.Thread:
    """A daemon thread that calls ``action`` once the run in ``run_dir`` has written ``when`` (by default,
    once its first metrics row is written), polling every 10 ms for up to 300 s."""

    def wait_then_act() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (run_dir / when).exists() and (when != "metrics.jsonl" or (run_dir / when).read_text()):
                action()
                return
            time.sleep(0.01)

    t = threading.Thread(target=wait_then_act, daemon=True)
    t.start()
    return t


def actor_pid(name: str) -> int:
    """The process id of the named Ray actor (asked inside the actor's process)."""
    import ray

    return ray.get(ray.get_actor(name).__ray_call__.remote(lambda _: os.getpid()))


def train_then_release(cfg, run_dir: Path, stopped: dict):
    """``train(cfg, run_dir)``; whatever happens, SIGKILL the process a test stopped (``stopped["pid"]``,
    never left behind stopped) and shut Ray down."""
    import ray

    from tandem.orchestrator import train

    try:
        return train(cfg, run_dir, quiet=True)
    finally:
        if "pid" in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped["pid"], signal.SIGKILL)
        ray.shutdown()
