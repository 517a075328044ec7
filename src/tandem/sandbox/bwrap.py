"""Bubblewrap backend: the command runs in fresh namespaces on a read-only view of the system.

Invariants of the sandbox a command sees (``bwrap`` 0.8 flags, built once per sandbox):
- ``--unshare-all``: own user, pid, net (loopback only, no route out), ipc, uts and cgroup namespaces;
  ``--die-with-parent`` and the pid namespace make every process die with the sandbox's ``bwrap``.
- ``--cap-drop ALL`` and ``--new-session`` (no capabilities, no TIOCSTI into the caller's terminal).
- Read-only: ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links or dirs), a short list of ``/etc``
  files programs need (no secrets), and the host's base CPython prefix (``sys.base_prefix``) at its own path.
  Nothing else of the host is visible: not ``/root``, ``/work``, ``/home``, the venv, or ``/sys``.
- The root (bwrap's tmpfs holding the mount points, with ``/etc`` etc.) is remounted read-only.
- Writable: ``/workspace`` (the private copy, also the cwd and ``HOME``) and a fresh ``/tmp`` tmpfs of at most
  ``memory_mb`` (its pages also count against the memory cgroup);
  fresh ``/proc`` and ``/dev``.
- Clean environment: PATH (python prefix first, so ``python3``/``python`` are the base CPython), HOME,
  LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE=1, PYTHONHASHSEED=0.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox.base import Sandbox

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
"""/etc entries bound read-only when present: enough for the dynamic loader, user names, time zones."""


def python_prefix() -> Path:
    """The host's base CPython installation (not a venv), bound read-only at the same path."""
    return Path(os.path.realpath(sys.base_prefix))


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a sandboxed command (both backends)."""
    return {
        "PATH": f"{python_prefix()}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def bwrap_args(workdir: Path, tmp_mb: int = 64) -> list[str]:
    """The bwrap argv prefix for a sandbox whose workspace copy is ``workdir``; the command follows it."""
    bwrap = shutil.which("bwrap") or "bwrap"
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    args += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    prefix = python_prefix()
    if not prefix.is_relative_to("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    args += ["--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    args += ["--bind", str(workdir), WORKSPACE, "--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv"]
    for key, value in sandbox_env(WORKSPACE).items():
        args += ["--setenv", key, value]
    return [*args, "--"]


@functools.cache
def _probe() -> str | None:
    """None when bwrap works here with our flags, else the reason it does not."""
    if shutil.which("bwrap") is None:
        return "`bwrap` is not on PATH (install the bubblewrap package)"
    with tempfile.TemporaryDirectory(prefix="tandem-bwrap-probe-") as d:
        try:
            r = subprocess.run(
                [*bwrap_args(Path(d)), "true"], capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"}
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"running bwrap failed: {e}"
    if r.returncode != 0:
        return f"bwrap exited with {r.returncode}: {r.stderr.decode(errors='replace').strip()}"
    return None


def bwrap_available() -> bool:
    """True when bubblewrap is installed and can create the namespaces this backend needs (checked once)."""
    return _probe() is None


class BwrapSandbox(Sandbox):
    """Commands run under bubblewrap with the workspace copy mounted read-write at ``/workspace``."""

    backend = "bwrap"

    def __init__(self, workspace: dict[str, str] | Path, config: SandboxConfig) -> None:
        reason = _probe()
        if reason is not None:
            raise SandboxError(
                f"the bwrap sandbox backend is not usable: {reason}. Install bubblewrap (and allow user "
                "namespaces), or set sandbox.backend = 'plain' to opt into unisolated execution"
            )
        super().__init__(workspace, config)
        self._prefix = bwrap_args(self.workdir, tmp_mb=config.memory_mb)

    def _argv(self, cmd: list[str]) -> list[str]:
        return [*self._prefix, *cmd]

    def _env(self) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin"}  # only bwrap itself sees this; --clearenv builds the command's env
