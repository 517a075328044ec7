"""Share one download, decode and verification of each weight version among the engines of one host.

Engines that follow a store on their own each download, decode and hash every version: with N engines on
a host that is N times the CPU for the same result, taken from the CPU that serves. A host share is a
directory on a host-local filesystem (``/dev/shm`` where it exists) in which the first engine to need a
version step ``a -> b`` (the step's *leader*) writes its verified patch: for every changed tensor the flat
indices and the new values. The other engines read the patch and apply it to their weights without
downloading or decoding anything. The leader decodes against the host's one shadow
(``tandem.weights.hostshadow``, in the same directory, used under the share's lock).

Invariants:
- A leader writes a patch only after its own shadow reached version ``b`` and was verified against the
  store's hash of ``b``, starting from its verified version ``a``; the file appears by an atomic rename.
- A patch file is never changed once its name exists: readers map it privately (``mmap`` copy-on-write, no
  read copy), and the writer only ever unlinks old files, which a live mapping survives.
- A patch file carries a BLAKE3 digest of its body, checked on every read; a file that is missing,
  truncated, corrupt or for another step is never applied: ``read`` returns None and the caller follows the
  store itself.
- A patch ``a -> b`` is applied only to weights at exactly version ``a``; applied to version ``a``'s
  verified weights it gives version ``b``'s verified weights.
- ``lock()`` is an exclusive ``flock`` on the share's lock file: a process takes it only when the patch it
  needs is not there yet, looks again under it (``find``, a listing) and, when there is still none, holds it
  while it advances and writes one, so the other engines of the host wait for that patch instead of
  decoding the same step in parallel. Reading a patch needs no lock, so the engines waiting for a step read
  its patch in parallel once the leader releases the lock. Locks end with their process.
- The directory is this user's alone: created ``0700``, and an existing one that another user owns or that
  group or others may write is refused (``PermissionError`` naming it). A patch's BLAKE3 digest detects
  damage, not forgery, so whoever can write the directory could otherwise plant patches the engines apply.
- The writer keeps the newest ``keep`` patch files (by target version) and removes older ones; only names
  of the form ``AAAAAAAA-BBBBBBBB.patch`` are patches. Temporary files a writer killed mid-write left behind
  (``.tmp-*``) are removed by the next write, which holds the exclusive lock, so no other write is in
  progress; they never count among the kept patches.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np

Patches = dict[str, tuple[np.ndarray, np.ndarray]]
"""Tensor name -> (sorted flat int64 indices, new values at them), values in the shadow's dtype."""

MAGIC = b"TPATCH1\n"
_NAME = re.compile(r"^([0-9]{8})-([0-9]{8})\.patch$")
_LEN = struct.Struct("<Q")


def default_share_root() -> Path:
    """``/dev/shm`` (memory-backed, host-local) when it exists, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def check_private_dir(path: Path) -> None:
    """Raise ``PermissionError`` naming ``path`` unless it is a directory owned by this process's user that
    neither group nor others may write (module invariants)."""
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"host share directory {str(path)!r} is owned by uid {st.st_uid} with mode "
            f"{st.st_mode & 0o777:o}; it must belong to this user (uid {os.geteuid()}) and be writable by it "
            "alone: remove it, or use another directory (weights.host_share = false turns the share off)"
        )


class HostShare:
    """A host share directory (see module invariants). ``path`` is created if needed."""

    def __init__(self, path: str | os.PathLike[str], keep: int = 8) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1: the newest patch must stay readable")
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_dir(self.path)
        self.keep = keep
        self._lock_path = self.path / "lock"

    def _file(self, a: int, b: int) -> Path:
        return self.path / f"{a:08d}-{b:08d}.patch"

    @contextlib.contextmanager
    def lock(self, shared: bool = False) -> Iterator[None]:
        """Hold the share's lock, exclusive or ``shared`` (blocks until it can be had): the host shadow is
        written only under the exclusive lock and may be read under either, so engines reloading from it
        hold it shared, in parallel with each other."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def write(self, a: int, b: int, patches: Patches) -> Path:
        """Publish the verified patch ``a -> b`` (atomic); returns its path."""
        header: list[dict[str, object]] = []
        parts: list[memoryview] = []  # the arrays' own bytes: hashed and written without a copy
        for name in sorted(patches):
            index, values = patches[name]
            index = np.ascontiguousarray(index, dtype=np.int64)
            values = np.ascontiguousarray(values)
            if index.shape != values.shape or index.ndim != 1:
                raise ValueError(f"patch of {name!r}: indices {index.shape} and values {values.shape} differ")
            header.append({"name": name, "n": int(index.size), "dtype": values.dtype.str})
            parts += [memoryview(index).cast("B"), memoryview(values.view(np.uint8)).cast("B")]
        head = json.dumps({"from": a, "to": b, "tensors": header}).encode()
        h = blake3.blake3(head)
        for p in parts:
            h.update(p)
        final = self._file(a, b)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=".patch")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + h.digest() + _LEN.pack(len(head)) + head)
                for p in parts:
                    f.write(p)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._collect()
        return final

    def find(self, a: int, upto: int) -> int | None:
        """The newest version ``b <= upto`` a patch from version ``a`` reaches, or None (a directory listing:
        nothing is read or checked)."""
        found = [b for f in self._patches() if f[0] == a and a < (b := f[1]) <= upto]
        return max(found) if found else None

    def _patches(self) -> list[tuple[int, int, Path]]:
        """``(a, b, path)`` of every patch file (names of other files are ignored)."""
        out = []
        for p in self.path.iterdir():
            if (m := _NAME.match(p.name)) is not None:
                out.append((int(m[1]), int(m[2]), p))
        return out

    def read(self, a: int, upto: int) -> tuple[int, Patches] | None:
        """The patch from version ``a`` to the newest version ``b <= upto`` one reaches, as ``(b, patches)``,
        or None when there is none or it fails its digest. Needs no lock: a patch file is complete once
        its name exists (atomic rename) and its digest is checked here."""
        b = self.find(a, upto)
        if b is None:
            return None
        try:
            with open(self._file(a, b), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return None
                # A private copy-on-write mapping: no read copy, and writable (the arrays become tensors).
                # Patch files are never modified in place (atomic rename; old ones are unlinked, which a
                # mapping survives), so the mapping always holds the bytes the digest is checked over.
                data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None
        return (b, patches) if (patches := _parse(data, a, b)) is not None else None

    def _collect(self) -> None:
        """Remove all but the newest ``keep`` patches, and temporary files of writers that died (called by
        ``write``, under the exclusive lock: see module invariants)."""
        files = sorted(self._patches(), key=lambda f: (f[1], f[0]))
        stale = list(self.path.glob(".tmp-*.patch"))
        for old in [f[2] for f in files[: -self.keep]] + stale:
            with contextlib.suppress(OSError):
                old.unlink()


def _parse(data: mmap.mmap | bytearray, a: int, b: int) -> Patches | None:
    """The patches of a patch file's bytes (writable), or None if they are not an intact patch ``a -> b``."""
    start = len(MAGIC) + 32 + _LEN.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        return None
    digest = data[len(MAGIC) : len(MAGIC) + 32]
    (head_len,) = _LEN.unpack_from(data, len(MAGIC) + 32)
    if blake3.blake3(memoryview(data)[start:]).digest() != digest:
        return None
    try:
        head = json.loads(data[start : start + head_len])
    except ValueError:
        return None
    if head.get("from") != a or head.get("to") != b:
        return None
    out: Patches = {}
    pos = start + head_len
    for t in head["tensors"]:
        n, dtype = int(t["n"]), np.dtype(t["dtype"])
        index = np.frombuffer(data, np.int64, n, pos)
        pos += 8 * n
        values = np.frombuffer(data, dtype, n, pos)
        pos += dtype.itemsize * n
        out[t["name"]] = (index, values)
    return out if pos == len(data) else None
