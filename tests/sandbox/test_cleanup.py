"""Leaving nothing behind (src/tandem/sandbox/cleanup.py): a process using sandboxes removes everything it
made when it exits, when Ctrl-C interrupts it and when SIGTERM or SIGHUP stops it. Real child processes and
real bwrap; nothing is mocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tandem.sandbox import bwrap_available

from .conftest import procs_with, wait_no_procs

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")
TANDEM = [sys.executable, "-c", "import sys; from tandem.cli.main import app; sys.argv[0] = 'tandem'; app()"]
SANDBOX_SCRIPT = """
import sys
from tandem.core.config import SandboxConfig
from tandem.sandbox import create_sandbox
scratch, mode, head, tail = sys.argv[1:]
marker = head + tail  # not on this process's own command line, so only the sandboxed command has it
config = SandboxConfig(scratch=scratch, workspace_mode=mode, timeout_s=600)
with create_sandbox({"a.py": "x = 1\\n"}, config) as sb:
    sb.exec(["sh", "-c", "sleep 600", marker])
"""
"""A process that runs one long command in a sandbox (``tandem sandbox run`` offers no scratch option)."""


def debris(pid: int) -> list[str]:
    """What tandem process ``pid`` made and left: directories, mounts, cgroups, loop devices."""
    tag = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"
    mine = f"-{pid}-"
    found = [
        str(p)
        for place in (Path(tempfile.gettempdir()), Path("/dev/shm"))
        for p in place.glob("tandem-*")
        if mine in p.name
    ]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if mine in line.split()[4]]
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/**/tandem-{tag}-{pid}-*")]
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if mine in backing.read_text():
                found.append(f"loop {backing.parent.parent.name}")
        except OSError:
            pass
    return sorted(found)


def wait_no_debris(pid: int, within_s: float = 60.0) -> list[str]:
    """Debris of dead process ``pid``, waiting up to ``within_s`` only while all that is left is loop devices
    (a lazily unmounted filesystem releases its device when its last user is gone). Anything else is
    returned at once: given time, another tandem process's sweep would remove it and hide a leak."""
    end = time.monotonic() + within_s
    while (left := debris(pid)) and all(x.startswith("loop ") for x in left) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def halves(marker: str) -> list[str]:
    """``marker`` as two arguments: the command line holding them does not contain ``marker`` itself (a
    process forked from it shares it until it execs), the sandboxed command joins them."""
    return [marker[:8], marker[8:]]


def sandboxed(marker: str) -> list[str]:
    """A command that sleeps with ``marker`` (given as ``halves``) on its command line."""
    return ["sh", "-c", 'exec sh -c "sleep 600" "$0$1"', *halves(marker)]


DEFAULT_SIGNALS = [
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT): signal.signal(s, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])",
]
"""Runs its arguments (same pid, through exec) with the signal dispositions an interactive start gives: a test
run under ``nohup`` would pass SIGHUP on ignored, and the CLI rightly leaves an ignored signal ignored."""


def start_and_signal(argv: list[str], marker: str, sig: signal.Signals) -> subprocess.Popen[bytes]:
    """Start ``argv`` (with default signal dispositions), wait until its sandboxed command (with ``marker``)
    runs, send ``sig``, wait for it."""
    proc = subprocess.Popen([*DEFAULT_SIGNALS, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not procs_with(marker):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc


def test_a_normal_exit_leaves_nothing(tmp_path: Path) -> None:
    r = subprocess.run([*TANDEM, "sandbox", "run", "--workspace", str(tmp_path), "--", "true"], timeout=120)
    assert r.returncode == 0
    proc = subprocess.Popen([*TANDEM, "sandbox", "run", "--workspace", str(tmp_path), "--", "true"])
    assert proc.wait(timeout=120) == 0
    assert wait_no_debris(proc.pid) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_sandbox_run_leaves_nothing(tmp_path: Path, marker: str, sig: signal.Signals) -> None:
    argv = [*TANDEM, "sandbox", "run", "--workspace", str(tmp_path), "--timeout", "600", "--"]
    proc = start_and_signal([*argv, *sandboxed(marker)], marker, sig)
    if sig != signal.SIGINT:  # Ctrl-C is typer's to report
        assert proc.returncode == 128 + sig
    assert wait_no_procs(marker) == []
    assert wait_no_debris(proc.pid) == []


@pytest.mark.parametrize(("scratch", "mode"), [("disk", "auto"), ("tmpfs", "auto"), ("disk", "copy")])
def test_sigterm_during_an_exec_leaves_nothing(scratch: str, mode: str, marker: str) -> None:
    if scratch == "tmpfs" and not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    argv = [sys.executable, "-c", SANDBOX_SCRIPT, scratch, mode, *halves(marker)]
    proc = start_and_signal(argv, marker, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    assert wait_no_procs(marker) == []
    assert wait_no_debris(proc.pid) == []


def test_sigterm_while_env_try_grades_leaves_nothing(tmp_path: Path, marker: str) -> None:
    solution = tmp_path / "solution.py"
    solution.write_text(f"import os\nos.system(\"sh -c 'sleep 600' {marker}\")\n")
    argv = [*TANDEM, "env", "try", "builtin:heldout:s0:l1:0", "--solution", str(solution)]
    proc = start_and_signal([*argv, "--set", "sandbox.timeout_s=600"], marker, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    assert wait_no_procs(marker) == []
    assert wait_no_debris(proc.pid) == []


def test_sigterm_while_eval_runs_sessions_leaves_nothing() -> None:
    """`tandem eval` makes its sandboxes on worker threads, which cannot set signal handlers: the command sets
    them itself, so SIGTERM unwinds and the exit hook removes them (before, 34 were left for the next sweep
    to find)."""
    argv = [*TANDEM, "eval", "--n-tasks", "64", "--set", "engine.kind=builtin"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 300
        while len(debris(proc.pid)) < 4:  # sessions are running in sandboxes
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert wait_no_debris(proc.pid) == []


def test_other_live_processes_keep_their_sandboxes(tmp_path: Path, marker: str) -> None:
    """A process exiting cleans up its own sandboxes only, never those of another live tandem process."""
    other = subprocess.Popen([sys.executable, "-c", SANDBOX_SCRIPT, "disk", "auto", *halves(marker)])
    try:
        while not procs_with(marker):
            assert other.poll() is None
            time.sleep(0.02)
        before = debris(other.pid)
        argv = [*TANDEM, "sandbox", "run", "--workspace", str(tmp_path), "--", "true"]
        assert subprocess.run(argv, timeout=120).returncode == 0
        assert debris(other.pid) == before and procs_with(marker)
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(timeout=120)
    assert wait_no_debris(other.pid) == []


def test_what_a_killed_process_left_is_swept_by_the_next_one(tmp_path: Path, marker: str) -> None:
    """SIGKILL leaves no chance to clean up: the next process that makes a sandbox removes what the dead one
    left, its disk's mount and loop device included, and kills its sandboxed processes (bwrap's
    die-with-parent does not always reach the sandbox's pid 1: about 1 kill in 10 left it running here)."""
    argv = [sys.executable, "-c", SANDBOX_SCRIPT, "disk", "auto", *halves(marker)]
    proc = start_and_signal(argv, marker, signal.SIGKILL)
    run = [*TANDEM, "sandbox", "run", "--workspace", str(tmp_path), "--", "true"]
    assert subprocess.run(run, timeout=120).returncode == 0
    assert wait_no_procs(marker) == []
    assert wait_no_debris(proc.pid) == []


FORK_SCRIPT = """
import os, sys
from tandem.core.config import SandboxConfig
from tandem.sandbox import create_sandbox
with create_sandbox({"a.py": "x = 1\\n"}, SandboxConfig(scratch=sys.argv[1])) as sb:
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal exit: the child runs the exit hooks it inherited
    os.waitpid(child, 0)
    print(sb.exec(["cat", "a.py"]).stdout, end="")
"""


@pytest.mark.parametrize("scratch", ["disk", "auto"])
def test_a_forked_child_exiting_leaves_its_parents_sandboxes_alone(scratch: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, scratch], capture_output=True, text=True, timeout=120
    )
    assert (r.returncode, r.stdout) == (0, "x = 1\n"), r.stderr[-2000:]


def test_removing_what_is_already_gone_changes_nothing_around_it(tmp_path: Path) -> None:
    """Two sweeps racing for one dead directory, or a release resumed after it had deleted the directory,
    must leave the temp dir's permissions alone (they once became 0700, locking every sandbox out of it)."""
    import stat

    from tandem.sandbox.cleanup import rmtree

    parent = tmp_path / "tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    rmtree(parent / "tandem-sbx-gone")
    assert stat.S_IMODE(parent.stat().st_mode) == 0o1777
    locked = parent / "tree" / "locked"  # a command may take write permission from its own directories
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    os.chmod(locked, 0o500)
    rmtree(parent / "tree")
    assert not (parent / "tree").exists() and stat.S_IMODE(parent.stat().st_mode) == 0o1777
