"""Blob backends of the weight store: the ``BlobBackend`` protocol, the filesystem backend and writer locks.

Invariants:
- ``put`` is atomic: a reader sees the whole new value or no value, never a prefix (filesystem: write a
  temporary file in the store, fsync, ``os.replace``; a failed write removes the temporary file).
- ``put_if_absent`` creates a key only if it does not exist yet, atomically (filesystem: ``os.link`` of a
  finished temporary file, which fails if the target exists).
- Keys are relative ``/``-separated paths of ``[A-Za-z0-9._-]`` segments; ``..`` and absolute keys are
  refused, so a key never escapes the store root.
- A missing key raises ``MissingKeyError`` naming the key and the store.
- Writer locks: one holder per store. ``FileLock`` is an ``O_CREAT|O_EXCL`` file holding pid/host/token,
  kept ``flock``-ed while held; a lock whose holder died on this host (no ``flock`` and pid gone, or pid
  reused) is broken automatically. ``ObjectLock`` is the same over ``put_if_absent`` for object stores; a
  stale one is deleted only while it is still the lock that was judged stale (``delete_if_unchanged``
  where the backend has it: S3's ``If-Match``), so two publishers breaking the same stale lock never both
  end up holding it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from tandem.core.procs import pid_alive
from tandem.weights.errors import MissingKeyError, StoreLockedError, WeightStoreError

_KEY_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
_TMP_DIR = ".tmp"
# A lock file younger than this is never judged stale: its creator may not have flock-ed it yet.
_LOCK_GRACE_S = 2.0


class WriterLock(Protocol):
    owner: dict[str, Any]

    def verify(self) -> None:
        """Raise ``StoreLockedError`` if the lock is no longer ours."""

    def release(self) -> None:
        """Give the lock up (idempotent)."""


class BlobBackend(Protocol):
    """Where manifests and blobs live. All methods are thread-safe."""

    def put(self, key: str, data: bytes) -> None: ...

    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the value (shorter if the value is shorter)."""
        ...

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Sorted keys that start with ``prefix``."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key; a missing key is not an error."""
        ...

    def acquire_lock(self, key: str) -> WriterLock: ...

    def describe(self) -> str: ...


def check_key(key: str) -> str:
    if not _KEY_RE.match(key) or any(part in (".", "..") for part in key.split("/")):
        raise WeightStoreError(f"invalid store key {key!r}: use relative '/'-separated [A-Za-z0-9._-] names")
    return key


def new_owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex, "since": time.time()}


def describe_holder(holder: dict[str, Any]) -> str:
    since = holder.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, int | float) else "?"
    )
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {when}"


def locked_error(store: str, lock: str, holder: dict[str, Any]) -> StoreLockedError:
    return StoreLockedError(
        f"weight store {store} already has a publisher ({describe_holder(holder)}; lock {lock}); only one "
        f"publisher per store is allowed: stop the other publisher, or if it is gone, delete {lock}"
    )


class FileBackend:
    """Blobs as files under ``root`` (the default backend)."""

    def __init__(self, root: str | Path, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable

    def describe(self) -> str:
        return str(self.root)

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write(self, f: Any, data: bytes) -> None:
        """Write ``data`` to an open temporary file (a seam for fault-injection in tests)."""
        f.write(data)

    def _write_tmp(self, data: bytes) -> Path:
        tmp_dir = self.root / _TMP_DIR
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / f"{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                self._write(f, data)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._write_tmp(data)
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._sync_dir(target.parent)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._write_tmp(data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._sync_dir(target.parent)
        return True

    def _sync_dir(self, directory: Path) -> None:
        if not self.durable:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _missing(self, key: str) -> MissingKeyError:
        return MissingKeyError(f"key {key!r} does not exist in store {self.root}")

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise self._missing(key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self.path(key), "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except FileNotFoundError:
            raise self._missing(key) from None

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            raise self._missing(key) from None

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        head, _, _ = prefix.rpartition("/")
        base = self.root / head if head else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != _TMP_DIR]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def check_writable(self, subdirs: tuple[str, ...] = ("",), what: str = "store directory") -> None:
        """Create the root (and ``subdirs``) if needed and write and remove a probe file in each, the way
        ``put`` writes; ``WeightStoreError`` naming the directory if that fails (a process that would only
        fail on its first write is refused at start instead)."""
        for sub in subdirs:
            key = f"{sub}/.write-check-{os.getpid()}" if sub else f".write-check-{os.getpid()}"
            try:
                self.put(key, b"ok")
                self.delete(key)
            except OSError as e:
                raise WeightStoreError(
                    f"{what} {str(self.root)!r} cannot be created or written ({e}); pass a writable directory"
                ) from None

    def acquire_lock(self, key: str) -> FileLock:
        return FileLock.acquire(self.path(key), self.describe())


class FileLock:
    """An exclusive lock file, flock-ed for as long as it is held."""

    def __init__(self, path: Path, fd: int, owner: dict[str, Any], store: str) -> None:
        self.path, self._fd, self.owner, self._store = path, fd, owner, store

    @classmethod
    def acquire(cls, path: Path, store: str) -> FileLock:
        owner = new_owner()
        path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if attempt < 2 and _break_if_stale(path):
                    continue
                raise locked_error(store, str(path), _read_holder(path)) from None
            try:
                os.write(fd, json.dumps(owner).encode())
                os.fsync(fd)
                # Blocking: a rival checking for staleness may hold the flock for a moment; it sees our live
                # pid in a young file and leaves it alone.
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            return cls(path, fd, owner, store)
        raise locked_error(store, str(path), _read_holder(path))

    def verify(self) -> None:
        if self._fd < 0:
            raise StoreLockedError(f"the writer lock of store {self._store} was released; acquire it again")
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise StoreLockedError(
                f"the writer lock {self.path} of store {self._store} was removed or replaced; stop "
                "publishing: another publisher may be active"
            )

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _break_if_stale(path: Path) -> bool:
    """Remove ``path`` if its holder is gone; True if the caller should retry creating it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live open file description holds it
        st = os.fstat(fd)
        holder = _read_holder(path)
        if holder.get("host", socket.gethostname()) != socket.gethostname():
            return False  # cannot judge another host's processes
        pid = holder.get("pid")
        young = time.time() - st.st_mtime < _LOCK_GRACE_S
        if young and isinstance(pid, int) and pid_alive(pid):
            return False
        if young and not holder:
            return False  # being created right now
        if os.stat(path).st_ino != st.st_ino:
            return True
        path.unlink()
        return True
    except FileNotFoundError:
        return True
    finally:
        os.close(fd)


class ObjectLock:
    """A lock object created with ``put_if_absent``; for backends without file locks (S3)."""

    def __init__(self, backend: BlobBackend, key: str, owner: dict[str, Any]) -> None:
        self.backend, self.key, self.owner = backend, key, owner
        self._held = True

    @classmethod
    def acquire(cls, backend: BlobBackend, key: str) -> ObjectLock:
        owner = new_owner()
        data = json.dumps(owner).encode()
        for attempt in range(2):
            if backend.put_if_absent(key, data):
                return cls(backend, key, owner)
            holder, tag = cls._read(backend, key)
            if attempt == 0 and cls._stale(holder):
                # Only the lock judged stale: a rival may have broken it and taken a new one meanwhile
                # (then our retry is refused, naming that rival).
                cls._delete(backend, key, tag)
                continue
            raise locked_error(backend.describe(), key, holder)
        raise locked_error(backend.describe(), key, cls._holder(backend, key))

    @staticmethod
    def _read(backend: BlobBackend, key: str) -> tuple[dict[str, Any], str | None]:
        """The holder and, where the backend tags values (``get_tagged``), the lock value's tag."""
        get_tagged = getattr(backend, "get_tagged", None)
        try:
            raw, tag = get_tagged(key) if get_tagged is not None else (backend.get(key), None)
            holder = json.loads(raw)
        except (MissingKeyError, ValueError):
            return {}, None
        return (holder, tag) if isinstance(holder, dict) else ({}, tag)

    @staticmethod
    def _delete(backend: BlobBackend, key: str, tag: str | None) -> None:
        """Delete the lock value read with ``tag`` (unconditionally on backends without tags)."""
        delete_if_unchanged = getattr(backend, "delete_if_unchanged", None)
        if tag is not None and delete_if_unchanged is not None:
            delete_if_unchanged(key, tag)
        else:
            backend.delete(key)

    @classmethod
    def _holder(cls, backend: BlobBackend, key: str) -> dict[str, Any]:
        return cls._read(backend, key)[0]

    @staticmethod
    def _stale(holder: dict[str, Any]) -> bool:
        pid = holder.get("pid")
        same_host = holder.get("host") == socket.gethostname()
        return same_host and isinstance(pid, int) and not pid_alive(pid)

    def verify(self) -> None:
        holder = self._holder(self.backend, self.key) if self._held else {}
        if holder.get("token") != self.owner["token"]:
            raise StoreLockedError(
                f"the writer lock {self.key} of store {self.backend.describe()} is no longer ours "
                f"(now: {describe_holder(holder) if holder else 'absent'}); stop publishing"
            )

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        holder, tag = self._read(self.backend, self.key)
        if holder.get("token") == self.owner["token"]:
            self._delete(self.backend, self.key, tag)
