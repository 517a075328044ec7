"""Helpers shared by the run tests.

``joined_ray``: most run tests join one Ray cluster started once for the test session
(``ray start --head --block`` on 127.0.0.1) through ``RAY_ADDRESS``, as a user's runs join a cluster,
instead of each starting a local one: that start costs about 6 s of a 2-core machine per run. Each run is a
Ray job of its own (its driver connects and disconnects), so Ray ends a run's actors when its driver leaves
and no run sees another's named actors. The runs that test a local cluster's start and end (the smoke run,
the stop tests) start their own as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SHARED_CLUSTER_CPUS = 8
"""Logical CPUs of the shared cluster: enough for the largest run a test starts (two engines of the smoke
preset and its trainer); Ray places actors by these counts, it does not pin cores."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """The address of a Ray cluster started for the session; killed (its whole session) at the end.

    Token authentication is off (``RAY_AUTH_MODE=disabled``), for the cluster and for every driver that
    joins it: the cluster serves this machine's tests only. A process that started a local cluster has
    token authentication on for good (``ray.init`` also sets ``RAY_AUTH_MODE=token`` in its environment),
    so the tests start local clusters in child processes."""
    import ray

    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path_factory.mktemp("ray-cluster") / "ray-start.log"
    cmd = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        f"--port={port}", f"--num-cpus={SHARED_CLUSTER_CPUS}", "--include-dashboard=false",
        "--disable-usage-stats",
    ]  # fmt: skip
    with open(log, "wb") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # until the cluster takes a driver (its GCS and raylet are up)
            if head.poll() is not None:
                raise RuntimeError(f"ray start exited with {head.returncode}: {log.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ray start: no GCS within 120 s: {log.read_text()[-3000:]}") from e
                time.sleep(0.2)
        ray.init(address=address)  # returns once the head node is registered
        ray.shutdown()
        yield address
    finally:
        _kill_session(head.pid)
        head.wait()
        # `ray start` wrote its address here for a bare ray.init() to join; killed, it cannot remove it
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(FileNotFoundError):
            if current.read_text().strip().endswith(f":{port}"):
                current.unlink()


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``: the cluster's GCS, raylet and agents and the workers the
    raylet started (each in a process group of its own, all in the head's session). A graceful stop
    (SIGTERM to ``ray start --block``, then a wait) took 34 s here; nothing a later start needs is lost."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(int(entry.name)) == sid:
                    os.kill(int(entry.name), signal.SIGKILL)


@pytest.fixture
def joined_ray(ray_cluster, monkeypatch) -> Iterator[str]:
    """``RAY_ADDRESS`` names the session's cluster for this test (its in-process runs and the ``tandem``
    commands it starts join it); this process's driver is disconnected at the end."""
    import ray

    if os.environ.get("RAY_AUTH_MODE", "disabled") != "disabled":
        pytest.fail(
            f"RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']} in the test process: a local Ray cluster started "
            "in it (ray.init sets that) or the environment turned on token authentication, and this process "
            "can no longer join the session's cluster; start local clusters in a child process"
        )
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # for the `tandem` commands the test starts too
    try:
        yield ray_cluster
    finally:
        ray.shutdown()


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
