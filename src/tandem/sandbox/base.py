"""The sandbox base class: private workspace copy, limited command execution, safe file access.

Invariants:
- ``workdir`` is a fresh private view of the workspace given at creation, which is never touched again:
  with ``workspace_mode`` overlay, a kernel overlayfs whose lower layer is a read-only copy shared by every
  sandbox of the same workspace (``tandem.sandbox.layers``) and whose upper layer is private, so creating a
  sandbox costs the same for 1 MB and 100 MB; with copy, a private copy. :meth:`Sandbox.close` (also run by a
  finalizer and at interpreter exit) kills every process of the sandbox, removes its cgroups, unmounts the
  overlay, deletes its private directory and releases the layer; it is idempotent, and whatever it has not
  done when the process exits is done then (``tandem.sandbox.cleanup``). The private directory
  of an overlay sandbox is on tmpfs (``/dev/shm``) when ``SandboxConfig.scratch`` allows it (``auto``: only
  with a memory cgroup, which tmpfs pages written by commands are charged to, and while the tmpfs keeps its
  reserve free, see ``scratch_dir``), else in the temp dir. There (and for every copy-mode workspace), what
  commands can write (the overlay's upper layer, or the copy) lives in a filesystem of ``disk_mb`` of its
  own where tandem can mount one (root; ``tandem.sandbox.disk``), so no command writes more to the host's
  disk: when an exec or :meth:`Sandbox.write` leaves it full, they raise :class:`SandboxDiskFull` (the
  sandbox stays usable once files are removed). A command that filled it and freed the room again before
  it ended (such as files it unlinked while open) is not reported; the cap held all the same.
- When the backend runs commands as an unprivileged agent uid (bwrap as root), every file of ``workdir``
  (and each file :meth:`write` creates) belongs to that uid, so the agent can edit what it was given.
- :meth:`Sandbox.exec` runs one command at a time per sandbox (a lock serializes exec/read/write/snapshot).
  The command starts in a new session, inside the sandbox's cgroups and under its rlimits (see ``limits``),
  either from the sandbox's spare launcher (already in the cgroups, under the rlimits, waiting for a command)
  or, when there is none, through the same prelude started on the spot.
  When it exits, whatever it left running is killed; at the timeout the whole tree is killed and the result
  is exit status 124 with ``timed_out=True`` and a note on stderr. Nothing survives an ``exec`` call (the
  next spare launcher, started later by tandem itself, runs no command until the next ``exec`` hands it
  one). The cgroup's limit counters are read once per exec, after it (the reading before a command is the
  previous exec's: nothing of the sandbox runs in between but an idle launcher).
- Each of stdout and stderr keeps at most ``max_output_bytes``; the rest is drained and dropped, and a
  visible marker line is appended. Output is decoded as UTF-8 with replacement characters. A command that
  writes more than ``output_flood_bytes(cap)`` beyond what is kept is killed there (limit ``output``, a note
  on stderr): draining a flood for the whole timeout had cost the host about half a core.
- ``read``/``write`` accept only relative paths that stay inside the workspace after resolving symlinks;
  anything else raises :class:`SandboxError` naming the path.
"""

from __future__ import annotations

import errno
import functools
import heapq
import itertools
import os
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from tandem.core.config import SANDBOX_MAX_TIMEOUT_S, SandboxConfig
from tandem.core.errors import SandboxError
from tandem.core.procs import pid_alive
from tandem.sandbox.cleanup import Resources, exit_on_signals, exiting, rmtree
from tandem.sandbox.disk import (
    MOUNT_NAME,
    NO_SPACE,
    CappedDisk,
    SandboxDiskFull,
    disk_cap_unavailable_reason,
    warn_uncapped,
)
from tandem.sandbox.forward import SocketForwarder
from tandem.sandbox.layers import WorkspaceTemplate, check_not_inside, check_relpath, layer_cache
from tandem.sandbox.limits import MIB, Cgroup, _host_tag, agent_uid, rlimit_script
from tandem.sandbox.overlay import mount_overlay, mounts_under, overlay_unavailable_reason, unmount
from tandem.sandbox.reaper import reap_later

TIMEOUT_EXIT = 124
SNAPSHOT_MAX_BYTES = 16 * MIB
SNAPSHOT_MAX_ENTRIES = 10_000
"""Most files and directories a snapshot visits (a task workspace holds a few dozen): past it the walk stops.
A probe's workspace of a million hard links to one empty file (they cost the memory cgroup almost nothing)
took 22.6 s to snapshot and 176 s to grade."""
SNAPSHOT_MAX_DEPTH = 64
"""Deepest directory level a snapshot enters (a probe nested 1100 directories; ``os.walk`` recursed past
Python's limit and the rollout's whole group failed)."""
"""Total bytes :meth:`Sandbox.snapshot` returns at most; files past it (in sorted order) are left out."""
_GRACE_S = 1.0  # how long pipes are drained after the command ended or was killed
_CHUNK = 65536
OUTPUT_FLOOD_MIN_BYTES = 64 * MIB


def output_flood_bytes(cap: int) -> int:
    """Output dropped past ``max_output_bytes`` (both streams together) at which a command is killed: no
    grader or tool needs this much, and draining it costs host CPU outside every sandbox limit."""
    return max(OUTPUT_FLOOD_MIN_BYTES, 64 * cap)


_swept_tmp = False


@dataclass
class ExecResult:
    exit_code: int
    """Exit status; 128+N when killed by signal N; 124 on timeout."""
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    """Output was cut at ``max_output_bytes`` (a visible marker line is appended)."""
    duration_s: float
    limits: tuple[str, ...] = ()
    """Limits the command ran into, among ``LIMIT_NAMES`` (see :func:`limits_hit`)."""


LIMIT_NAMES = ("timeout", "output", "memory", "pids", "cpu", "file_size", "leftover_processes")
"""What :attr:`ExecResult.limits` may name: the wall-clock timeout, the output cap, the memory limit (an OOM
kill in the memory cgroup, or Python's MemoryError under the address-space rlimit), the pids limit (a fork
refused by the pids cgroup), the CPU-time rlimit (SIGXCPU), the file-size rlimit (SIGXFSZ or EFBIG), and
processes still running when the command exited (they are killed; detected inside bwrap's pid namespace, or
in the sandbox's cgroup for the plain backend)."""


def limits_hit(
    code: int,
    output: str,
    timed_out: bool,
    truncated: bool,
    before: dict[str, int],
    after: dict[str, int],
    leftovers: int,
) -> tuple[str, ...]:
    """Names of the limits an exec ran into, from its status, its output (stdout and stderr: a grader may
    report its child's MemoryError on stdout) and the cgroup counters' deltas."""

    def grew(key: str) -> bool:
        return after.get(key, 0) > before.get(key, 0)

    hit = {
        "timeout": timed_out,
        "output": truncated,
        "memory": grew("oom_kill")
        or (grew("mem_failcnt") and code == 128 + signal.SIGKILL)
        or "MemoryError" in output,
        "pids": grew("pids_max"),
        "cpu": code == 128 + signal.SIGXCPU,
        "file_size": code == 128 + signal.SIGXFSZ
        or "File too large" in output
        or "File size limit exceeded" in output,
        "leftover_processes": leftovers > 0,
    }
    return tuple(name for name in LIMIT_NAMES if hit[name])


TMPFS_SCRATCH = Path("/dev/shm")
"""The tmpfs a sandbox's private directory goes to when ``SandboxConfig.scratch`` picks tmpfs."""


@functools.cache
def _writable_tmpfs(path: Path) -> bool:
    """Whether ``path`` is the mount point of a tmpfs this process may create directories in."""
    try:
        with open("/proc/self/mounts") as f:
            mounted = any(
                len(parts) > 2 and parts[1] == str(path) and parts[2] == "tmpfs"
                for parts in (line.split() for line in f)
            )
    except OSError:
        return False
    return mounted and os.access(path, os.W_OK | os.X_OK)


TMPFS_RESERVE_FRAC = 0.5
"""``auto`` puts a sandbox on the tmpfs only while, after the sandbox's own ``memory_mb``, at least this
fraction of the tmpfs stays free: other programs use ``/dev/shm`` too (Ray's object store among them), and
sandboxes must not crowd them out."""


def _tmpfs_room(path: Path, need_bytes: int) -> bool:
    """Whether ``path``'s filesystem has ``need_bytes`` free beyond ``TMPFS_RESERVE_FRAC`` of its size."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - need_bytes >= TMPFS_RESERVE_FRAC * st.f_blocks * st.f_frsize


def scratch_dir(config: SandboxConfig, mode: str, memory_capped: bool) -> Path | None:
    """The directory a sandbox's private directory is made in (None: the temp dir), by
    ``config.scratch`` (see there): tmpfs only for overlay workspaces; ``auto`` also needs the sandbox's
    memory cgroup, which is charged for what commands write to tmpfs, and room on the tmpfs for the
    sandbox's ``memory_mb`` above the reserve (``TMPFS_RESERVE_FRAC``)."""
    if config.scratch == "disk" or mode != "overlay":
        return None
    usable = _writable_tmpfs(TMPFS_SCRATCH)
    if config.scratch == "tmpfs":
        if not usable:
            raise SandboxError(
                f"sandbox.scratch = 'tmpfs' but {TMPFS_SCRATCH} is not a writable tmpfs on this machine; "
                "set sandbox.scratch = 'disk' (or 'auto')"
            )
        return TMPFS_SCRATCH
    if usable and memory_capped and _tmpfs_room(TMPFS_SCRATCH, config.memory_mb * MIB):
        return TMPFS_SCRATCH
    return None


def _sweep_tmp() -> None:
    """Delete workdirs that dead tandem processes on this host left in the temp dir or the tmpfs scratch
    (crashes), once."""
    global _swept_tmp
    if _swept_tmp:
        return
    _swept_tmp = True
    prefix = f"tandem-sbx-{_host_tag()}-"
    places = [Path(tempfile.gettempdir())] + ([TMPFS_SCRATCH] if _writable_tmpfs(TMPFS_SCRATCH) else [])
    for p in (p for place in places for p in place.glob(prefix + "*")):
        try:
            pid = int(p.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            for point in mounts_under(p):
                unmount(point)
            rmtree(p)


def _chown_tree(root: Path, owner: int) -> None:
    os.lchown(root, owner, owner)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), owner, owner)


class Sandbox:
    """Base class of sandbox backends; subclasses say how a command is wrapped (``_argv``, ``_env``)."""

    backend = "base"
    snapshot_skipped_symlinks: list[str] = []
    snapshot_limits: list[str] = []
    """Relative paths of the symlinks the last :meth:`snapshot` left out."""
    reports_leftovers = False
    """True when ``_argv`` wraps the command so that it reports left-over processes on fd 3."""
    workdir: Path
    """Host path of the private writable copy of the workspace."""

    def __init__(
        self,
        workspace: dict[str, str] | Path | WorkspaceTemplate,
        config: SandboxConfig,
        gateway: str | None = None,
    ) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = None
        if exiting():  # the exit hook is releasing everything: what is made now would be left behind
            raise SandboxError("this process is exiting; no new sandbox can be made")
        exit_on_signals()
        _sweep_tmp()
        self.owner = agent_uid(config)
        """Host uid (and gid) commands run as and workspace files belong to; None: this process's own."""
        self.mode = self._resolve_mode()
        """``overlay`` or ``copy``: how ``workdir`` is made (``workspace_mode`` after auto)."""
        self._cgroup = Cgroup(config.memory_mb, config.pids, config.cpus)
        try:
            self.scratch = scratch_dir(config, self.mode, self._cgroup.has_memory)
            """Where the private directory was made (None: the temp dir), see ``SandboxConfig.scratch``."""
            self._root = Path(
                tempfile.mkdtemp(prefix=f"tandem-sbx-{_host_tag()}-{os.getpid()}-", dir=self.scratch)
            )
        except BaseException:
            self._cgroup.remove()
            raise
        self.workdir = self._root / "workspace"
        self._res = Resources(self._root, self._cgroup)
        """Everything this sandbox made, released by :meth:`close` (``tandem.sandbox.cleanup``)."""
        self._layer, self._forwarder = self._res.layer, self._res.forwarder
        self._mounts = self._res.mounts
        """Mount points this sandbox made under its directory, in the order made (unmounted in reverse)."""
        self._finalizer = weakref.finalize(self, self._res.release)
        self._disk: CappedDisk | None = None
        """The size-capped filesystem holding what commands may write (None: tmpfs scratch, or no cap)."""
        self._prelude = (
            self._cgroup.join_script()
            + rlimit_script(config, use_nproc=not self._cgroup.has_pids, uid=self.owner)
            + 'exec "$@"\n'
        )
        self._spare: _Spare | None = None
        self._execs = 0
        self._counters = self._cgroup.counters()
        """The cgroup's limit counters after the last exec (before the first: at creation)."""
        try:
            self._disk = self._capped_disk()
            if self.mode == "overlay":
                self._mount(workspace)
            else:
                if self._disk is not None:
                    self.workdir = self._disk.mount / "workspace"
                self.workdir.mkdir(mode=0o755)
                self._fill_copy(workspace)
                if self.owner is not None:
                    _chown_tree(self.workdir, self.owner)
            if self.owner is not None:
                os.chown(self._root, self.owner, self.owner)
            self.gateway = gateway
            """The rollout gateway's URL given at creation (None: commands reach no network at all)."""
            if gateway is not None:
                self._forwarder.append(SocketForwarder(gateway, self._root / "run", self.owner))
            self._spawn_spare()
        except BaseException:
            self.close()
            raise

    # ---- backend hooks -------------------------------------------------------------------------
    def _argv(self, cmd: list[str], env: dict[str, str]) -> list[str]:
        raise NotImplementedError

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        raise NotImplementedError

    # ---- the gateway door ----------------------------------------------------------------------
    def gateway_url(self) -> str:
        """The gateway's URL as seen by commands in this sandbox (``OPENAI_BASE_URL``)."""
        if self.gateway is None:
            raise SandboxError("this sandbox was created without a gateway; pass gateway=URL")
        return self.gateway

    def with_gateway(self, cmd: list[str]) -> list[str]:
        """``cmd`` wrapped so that :meth:`gateway_url` is reachable while it runs."""
        self.gateway_url()
        return list(cmd)

    def _cwd(self) -> Path:
        return self.workdir

    # ---- lifecycle -----------------------------------------------------------------------------
    def _resolve_mode(self) -> str:
        mode = self.config.workspace_mode
        if mode == "copy":
            return "copy"
        reason = overlay_unavailable_reason()
        if reason is None:
            return "overlay"
        if mode == "overlay":
            raise SandboxError(
                f"sandbox.workspace_mode = 'overlay' but overlays cannot be mounted here: {reason}. "
                "Run tandem as root, or set sandbox.workspace_mode = 'copy' (or 'auto')"
            )
        return "copy"

    def _mount(self, workspace: dict[str, str] | Path | WorkspaceTemplate) -> None:
        if isinstance(workspace, WorkspaceTemplate):
            if workspace.owner != self.owner:
                raise SandboxError(
                    f"the workspace template belongs to uid {workspace.owner} but this sandbox runs commands "
                    f"as {self.owner}; make the template with the same sandbox config"
                )
            cache, key = workspace.cache, workspace.key
            lower = cache.retain(key)
        elif isinstance(workspace, (dict, str, os.PathLike)):
            cache = layer_cache(self.owner)
            key, lower = cache.acquire(workspace if isinstance(workspace, dict) else Path(workspace))
        else:
            raise SandboxError(
                f"workspace must be a dict (relative path -> text) or a directory path, got {type(workspace)}"
            )
        self._layer.append((cache, key))
        writable = self._disk.mount if self._disk is not None else self._root
        upper, work = writable / "upper", writable / "work"
        for d in (upper, work, self.workdir):
            d.mkdir(mode=0o755)
        if self.owner is not None:
            os.chown(upper, self.owner, self.owner)
        mount_overlay(lower, upper, work, self.workdir)
        self._mounts.append(self.workdir)

    def _capped_disk(self) -> CappedDisk | None:
        """A filesystem of ``disk_mb`` for what commands write, when the private directory is on disk (the
        scratch is not tmpfs); None on tmpfs, or where none can be made (warned once)."""
        if self.scratch is not None:
            return None
        reason = disk_cap_unavailable_reason()
        if reason is not None:
            warn_uncapped(reason)
            return None
        self._mounts.append(self._root / MOUNT_NAME)  # listed first: a cut-short creation is still unmounted
        try:
            disk = CappedDisk(self._root, self.config.disk_mb * MIB)
        except OSError as e:
            raise SandboxError(
                f"could not make the sandbox's disk of sandbox.disk_mb = {self.config.disk_mb} MiB: {e}"
            ) from e
        self._res.disk.append(disk)
        return disk

    def _fill_copy(self, workspace: dict[str, str] | Path | WorkspaceTemplate) -> None:
        """Copy ``workspace`` into ``workdir``; a copy that fills the capped disk is a clear error."""
        try:
            self._populate(workspace)
        except (OSError, SandboxError) as e:
            said = isinstance(e, SandboxDiskFull) or NO_SPACE in str(e)  # copytree gathers its errors' texts
            if self._disk is None or not (said or self._disk.full()):
                raise
            raise SandboxError(
                f"the workspace does not fit in the sandbox's disk (sandbox.disk_mb = {self.config.disk_mb} "
                f"MiB); raise sandbox.disk_mb or use workspace_mode 'overlay' (needs root). ({e})"
            ) from e

    def _populate(self, workspace: dict[str, str] | Path | WorkspaceTemplate) -> None:
        if isinstance(workspace, WorkspaceTemplate):
            shutil.copytree(workspace.path, self.workdir, symlinks=True, dirs_exist_ok=True)
        elif isinstance(workspace, dict):
            for path, content in workspace.items():
                self._write(path, content)
        elif isinstance(workspace, (str, os.PathLike)):
            src = Path(workspace)
            if not src.is_dir():
                raise SandboxError(
                    f"workspace directory {str(src)!r} does not exist; pass an existing directory"
                )
            check_not_inside(src, self.workdir)
            shutil.copytree(src, self.workdir, symlinks=True, dirs_exist_ok=True)
        else:
            raise SandboxError(
                f"workspace must be a dict (relative path -> text) or a directory path, got {type(workspace)}"
            )

    def close(self, wait: bool = True) -> None:
        """Kill every remaining process of the sandbox and delete its workdir and cgroups. Idempotent.

        With ``wait=False`` the processes are still killed before this returns, but the unmount, deletion
        and cgroup removal run on the background reaper (``tandem.sandbox.reaper``)."""
        self._closed = True
        proc = self._proc
        if proc is not None:  # an exec running in another thread: kill it so it returns and frees the lock
            self._kill_tree(proc)
        with self._lock:
            self._discard_spare()
            if wait or not self._finalizer.alive:
                self._finalizer()
                return
            self._cgroup.kill_all()
            reap_later(self._finalizer)

    # ---- spare launchers -----------------------------------------------------------------------
    def _spawn_spare(self) -> None:
        """Start the next command's launcher now: it joins the cgroups (a slow kernel operation, ~10 ms)
        and sets the rlimits while the sandbox is idle, then waits for its command (bwrap backend only).
        The first is started at creation (on the pool's thread for pooled sandboxes); after each exec, the
        spare-starter thread starts the next one ``SPARE_DELAY_S`` later (see there), never on the caller's
        thread."""
        if not self.reports_leftovers or self._closed or self._spare is not None or exiting():
            return
        status_r, status_w = os.pipe()
        cmd_r, cmd_w = os.pipe()
        script = (
            f"exec 3>&{status_w} {status_w}>&-\n"
            + self._cgroup.join_script()
            + rlimit_script(self.config, use_nproc=not self._cgroup.has_pids, uid=self.owner, shell="bash")
            + f"IFS= read -r -d '' command <&{cmd_r} || [ -n \"$command\" ] || exit 0\n"
            + f"exec {cmd_r}<&-\n"
            + 'eval "$command"\n'
        )
        try:
            proc = subprocess.Popen(
                ["/bin/bash", "-c", script, "tandem-sandbox"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self._cwd(),
                env=self._env({}),
                start_new_session=True,
                close_fds=True,
                pass_fds=(status_w, cmd_r),
            )
        except OSError:
            os.close(status_r)
            os.close(cmd_w)
            return
        finally:
            os.close(status_w)
            os.close(cmd_r)
        self._spare = _Spare(proc, status_r, cmd_w)

    def _spawn_spare_if_idle(self, execs: int) -> bool:
        """Start the spare launcher that exec number ``execs`` scheduled, unless the sandbox is closed or has
        run another exec since (which schedules its own, or says with ``last=True`` that none is needed).
        False: the sandbox is busy (an exec, read, write or snapshot holds its lock); try again later."""
        if not self._lock.acquire(blocking=False):
            return self._closed or self._execs != execs
        try:
            if self._execs == execs:
                self._spawn_spare()
            return True
        finally:
            self._lock.release()

    def _discard_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is None:
            return
        os.close(spare.cmd_w)  # EOF: it exits without running anything
        os.close(spare.status_r)
        self._kill_tree(spare.proc)
        for f in (spare.proc.stdout, spare.proc.stderr):
            if f is not None:
                f.close()
        try:
            spare.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.workdir} is closed; create a new one")

    # ---- execution -----------------------------------------------------------------------------
    def exec(
        self,
        cmd: list[str],
        timeout_s: float | None = None,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        last: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` (argv list) with cwd = the workspace; a failing command is a result, not an error.

        ``env`` adds variables to the sandbox's clean environment for this command only. ``last=True`` says
        no command follows, so no spare launcher is started for one (saves its CPU in one-shot sandboxes).
        Raises :class:`SandboxDiskFull` (holding the result) when the command left the capped disk full, and
        :class:`SandboxError` for input no command can run with (an argument holding a NUL byte, a timeout
        that is not in (0, ``SANDBOX_MAX_TIMEOUT_S``]), whichever way the command would have started."""
        if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(a, str) for a in cmd):
            raise SandboxError(
                f"command must be a non-empty list of strings, got {cmd!r}; e.g. ['python3', 'test.py']"
            )
        for arg in cmd:  # the spare launcher reads its command up to a NUL: it ran a cut-off command line
            if "\x00" in arg:
                shown = repr(arg[:100]) + ("..." if len(arg) > 100 else "")
                raise SandboxError(f"command argument {shown} holds a NUL byte, which no argv can carry")
        extra = dict(env or {})
        for key, value in extra.items():
            if not isinstance(key, str) or not key or "=" in key or "\x00" in key:
                raise SandboxError(f"environment variable name {key!r} is invalid")
            if not isinstance(value, str) or "\x00" in value:
                raise SandboxError(f"environment variable {key} must be a string without NUL bytes")
        timeout = self.config.timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < timeout <= SANDBOX_MAX_TIMEOUT_S:  # longer overflowed the wait (OverflowError)
            raise SandboxError(
                f"timeout_s must be > 0 and at most {SANDBOX_MAX_TIMEOUT_S} seconds (a week), got "
                f"{timeout_s!r}"
            )
        data = stdin.encode() if stdin is not None else None
        with self._lock:
            self._check_open()
            self._execs += 1  # a spare scheduled by an earlier exec is now stale
            start = time.monotonic()
            before = self._counters  # nothing runs between commands: the last exec's reading still holds
            disk_before = self._disk.usage()[0] if self._disk is not None else 0
            argv = ["/bin/sh", "-c", self._prelude, "tandem-sandbox", *self._argv(list(cmd), extra)]
            status_r, status_w = -1, -1
            stdin: int = subprocess.PIPE if data is not None else subprocess.DEVNULL
            spare = self._spare if data is None else None
            if spare is not None and spare.proc.poll() is not None:
                self._discard_spare()
                spare = None
            if spare is not None:  # a launcher already in the cgroups, under the rlimits: hand it the command
                self._spare = None
                line = "exec " + " ".join(shlex.quote(a) for a in argv[4:])
                try:
                    os.write(spare.cmd_w, line.encode() + b"\0")
                    os.close(spare.cmd_w)
                    status_r = spare.status_r
                except OSError:  # it died in between: discard it and start the command the usual way
                    self._spare = spare
                    self._discard_spare()
                    spare = None
            if spare is None and self.reports_leftovers:  # the status channel becomes fd 3 of the wrapper
                status_r, status_w = os.pipe()
                if data is None:  # it arrives as stdin, which the prelude moves to 3 (dash: fds 0-9 only)
                    argv[2] = "exec 3>&0 </dev/null\n" + argv[2]
                    stdin = status_w
                else:  # stdin is taken: bash moves the pipe's own fd, which may be above 9
                    move = f'exec 3>&{status_w} {status_w}>&-; exec /bin/sh "$@"'
                    argv = ["/bin/bash", "-c", move, "tandem-status", *argv[1:]]
            try:
                proc = (
                    spare.proc
                    if spare is not None
                    else subprocess.Popen(
                        argv,
                        stdin=stdin,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=self._cwd(),
                        env=self._env(extra),
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(status_w,) if status_w >= 0 and data is not None else (),
                    )
                )
            except OSError as e:
                if status_r >= 0:
                    os.close(status_r)
                raise SandboxError(f"could not start {argv[4:]!r}: {e}") from e
            finally:
                if status_w >= 0 and spare is None:
                    os.close(status_w)
            self._proc = proc
            self._leftovers = 0
            if self._closed:  # close() ran in another thread between our check and the start
                self._kill_tree(proc)
            try:
                out, err, truncated, timed_out = self._communicate(proc, data, start + timeout)
            finally:
                self._kill_tree(proc)
                try:
                    proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:  # unkillable (D state); do not hang the caller
                    pass
                for f in (proc.stdin, proc.stdout, proc.stderr):
                    if f is not None:
                        f.close()
                self._proc = None
                if status_r >= 0:
                    self._leftovers = max(self._leftovers, _read_leftovers(status_r))
            duration = time.monotonic() - start
            after = self._counters = self._cgroup.counters()
            if not last and self.reports_leftovers:
                _spare_later(self, self._execs)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        if code < 0:
            code = 128 - code
        limits = limits_hit(code, out + err, timed_out, truncated, before, after, self._leftovers)
        if timed_out:
            code = TIMEOUT_EXIT
            err += f"\n[tandem sandbox: command timed out after {timeout:g} s; its process tree was killed]\n"
        result = ExecResult(code, out, err, timed_out, truncated, duration, limits)
        disk = self._disk if not self._closed else None  # closed by another thread: the disk may be gone
        if disk is not None and disk.filled_by(disk_before, out + err, self.config.file_mb * MIB):
            raise SandboxDiskFull(disk.full_message(f"command {list(cmd)!r} (exit status {code})"), result)
        return result

    def _kill_tree(self, proc: subprocess.Popen[bytes]) -> None:
        # Only while the session leader is unreaped: then its pid (= the group id) cannot have been reused.
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._cgroup.kill_all()

    def _communicate(
        self, proc: subprocess.Popen[bytes], data: bytes | None, deadline: float
    ) -> tuple[str, str, bool, bool]:
        assert proc.stdout is not None and proc.stderr is not None
        cap = self.config.max_output_bytes
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        cut = dict.fromkeys(bufs, False)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ, "out")
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            pidfd = None
        pos = 0
        if data is not None and proc.stdin is not None:
            if data:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
            else:
                proc.stdin.close()
        open_outputs, exited, timed_out = 2, False, False
        drain_until: float | None = None
        dropped, flood, flooded = 0, output_flood_bytes(cap), False
        try:
            while open_outputs or not exited:
                now = time.monotonic()
                end = deadline if drain_until is None else drain_until
                if now >= end:
                    if drain_until is not None:
                        break  # leftovers we could not kill still hold the pipes: stop waiting for them
                    timed_out = True
                    self._kill_tree(proc)
                    drain_until = now + _GRACE_S
                    continue
                wait = end - now if pidfd is not None else min(end - now, 0.01)
                for key, _ in sel.select(wait):
                    fd = key.fd
                    if key.data == "exit":
                        sel.unregister(fd)
                        exited = True
                        if not self.reports_leftovers:  # the leader is done: anything else is left over
                            self._leftovers = len(set(self._cgroup.pids()) - {proc.pid})
                        self._kill_tree(proc)  # whatever it left behind would otherwise hold the pipes
                        if drain_until is None:
                            drain_until = time.monotonic() + _GRACE_S
                    elif key.data == "in":
                        assert data is not None and proc.stdin is not None
                        try:
                            pos += os.write(fd, data[pos : pos + _CHUNK])
                        except BlockingIOError:
                            pass
                        except BrokenPipeError:  # the command stopped reading: drop the rest of stdin
                            pos = len(data)
                        if pos >= len(data):
                            sel.unregister(fd)
                            proc.stdin.close()
                    else:
                        chunk = os.read(fd, _CHUNK)
                        if not chunk:
                            sel.unregister(fd)
                            open_outputs -= 1
                            continue
                        buf = bufs[fd]
                        room = cap - len(buf)
                        if room > 0:
                            buf += chunk[:room]
                        if len(chunk) > room:
                            cut[fd] = True
                            dropped += len(chunk) - max(room, 0)
                            if dropped > flood and not flooded:  # module invariants: stop the drain
                                flooded = True
                                self._kill_tree(proc)
                                drain_until = min(drain_until or deadline, time.monotonic() + _GRACE_S)
                if pidfd is None and not exited and _exited_unreaped(proc.pid):
                    exited = True
                    self._kill_tree(proc)
                    drain_until = drain_until or time.monotonic() + _GRACE_S
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
        texts = []
        for fd, buf in bufs.items():
            text = buf.decode("utf-8", errors="replace")
            if cut[fd]:
                text += f"\n[... output truncated at {cap} bytes ...]\n"
            texts.append(text)
        if flooded:
            texts[1] += (
                f"\n[tandem sandbox: command killed after writing over {flood} bytes past the "
                f"{cap}-byte output limit]\n"
            )
        return texts[0], texts[1], any(cut.values()), timed_out

    # ---- files ---------------------------------------------------------------------------------
    def _resolve(self, path: str) -> Path:
        full = self.workdir / check_relpath(path)
        root = Path(os.path.realpath(self.workdir))
        real = Path(os.path.realpath(full))
        if real != root and root not in real.parents:
            raise SandboxError(f"path {path!r} leads outside the workspace through a symlink; refusing")
        return real

    def read(self, path: str) -> str:
        """Text of workspace file ``path`` (relative); undecodable bytes become U+FFFD."""
        with self._lock:
            self._check_open()
            real = self._resolve(path)
            if not real.is_file():
                what = "is a directory" if real.is_dir() else "does not exist"
                raise SandboxError(f"{path!r} {what} in the workspace; pass the path of a file")
            limit = self.config.file_mb * MIB
            if real.stat().st_size > limit:
                raise SandboxError(
                    f"{path!r} is larger than file_mb={self.config.file_mb} MiB; not reading it"
                )
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                return f.read(limit).decode("utf-8", errors="replace")

    def write(self, path: str, content: str) -> None:
        """Write text ``content`` to workspace file ``path`` (relative), creating parent directories."""
        with self._lock:
            self._check_open()
            self._write(path, content)

    def _write(self, path: str, content: str) -> None:
        if not isinstance(content, str):
            raise SandboxError(f"content of {path!r} must be str, got {type(content).__name__}")
        data = content.encode()
        if len(data) > self.config.file_mb * MIB:
            raise SandboxError(
                f"content for {path!r} is {len(data)} bytes, over file_mb={self.config.file_mb} MiB"
            )
        real = self._resolve(path)
        if real.is_dir():
            raise SandboxError(f"{path!r} is a directory in the workspace; pass a file path")
        real.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError as e:
            if e.errno != errno.ENOSPC or self._disk is None:
                raise
            raise SandboxDiskFull(self._disk.full_message(f"writing {path!r}"), None) from e
        if self.owner is not None:  # the file and any directory just made for it become the agent's
            node, top = real, Path(os.path.realpath(self.workdir))
            while node != top and node.is_relative_to(top):
                if os.lstat(node).st_uid != self.owner:
                    os.lchown(node, self.owner, self.owner)
                node = node.parent

    def snapshot(self) -> dict[str, str]:
        """All regular UTF-8 text files of the workspace (relative path -> content), capped in total.

        Symlinks are never followed (nor returned); their relative paths are left in
        ``snapshot_skipped_symlinks`` so callers can flag them. The walk is iterative, in sorted order, and
        bounded: at most ``SNAPSHOT_MAX_ENTRIES`` entries visited, ``SNAPSHOT_MAX_DEPTH`` levels entered and
        ``SNAPSHOT_MAX_BYTES`` of text kept; names that are not UTF-8 are skipped. What a bound or a name left
        out is named in ``snapshot_limits`` (``"entries"``, ``"depth"``, ``"names"``), for callers to flag."""
        with self._lock:
            self._check_open()
            out: dict[str, str] = {}
            self.snapshot_skipped_symlinks = []
            limits: set[str] = set()
            total = visited = 0
            limit = self.config.file_mb * MIB
            stack: list[tuple[str, int]] = [("", 0)]  # (relative directory, depth), popped last-first
            while stack:
                rel, depth = stack.pop()
                try:
                    with os.scandir(os.path.join(self.workdir, rel) if rel else self.workdir) as it:
                        entries = sorted(it, key=lambda e: e.name)
                except OSError:
                    continue
                subdirs = []
                for entry in entries:
                    visited += 1
                    if visited > SNAPSHOT_MAX_ENTRIES:
                        limits.add("entries")
                        stack.clear()
                        break
                    path = f"{rel}/{entry.name}" if rel else entry.name
                    try:
                        path.encode("utf-8")
                    except UnicodeEncodeError:  # surrogate-escaped bytes: no name a task can hold
                        limits.add("names")
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISLNK(st.st_mode):
                        self.snapshot_skipped_symlinks.append(path)
                    elif stat.S_ISDIR(st.st_mode):
                        if entry.name == "__pycache__":
                            continue
                        if depth + 1 >= SNAPSHOT_MAX_DEPTH:
                            limits.add("depth")
                            continue
                        subdirs.append((path, depth + 1))
                    elif stat.S_ISREG(st.st_mode) and st.st_size <= limit:
                        if total + st.st_size > SNAPSHOT_MAX_BYTES:
                            continue
                        try:
                            with open(entry.path, "rb") as f:
                                raw = f.read(limit)
                            text = raw.decode("utf-8")
                        except (OSError, UnicodeDecodeError):
                            continue
                        if "\x00" in text:
                            continue
                        total += len(raw)
                        out[path] = text
                stack.extend(reversed(subdirs))
            self.snapshot_limits = sorted(limits)
            return out


SPARE_DELAY_S = 0.05
"""How long after a command returns its sandbox's next spare launcher is started (on a background thread):
a sandbox closed within that time (the usual one-command use) never starts one, and the next command of
a multi-command session (seconds later: the model writes its next turn) still finds one ready."""
_spare_queue: list[tuple[float, int, weakref.ref[Sandbox], int]] = []
_spare_cond = threading.Condition()
_spare_seq = itertools.count()
_spare_thread: threading.Thread | None = None


def _spare_later(box: Sandbox, execs: int) -> None:
    """Have the spare-starter thread start ``box``'s next spare launcher ``SPARE_DELAY_S`` from now, if its
    exec number ``execs`` is still the last one then."""
    global _spare_thread
    with _spare_cond:
        due = time.monotonic() + SPARE_DELAY_S
        heapq.heappush(_spare_queue, (due, next(_spare_seq), weakref.ref(box), execs))
        if _spare_thread is None:
            _spare_thread = threading.Thread(target=_spare_loop, name="tandem-sandbox-spares", daemon=True)
            _spare_thread.start()
        _spare_cond.notify()


def _spare_loop() -> None:
    while True:
        with _spare_cond:
            while not _spare_queue or _spare_queue[0][0] > time.monotonic():
                _spare_cond.wait(_spare_queue[0][0] - time.monotonic() if _spare_queue else None)
            _, _, ref, execs = heapq.heappop(_spare_queue)
        box = ref()
        if box is not None:
            try:
                if not box._spawn_spare_if_idle(execs):
                    with _spare_cond:
                        due = time.monotonic() + SPARE_DELAY_S
                        heapq.heappush(_spare_queue, (due, next(_spare_seq), ref, execs))
            except Exception:  # noqa: BLE001 - a missing spare only means the next exec starts the slow way
                pass
        del box


@dataclass
class _Spare:
    """A launcher waiting for its command: the process, its status channel and its command pipe."""

    proc: subprocess.Popen[bytes]
    status_r: int
    cmd_w: int


def _read_leftovers(fd: int) -> int:
    """The count the in-sandbox wrapper wrote on the status channel (``leftover N``), then close ``fd``."""
    data = b""
    try:
        os.set_blocking(fd, False)
        while len(data) < 4096:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    lines = data.decode(errors="replace").split()
    try:
        return int(lines[-1]) if len(lines) >= 2 and lines[-2] == "leftover" else 0
    except ValueError:
        return 0


def _exited_unreaped(pid: int) -> bool:
    """True when ``pid`` has exited, without reaping it (its pid stays reserved for ``killpg``)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None
