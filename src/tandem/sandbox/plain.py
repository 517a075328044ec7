"""Plain-process backend: NO isolation (host filesystem and network are reachable). Explicit opt-in only.

Invariants: it exists for machines without bubblewrap and for debugging; the first one created in a
process logs a warning through ``logging`` and prints it on stderr (unless logging already prints it
there). Limits still apply: rlimits, cgroups where available, a clean environment (same as bwrap's, with
HOME = the workdir), cwd = the private workspace copy, and the whole process tree (process group, plus the
cgroup when present) is killed at exit or timeout.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tandem.core.config import SandboxConfig
from tandem.sandbox.base import Sandbox
from tandem.sandbox.bwrap import python_prefix, sandbox_env

log = logging.getLogger(__name__)
WARNING = (
    "tandem sandbox backend 'plain' runs commands WITHOUT isolation: they can read and write the host "
    "filesystem and use the network. Use backend 'bwrap' for anything untrusted."
)
_warned = False


def warn_plain() -> None:
    """Warn (logging + stderr) that the plain backend is unisolated, once per process."""
    global _warned
    if _warned:
        return
    _warned = True
    log.warning(WARNING)
    if log.hasHandlers():  # otherwise logging's last-resort handler has just printed it on stderr
        print(f"WARNING: {WARNING}", file=sys.stderr, flush=True)


class PlainSandbox(Sandbox):
    """Commands run as ordinary child processes in the workspace copy (opt-in; see module docstring)."""

    backend = "plain"

    def __init__(
        self,
        workspace: dict[str, str] | Path,
        config: SandboxConfig,
        gateway: str | None = None,
        ro_mounts: list[str] | None = None,
        hidden: list[str] | None = None,
    ) -> None:
        warn_plain()
        super().__init__(workspace, config, gateway)
        self._environ = sandbox_env(str(self.workdir), python_prefix())

    def _argv(self, cmd: list[str], env: dict[str, str]) -> list[str]:
        return cmd

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        return {**self._environ, **env}
