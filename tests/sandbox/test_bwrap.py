"""The bwrap backend, end to end with real bubblewrap: isolation, limits, timeouts, cleanup."""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid
from pathlib import Path

import pytest

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox import Sandbox, bwrap_available, create_sandbox, drain_reaper
from tandem.sandbox.base import output_flood_bytes
from tandem.sandbox.bwrap import sandbox_python

from .conftest import procs_with, wait_no_procs

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")


@pytest.fixture
def sb(cfg: SandboxConfig):
    with create_sandbox({"solution.py": "def f():\n    return 1\n"}, cfg) as s:
        yield s


def test_exit_status_stdout_stderr(sb: Sandbox) -> None:
    r = sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, "out\n", "err\n", False, False)
    assert sb.exec(["sh", "-c", "kill -9 $$"]).exit_code == 137
    assert sb.exec(["cat"], stdin="line\n" * 3).stdout == "line\n" * 3
    assert sb.exec(["no-such-command-xyz"]).exit_code != 0


def test_cwd_python_and_environment(sb: Sandbox) -> None:
    prefix = sandbox_python(sb.owner)  # the host's base prefix, or None: the system's /usr/bin/python3
    r = sb.exec(
        ["python3", "-c", "import os, sys, solution; print(os.getcwd(), sys.base_prefix, solution.f())"]
    )
    assert r.stdout.split() == ["/workspace", sys.base_prefix if prefix else "/usr", "1"], r.stderr
    assert sb.exec(["python", "-c", "print(2)"]).stdout == "2\n"
    env = dict(line.split("=", 1) for line in sb.exec(["env"]).stdout.splitlines())
    env.pop("PWD", None)
    assert env == {
        "PATH": f"{prefix or '/tandem'}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/workspace",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def test_no_network(sb: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = (
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')"
        )
        r = sb.exec(["python3", "-c", code])
        assert r.exit_code != 0 and "connected" not in r.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


TRACE_THE_WRAPPER = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", libc.ptrace(16, 1, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH to pid 1
for f in ("/proc/1/mem", "/proc/1/fd/1"):
    try:
        open(f, "rb").close()
        print("opened", f)
    except OSError as e:
        print("refused", f, e.errno)
os.kill(1, signal.SIGKILL)  # ignored: signals from inside a pid namespace do not reach its init
print("survived")
"""


def test_the_wrapper_reporting_a_command_cannot_be_traced_or_killed_by_it(sb: Sandbox) -> None:
    """A command that could trace pid 1 (which reports its exit status and leftovers and holds the output
    pipes) could forge a grade: a probe scored 1.0 on all three task sources by rewriting it."""
    r = sb.exec(["python3", "-c", TRACE_THE_WRAPPER])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [
        "ptrace -1 1",  # EPERM
        "refused /proc/1/mem 13",  # EACCES
        "refused /proc/1/fd/1 13",
        "survived",
    ]
    assert "leftover_processes" not in r.limits


def test_orphans_are_reaped_and_not_counted_as_leftovers(sb: Sandbox) -> None:
    r = sb.exec(["sh", "-c", "(sleep 0.2 &); (true &); sleep 1; ls /proc | grep -c '^[0-9]'"])
    assert r.exit_code == 0 and int(r.stdout) == 4, r.stdout  # pid 1, sh, ls, grep: no zombies
    assert "leftover_processes" not in r.limits


def test_system_is_read_only(sb: Sandbox) -> None:
    name = f"tandem-ro-{uuid.uuid4().hex}"
    for target in (f"/usr/{name}", f"/etc/{name}", f"/{name}", f"{sys.base_prefix}/{name}"):
        r = sb.exec(["sh", "-c", f"echo x > {target}"])
        assert r.exit_code != 0, target
        assert not Path(target).exists()
    assert sb.exec(["sh", "-c", "echo x > /tmp/t && cat /tmp/t"]).stdout == "x\n"
    assert sb.exec(["ls", "/tmp"]).stdout == ""  # every exec gets a fresh /tmp


def test_host_directories_are_invisible(sb: Sandbox) -> None:
    secret = Path.home() / f"tandem-secret-{uuid.uuid4().hex}"
    secret.write_text("top secret")
    try:
        r = sb.exec(["sh", "-c", f"cat {secret}; ls -a {Path.home()}"])
        assert "top secret" not in r.stdout and secret.name not in r.stdout
    finally:
        secret.unlink()
    for hidden in ("/work", "/sys", sys.prefix, str(Path(__file__).parent), "/var", "/opt"):
        assert sb.exec(["ls", hidden]).exit_code != 0, hidden
    assert sb.exec(["cat", "/etc/shadow"]).exit_code != 0


def test_original_workspace_is_never_modified(tmp_path: Path, cfg: SandboxConfig) -> None:
    (tmp_path / "a.txt").write_text("original")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("keep")
    with create_sandbox(tmp_path, cfg) as s:
        r = s.exec(["sh", "-c", "echo changed > a.txt && rm sub/b.txt && touch new.txt"])
        assert r.exit_code == 0, r.stderr
        s.write("sub/written.txt", "hello")
        assert s.read("a.txt") == "changed\n"
        assert (s.workdir / "sub" / "written.txt").read_text() == "hello"
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a.txt", "sub", "sub/b.txt"]
    assert (tmp_path / "a.txt").read_text() == "original"


def test_timeout_kills_whole_tree(sb: Sandbox, marker: str) -> None:
    # a forked child, and a grandchild that escapes into its own session, both sleeping
    code = "import os, time\nif os.fork() == 0 and os.fork() == 0:\n    os.setsid()\ntime.sleep(100)\n"
    r = sb.exec(["python3", "-c", code, marker], timeout_s=1.0)
    assert r.exit_code == 124 and r.timed_out
    assert "timed out" in r.stderr
    assert wait_no_procs(marker) == []
    r = sb.exec(["sleep", "100"], timeout_s=0.5)
    assert (r.exit_code, r.timed_out) == (124, True)


def test_background_processes_do_not_outlive_exec(sb: Sandbox, marker: str) -> None:
    r = sb.exec(["sh", "-c", f"python3 -c 'import time; time.sleep(100)' {marker} & echo started"])
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "started\n", False)
    assert wait_no_procs(marker) == []


def test_memory_hog_is_stopped() -> None:
    cfg = SandboxConfig(memory_mb=128, timeout_s=30)
    hog = "chunks = []\nfor _ in range(2048):\n    chunks.append(bytearray(1 << 20))\nprint('survived')\n"
    with create_sandbox({"hog.py": hog}, cfg) as s:
        r = s.exec(["python3", "hog.py"])
        assert r.exit_code != 0 and "survived" not in r.stdout
        assert not r.timed_out
        r = s.exec(
            [
                "sh",
                "-c",
                "for i in 1 2 3 4 5 6 7 8 9; do head -c 16000000 /dev/zero > /tmp/$i || exit 1; done",
            ]
        )
        assert r.exit_code != 0  # /tmp is a tmpfs no larger than memory_mb
        for d in s._cgroup.dirs:  # cgroup v1 limits, where this machine has them
            if (d / "memory.limit_in_bytes").exists():
                assert int((d / "memory.limit_in_bytes").read_text()) == 128 << 20
            if (d / "pids.max").exists():
                assert (d / "pids.max").read_text().strip() == str(cfg.pids)


def test_rlimits() -> None:
    cfg = SandboxConfig(cpu_s=1, file_mb=1, timeout_s=30)
    with create_sandbox({}, cfg) as s:
        r = s.exec(["python3", "-c", "import resource as r; print(r.getrlimit(r.RLIMIT_NOFILE))"])
        assert r.stdout.strip() == "(256, 256)"
        r = s.exec(["python3", "-c", "open('big', 'wb').write(b'x' * (2 << 20))"])
        assert r.exit_code != 0 and "File too large" in r.stderr
        r = s.exec(["sh", "-c", "head -c 1000000 /dev/zero > /tmp/ok && head -c 2000000 /dev/zero > big"])
        assert r.exit_code != 0 and not (s.workdir / "big").stat().st_size > 1 << 20
        r = s.exec(["python3", "-c", "while True: pass"])
        assert r.exit_code in (128 + 24, 137) and not r.timed_out  # SIGXCPU, then SIGKILL at the hard limit


SPIN = """
import os, sys, time
wall = float(sys.argv[1])
t0 = time.monotonic()
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - t0 < wall:
            pass
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
t = os.times()
print(t.children_user + t.children_system, time.monotonic() - t0)
"""


def test_cpu_quota_caps_all_the_processes_of_a_sandbox_together() -> None:
    """``cpus``: two processes spinning for a second get at most that many CPUs between them (the CFS
    quota is a hard cap, so a loaded machine can only lower what they get), and the quota's throttling is
    counted; ``cpus=None`` makes no cpu cgroup. A bad value is refused naming the field."""
    from tandem.sandbox.limits import _own_cgroup_dir

    if _own_cgroup_dir("cpu") is None:
        pytest.skip("no writable cgroup v1 cpu controller on this machine")
    cfg = SandboxConfig(cpus=0.25, timeout_s=30)
    with create_sandbox({"spin.py": SPIN}, cfg) as s:
        assert s._cgroup.has_cpu
        (d,) = [d for d in s._cgroup.dirs if (d / "cpu.cfs_quota_us").exists()]
        assert int((d / "cpu.cfs_quota_us").read_text()) == 25_000
        before = s._cgroup.counters().get("cpu_throttled", 0)
        r = s.exec(["python3", "spin.py", "1.0"])
        assert r.exit_code == 0, r.stderr
        cpu, wall = (float(x) for x in r.stdout.split())
        assert cpu <= 0.25 * wall + 0.15, (cpu, wall)  # two spinners uncapped would use up to 2 x wall
        assert s._cgroup.counters()["cpu_throttled"] > before
    with create_sandbox({}, SandboxConfig(cpus=None)) as s:
        assert not s._cgroup.has_cpu
    with pytest.raises(ValueError, match="cpus"):
        SandboxConfig(cpus=0)


def test_pids_limit() -> None:
    cfg = SandboxConfig(pids=16, timeout_s=30)
    with create_sandbox({}, cfg) as s:
        if not s._cgroup.has_pids and os.getuid() == 0:
            pytest.skip("no pids cgroup and root is exempt from RLIMIT_NPROC")
        code = """
import os
r, w = os.pipe()
n = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.read(r, 1)  # children block until the sandbox kills them
        os._exit(0)
    n += 1
print(n)
"""
        r = s.exec(["python3", "-c", code])
        assert r.exit_code == 0, r.stderr
        assert int(r.stdout) < 16


def test_output_is_truncated_with_marker() -> None:
    with create_sandbox({}, SandboxConfig(max_output_bytes=100)) as s:
        r = s.exec(["python3", "-c", "import sys; print('x' * 1000); sys.stdout.write('y' * 10_000_000)"])
        assert r.exit_code == 0 and r.truncated
        assert r.stdout == "x" * 100 + "\n[... output truncated at 100 bytes ...]\n"
        r = s.exec(["echo", "short"])
        assert (r.stdout, r.truncated) == ("short\n", False)


def test_an_output_flood_is_killed_instead_of_drained_until_the_timeout() -> None:
    """Before: a command writing without end was drained for its whole timeout (5 s cost the host 2.3 s of
    CPU here) and ended as a timeout. Now it is killed once it has written ``output_flood_bytes`` past the
    cap, long before the timeout, and the next command runs as usual."""
    flood = output_flood_bytes(100)
    with create_sandbox({}, SandboxConfig(max_output_bytes=100, timeout_s=60)) as s:
        r = s.exec(["python3", "-c", "import os\nb = b'x' * 65536\nwhile True: os.write(1, b)"])
        assert not r.timed_out and r.limits == ("output",), (r.limits, r.stderr[-300:])
        assert r.exit_code == 137 and r.stdout.startswith("x" * 100)
        assert f"killed after writing over {flood} bytes past the 100-byte output limit" in r.stderr
        r = s.exec(["python3", "-c", f"import os; os.write(1, b'y' * {flood // 2})"])  # below it: kept going
        assert (r.exit_code, r.limits, r.stdout[:3]) == (0, ("output",), "yyy")
        assert (r := s.exec(["echo", "next"])).stdout == "next\n"


def test_commands_no_argv_can_carry_are_refused_whichever_way_they_start(sb: Sandbox) -> None:
    """Before: a NUL in an argument ran a command line cut at the NUL when a spare launcher took it (exit 2,
    "unexpected EOF while looking for matching"), and raised a bare ValueError when started afresh; a
    timeout past ~24 days (the epoll wait's limit) raised OverflowError. Now both are a SandboxError naming
    the value, on either path, and the sandbox keeps working."""
    assert sb._spare is not None  # made at creation: the first exec goes through the spare launcher
    for stdin in (None, "x"):  # with stdin the command starts afresh (no spare)
        with pytest.raises(SandboxError, match="NUL"):
            sb.exec(["sh", "-c", "echo cut\x00; echo rest"], stdin=stdin)
    for bad in (float("inf"), 1e9, 30 * 24 * 3600.0, float("nan"), 0.0):
        with pytest.raises(SandboxError, match="timeout_s"):
            sb.exec(["true"], timeout_s=bad)
    assert sb.exec(["echo", "alive"], timeout_s=7 * 24 * 3600).stdout == "alive\n"


def test_read_write_reject_escapes(sb: Sandbox) -> None:
    assert (
        sb.exec(["sh", "-c", "ln -s /etc/passwd leak && ln -s / rootlink && ln -s solution.py ok"]).exit_code
        == 0
    )
    for bad in (
        "/etc/passwd",
        "../x",
        "a/../../x",
        "leak",
        "rootlink/etc/passwd",
        "",
        "/workspace/solution.py",
    ):
        with pytest.raises(SandboxError):
            sb.read(bad)
        with pytest.raises(SandboxError):
            sb.write(bad, "x")
    assert sb.read("ok").startswith("def f")
    with pytest.raises(SandboxError, match="does not exist"):
        sb.read("missing.py")
    sb.write("deep/er/new.py", "x = 1\n")
    assert sb.exec(["cat", "deep/er/new.py"]).stdout == "x = 1\n"
    with pytest.raises(SandboxError, match="file_mb"):
        sb.write("huge.txt", "x" * (sb.config.file_mb * 1024 * 1024 + 1))


def test_snapshot(sb: Sandbox) -> None:
    sb.write("pkg/mod.py", "y = 2\n")
    code = (
        "import os; os.makedirs('__pycache__'); open('__pycache__/c.txt', 'w').write('c'); "
        "open('b.bin', 'wb').write(b'\\x00\\xff')"
    )
    assert sb.exec(["python3", "-c", code]).exit_code == 0
    assert sb.exec(["ln", "-s", "/etc/hostname", "link"]).exit_code == 0
    assert sb.snapshot() == {"pkg/mod.py": "y = 2\n", "solution.py": "def f():\n    return 1\n"}


def test_snapshot_is_bounded_and_a_deep_tree_is_deleted_at_close(cfg: SandboxConfig) -> None:
    """A probe nested 1100 directories (``os.walk`` and ``shutil.rmtree`` recursed past Python's limit: the
    group failed, or the sandbox's files stayed in ``/dev/shm``), wrote a million hard links (a 22.6 s
    snapshot, a 176 s grading) and a name that is not UTF-8."""
    from tandem.sandbox import base

    s = create_sandbox({"solution.py": "x = 1\n"}, cfg)
    root = s.workdir.parent
    deep = (
        "import os\nos.makedirs('__pycache__/d'); os.chdir('__pycache__/d')\n"
        "open('ballast', 'wb').write(b'b' * 4096)\n"
        "for _ in range(1500):\n    os.mkdir('a'); os.chdir('a')\n"
        "open('leaf.py', 'w').write('deep')\nos.chmod('.', 0o500)\n"  # and one it cannot write into
    )
    assert s.exec(["python3", "-c", deep]).exit_code == 0
    code = "import os\nos.mkdir('x'); os.chdir('x')\nfor _ in range(80):\n    os.mkdir('a'); os.chdir('a')\n"
    code += "open('leaf.py', 'w').write('y')\nopen(b'/workspace/bad\\xff.py', 'w').write('z')\n"
    assert s.exec(["python3", "-c", code]).exit_code == 0
    files = s.snapshot()
    assert sorted(files) == ["solution.py"] and s.snapshot_limits == ["depth", "names"]
    many = f"import os\nos.mkdir('many')\nfor i in range({base.SNAPSHOT_MAX_ENTRIES}):\n"
    many += "    os.link('solution.py', f'many/{i}.py')\n"
    assert s.exec(["python3", "-c", many]).exit_code == 0
    files = s.snapshot()
    cap = base.SNAPSHOT_MAX_ENTRIES
    assert "entries" in s.snapshot_limits and cap // 2 < len(files) < cap
    s.close()
    drain_reaper()
    assert not root.exists()


def test_close_cleans_up_and_is_idempotent(cfg: SandboxConfig) -> None:
    s = create_sandbox({"a.py": "1"}, cfg)
    workdir, cgroups = s.workdir, list(s._cgroup.dirs)
    s.close()
    s.close()
    assert not workdir.exists() and not any(d.exists() for d in cgroups)
    with pytest.raises(SandboxError, match="closed"):
        s.exec(["true"])


def test_no_leaks_over_many_sandboxes(cfg: SandboxConfig) -> None:
    before = _leftovers()
    for i in range(15):
        with create_sandbox({"f.py": str(i)}, cfg) as s:
            assert s.exec(["cat", "f.py"]).stdout == str(i)
    create_sandbox({}, cfg).close()
    assert _leftovers() == before
    with pytest.raises(SandboxError):
        create_sandbox({"../escape.py": "x"}, cfg)
    assert _leftovers() == before


def _leftovers() -> set[str]:
    import tempfile

    from tandem.sandbox.limits import CGROUP_ROOT

    mine = f"-{os.getpid()}-"
    found = {p.name for p in Path(tempfile.gettempdir()).glob("tandem-sbx-*") if mine in p.name}
    found |= {p.name for p in CGROUP_ROOT.glob("*/**/tandem-*") if mine in p.name}
    return found


def test_close_from_another_thread_stops_a_running_exec(cfg: SandboxConfig, marker: str) -> None:
    s = create_sandbox({}, cfg)
    results = []
    t = threading.Thread(
        target=lambda: results.append(s.exec(["python3", "-c", "import time; time.sleep(100)", marker]))
    )
    t.start()
    while not procs_with(marker) and t.is_alive():
        threading.Event().wait(0.02)
    s.close()
    t.join(timeout=15)
    assert not t.is_alive() and results[0].exit_code == 137 and not results[0].timed_out
    assert wait_no_procs(marker) == [] and not s.workdir.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes run as another user only when tandem is root")
def test_a_temp_dir_the_sandbox_user_cannot_reach_is_named_with_the_fix() -> None:
    """Before: with TMPDIR under a directory of mode 700, every sandbox failed with bwrap's "Can't find source
    path ...-etc-...: Permission denied" and the advice to install bubblewrap."""
    import shutil
    import tempfile

    private = Path(tempfile.mkdtemp(prefix="private-"))  # beside pytest's own (mode 700) directory
    try:
        (private / "tmp").mkdir()
        _sandbox_in_temp_dir(private)
    finally:
        shutil.rmtree(private)


def _sandbox_in_temp_dir(private: Path) -> None:
    import subprocess

    private.chmod(0o700)
    code = (
        "from tandem.core.config import SandboxConfig\n"
        "from tandem.core.errors import SandboxError\n"
        "from tandem.sandbox import create_sandbox\n"
        "try:\n"
        "    with create_sandbox({'a.txt': 'x'}, SandboxConfig()) as s:\n"
        "        print('ran', s.exec(['cat', 'a.txt']).stdout)\n"
        "except SandboxError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, TMPDIR=str(private / "tmp"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"the temp dir '{private / 'tmp'}' is not searchable by the sandbox's user (uid 61000)" in r.stdout
    assert f"'{private}' has mode 700" in r.stdout and f"chmod o+x '{private}'" in r.stdout
    assert "Install bubblewrap" not in r.stdout
    os.chown(private, -1, 61000)  # the sandbox's user runs with its uid as its gid
    private.chmod(0o710)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout == "ran x\n", r.stdout + r.stderr[-2000:]
