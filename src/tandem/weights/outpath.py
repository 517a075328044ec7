"""Output paths of user-facing writers (``tandem weights diff -o`` / ``apply -o``): one atomic write helper.

Invariants:
- ``atomic_output(path)`` writes to a fresh temporary file beside ``path`` (created with ``O_EXCL``, so it
  never follows or reuses an existing name), fsyncs it and renames it over ``path``. On any failure (the
  write, the fsync or the rename) the temporary file is removed and ``path`` is left as it was.
- An existing ``path`` is replaced only if it is a regular file: a symlink (not followed), device, FIFO,
  socket or directory is refused with ``OutputPathError`` naming the path, before anything is written and
  again just before the rename.
- ``check_not_input`` refuses an output that is (the same file as) one of the command's inputs.
- ``check_output_dir`` accepts a directory output only if it does not exist yet or is an empty real
  directory, so a model directory is never written beside another version's files.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from tandem.core.errors import TandemError


class OutputPathError(TandemError, ValueError):
    """An output path that must not be written: not a regular file, an input, or a non-empty directory."""


_KINDS = (
    (stat.S_ISREG, "file"),
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def check_output_file(path: str | Path) -> None:
    """Refuse an existing ``path`` that is not a regular file (a symlink is refused, not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OutputPathError(
            f"output {str(path)!r} exists and is a {_kind(mode)}, not a regular file; it was left untouched: "
            f"pass a new path or an existing regular file to overwrite"
        )


def check_output_dir(path: str | Path) -> None:
    """Refuse an existing ``path`` that is not an empty real directory (symlinks are not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise OutputPathError(
            f"output directory {str(path)!r} exists and is a {_kind(mode)}, not a directory; it was left "
            f"untouched: choose an empty or new directory"
        )
    with os.scandir(path) as entries:
        if next(entries, None) is not None:
            raise OutputPathError(
                f"output directory {str(path)!r} is not empty; nothing was written (its files would be mixed "
                f"with the new version's): choose an empty or new directory"
            )


def check_not_input(output: str | Path, inputs: Iterable[tuple[str, str | Path]], option: str = "-o") -> None:
    """Refuse ``output`` when it is the same file or directory as one of ``inputs`` (``(label, path)``)."""
    for label, path in inputs:
        try:
            same = os.path.samefile(output, path)
        except OSError:  # either side does not exist: they cannot be the same
            continue
        if same:
            raise OutputPathError(
                f"{option} {str(output)!r} is {label} ({str(path)!r}); it would be overwritten while it is "
                f"an input: write the output to another path"
            )


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; renamed over ``path`` when the block succeeds."""
    path = Path(path)
    check_output_file(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_output_file(path)  # again: it may have been replaced while we wrote
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
