"""Leaving nothing behind: what sandboxes made goes when they close, when the process exits, and when the
process is stopped by SIGTERM or SIGHUP.

Invariants:
- A sandbox's kernel and disk resources are one :class:`Resources` record: its private directory, cgroups,
  layer references, gateway forwarder, mounts and capped disk. :meth:`Resources.release` undoes them in a safe
  order (forwarder; processes and cgroups; mounts, last made first; the private directory; layer references)
  and can be resumed: an exception or a signal that cuts it short leaves every step not yet done to the next
  call, and the record stays listed as unfinished until one call completes. Only the process that made a
  record releases it: in a forked child (which inherits the records, finalizers and exit hooks) it does
  nothing, so a child's exit never tears down its parent's sandboxes.
- At interpreter exit (an ``atexit`` hook registered when this module is imported, so it runs after hooks
  registered later), :func:`release_everything` waits for the reaper, releases every unfinished record
  (sandboxes still open, closes cut short) and removes this process's layer caches; from then on no sandbox
  or spare launcher is made (:func:`exiting`). It touches only what this process made: other processes'
  leftovers are removed only by the sweeps, once their process is dead. :func:`rmtree` never changes
  anything outside the tree it deletes.
- :func:`exit_on_signals` (called when a sandbox, pool or template is made on the main thread): SIGTERM and
  SIGHUP whose action is still the default raise ``SystemExit(128 + N)`` in the main thread instead, so
  ``finally`` blocks and the exit hook run as on a normal exit. The handler restores the default action before
  raising, so a second signal kills at once. Handlers installed by others (Ray, a server's own) are left
  alone, and so is SIGINT: Python's KeyboardInterrupt already unwinds the same way.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.sandbox.overlay import unmount
from tandem.sandbox.reaper import drain_reaper

if TYPE_CHECKING:
    from tandem.sandbox.disk import CappedDisk
    from tandem.sandbox.forward import SocketForwarder
    from tandem.sandbox.layers import LayerCache
    from tandem.sandbox.limits import Cgroup

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals turned into a normal exit by :func:`exit_on_signals`."""
_unfinished: dict[int, Resources] = {}
_keys = itertools.count()
_exiting = threading.Event()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def rmtree(path: Path) -> None:
    """Delete ``path`` recursively, also where a command removed write permission from its own directories.
    Never changes anything outside ``path``: a path already gone (another process's sweep, a resumed release)
    is left alone, and only directories inside the tree get their permissions mended.

    Iterative and relative to directory descriptors (``_rmtree_at``), so any depth goes: ``shutil.rmtree``
    recursed past Python's limit on a probe's 1100 nested directories and left the sandbox's 300 MB in
    ``/dev/shm``, and paths that deep exceed ``PATH_MAX``. Symlinks are removed, never followed."""
    top = os.path.abspath(path)
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _quietly(os.unlink, top)
        return
    try:
        fd = os.open(top, _DIR_FLAGS)
    except PermissionError:
        _quietly(os.chmod, top, 0o700)
        try:
            fd = os.open(top, _DIR_FLAGS)
        except OSError:
            return
    except OSError:
        return
    try:
        _rmtree_at(fd, st.st_dev)
    finally:
        os.close(fd)
    _quietly(os.rmdir, top)


def _quietly(func, *args, **kwargs) -> None:  # noqa: ANN001 - a deletion step; a failure leaves the entry
    try:
        func(*args, **kwargs)
    except OSError:
        pass


def _rmtree_at(top_fd: int, dev: int) -> None:
    """Empty the directory open at ``top_fd`` (on device ``dev``): go down with ``openat`` into the first
    subdirectory left, delete the files of each directory, come back up through ``..`` and remove the
    emptied directory by name. Holds one descriptor besides ``top_fd`` whatever the depth (every process of
    the sandbox is dead, so nothing moves directories meanwhile). A directory it cannot empty, or on another
    filesystem (a mount left behind), is left, and the walk goes on beside it."""
    names: list[str] = []  # the path from top_fd down to the current directory
    skipped: list[set[str]] = [set()]  # per level: subdirectories that could not be removed
    fd = os.dup(top_fd)
    try:
        while True:
            child = None
            try:
                os.fchmod(fd, 0o700)  # a command may have removed write or search permission from it
            except OSError:
                pass
            with os.scandir(fd) as it:
                entries = list(it)
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if not is_dir:
                    _quietly(os.unlink, entry.name, dir_fd=fd)
                elif child is None and entry.name not in skipped[-1]:
                    child = entry.name
            if child is not None:
                try:
                    down = os.open(child, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    _quietly(os.chmod, child, 0o700, dir_fd=fd)
                    try:
                        down = os.open(child, _DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        skipped[-1].add(child)
                        continue
                if os.fstat(down).st_dev != dev:  # a mount point: never delete into another filesystem
                    os.close(down)
                    skipped[-1].add(child)
                    continue
                os.close(fd)
                fd = down
                names.append(child)
                skipped.append(set())
                continue
            if not names:  # back at the top, nothing left to enter
                return
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            name = names.pop()
            skipped.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                skipped[-1].add(name)
    finally:
        os.close(fd)


@dataclass(eq=False)
class Resources:
    """What one sandbox made; the lists are filled as the sandbox makes things (see module invariants)."""

    root: Path
    """The sandbox's private directory."""
    cgroup: Cgroup
    layer: list[tuple[LayerCache, str]] = field(default_factory=list)
    forwarder: list[SocketForwarder] = field(default_factory=list)
    mounts: list[Path] = field(default_factory=list)
    """Mount points under ``root``, in the order made (unmounted in reverse)."""
    disk: list[CappedDisk] = field(default_factory=list)
    key: int = field(default_factory=lambda: next(_keys))
    pid: int = field(default_factory=os.getpid)
    """The process that made these resources, the only one that releases them."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        _unfinished[self.key] = self

    def release(self) -> None:
        """Undo everything listed (module invariants). Idempotent and resumable; thread-safe."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            while self.forwarder:
                self.forwarder[-1].close()
                self.forwarder.pop()
            self.cgroup.remove()
            while self.mounts:
                try:
                    unmount(self.mounts[-1])
                except OSError:
                    pass
                self.mounts.pop()
            while self.disk:  # its filesystem is unmounted now (it is among the mounts)
                self.disk.pop().release()
            rmtree(self.root)
            while self.layer:
                cache, key = self.layer.pop()
                cache.release(key)
            _unfinished.pop(self.key, None)


def exiting() -> bool:
    """True once the exit hook has started: nothing new (such as a spare launcher) should be started."""
    return _exiting.is_set()


def release_everything() -> None:
    """This process's sandbox resources, all released (module invariants); run at exit."""
    from tandem.sandbox.layers import remove_layer_caches

    _exiting.set()
    drain_reaper()
    for res in list(_unfinished.values()):
        try:
            res.release()
        except Exception:  # noqa: BLE001 - best effort at exit; the next process's sweep removes the rest
            pass
    remove_layer_caches()


atexit.register(release_everything)


def release_now() -> None:
    """What the exit hooks would release (``release_everything`` and the ``/etc`` copies), released now, for
    a process about to be killed rather than exit (a Ray actor's shutdown: ``ray.kill`` may come before its
    exit hooks finish). No sandbox can be made afterwards (:func:`exiting`)."""
    from tandem.sandbox.bwrap import remove_etc_copies

    release_everything()
    remove_etc_copies()


def _exit_now(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second signal kills at once
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """Make SIGTERM and SIGHUP a normal exit (module invariants); does nothing off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in EXIT_SIGNALS:
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _exit_now)
        except (ValueError, OSError):  # not the main interpreter, or the platform refuses
            pass
