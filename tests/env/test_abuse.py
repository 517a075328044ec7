"""Abuse from a submitted solution, graded exactly as RL grades it (real bwrap sandboxes, real limits).

Each case is a ``solution.py`` that does something hostile when the hidden tests import it; each must score
0, name what happened (a ``limit_*`` component or flag) where the sandbox can see it, leave nothing running,
and leave the grader usable for the next submission.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from tandem.cli.env import grade
from tandem.core.config import RewardConfig, SandboxConfig
from tandem.env.reward import score
from tandem.env.tasks import SOLUTION_FILE, generate_task
from tandem.sandbox import bwrap_available

from ..sandbox.conftest import wait_no_procs

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")


@pytest.fixture(scope="module")
def task():
    return generate_task("train", 0, 0, 1)


@pytest.fixture(scope="module")
def cfg() -> SandboxConfig:
    return SandboxConfig(timeout_s=20.0, cpu_s=2, memory_mb=256, pids=32, max_output_bytes=4096)


def grade_solution(task, cfg, source: str):
    files = {**task.workspace, SOLUTION_FILE: source}
    return score(task, files, RewardConfig(kind="fraction"), cfg)


def with_reference(task, prefix: str) -> str:
    return prefix + "\n" + task.meta["solution"]


def test_reference_is_clean(task, cfg) -> None:
    r = grade_solution(task, cfg, task.meta["solution"])
    assert r.value == 1.0
    assert not [k for k in r.components if k.startswith("limit_")], r.components


def test_network_connection_is_refused(task, cfg) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    hits: list[object] = []

    def accept() -> None:
        try:
            hits.append(listener.accept())
        except OSError:
            pass

    source = with_reference(
        task, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
    )
    try:
        r = grade_solution(task, cfg, source)
        accept()
    finally:
        listener.close()
    assert hits == [] and r.value == 0.0  # the import fails with ConnectionRefusedError: nothing passes


def test_writes_outside_and_host_secrets(task, cfg) -> None:
    secret = Path.home() / f"tandem-abuse-secret-{uuid.uuid4().hex}"
    secret.write_text("TOP-SECRET-VALUE")
    target = Path("/usr") / f"tandem-abuse-{uuid.uuid4().hex}"
    source = with_reference(
        task,
        "import pathlib, sys\n"
        f"data = pathlib.Path({str(secret)!r}).read_text()\n"  # raises: the home directory is not there
        f"pathlib.Path({str(target)!r}).write_text('x')\n",
    )
    try:
        r = grade_solution(task, cfg, source)
        assert r.value == 0.0
        assert not target.exists()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem.cli.main",
                "sandbox",
                "run",
                "--workspace",
                str(Path(__file__).parent),
                "--",
                "sh",
                "-c",
                f"cat {secret}; touch /usr/x /etc/x /x; ls /root",
            ],
            capture_output=True,
            text=True,
        )
        assert out.returncode != 0 and "TOP-SECRET" not in out.stdout + out.stderr
    finally:
        secret.unlink()


def test_fork_bomb_is_stopped_and_named(task, cfg) -> None:
    marker = f"tandem-bomb-{uuid.uuid4().hex}"
    source = (
        f"import os, sys\nsys.argv[0] = {marker!r}\n"
        "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    host_ok: list[int] = []
    t = threading.Thread(target=lambda: host_ok.append(subprocess.run(["true"]).returncode))
    r_holder: list = []
    # The bomb's processes spin until the wall limit (each would need cpu_s of CPU on a shared core), so a
    # shorter one than the fixture's keeps the test short; the reference still grades in well under it.
    quick = cfg.model_copy(update={"timeout_s": 8.0})
    worker = threading.Thread(target=lambda: r_holder.append(grade_solution(task, quick, source)))
    worker.start()
    t.start()  # the host can still start processes while the bomb runs
    t.join()
    worker.join()
    r = r_holder[0]
    assert host_ok == [0]
    assert r.value == 0.0 and r.components.get("limit_pids") == 1.0, r.components
    assert wait_no_procs(marker) == []


def test_memory_bomb_is_killed_and_named(task, cfg) -> None:
    r = grade_solution(task, cfg, with_reference(task, "hog = [bytearray(1 << 20) for _ in range(4096)]"))
    assert r.value == 0.0 and r.components.get("limit_memory") == 1.0, r.components


def test_endless_loop_is_killed_at_the_cpu_limit(task, cfg) -> None:
    r = grade_solution(task, cfg, with_reference(task, "while True:\n    pass"))
    assert r.value == 0.0 and r.components.get("limit_cpu") == 1.0, r.components


def test_endless_sleep_is_killed_at_the_wall_limit(task) -> None:
    cfg = SandboxConfig(timeout_s=2.0)
    r = grade_solution(task, cfg, with_reference(task, "import time\ntime.sleep(1000)"))
    assert r.value == 0.0 and r.components.get("limit_timeout") == 1.0, r.components


def test_output_flood_is_truncated_and_named(task, cfg) -> None:
    source = "import sys\nfor _ in range(100000):\n    print('spam' * 50)\nraise SystemExit(0)\n"
    r = grade_solution(task, cfg, source)
    assert r.value == 0.0 and r.components.get("limit_output") == 1.0, r.components


def test_background_process_is_killed_and_voids_a_passing_solution(task, cfg) -> None:
    marker = f"tandem-daemon-{uuid.uuid4().hex}"
    source = with_reference(
        task,
        "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 1000; : " + marker + "'], "
        "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)",
    )
    r = grade_solution(task, cfg, source)
    assert r.components["tests_passed"] == r.components["tests_total"]  # it did pass the tests...
    assert r.value == 0.0 and r.components.get("limit_leftover_processes") == 1.0  # ...and earns nothing
    assert wait_no_procs(marker) == []


def test_symlink_out_of_the_workspace_is_not_followed(task, cfg, tmp_path: Path) -> None:
    outside = tmp_path / "outside.py"
    outside.write_text(task.meta["solution"])  # a correct solution, reachable only through the link
    sol = tmp_path / "sol"
    sol.mkdir()
    (sol / SOLUTION_FILE).symlink_to(outside)
    out = grade(task.id, sol, RewardConfig(kind="fraction"), cfg)
    assert out["reward"] == 0.0 and out["flags"]["symlinks_ignored"] is True
    # the same from inside a sandbox: the snapshot that grading reads skips the link
    from tandem.sandbox import create_sandbox

    with create_sandbox(task.workspace, cfg) as s:
        s.exec(["sh", "-c", f"rm {SOLUTION_FILE}; ln -s /etc/passwd {SOLUTION_FILE}"])
        files = s.snapshot()
        assert SOLUTION_FILE not in files and s.snapshot_skipped_symlinks == [SOLUTION_FILE]


def test_grader_still_works_after_abuse(task, cfg) -> None:
    assert os.getpid() > 0
    assert grade_solution(task, cfg, task.meta["solution"]).value == 1.0
