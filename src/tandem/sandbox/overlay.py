"""Kernel overlayfs mounts for copy-on-write workspaces.

Invariants:
- A workspace overlay is ``lowerdir`` (a shared read-only layer, never written through the overlay),
  ``upperdir`` and ``workdir`` (private to one sandbox, on the same filesystem) mounted at ``merged``. Writes
  land in the upper directory only; deleting a lower file leaves a whiteout in the upper directory.
- Mounting needs CAP_SYS_ADMIN in the initial namespaces (tandem running as root); :func:`overlay_available`
  probes that once per process and says why not, so ``workspace_mode = "auto"`` can fall back to copying.
- :func:`unmount` detaches lazily (``MNT_DETACH``), so it succeeds even while a leftover process still holds a
  file open; the mount disappears when its last user does. :func:`mounts_under` lists the mount points below a
  directory (from ``/proc/self/mountinfo``) so sweeps unmount before deleting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import tempfile
from pathlib import Path

MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class OverlayError(OSError):
    """An overlay mount or unmount failed; the message names the paths and the kernel's reason."""


def _check_path(p: Path) -> bytes:
    s = str(p)
    if any(c in s for c in ",:\\\n"):
        raise OverlayError(f"overlay path {s!r} contains one of , : \\ or a newline; use a plainer temp dir")
    return os.fsencode(s)


def mount_overlay(lower: Path, upper: Path, work: Path, merged: Path) -> None:
    """Mount ``lower`` (read-only) + ``upper``/``work`` at ``merged``; raises :class:`OverlayError`."""
    opts = b"lowerdir=%s,upperdir=%s,workdir=%s" % (_check_path(lower), _check_path(upper), _check_path(work))
    if _libc.mount(b"overlay", os.fsencode(str(merged)), b"overlay", 0, opts) != 0:
        err = ctypes.get_errno()
        raise OverlayError(err, f"mounting an overlay at {merged} over {lower} failed: {os.strerror(err)}")


MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384


def bind_readonly(source: Path, target: Path) -> None:
    """Bind ``source`` at ``target`` (an existing empty directory or file) read-only, as this process (root):
    the way to hand an unprivileged sandbox a path it could not reach itself (e.g. under a private /root)."""
    src, dst = os.fsencode(str(source)), os.fsencode(str(target))
    if _libc.mount(src, dst, None, MS_BIND | MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise OverlayError(err, f"bind-mounting {source} at {target} failed: {os.strerror(err)}")
    if _libc.mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0:
        err = ctypes.get_errno()
        unmount(target)
        raise OverlayError(err, f"making the bind mount of {source} read-only failed: {os.strerror(err)}")


def unmount(path: Path) -> None:
    """Detach the mount at ``path`` (lazily); a path that is not a mount point is left alone."""
    if _libc.umount2(os.fsencode(str(path)), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OverlayError(err, f"unmounting {path} failed: {os.strerror(err)}")


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` for a space, etc.)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below ``directory``, deepest first (the order to unmount them in)."""
    root = os.path.realpath(directory)
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) > 4:
            point = _unescape(parts[4])
            if point == root or point.startswith(root + os.sep):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


@functools.cache
def overlay_unavailable_reason() -> str | None:
    """None when this process can mount overlays (probed once with a real mount), else why not."""
    if os.geteuid() != 0:
        return f"mounting overlayfs needs root (tandem runs as uid {os.geteuid()})"
    try:
        with open("/proc/filesystems") as f:
            if "overlay" not in f.read():
                return "the kernel has no overlay filesystem (modprobe overlay)"
    except OSError as e:
        return f"cannot read /proc/filesystems: {e}"
    with tempfile.TemporaryDirectory(prefix="tandem-overlay-probe-") as d:
        parts = [Path(d) / n for n in ("lower", "upper", "work", "merged")]
        for p in parts:
            p.mkdir()
        (parts[0] / "probe").write_text("ok")
        try:
            mount_overlay(*parts)
        except OverlayError as e:
            return str(e)
        try:
            ok = (parts[3] / "probe").read_text() == "ok"
        finally:
            unmount(parts[3])
        return None if ok else "an overlay mounted but did not show its lower layer"


def overlay_available() -> bool:
    """True when :func:`mount_overlay` works in this process."""
    return overlay_unavailable_reason() is None
