"""Resource limits of sandboxed commands: rlimits always, cgroup v1 memory, pids and CPU where available.

Invariants:
- Limits are applied by a tiny ``/bin/sh`` prelude that the sandbox runs *instead of* a Python ``preexec_fn``
  (which is unsafe in threaded parents): it joins the cgroups, sets the rlimits, then ``exec``s the command.
  So the command and everything it forks start inside the cgroups and under the rlimits; nothing runs
  before the limits are in place.
- One cgroup per controller (memory, pids, and cpu when ``cpus`` caps it: a CFS quota of ``cpus`` x the
  100 ms period, shared by all the sandbox's processes) per sandbox, created as a child of this process's
  own cgroup (so outer limits still apply), named ``tandem-<host>-<pid>-<n>``; :meth:`Cgroup.remove`
  kills what is left in it and removes it. Cgroups left behind by dead processes on this host are swept
  on first use.
- Missing or unwritable cgroup controllers are detected once and silently replaced by rlimits alone.
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import signal
import socket
import threading
import time
from pathlib import Path

from tandem.core.config import SandboxConfig
from tandem.core.procs import pid_alive

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1024 * 1024
NOFILE = 256
_counter = itertools.count()
_swept: set[Path] = set()
_lock = threading.Lock()


def _host_tag() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _own_cgroup_dir(controller: str) -> Path | None:
    """This process's cgroup v1 directory for ``controller``; None if there is none or it is read-only."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and controller in parts[1].split(","):
            d = CGROUP_ROOT / controller / parts[2].lstrip("/")
            if (d / "cgroup.procs").is_file() and os.access(d, os.W_OK):
                return d
    return None


def _kill_procs(d: Path, deadline_s: float = 2.0) -> None:
    """SIGKILL every process in cgroup dir ``d`` until it is empty (processes may fork while we kill)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > end:
            log.warning("processes %s in cgroup %s survived SIGKILL for %.1f s", pids, d, deadline_s)
            return
        time.sleep(0.002)


def _rmdir(d: Path, attempts: int = 50) -> bool:
    for _ in range(attempts):
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            _kill_procs(d, deadline_s=0.1)
            time.sleep(0.01)
    log.warning("could not remove cgroup %s; it will be swept by the next tandem process on this host", d)
    return False


def _sweep(parent: Path) -> None:
    """Remove cgroups of dead tandem processes on this host (left by crashes) under ``parent``, once."""
    with _lock:
        if parent in _swept:
            return
        _swept.add(parent)
    prefix = f"tandem-{_host_tag()}-"
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for d in entries:
        if not d.name.startswith(prefix):
            continue
        try:
            pid = int(d.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            _kill_procs(d)
            _rmdir(d, attempts=5)


CFS_PERIOD_US = 100_000
"""The CFS period a sandbox's CPU quota is counted in (the kernel's default)."""


class Cgroup:
    """Memory, pids and (with ``cpus``) cpu cgroups v1 for one sandbox; a controller the machine lacks is
    skipped."""

    def __init__(self, memory_mb: int, pids: int, cpus: float | None = None) -> None:
        name = f"tandem-{_host_tag()}-{os.getpid()}-{next(_counter)}"
        self.dirs: list[Path] = []
        controllers: list[tuple[str, list[tuple[str, int]]]] = [
            (
                "memory",
                [
                    ("memory.limit_in_bytes", memory_mb * MIB),
                    ("memory.memsw.limit_in_bytes", memory_mb * MIB),
                ],
            ),
            ("pids", [("pids.max", pids)]),
        ]
        if cpus is not None:  # the quota first: it is this controller's limit (the period is the default)
            quota = max(1000, round(cpus * CFS_PERIOD_US))  # the kernel's smallest quota is 1 ms
            controllers.append(("cpu", [("cpu.cfs_quota_us", quota), ("cpu.cfs_period_us", CFS_PERIOD_US)]))
        for controller, settings in controllers:
            parent = _own_cgroup_dir(controller)
            if parent is None:
                continue
            _sweep(parent)
            d = parent / name
            try:
                d.mkdir()
            except OSError as e:
                log.debug("cgroup %s unavailable (%s); relying on rlimits", controller, e)
                continue
            self.dirs.append(d)
            for i, (key, value) in enumerate(settings):
                try:
                    (d / key).write_text(str(value))
                except OSError as e:
                    if i == 0:  # the main limit of this controller failed: do not pretend it is limited
                        log.debug("cannot set %s in %s (%s); relying on rlimits", key, d, e)
                        _rmdir(d)
                        self.dirs.remove(d)
                        break
        self.has_pids = any(d.is_relative_to(CGROUP_ROOT / "pids") for d in self.dirs)
        self.has_memory = any(d.is_relative_to(CGROUP_ROOT / "memory") for d in self.dirs)
        self.has_cpu = any(d.is_relative_to(CGROUP_ROOT / "cpu") for d in self.dirs)

    def join_script(self) -> str:
        """Shell lines that move the current shell (``$$``) into every cgroup of this sandbox."""
        return "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))} || exit 125\n" for d in self.dirs)

    def pids(self) -> list[int]:
        """Pids currently in this sandbox's cgroups (empty without cgroups)."""
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def counters(self) -> dict[str, int]:
        """Cumulative limit counters: ``oom_kill``, ``mem_failcnt``, ``pids_max`` (refused forks) and
        ``cpu_throttled`` (CFS periods in which the CPU quota held the sandbox back)."""
        out: dict[str, int] = {}
        for d in self.dirs:
            for fname, key, prefix in (
                ("memory.oom_control", "oom_kill", "oom_kill "),
                ("pids.events", "pids_max", "max "),
                ("cpu.stat", "cpu_throttled", "nr_throttled "),
            ):
                try:
                    for line in (d / fname).read_text().splitlines():
                        if line.startswith(prefix):
                            out[key] = int(line.split()[1])
                except (OSError, ValueError, IndexError):
                    pass
            try:
                out["mem_failcnt"] = int((d / "memory.failcnt").read_text())
            except (OSError, ValueError):
                pass
        return out

    def kill_all(self) -> None:
        for d in self.dirs:
            _kill_procs(d)

    def remove(self) -> None:
        for d in self.dirs:
            _kill_procs(d)
            _rmdir(d)
        self.dirs = []


def agent_uid(config: SandboxConfig) -> int | None:
    """The uid a sandbox's commands run as: ``config.uid`` for the bwrap backend when tandem is root and the
    uid is not 0, else None (this process's own uid)."""
    if config.backend == "bwrap" and os.geteuid() == 0 and config.uid != 0:
        return config.uid
    return None


def _uid_process_count(uid: int) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def rlimit_script(config: SandboxConfig, use_nproc: bool, uid: int | None = None, shell: str = "sh") -> str:
    """Shell lines setting the rlimits of ``config`` (``ulimit``: one limit per call; ``shell`` is ``sh``
    (dash: -f in 512 B blocks, -p processes) or ``bash`` (-f in 1 KiB blocks, -u processes)).

    ``uid`` is the uid the command will run as (None: this process's). RLIMIT_NPROC counts every process of
    that uid on the host, and root is exempt from it, so it is only used without a pids cgroup and for a
    non-root uid, set to ``pids`` above the uid's current count.
    """
    uid = os.getuid() if uid is None else uid
    lines = [
        "ulimit -c 0",
        f"ulimit -n {NOFILE}",
        f"ulimit -f {config.file_mb * (1024 if shell == 'bash' else 2048)}",
        f"ulimit -S -t {config.cpu_s}",
        f"ulimit -H -t {config.cpu_s + 1}",  # SIGXCPU at the soft limit, SIGKILL one second later
        f"ulimit -v {config.memory_mb * 1024}",
    ]
    if use_nproc and uid != 0:
        flag = "-u" if shell == "bash" else "-p"
        lines.append(f"ulimit {flag} {_uid_process_count(uid) + config.pids}")
    return "".join(f"{line} || exit 125\n" for line in lines)
