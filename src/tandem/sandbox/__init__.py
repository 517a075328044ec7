"""Isolated command execution for agent tools and reward tests.

``create_sandbox(workspace, config)`` gives a private view of the workspace (a dict of files, a
directory, or a :class:`WorkspaceTemplate` of either): a copy-on-write overlay over a shared read-only
layer where overlays can be mounted (root), else a copy; it returns a :class:`Sandbox` whose ``exec`` runs
commands there under limits. :class:`SandboxPool` keeps ready sandboxes of one workspace so that start
latency is hidden.

Invariants:
- The original workspace is never modified; every sandbox works on its own copy (``Sandbox.workdir``).
- ``bwrap`` (default): commands run as the unprivileged ``SandboxConfig.uid`` when tandem is root; no
  network, read-only system, only ``/workspace`` (the copy) and a fresh ``/tmp``
  writable, nothing of the host's home or project directories visible, clean environment, ``python3`` is the
  host's base CPython. ``plain`` is unisolated and exists only as an explicit opt-in that warns.
- Limits on every command: address space, CPU time, file size and open files (rlimits), and cgroup v1 memory
  and pids limits where the machine has them; a wall-clock timeout kills the whole process tree and yields
  exit status 124. Output is capped per stream with a visible marker.
- Disk: what a sandbox on disk scratch (and every copy-mode workspace) can write is capped at
  ``SandboxConfig.disk_mb`` by a filesystem of its own where tandem runs as root (``tandem.sandbox.disk``);
  an exec that leaves it full raises :class:`SandboxDiskFull`. Tmpfs scratch is capped by the memory cgroup.
- Nothing outlives an ``exec``; ``close()`` (idempotent, also run at garbage collection and interpreter
  exit) removes the workdir, its mounts and the cgroups. A process removes everything it made when it exits,
  also after Ctrl-C, and after SIGTERM or SIGHUP once it has made a sandbox on its main thread
  (:func:`exit_on_signals`, ``tandem.sandbox.cleanup``). Leftovers of killed processes are swept on the next
  start (only those of dead processes).
- ``read``/``write`` only touch files inside the workspace; escapes raise ``SandboxError``.
"""

from tandem.sandbox.base import LIMIT_NAMES, ExecResult, Sandbox
from tandem.sandbox.bwrap import BwrapSandbox, bwrap_available
from tandem.sandbox.cleanup import exit_on_signals
from tandem.sandbox.disk import SandboxDiskFull
from tandem.sandbox.factory import create_sandbox
from tandem.sandbox.layers import WorkspaceTemplate
from tandem.sandbox.plain import PlainSandbox
from tandem.sandbox.pool import SandboxPool
from tandem.sandbox.reaper import drain_reaper

__all__ = [
    "LIMIT_NAMES",
    "BwrapSandbox",
    "ExecResult",
    "PlainSandbox",
    "Sandbox",
    "SandboxDiskFull",
    "SandboxPool",
    "WorkspaceTemplate",
    "bwrap_available",
    "create_sandbox",
    "drain_reaper",
    "exit_on_signals",
]
