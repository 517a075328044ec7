"""Numba's on-disk kernel cache, invalidated when any kernel source of the package changes.

Numba keys a cached function by the modification time and size of the file that defines it, and nothing
else. A codec kernel that calls (and so inlines) a helper from another module kept its old machine code
after that module changed: an in-place upgrade (``git pull`` in an editable install) ran the new Python
beside stale compiled kernels until ``__pycache__`` was cleared (measured on ``patch_quads`` after a change
to a helper it calls).

Invariants:
- ``install(directory)`` puts locators in front of numba's own, for functions defined in a file directly
  inside ``directory`` only: the same cache places as numba's (``NUMBA_CACHE_DIR`` when set, else the
  source's ``__pycache__``, else the user-wide cache), with a source stamp that adds a digest of every
  kernel source of ``directory`` (each ``*.py`` file there that mentions ``njit``, by content). Any change
  to one of them invalidates every cached kernel of the directory; a cache entry is only ever used with
  the sources it was compiled from.
- Functions elsewhere (other packages' numba code) keep numba's own locators untouched.
- ``install`` runs before the directory's first ``@njit(cache=True)`` decorator (numba picks a function's
  locator when it is decorated) and is idempotent per directory. On a numba without these internals it
  does nothing: caching then works as numba's default does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from numba.core import caching

_installed: set[str] = set()


def sources_digest(directory: str | Path) -> str:
    """SHA-256 over the names and contents of the kernel sources directly in ``directory`` (the ``*.py``
    files that mention ``njit``), in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.py")):
        data = path.read_bytes()
        if b"njit" in data:
            h.update(path.name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _numba_locators() -> tuple[type | None, list[type]]:
    """numba's cache implementation class and its file-backed locator classes, in its order (names as in
    numba 0.65; the same names with a leading underscore are tried for other releases)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    found = [getattr(caching, n, None) or getattr(caching, "_" + n, None) for n in names]
    return impl, [c for c in found if c is not None]


def install(directory: str | Path) -> bool:
    """Register the stamped locators for ``directory`` (module invariants); True when they are in place."""
    directory = os.path.realpath(directory)
    if directory in _installed:
        return True
    impl, bases = _numba_locators()
    if impl is None or not bases or not isinstance(getattr(impl, "_locator_classes", None), list):
        return False
    digest = sources_digest(directory)

    def stamped(base: type) -> type:
        class Stamped(base):  # type: ignore[misc, valid-type]
            """numba's ``base`` for the kernels of one directory, stamped with their sources' digest."""

            kernel_directory = directory
            kernel_digest = digest

            def get_source_stamp(self):  # noqa: ANN202 - numba's interface: any picklable object
                return (super().get_source_stamp(), self.kernel_digest)

            @classmethod
            def from_function(cls, py_func, py_file):  # noqa: ANN206
                if os.path.dirname(os.path.realpath(py_file)) != cls.kernel_directory:
                    return None
                return super().from_function(py_func, py_file)

        Stamped.__name__ = Stamped.__qualname__ = "Stamped" + base.__name__.lstrip("_")
        return Stamped

    impl._locator_classes[:0] = [stamped(b) for b in bases]
    _installed.add(directory)
    return True
