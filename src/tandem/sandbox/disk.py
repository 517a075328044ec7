"""A size cap for what a sandbox writes to disk: its writable files live in a filesystem of their own.

When a sandbox's private directory is on disk (``SandboxConfig.scratch``; copy-mode workspaces always are),
the files its commands can write (an overlay's upper and work directories, or a copy-mode workspace) are put
in a :class:`CappedDisk`: a fresh ext4 filesystem in a sparse image file of ``SandboxConfig.disk_mb`` MiB
inside the private directory, attached to a loop device and mounted at ``<private dir>/disk``.

Invariants:
- The kernel enforces the cap: a write past it fails with ENOSPC, whatever the write rate (no overshoot);
  files a command unlinked but keeps open count too, and the number of files is bounded by the image's inodes.
  On the host the image is one file whose allocated blocks never exceed its size (blocks are allocated as the
  filesystem writes them).
- Cheap to make: the filesystem is formatted once per size and process (``mkfs.ext4``, about 10 ms) and its
  few written extents (about 100 KB) are kept in memory; each disk writes them into its own sparse image,
  attaches a loop device (``LOOP_CONFIGURE`` with auto-clear) and mounts it (``noinit_itable``: the unwritten
  inode tables read as zeros from the sparse image, so nothing more is ever written at mount).
- The loop device detaches itself when the filesystem is finally unmounted (auto-clear), including after the
  lazy unmount of a sweep of a dead process's directory; unmounting is the owner's job (the sandbox lists the
  mount point with its other mounts), deleting the image goes with the private directory.
- Room check: a disk is made only while the filesystem holding the private directory has, available to
  unprivileged users, its whole size plus what the live disks of this process may still write (their sizes
  minus their images' allocated blocks); otherwise :class:`SandboxError` says how much is free and what to do.
  Other processes' disks are not counted (each process checks its own).
- Reporting: a command that leaves the disk full (:meth:`CappedDisk.filled_by`) makes ``Sandbox.exec`` raise
  :class:`SandboxDiskFull` with the command's result; one that filled it and freed the room before it ended
  (files it unlinked while open) is not reported, the cap having held all the same.
- Needs root (mounting, loop devices), ``mkfs.ext4`` and the kernel's ext4 and loop support;
  :func:`disk_cap_unavailable_reason` says why not (probed once with a real disk), and a sandbox made
  without the cap logs a warning once per process (:func:`warn_uncapped`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import logging
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.core.errors import SandboxError
from tandem.sandbox.limits import _host_tag
from tandem.sandbox.overlay import _libc, unmount

if TYPE_CHECKING:
    from tandem.sandbox.base import ExecResult

log = logging.getLogger(__name__)
MIB = 1024 * 1024
NO_SPACE = os.strerror(errno.ENOSPC)
"""How a write refused for want of room reads in a command's output ("No space left on device")."""
IMAGE_NAME = "disk.img"
MOUNT_NAME = "disk"
FULL_FRACTION = 0.01
"""A disk counts as full (:meth:`CappedDisk.full`) when less than this fraction of its blocks is left, or no
inode: ext4 keeps a few blocks back from writers, so a disk that refused a write still shows a little room."""

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_SET_FD, _LOOP_CLR_FD, _LOOP_SET_STATUS64 = 0x4C00, 0x4C01, 0x4C04
_LO_FLAGS_AUTOCLEAR = 4
_LOOP_INFO64 = "=5Q4I64s64s32s2Q"  # struct loop_info64 (linux/loop.h)
_MS_NOSUID, _MS_NODEV = 2, 4
_MKFS_OPTIONS = ["-q", "-F", "-m", "0", "-O", "^has_journal,^resize_inode"]
_MKFS_OPTIONS += ["-E", "lazy_itable_init=1,nodiscard"]
"""No journal (scratch dies with the sandbox), no blocks reserved for root, no room kept for growing, and
inode tables left unwritten (they are zeros in a sparse image)."""

_templates: dict[int, list[tuple[int, bytes]]] = {}
_templates_lock = threading.Lock()
_live: dict[Path, int] = {}
"""Image path -> size of every live disk of this process (for the room check)."""
_live_lock = threading.Lock()


def _scratch_prefix(what: str) -> str:
    """A temp dir name the sandbox sweep removes (unmounting what is inside) if this process dies."""
    return f"tandem-sbx-{_host_tag()}-{os.getpid()}-{what}-"


def _mkfs() -> str | None:
    return shutil.which("mkfs.ext4") or shutil.which("mkfs.ext4", path="/usr/sbin:/sbin")


def _extents(path: Path) -> list[tuple[int, bytes]]:
    """The data extents of sparse file ``path`` as ``(offset, bytes)`` (holes left out)."""
    out: list[tuple[int, bytes]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:  # ENXIO: only a hole is left
                if e.errno == errno.ENXIO:
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, os.pread(fd, end - start, start)))
            pos = end
    finally:
        os.close(fd)
    return out


def _template(size: int) -> list[tuple[int, bytes]]:
    """The written extents of an empty ext4 filesystem of ``size`` bytes (formatted once per size)."""
    with _templates_lock:
        found = _templates.get(size)
        if found is not None:
            return found
        mkfs = _mkfs()
        if mkfs is None:
            raise SandboxError("mkfs.ext4 is not installed (apt-get install e2fsprogs); needed for disks")
        with tempfile.TemporaryDirectory(prefix=_scratch_prefix("mkfs")) as d:
            image = Path(d) / IMAGE_NAME
            with open(image, "wb") as f:
                f.truncate(size)
            r = subprocess.run([mkfs, *_MKFS_OPTIONS, str(image)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SandboxError(f"mkfs.ext4 failed for a {size} byte sandbox disk: {r.stderr.strip()}")
            _templates[size] = _extents(image)
        return _templates[size]


def _write_image(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        for offset, data in _template(size):
            os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _loop_node(n: int) -> str:
    node = f"/dev/loop{n}"
    if not os.path.exists(node):  # a /dev without devtmpfs: make the node ourselves (block major 7)
        try:
            os.mknod(node, stat.S_IFBLK | 0o660, os.makedev(7, n))
        except FileExistsError:
            pass
    return node


def _configure(loop_fd: int, image_fd: int) -> None:
    """Attach ``image_fd`` to the loop device, auto-clearing (LOOP_CONFIGURE; LOOP_SET_FD before 5.8)."""
    info = struct.pack(_LOOP_INFO64, 0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
    try:
        fcntl.ioctl(loop_fd, _LOOP_CONFIGURE, struct.pack("=II", image_fd, 0) + info + bytes(64))
        return
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTTY):
            raise
    fcntl.ioctl(loop_fd, _LOOP_SET_FD, image_fd)
    try:
        fcntl.ioctl(loop_fd, _LOOP_SET_STATUS64, info)
    except OSError:
        fcntl.ioctl(loop_fd, _LOOP_CLR_FD, 0)
        raise


def _mount_ext4(node: str, target: Path) -> None:
    flags = _MS_NOSUID | _MS_NODEV
    if _libc.mount(node.encode(), os.fsencode(str(target)), b"ext4", flags, b"noinit_itable") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting {node} at {target} failed: {os.strerror(err)}")


def _attach_and_mount(image: Path, target: Path) -> None:
    """Attach ``image`` to a free loop device and mount its ext4 filesystem at ``target``."""
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    ctl = -1
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        for _ in range(64):  # another process may take the free device between asking and attaching
            node = _loop_node(fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE))
            loop_fd = os.open(node, os.O_RDWR | os.O_CLOEXEC)
            try:
                try:
                    _configure(loop_fd, image_fd)
                except OSError as e:
                    if e.errno == errno.EBUSY:
                        continue
                    raise
                _mount_ext4(node, target)
                return  # the mount holds the device until it is unmounted
            finally:
                os.close(loop_fd)  # auto-clear: a device nothing mounted detaches at this last close
        raise OSError(errno.EBUSY, "no free loop device after 64 attempts")
    finally:
        if ctl >= 0:
            os.close(ctl)
        os.close(image_fd)


def _allocated(image: Path) -> int:
    try:
        return os.stat(image).st_blocks * 512
    except OSError:
        return 0


def _reserve(image: Path, size: int, parent: Path) -> None:
    """Count a disk of ``size`` at ``image`` as live if ``parent``'s filesystem has room (see module)."""
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    with _live_lock:
        owed = sum(max(0, n - _allocated(p)) for p, n in _live.items())
        if free < size + owed:
            raise SandboxError(
                f"not enough free disk for a sandbox: {parent} has {free // MIB} MiB available, and this "
                f"sandbox may write sandbox.disk_mb = {size // MIB} MiB while this process's other sandboxes "
                f"may still write {owed // MIB} MiB; free disk space, lower sandbox.disk_mb, or set "
                "sandbox.scratch = 'tmpfs' (capped by memory_mb instead)"
            )
        _live[image] = size


class CappedDisk:
    """A filesystem of ``size`` bytes mounted at ``<directory>/disk`` (see module invariants)."""

    def __init__(self, directory: Path, size: int) -> None:
        self.image = directory / IMAGE_NAME
        """The sparse image file (deleted with ``directory``)."""
        self.mount = directory / MOUNT_NAME
        """Where the filesystem is mounted; the owner unmounts it (:func:`tandem.sandbox.overlay.unmount`)."""
        self.size = size
        _reserve(self.image, size, directory)
        try:
            _write_image(self.image, size)
            self.mount.mkdir(mode=0o755)
            _attach_and_mount(self.image, self.mount)
        except BaseException:
            self.release()
            raise

    def full(self, slack: int = 0) -> bool:
        """Whether a write may have been refused for want of room: less than ``FULL_FRACTION`` of the blocks
        plus ``slack`` bytes left (a refused write of n bytes leaves up to n free), or no inode left."""
        try:
            st = os.statvfs(self.mount)
        except OSError:
            return False
        free = st.f_bavail * st.f_frsize
        return st.f_favail == 0 or free < FULL_FRACTION * st.f_blocks * st.f_frsize + slack

    def usage(self) -> tuple[int, int]:
        """``(bytes, files)`` in use on the disk (the empty filesystem's own are counted too)."""
        st = os.statvfs(self.mount)
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree

    def filled_by(self, used_before: int, output: str, largest_write: int) -> bool:
        """Whether a command that ran with ``used_before`` bytes in use and printed ``output`` filled the
        disk: it is :meth:`full`, counting as free the room a refused write leaves (up to
        ``largest_write``) when the output says a write was refused, and the command wrote to the disk or
        said so (a disk that merely was near full already is not blamed on a command that wrote nothing)."""
        said = NO_SPACE in output
        try:
            if not said and self.usage()[0] <= used_before:
                return False
        except OSError:
            return False
        return self.full(slack=largest_write if said else 0)

    def full_message(self, what: str) -> str:
        """Why :class:`SandboxDiskFull` is raised, for ``what`` (the command or write that ran into it)."""
        used, files = self.usage()
        return (
            f"the sandbox's disk is full: what its commands write may take at most sandbox.disk_mb = "
            f"{self.size // MIB} MiB on disk, and {what} ran into that cap ({used / MIB:.1f} MiB in {files} "
            "files and directories now); remove files from the workspace, or raise sandbox.disk_mb if the "
            "task needs more"
        )

    def release(self) -> None:
        """Stop counting this disk as live (after its filesystem is unmounted). Idempotent."""
        with _live_lock:
            _live.pop(self.image, None)


class SandboxDiskFull(SandboxError):
    """What a sandbox's commands wrote reached its disk cap (``SandboxConfig.disk_mb``): raised by
    ``Sandbox.exec`` after the command ended (its result is ``result``) and by ``Sandbox.write`` (``result``
    None). The sandbox stays usable: removing files makes room again."""

    def __init__(self, message: str, result: ExecResult | None) -> None:
        super().__init__(message)
        self.result = result
        """The command's result, as ``exec`` would have returned it."""


_warned_uncapped = False


def warn_uncapped(reason: str) -> None:
    """Say once per process that disk scratch is not capped here, and why."""
    global _warned_uncapped
    if not _warned_uncapped:
        _warned_uncapped = True
        log.warning(
            "sandbox disk scratch is not capped (sandbox.disk_mb is not enforced): %s. A command can fill "
            "%s until its timeout; run tandem as root, or set sandbox.scratch = 'tmpfs'",
            reason,
            tempfile.gettempdir(),
        )


@functools.cache
def disk_cap_unavailable_reason() -> str | None:
    """None when this process can make a :class:`CappedDisk` (probed once with a real one), else why not."""
    if os.geteuid() != 0:
        return f"loop-mounting a filesystem needs root (tandem runs as uid {os.geteuid()})"
    if _mkfs() is None:
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    if not os.path.exists("/dev/loop-control"):
        return "the kernel has no loop devices (/dev/loop-control is missing; modprobe loop)"
    with tempfile.TemporaryDirectory(prefix=_scratch_prefix("disk-probe")) as d:
        try:
            disk = CappedDisk(Path(d), 4 * MIB)
        except (OSError, SandboxError) as e:
            return str(e)
        try:
            (disk.mount / "probe").write_text("ok")
            ok = (disk.mount / "probe").read_text() == "ok"
        finally:
            unmount(disk.mount)
            disk.release()
        return None if ok else "a loop-mounted ext4 filesystem did not keep a file written to it"
