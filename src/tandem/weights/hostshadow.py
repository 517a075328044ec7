"""One verified copy of the followed weights per host: the shadow the engines of a host share.

A follower decodes each delta against a *shadow* (the published arrays of its version). Engines that share a
host share (``tandem.weights.hostshare``) need only one: the engine that leads a step advances it and writes
the step's patch; the others patch their own weights from that patch and never touch a shadow. So a host
holds one shadow instead of one per engine (host memory: for a large model, one copy of the weights per
engine does not fit) and a delta writes one shadow instead of one per engine (memory traffic the serving
engines of the host pay for).

The shadow lives in the share directory as one flat file (``shadow-<uuid>.bin``, tensors at 64-byte aligned
offsets) mapped shared by every process that leads, plus ``shadow.json``: the file, the tensors' layout, the
version the file holds and whether an update is in progress.

Invariants:
- The shadow and its state are written only under the share's exclusive lock (``HostShare.lock``) and read
  only under it or the shared lock (engines reloading from the shadow, in parallel).
- ``load`` returns a version only for a shadow that was verified at that version: ``begin`` marks the state
  dirty before the holder writes in place, and ``commit`` clears it only with a verified version. A holder
  that dies in between leaves it dirty; the next ``load`` then returns no shadow (the next leader recovers
  from a snapshot), so a half-written shadow is never taken for a version.
- The state file changes by atomic rename; a new layout goes to a new file, and older files are removed
  (a process that still maps one keeps its mapping, but ``load`` re-maps whenever the state names another).
- A new shadow file has all its blocks allocated before it is mapped (``posix_fallocate``): a full
  ``/dev/shm`` is an ``OSError`` from ``commit`` (the new file removed, the state unchanged), never a
  ``SIGBUS`` that kills the process when a store to a sparse page finds no memory.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np

ALIGN = 64
STATE = "shadow.json"


def _layout(tensors: dict[str, np.ndarray]) -> tuple[list[list[object]], int]:
    """(``[name, dtype, shape, offset]`` per tensor in name order, total bytes)."""
    out: list[list[object]] = []
    pos = 0
    for name in sorted(tensors):
        t = tensors[name]
        out.append([name, t.dtype.str, list(t.shape), pos])
        pos += -(-int(t.nbytes) // ALIGN) * ALIGN
    return out, pos


class HostShadow:
    """The host's shadow in share directory ``path`` (see module invariants); one object per process."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)  # normally the share's (checked there)
        self.tensors: dict[str, np.ndarray] | None = None  # views into the mapped file named ``_file``
        self._file: str | None = None
        self._layout: list[list[object]] | None = None

    # -------------------------------------------------------------- state
    def _read_state(self) -> dict | None:
        try:
            state = json.loads((self.path / STATE).read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def _write_state(self, state: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.path / STATE)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _map(self, name: str, layout: list[list[object]]) -> bool:
        """Map file ``name`` with ``layout``; False (nothing mapped) if it is missing or too short."""
        size = max((int(o) + np.dtype(d).itemsize * int(np.prod(s)) for _, d, s, o in layout), default=0)
        try:
            with open(self.path / name, "r+b") as f:
                if os.fstat(f.fileno()).st_size < size or size == 0:
                    return False
                mm = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            return False
        self.tensors = {
            str(n): np.frombuffer(mm, np.dtype(d), int(np.prod(s)), int(o)).reshape(s)
            for n, d, s, o in layout
        }
        self._file, self._layout = name, layout
        return True

    # -------------------------------------------------------------- API (under the share's lock: see module)
    def load(self) -> tuple[int | None, dict[str, np.ndarray] | None]:
        """The shadow's verified version and its arrays (writable views into the shared file), or
        ``(None, None)`` when there is none, an update was left unfinished, or its file is unreadable."""
        state = self._read_state()
        if state is None or state.get("dirty") or state.get("version") is None:
            return None, None
        if state["file"] != self._file or state["tensors"] != self._layout:
            self.tensors = None
            if not self._map(state["file"], state["tensors"]):
                return None, None
        return int(state["version"]), self.tensors

    def begin(self) -> None:
        """Mark the shadow as being updated in place: until ``commit``, ``load`` returns no shadow."""
        state = self._read_state()
        if state is not None and not state.get("dirty"):
            self._write_state({**state, "dirty": True})

    def commit(self, version: int, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Record ``tensors`` (verified at ``version``) as the shadow: kept in place when they are this
        object's views, copied into the mapped file otherwise (into a new file when the layout differs).
        Returns the shadow's arrays (views into the file)."""
        mine = self.tensors is not None and len(tensors) == len(self.tensors)
        if not (mine and all(tensors.get(n) is t for n, t in self.tensors.items())):
            layout, size = _layout(tensors)
            if layout != self._layout or self.tensors is None:
                self._create(layout, size)
            assert self.tensors is not None
            for name, t in tensors.items():
                np.copyto(self.tensors[name], t)
        assert self._file is not None
        self._write_state(
            {"file": self._file, "tensors": self._layout, "version": int(version), "dirty": False}
        )
        self._collect()
        return self.tensors

    def drop(self) -> None:
        """Forget the shadow (e.g. after a failed recovery): ``load`` returns none until the next commit."""
        state = self._read_state()
        if state is not None:
            self._write_state({**state, "version": None, "dirty": False})

    def _create(self, layout: list[list[object]], size: int) -> None:
        name = f"shadow-{uuid.uuid4().hex}.bin"  # never reused: a stale mapping can never match the state
        path = self.path / name
        try:
            with open(path, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(size, 1))  # module invariants: no SIGBUS when full
        except OSError as e:
            path.unlink(missing_ok=True)
            why = f"host shadow: cannot allocate {size} bytes for {path} ({e.strerror})"
            todo = f"free space in {self.path.parent} or turn weights.host_share off"
            raise OSError(e.errno, f"{why}; {todo}") from None
        if not self._map(name, layout):
            path.unlink(missing_ok=True)
            raise OSError(f"host shadow: could not map the new file {path}")

    def _collect(self) -> None:
        for p in self.path.glob("shadow-*.bin"):
            if p.name != self._file:
                with contextlib.suppress(OSError):
                    p.unlink()
