"""Copy-on-write workspaces, templates, the warm pool, the reaper, the agent uid and limit reporting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox import SandboxPool, WorkspaceTemplate, bwrap_available, create_sandbox, drain_reaper
from tandem.sandbox.layers import layer_cache
from tandem.sandbox.limits import agent_uid
from tandem.sandbox.overlay import mounts_under, overlay_available

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")
needs_overlay = pytest.mark.skipif(
    not overlay_available(), reason="overlayfs cannot be mounted here (not root)"
)


@pytest.fixture
def cfg() -> SandboxConfig:
    return SandboxConfig(timeout_s=20.0)


def _tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (src / "README").write_text("readme\n")
    return src


@needs_overlay
def test_overlay_is_copy_on_write_and_shares_one_layer(tmp_path: Path, cfg: SandboxConfig) -> None:
    src = _tree(tmp_path)
    cache = layer_cache(agent_uid(cfg))
    built = cache.built
    a, b = create_sandbox(src, cfg), create_sandbox(src, cfg)
    try:
        assert a.mode == b.mode == "overlay"
        assert cache.built == built + 1  # both views sit on one shared read-only layer
        r = a.exec(["sh", "-c", "echo 2 >> pkg/mod.py && rm README && mkdir new && echo x > new/f && ls"])
        assert r.exit_code == 0, r.stderr
        assert a.snapshot() == {"pkg/mod.py": "VALUE = 1\n2\n", "new/f": "x\n"}
        assert b.snapshot() == {
            "pkg/mod.py": "VALUE = 1\n",
            "README": "readme\n",
        }  # b does not see a's writes
        assert (src / "README").read_text() == "readme\n"  # and the source directory is untouched
        assert mounts_under(a.workdir) == [a.workdir]
    finally:
        a.close()
        b.close()
    assert not a.workdir.exists() and mounts_under(a.workdir) == []


def test_copy_and_overlay_give_the_same_workspace(tmp_path: Path, cfg: SandboxConfig) -> None:
    src = _tree(tmp_path)
    views = []
    for mode in ("copy", "auto"):
        with create_sandbox(src, cfg.model_copy(update={"workspace_mode": mode})) as s:
            s.write("pkg/added.py", "A = 1\n")
            r = s.exec(["python3", "-c", "import pkg.mod, pkg.added; print(pkg.mod.VALUE + pkg.added.A)"])
            views.append((s.snapshot(), r.stdout))
    assert views[0] == views[1] and views[0][1] == "2\n"


COPY_INTO_ITSELF = """
import sys
from pathlib import Path
from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox import create_sandbox
try:
    # the plain backend: the test's temp dir is private to root, and the refusal is the backends' common part
    config = SandboxConfig(backend="plain", workspace_mode=sys.argv[2])
    create_sandbox(Path(sys.argv[1]), config).close()
except SandboxError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_a_workspace_holding_the_temp_dir_is_refused_not_copied_into_itself(tmp_path: Path, mode: str):
    """Before: the copy of a directory holding the temp dir (a layer or a copy-mode workspace is made there)
    took in its own growing copy until the paths were too long, and failed with a shutil.Error of every path
    (with `/` as the workspace it would copy the host's disk into itself)."""
    if mode == "overlay" and not overlay_available():
        pytest.skip("overlayfs cannot be mounted here (not root)")
    (tmp_path / "a.txt").write_text("hi")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", COPY_INTO_ITSELF, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=120,  # only detects a hang
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert r.returncode == 3, r.stderr[-2000:]
    assert r.stdout.startswith(f"workspace directory {str(tmp_path)!r} holds "), r.stdout
    assert "copy its own copy" in r.stdout and len(r.stdout) < 1000
    assert list(tmp.rglob(".partial*")) == []  # no layer copy was begun


def test_overlay_mode_refused_clearly_when_unavailable(cfg: SandboxConfig) -> None:
    if overlay_available():
        pytest.skip("overlays work here; the refusal path needs a non-root process")
    with pytest.raises(SandboxError, match="workspace_mode"):
        create_sandbox({"a": "1"}, cfg.model_copy(update={"workspace_mode": "overlay"}))


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the agent uid needs root")
def test_commands_run_as_the_unprivileged_agent_uid(cfg: SandboxConfig) -> None:
    with create_sandbox({"a.py": "x = 1\n"}, cfg) as s:
        r = s.exec(["sh", "-c", "id -u; id -G; grep CapEff /proc/self/status; echo y >> a.py; cat a.py"])
        uid, groups, caps, *content = r.stdout.split("\n")
        assert (uid, groups) == (str(cfg.uid), str(cfg.uid)), r.stderr
        assert caps.split()[1] == "0000000000000000"
        assert content[:2] == ["x = 1", "y"]
        s.write("sub/new.py", "z = 2\n")  # files tandem writes are the agent's to edit
        assert s.exec(["sh", "-c", "echo w >> sub/new.py"]).exit_code == 0
        assert s.exec(["touch", "/tandem-root-owned"]).exit_code != 0


def test_template_pool_hands_out_pristine_sandboxes(cfg: SandboxConfig) -> None:
    with (
        WorkspaceTemplate({"counter.txt": "0\n"}, cfg) as template,
        SandboxPool(template, cfg, size=2) as pool,
    ):
        seen = []
        for _ in range(3):
            s = pool.acquire()
            seen.append(s.exec(["sh", "-c", "cat counter.txt; echo 1 > counter.txt"]).stdout)
            s.close(wait=False)
        assert seen == ["0\n"] * 3
        assert pool.hits + pool.misses == 3 and pool.hits >= 1
    drain_reaper()
    with pytest.raises(SandboxError, match="pool is closed"):
        pool.acquire()


def test_close_without_waiting_kills_now_and_cleans_up_on_the_reaper(cfg: SandboxConfig) -> None:
    s = create_sandbox({"a": "1"}, cfg)
    root, cgroups = s.workdir.parent, list(s._cgroup.dirs)
    s.close(wait=False)
    with pytest.raises(SandboxError, match="closed"):
        s.exec(["true"])
    drain_reaper()
    assert not root.exists() and not any(d.exists() for d in cgroups)


def test_limits_are_reported(cfg: SandboxConfig) -> None:
    small = cfg.model_copy(update={"cpu_s": 1, "file_mb": 1, "pids": 16, "max_output_bytes": 2000})
    with create_sandbox({}, small) as s:
        assert s.exec(["true"]).limits == ()
        assert s.exec(["sh", "-c", "sleep 100 & echo started"]).limits == ("leftover_processes",)
        assert s.exec(["sleep", "5"], timeout_s=0.5).limits == ("timeout",)
        assert s.exec(["python3", "-c", "print('x' * 3000)"]).limits == ("output",)
        assert "cpu" in s.exec(["python3", "-c", "while True: pass"]).limits
        assert "file_size" in s.exec(["python3", "-c", "open('f', 'wb').write(b'x' * (2 << 20))"]).limits
        assert "memory" in s.exec(["python3", "-c", "x = bytearray(1 << 40)"]).limits
        if s._cgroup.has_pids:
            bomb = "import os\nfor _ in range(64):\n    os.fork() if os.getpid() else None\n"
            assert "pids" in s.exec(["python3", "-c", bomb]).limits
        assert s.exec(["cat"], stdin="in\n").limits == ()  # the stdin path reports too


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent uid exists only when tandem runs as root")
def test_read_only_mounts_reach_the_sandbox_even_from_private_directories(tmp_path: Path) -> None:
    cfg = SandboxConfig(timeout_s=20.0)
    private = Path.home() / f"tandem-mount-test-{os.getpid()}"  # under /root: 0700, unreachable for the uid
    (private / "pkg").mkdir(parents=True)
    (private / "pkg" / "helper.py").write_text("VALUE = 42\n")
    public = tmp_path / "lib"
    public.mkdir()
    (public / "other.py").write_text("OTHER = 1\n")
    try:
        with create_sandbox({}, cfg, ro_mounts=[str(private / "pkg"), str(public)]) as s:
            code = "import helper, other; print(helper.VALUE + other.OTHER)"
            r = s.exec(["python3", "-c", code], env={"PYTHONPATH": f"{private / 'pkg'}:{public}"})
            assert r.stdout == "43\n", r.stderr
            write = f"echo x > {private / 'pkg' / 'helper.py'}"
            assert s.exec(["sh", "-c", write]).exit_code != 0  # read-only
            root = s.workdir.parent
            assert mounts_under(root)  # the overlay and the staged bind of the private directory
        assert not root.exists() and mounts_under(root) == []
        with pytest.raises(SandboxError, match="existing absolute host path"):
            create_sandbox({}, cfg, ro_mounts=["relative/path"])
    finally:
        (private / "pkg" / "helper.py").unlink()
        (private / "pkg").rmdir()
        private.rmdir()


def test_a_dead_spare_launcher_falls_back_to_a_fresh_start(cfg: SandboxConfig) -> None:
    with create_sandbox({"a": "1"}, cfg) as s:
        assert s._spare is not None  # bwrap sandboxes keep one launcher ready
        s._spare.proc.kill()
        s._spare.proc.wait()
        r = s.exec(["cat", "a"])
        assert (r.exit_code, r.stdout, r.limits) == (0, "1", ())
        assert s.exec(["cat", "a"], last=True).stdout == "1" and s._spare is None


def test_the_next_spare_starts_later_but_not_for_a_closed_or_last_sandbox(cfg: SandboxConfig) -> None:
    import time

    from tandem.sandbox.base import SPARE_DELAY_S

    def spare_within(s, seconds: float):
        end = time.monotonic() + seconds
        while s._spare is None and time.monotonic() < end:
            time.sleep(0.01)
        return s._spare

    with create_sandbox({"a": "1"}, cfg) as s:
        first = s._spare
        assert first is not None
        assert s.exec(["cat", "a"]).stdout == "1"
        assert first.proc.returncode is not None  # the command ran in the launcher made at creation
        assert s._spare is None  # the next one is not started on the caller's thread...
        nxt = spare_within(s, 5.0)  # ...but shortly after, in the background
        assert nxt is not None and nxt.proc.poll() is None
        assert s.exec(["cat", "a"]).stdout == "1" and nxt.proc.returncode is not None
        assert s.exec(["cat", "a"], last=True).stdout == "1"  # the spare the previous exec scheduled is stale
        time.sleep(SPARE_DELAY_S + 0.3)
        assert s._spare is None
    s = create_sandbox({"a": "1"}, cfg)
    s.exec(["true"])
    s.close(wait=False)
    time.sleep(SPARE_DELAY_S + 0.3)
    assert s._spare is None
    drain_reaper()


def test_etc_holds_only_the_listed_files_read_only(cfg: SandboxConfig) -> None:
    from tandem.sandbox.bwrap import ETC_FILES

    present = sorted(n for n in ETC_FILES if os.path.exists(f"/etc/{n}"))
    with create_sandbox({"a": "1"}, cfg) as s:
        r = s.exec(["sh", "-c", "ls -A /etc; cat /etc/passwd; touch /etc/passwd /etc/new"])
        listed = r.stdout.split("\n")[: len(present)]
        assert listed == present, r.stdout
        assert Path("/etc/passwd").read_text() in r.stdout and r.exit_code != 0


@needs_overlay
def test_overlay_scratch_is_tmpfs_charged_to_the_memory_cgroup(tmp_path: Path) -> None:
    import tempfile

    from tandem.sandbox.base import TMPFS_SCRATCH, _writable_tmpfs
    from tandem.sandbox.limits import Cgroup

    probe = Cgroup(64, 16)
    has_memory = probe.has_memory
    probe.remove()
    if not (has_memory and _writable_tmpfs(TMPFS_SCRATCH)):
        pytest.skip("needs a cgroup v1 memory controller and a writable /dev/shm tmpfs")
    cfg = SandboxConfig(timeout_s=20.0, memory_mb=96, file_mb=64)
    with create_sandbox({"a.txt": "x\n"}, cfg) as sb:
        assert sb.mode == "overlay" and sb.scratch == TMPFS_SCRATCH
        assert sb.workdir.is_relative_to(TMPFS_SCRATCH)
        # What commands write lives in memory and counts against the sandbox's memory limit: 4 x 30 MB of
        # files in a 96 MB sandbox get the writer killed and reported, and the host keeps what fit.
        write = "import os\nfor i in range(4):\n    open(f'f{i}', 'wb').write(os.urandom(30 << 20))\n"
        r = sb.exec(["python3", "-c", write])
        assert r.exit_code != 0 and "memory" in r.limits, (r.exit_code, r.stderr[-300:], r.limits)
        kept = sum(p.stat().st_size for p in sb.workdir.glob("f*"))
        assert 0 < kept < 96 << 20
        root = sb.workdir.parent
    assert not root.exists() and mounts_under(root) == []
    disk = create_sandbox({"a.txt": "x\n"}, cfg.model_copy(update={"scratch": "disk"}))
    copy = create_sandbox({"a.txt": "x\n"}, cfg.model_copy(update={"workspace_mode": "copy"}))
    try:
        for sb in (disk, copy):
            assert sb.scratch is None and sb.workdir.is_relative_to(tempfile.gettempdir())
            assert sb.exec(["cat", "a.txt"]).stdout == "x\n"
    finally:
        disk.close()
        copy.close()


def test_scratch_tmpfs_refused_clearly_where_there_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.sandbox.base as base

    monkeypatch.setattr(base, "TMPFS_SCRATCH", Path("/nonexistent-tandem-tmpfs"))
    cfg = SandboxConfig(scratch="tmpfs", workspace_mode="auto")
    with pytest.raises(SandboxError, match="sandbox.scratch = 'tmpfs'.*set sandbox.scratch = 'disk'"):
        base.scratch_dir(cfg, "overlay", memory_capped=True)
    assert base.scratch_dir(cfg.model_copy(update={"scratch": "auto"}), "overlay", True) is None
    assert base.scratch_dir(cfg, "copy", True) is None  # copies always go to disk


def test_auto_scratch_leaves_the_tmpfs_reserve_to_other_programs() -> None:
    import tandem.sandbox.base as base

    if not base._writable_tmpfs(base.TMPFS_SCRATCH):
        pytest.skip("needs a writable /dev/shm tmpfs")
    st = os.statvfs(base.TMPFS_SCRATCH)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    small = SandboxConfig(scratch="auto", memory_mb=16)
    room = free - (16 << 20) >= base.TMPFS_RESERVE_FRAC * size
    assert base.scratch_dir(small, "overlay", True) == (base.TMPFS_SCRATCH if room else None)
    assert base.scratch_dir(small, "overlay", memory_capped=False) is None  # nothing would cap its writes
    # a sandbox whose memory limit could fill what is free goes to disk; an explicit "tmpfs" is obeyed
    big = small.model_copy(update={"memory_mb": free // (1 << 20) + 1})
    assert base.scratch_dir(big, "overlay", memory_capped=True) is None
    forced = big.model_copy(update={"scratch": "tmpfs"})
    assert base.scratch_dir(forced, "overlay", memory_capped=True) == base.TMPFS_SCRATCH


def test_hidden_paths_inside_mounts_look_empty_and_must_be_inside_one(tmp_path: Path) -> None:
    cfg = SandboxConfig(timeout_s=20.0)
    lib = tmp_path / "lib"
    (lib / "secret").mkdir(parents=True)
    (lib / "secret" / "answers.txt").write_text("42\n")
    (lib / "key.txt").write_text("k\n")
    (lib / "ok.txt").write_text("fine\n")
    hidden = [str(lib / "secret"), str(lib / "key.txt")]
    with create_sandbox({}, cfg, ro_mounts=[str(lib)], hidden=hidden) as s:
        secret, key = str(lib / "secret"), str(lib / "key.txt")
        code = f"import os; print(os.listdir({secret!r}), repr(open({key!r}).read()))"
        r = s.exec(["python3", "-c", code])
        assert r.stdout == "[] ''\n", r.stderr
        assert s.exec(["cat", str(lib / "ok.txt")]).stdout == "fine\n"
        assert s.exec(["sh", "-c", f"echo x > {lib / 'secret' / 'new'}"]).exit_code != 0  # read-only
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(SandboxError, match="inside one of the read-only mounts"):
        create_sandbox({}, cfg, ro_mounts=[str(lib)], hidden=[str(outside)])
