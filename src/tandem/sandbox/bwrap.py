"""Bubblewrap backend: the command runs in fresh namespaces on a read-only view of the system.

Invariants of the sandbox a command sees (``bwrap`` 0.8 flags, built once per sandbox):
- ``--unshare-all``: own user, pid, net (loopback only, no route out), ipc, uts and cgroup namespaces;
  ``--die-with-parent`` and the pid namespace make every process die with the sandbox's ``bwrap``.
- ``--cap-drop ALL`` and ``--new-session`` (no capabilities, no TIOCSTI into the caller's terminal).
- Nothing inside the sandbox that reports on a command can be traced by it: pid 1 is the wrapper that runs
  the command and reports its exit status and leftover processes, and it runs ``INIT``, an execute-only
  copy of ``/bin/sh`` (mode 0111), so the kernel makes it non-dumpable: a command of the same uid can
  neither ``ptrace`` it nor open its ``/proc/1/mem`` or ``/proc/1/fd`` (a solution that traced bwrap's
  init or a dumpable wrapper could rewrite the grader's exit status and stdout: a forged full pass), nor
  kill it (signals from inside a pid namespace do not reach its init). bwrap itself stays outside
  (``--as-pid-1``).
- Run as root, tandem starts ``bwrap`` through ``setpriv`` as the unprivileged ``SandboxConfig.uid`` (no
  supplementary groups, no capabilities; the cgroups and rlimits are set before the switch), so a command
  is not root inside the sandbox nor outside it. Without root, commands run as tandem's uid. (``setpriv``
  rather than ``Popen(user=...)``: the latter makes CPython fork instead of vfork, and a fork of a large
  trainer process costs more in page faults than ``setpriv`` does.)
- Read-only: ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links or dirs), ``/etc`` holding only a short
  list of files programs need (no secrets; a copy tandem takes, see :func:`etc_copy`), and the host's base
  CPython prefix (``sys.base_prefix``) at its own path when the command's uid can reach it; otherwise (e.g.
  pyenv under a private ``/root``) ``python3`` is the system's ``/usr/bin/python3``, and a machine without
  one gets a :class:`SandboxError` saying what to do.
  Nothing else of the host is visible: not ``/root``, ``/work``, ``/home``, the venv, or ``/sys``.
- Read-only mounts (``ro_mounts``, e.g. an external harness's libraries) at their own paths; ``hidden`` paths
  inside them show an empty read-only directory or file bound over them, after every mount.
- The root (bwrap's tmpfs holding the mount points) is remounted read-only.
- Writable: ``/workspace`` (the private copy, also the cwd and ``HOME``) and a fresh ``/tmp`` tmpfs of at most
  ``memory_mb`` (its pages also count against the memory cgroup);
  fresh ``/proc`` and ``/dev``.
- Clean environment: PATH (python prefix first, so ``python3``/``python`` are the base CPython), HOME,
  LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE=1, PYTHONHASHSEED=0.
- Cost: every bind bwrap makes re-reads the whole ``/proc/self/mountinfo`` (every mount of the host,
  including each live sandbox's overlay), so the flags keep binds few: one for ``/etc`` instead of one per
  file. The flags that do not depend on the sandbox are computed once per (uid, tmp size, ``/etc`` copy).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox.base import Sandbox
from tandem.sandbox.forward import SANDBOX_DIR, SANDBOX_PORT, launcher_argv
from tandem.sandbox.limits import _host_tag, agent_uid
from tandem.sandbox.overlay import bind_readonly

WORKSPACE = "/workspace"
ETC_FILES = (
    "alternatives",
    "group",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "nsswitch.conf",
    "passwd",
)
"""/etc entries the sandbox's ``/etc`` holds when present: enough for the dynamic loader, user names, time
zones."""
_etc_lock = threading.Lock()
_etc_copies: dict[tuple[tuple[str, int, int, int, int], ...], Path] = {}


INIT_NAME = "tandem-init"
"""An execute-only copy of the host's ``/bin/sh`` in the ``/etc`` copy: the sandbox's pid 1 (``_argv``)."""
INIT = f"/etc/{INIT_NAME}"


def _etc_key() -> tuple[tuple[str, int, int, int, int], ...]:
    key = []
    for name in ETC_FILES:
        try:
            st = os.stat(f"/etc/{name}")  # follows symlinks, as a bind of the path would
        except OSError:
            continue
        key.append((name, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    st = os.stat("/bin/sh")
    key.append((INIT_NAME, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(key)


def remove_etc_copies() -> None:
    """Delete this process's ``/etc`` copies (at exit, or by ``cleanup.release_now``)."""
    with _etc_lock:
        for d in _etc_copies.values():
            if f"-{os.getpid()}-etc-" in d.name:  # not a parent's, in a forked child that exits
                shutil.rmtree(d, ignore_errors=True)
        _etc_copies.clear()


def etc_copy() -> Path:
    """A directory holding a copy of the ``ETC_FILES`` present on the host (files by content, directories
    with their symlinks), bound read-only as the sandbox's ``/etc`` (one bind instead of one per file).

    It is private to this process (``tandem-sbx-<host>-<pid>-etc-*`` in the temp dir, readable by all, written
    only by this process's uid), taken again when an entry's device, inode, mtime or size changes (older
    copies stay while sandboxes may still bind them), removed at exit, and swept like sandbox directories if
    the process dies."""
    key = _etc_key()
    with _etc_lock:
        d = _etc_copies.get(key)
        if d is not None and d.is_dir():
            return d
        tag = hashlib.sha256(repr(key).encode()).hexdigest()[:8]
        d = Path(tempfile.mkdtemp(prefix=f"tandem-sbx-{_host_tag()}-{os.getpid()}-etc-{tag}-"))
        try:
            for name, *_ in key:
                if name == INIT_NAME:
                    shutil.copyfile("/bin/sh", d / name)
                    os.chmod(d / name, 0o111)  # execute-only: its processes are not dumpable (see _argv)
                    continue
                src, dst = Path("/etc") / name, d / name
                if src.is_dir():
                    shutil.copytree(src, dst, symlinks=True)
                else:
                    shutil.copy2(src, dst)
            os.chmod(d, 0o755)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        if not _etc_copies:
            atexit.register(remove_etc_copies)
        _etc_copies[key] = d
        return d


SYSTEM_PYTHON = Path("/usr/bin/python3")
PYTHON_ALIAS_DIR = "/tandem/bin"
"""Holds a ``python`` -> ``/usr/bin/python3`` link (first on PATH) when commands use the system Python."""


def python_prefix() -> Path:
    """The host's base CPython installation (not a venv), bound read-only at the same path."""
    return Path(os.path.realpath(sys.base_prefix))


def _world_reachable(path: Path) -> bool:
    """True when any uid can traverse to ``path`` (every directory on the way is world-executable)."""
    for p in (path, *path.parents):
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


@functools.cache
def sandbox_python(uid: int | None) -> Path | None:
    """The Python prefix to bind for commands running as ``uid``: the host's base prefix, or None when they
    use the system's ``/usr/bin/python3`` (the prefix is private to another uid). Raises when neither
    works. Decided once per uid."""
    prefix = python_prefix()
    if uid is None or _world_reachable(prefix / "bin" / "python3"):
        return prefix
    if SYSTEM_PYTHON.exists():
        return None
    raise SandboxError(
        f"sandboxed commands run as uid {uid}, which cannot reach the host Python under {prefix} (a parent "
        "directory is private), and there is no /usr/bin/python3. Install the system Python "
        "(apt-get install python3) or set sandbox.uid = 0 to run commands as root"
    )


def sandbox_env(home: str, prefix: Path | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed command (both backends); ``prefix``: the Python to put first."""
    head = f"{prefix}/bin:" if prefix is not None else f"{PYTHON_ALIAS_DIR}:"
    return {
        "PATH": f"{head}/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def bwrap_args(workdir: Path, tmp_mb: int = 64, uid: int | None = None) -> list[str]:
    """The argv prefix for a sandbox whose workspace is ``workdir``, run as ``uid``; the command follows."""
    head, tail = _static_args(tmp_mb, uid, etc_copy())
    return [*head, "--bind", str(workdir), WORKSPACE, *tail]


@functools.cache
def _static_args(tmp_mb: int, uid: int | None, etc: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The flags before and after the workspace bind, which do not depend on the sandbox."""
    args: list[str] = []
    if uid is not None:
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        args += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    args += [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    args += ["--as-pid-1"]  # no bwrap process inside: the wrapper (INIT) is pid 1, see BwrapSandbox._argv
    args += ["--cap-drop", "ALL"]
    args += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    args += ["--ro-bind", str(etc), "/etc"]
    prefix = sandbox_python(uid)
    if prefix is None:  # `python` is the system python3, as with Debian's python-is-python3
        args += ["--symlink", str(SYSTEM_PYTHON), f"{PYTHON_ALIAS_DIR}/python"]
    elif not prefix.is_relative_to("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    args += ["--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    tail = ["--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv"]
    for key, value in sandbox_env(WORKSPACE, prefix).items():
        tail += ["--setenv", key, value]
    return tuple(args), (*tail, "--")


LEFTOVER_WRAPPER = 'rc=0; "$@" 3>&- || rc=$?; set -- /proc/[0-9]*; echo "leftover $(($# - 1))" >&3; exit $rc'
"""Run by ``INIT`` as pid 1 of the sandbox's pid namespace (``--as-pid-1``: no bwrap process inside): runs
the command as pid 2 without the status fd (reaping any orphan meanwhile, as its foreground wait takes
every child), then reports on fd 3 how many other processes are still alive in the namespace, and exits
with the command's status (128+N when a signal killed it); its exit ends the namespace."""


def _unsearchable_temp_dir(uid: int) -> str | None:
    """The reason ``uid`` cannot reach the temp dir (where sandboxes and their /etc copy live), or None.
    Checks each ancestor's search bit as the kernel would for the sandbox's user, which runs with gid ``uid``
    and no other groups (``bwrap_args``)."""
    tmp = Path(tempfile.gettempdir()).resolve()
    for d in [tmp, *tmp.parents]:
        st = d.stat()
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == uid else stat.S_IXOTH
        if not st.st_mode & bit:
            return (
                f"the temp dir {str(tmp)!r} is not searchable by the sandbox's user (uid {uid}): "
                f"{str(d)!r} has mode {stat.S_IMODE(st.st_mode):o}; set TMPDIR to a directory it can reach "
                f"(such as /tmp) or allow it (chmod o+x {str(d)!r})"
            )
    return None


@functools.cache
def _probe(uid: int | None = None) -> str | None:
    """None when bwrap works here with our flags (run as ``uid``), else the reason it does not."""
    if shutil.which("bwrap") is None:
        return "`bwrap` is not on PATH (install the bubblewrap package)"
    if uid is not None and shutil.which("setpriv") is None:
        return "`setpriv` (util-linux) is not on PATH; install util-linux or set sandbox.uid = 0"
    if uid is not None and (reason := _unsearchable_temp_dir(uid)):
        return reason
    with tempfile.TemporaryDirectory(prefix="tandem-bwrap-probe-") as d:
        if uid is not None:
            os.chown(d, uid, uid)
        try:
            r = subprocess.run(
                [*bwrap_args(Path(d), uid=uid), "true"],
                capture_output=True,
                timeout=30,
                env={"PATH": "/usr/bin:/bin"},
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"running bwrap failed: {e}"
    if r.returncode != 0:
        return f"bwrap exited with {r.returncode}: {r.stderr.decode(errors='replace').strip()}"
    return None


def bwrap_available(config: SandboxConfig | None = None) -> bool:
    """True when bubblewrap is installed and works with ``config``'s uid (default config; checked once)."""
    return _probe(agent_uid((config or SandboxConfig()).model_copy(update={"backend": "bwrap"}))) is None


def _inside_any(path: str, roots: list[str]) -> bool:
    p = os.path.normpath(path)
    return any(p == os.path.normpath(r) or p.startswith(os.path.normpath(r).rstrip("/") + "/") for r in roots)


class BwrapSandbox(Sandbox):
    """Commands run under bubblewrap with the workspace copy mounted read-write at ``/workspace``."""

    backend = "bwrap"

    def __init__(
        self,
        workspace: dict[str, str] | Path,
        config: SandboxConfig,
        gateway: str | None = None,
        ro_mounts: list[str] | None = None,
        hidden: list[str] | None = None,
    ) -> None:
        reason = _probe(agent_uid(config))
        for m in ro_mounts or []:
            if not os.path.isabs(m) or not os.path.exists(m):
                raise SandboxError(f"read-only mount {m!r} must be an existing absolute host path")
        for h in hidden or []:
            if not os.path.isabs(h) or not os.path.exists(h) or not _inside_any(h, ro_mounts or []):
                raise SandboxError(
                    f"hidden path {h!r} must be an existing absolute host path inside one of the read-only "
                    f"mounts {ro_mounts or []}"
                )
        if reason is not None:
            raise SandboxError(
                f"the bwrap sandbox backend is not usable: {reason}. Fix that (bubblewrap must be "
                "installed and user namespaces allowed), or set sandbox.backend = 'plain' to opt into "
                "unisolated execution"
            )
        super().__init__(workspace, config, gateway)
        self._prefix = bwrap_args(self.workdir, tmp_mb=config.memory_mb, uid=self.owner)
        if gateway is not None:  # the forwarder's socket directory: the sandbox's one way out
            at = self._prefix.index("--remount-ro")
            self._prefix[at:at] = ["--ro-bind", str(self._root / "run"), SANDBOX_DIR]
        try:
            for i, m in enumerate(ro_mounts or []):
                source = m
                if self.owner is not None and not _world_reachable(Path(m)):
                    # the agent uid cannot reach it (e.g. under a private /root): root binds it into the
                    # sandbox's own directory first, and bwrap takes it from there
                    stage = self._root / "mounts" / str(i)
                    stage.parent.mkdir(exist_ok=True)
                    if os.path.isdir(m):
                        stage.mkdir()
                    else:
                        stage.touch()
                    bind_readonly(Path(m), stage)
                    self._mounts.append(stage)
                    os.chown(stage.parent, self.owner, self.owner)
                    source = str(stage)
                at = self._prefix.index("--remount-ro")
                self._prefix[at:at] = ["--ro-bind", source, m]
            for h in hidden or []:  # after every mount, so the empty binds cover what those show
                at = self._prefix.index("--remount-ro")
                self._prefix[at:at] = ["--ro-bind", self._empty(os.path.isdir(h)), h]
        except BaseException:
            self.close()
            raise

    def _empty(self, directory: bool) -> str:
        """An empty read-only directory (or file) in the sandbox's own directory, reachable by its uid: what
        a hidden path shows."""
        path = self._root / "mounts" / ("empty-dir" if directory else "empty-file")
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            if directory:
                path.mkdir()
            else:
                path.touch()
            path.chmod(0o555 if directory else 0o444)
            if self.owner is not None:
                os.chown(path.parent, self.owner, self.owner)
        return str(path)

    reports_leftovers = True

    def _argv(self, cmd: list[str], env: dict[str, str]) -> list[str]:
        setenv = [arg for key, value in env.items() for arg in ("--setenv", key, value)]
        return [*self._prefix[:-1], *setenv, "--", INIT, "-c", LEFTOVER_WRAPPER, "tandem-exec", *cmd]

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin"}  # only bwrap itself sees this; --clearenv builds the command's env

    def gateway_url(self) -> str:
        path = urlparse(super().gateway_url()).path.rstrip("/")
        return f"http://127.0.0.1:{SANDBOX_PORT}{path}"

    def with_gateway(self, cmd: list[str]) -> list[str]:
        self.gateway_url()
        return launcher_argv(list(cmd))
