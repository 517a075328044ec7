"""Shared read-only lower layers for copy-on-write workspaces.

A layer is a directory holding one workspace's files, built once per process and shared by every overlay
sandbox of that workspace (all the rollouts of a GRPO group, every sandbox of a benchmark burst).

Invariants:
- A layer is keyed by its content: a dict workspace by the SHA-256 of its sorted (path, content) pairs, a
  directory workspace by its real path plus a walk of every entry's relative path, type, size, mode and
  mtime (so an edited directory gets a new layer; the walk reads no file data). A directory that holds the
  cache (the temp dir, e.g. ``/``) is refused (:func:`check_not_inside`): its copy would copy itself.
- A layer is complete before anyone sees it: it is built under a temporary name and renamed into place.
  Its files and directories belong to ``owner`` (the sandbox's agent uid), so files copied up into an
  overlay's upper directory are the agent's to modify; nothing ever writes into a layer after the rename.
- Layers are reference-counted: :meth:`LayerCache.acquire` / :meth:`LayerCache.release`. At most
  ``max_unused`` layers without references are kept (least recently used are deleted first); a layer in use
  is never deleted. All layers of a process live under ``<tmp>/tandem-layers-<host>-<pid>-<n>/``, which the
  process deletes at exit (``tandem.sandbox.cleanup``); the directories of dead processes on this host are
  deleted by the first cache created afterwards.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import stat
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path, PurePosixPath

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.core.procs import pid_alive
from tandem.sandbox.cleanup import exit_on_signals

_ids = itertools.count()


def _host_tag() -> str:
    import socket

    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def check_relpath(path: object) -> PurePosixPath:
    """``path`` as a relative POSIX path inside a workspace, or :class:`SandboxError` naming it."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxError(f"workspace path must be a non-empty string, got {path!r}")
    p = PurePosixPath(path)
    if p.is_absolute():
        raise SandboxError(
            f"path {path!r} is absolute; pass a path relative to the workspace, e.g. 'solution.py'"
        )
    if ".." in p.parts:
        raise SandboxError(f"path {path!r} contains '..'; pass a path inside the workspace")
    return p


def check_not_inside(source: Path, copy: Path) -> None:
    """Refuse to copy directory ``source`` to ``copy`` when ``copy`` lies inside it: the copy took in its own
    growing copy until the paths were too long (a workspace holding the temp dir, such as ``/``, copied the
    host's disk into itself)."""
    if Path(os.path.realpath(copy)).is_relative_to(os.path.realpath(source)):
        raise SandboxError(
            f"workspace directory {str(source)!r} holds {str(copy)!r}, where the sandbox's copy of it is "
            "made (it would copy its own copy); pass a directory that does not hold the temp dir, or set "
            "TMPDIR elsewhere"
        )


def dict_key(files: dict[str, str]) -> str:
    """Content key of a dict workspace (validates every path and content)."""
    h = hashlib.sha256(b"dict\0")
    for path in sorted(files):
        check_relpath(path)
        content = files[path]
        if not isinstance(content, str):
            raise SandboxError(f"content of {path!r} must be str, got {type(content).__name__}")
        data = content.encode()
        h.update(b"%d\0%s\0%d\0" % (len(path.encode()), path.encode(), len(data)))
        h.update(data)
    return h.hexdigest()[:32]


def dir_key(directory: Path) -> str:
    """Key of a directory workspace: real path plus a metadata walk (no file data is read)."""
    root = os.path.realpath(directory)
    h = hashlib.sha256(b"dir\0" + os.fsencode(root) + b"\0")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            rel = os.path.relpath(full, root)
            h.update(b"%s\0%d\0%d\0%d\0" % (os.fsencode(rel), st.st_mode, st.st_size, st.st_mtime_ns))
    return h.hexdigest()[:32]


def _chown_tree(root: Path, owner: int | None) -> None:
    if owner is None:
        return
    os.lchown(root, owner, owner)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), owner, owner)


def write_files(root: Path, files: dict[str, str]) -> None:
    """Write a dict workspace under ``root`` (paths already checked by :func:`dict_key`)."""
    for path, content in files.items():
        target = root / check_relpath(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode())


def _sweep(parent: Path, prefix: str) -> None:
    for p in parent.glob(prefix + "*"):
        try:
            pid = int(p.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


class LayerCache:
    """Builds, shares and evicts read-only layers (see module invariants); thread-safe."""

    def __init__(self, owner: int | None, max_unused: int = 64) -> None:
        self.owner = owner
        """Uid (and gid) owning every layer's files; None keeps this process's own."""
        self.max_unused = max_unused
        """Layers without references kept for reuse; older ones are deleted."""
        prefix = f"tandem-layers-{_host_tag()}-"
        _sweep(Path(tempfile.gettempdir()), prefix)
        self.pid = os.getpid()
        """The process that made the cache; only it removes the cache at exit."""
        self.root = Path(tempfile.mkdtemp(prefix=f"{prefix}{self.pid}-"))
        os.chmod(self.root, 0o700)
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}
        self._unused: OrderedDict[str, None] = OrderedDict()
        self._building: dict[str, threading.Event] = {}
        self.built = 0
        """Layers built so far (a measure of sharing: sandboxes created minus layers built were free)."""

    def acquire(self, workspace: dict[str, str] | Path) -> tuple[str, Path]:
        """``(key, path)`` of the layer holding ``workspace``, built if needed; pair with :meth:`release`."""
        if isinstance(workspace, dict):
            key = dict_key(workspace)
        else:
            if not Path(workspace).is_dir():
                raise SandboxError(
                    f"workspace directory {str(workspace)!r} does not exist; pass an existing directory"
                )
            check_not_inside(Path(workspace), self.root)
            key = dir_key(Path(workspace))
        path = self.root / key
        while True:
            with self._lock:
                if key in self._refs:
                    self._refs[key] += 1
                    self._unused.pop(key, None)
                    return key, path
                event = self._building.get(key)
                if event is None:
                    self._building[key] = threading.Event()
                    break
            event.wait()  # another thread is building this layer; then take a reference to it
        try:
            self._build(workspace, path)
        except BaseException:
            with self._lock:
                self._building.pop(key).set()
            raise
        with self._lock:
            self._refs[key] = 1
            self.built += 1
            self._building.pop(key).set()
        return key, path

    def _build(self, workspace: dict[str, str] | Path, path: Path) -> None:
        tmp = self.root / f".partial-{next(_ids)}"
        try:
            if isinstance(workspace, dict):
                tmp.mkdir(mode=0o755)
                write_files(tmp, workspace)
            else:
                shutil.copytree(workspace, tmp, symlinks=True)
                os.chmod(tmp, stat.S_IMODE(os.stat(tmp).st_mode) | 0o700)
            _chown_tree(tmp, self.owner)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def retain(self, key: str) -> Path:
        """One more reference to the existing layer ``key``; its path."""
        with self._lock:
            if self._refs.get(key, 0) <= 0 and key not in self._unused:
                raise SandboxError(f"layer {key} is not in this cache (its template was closed?)")
            self._refs[key] = self._refs.get(key, 0) + 1
            self._unused.pop(key, None)
        return self.root / key

    def release(self, key: str) -> None:
        """Drop one reference; an unused layer beyond ``max_unused`` is deleted (oldest first)."""
        doomed: list[Path] = []
        with self._lock:
            n = self._refs.get(key, 0) - 1
            if n < 0:
                return
            self._refs[key] = n
            if n == 0:
                self._unused[key] = None
            while len(self._unused) > self.max_unused:
                old, _ = self._unused.popitem(last=False)
                del self._refs[old]
                doomed.append(self.root / old)
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"layers": len(self._refs), "unused": len(self._unused), "built": self.built}


_caches: dict[int | None, LayerCache] = {}
_caches_lock = threading.Lock()


def layer_cache(owner: int | None) -> LayerCache:
    """This process's layer cache for layers owned by ``owner`` (one per owner)."""
    with _caches_lock:
        cache = _caches.get(owner)
        if cache is None:
            cache = _caches[owner] = LayerCache(owner)
        return cache


def remove_layer_caches() -> None:
    """Delete every layer cache of this process with its directory (at exit: nothing may use them after).
    A forked child only forgets the caches it inherited: they are its parent's."""
    with _caches_lock:
        caches = list(_caches.values())
        _caches.clear()
    for cache in caches:
        if cache.pid == os.getpid():
            shutil.rmtree(cache.root, ignore_errors=True)


class WorkspaceTemplate:
    """A workspace frozen into a shared read-only layer: sandboxes made from it clone it in constant time.

    Invariant: the layer holds the workspace as it was when the template was made (later edits of a source
    directory are not seen); it lives until :meth:`close` (or garbage collection) and every sandbox made
    from it has released it. Its files belong to ``owner``, the agent uid of ``config``.
    """

    def __init__(self, workspace: dict[str, str] | Path, config: SandboxConfig) -> None:
        from tandem.sandbox.limits import agent_uid

        exit_on_signals()
        self.owner = agent_uid(config)
        """Uid owning the layer's files (sandboxes must run as it)."""
        self.cache = layer_cache(self.owner)
        self.key, self.path = self.cache.acquire(workspace)
        self._finalizer = weakref.finalize(self, self.cache.release, self.key)

    def close(self) -> None:
        """Drop the template's own reference to its layer. Idempotent."""
        self._finalizer()

    def __enter__(self) -> WorkspaceTemplate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
