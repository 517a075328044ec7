"""Option checks shared by commands that run long (``tandem midtrain``, ``tandem serve``): each returns the
message of the one ``error:`` line a refusal prints, or None, before anything is loaded or trained.

Invariants: a check never leaves anything behind when it refuses (``writable_dir_problem`` removes the
directories it made and its probe files); the messages name the option, the value and what to do.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

MAX_THREADS = 1024
"""Most torch threads an option accepts: beyond a C int torch refuses the value with an unclear error, and
at 100000 a process crashed (SIGSEGV); no machine this runs on has more cores than this."""


def threads_problem(flag: str, value: int) -> str | None:
    """Why ``value`` cannot be a torch thread count, or None."""
    if value < 1:
        return f"{flag} must be >= 1, got {value}"
    if value > MAX_THREADS:
        return f"{flag} must be <= {MAX_THREADS} (more threads than any machine has cores), got {value}"
    return None


def writable_dir_problem(flag: str, path: Path) -> str | None:
    """Why ``path`` cannot be made (if missing) and written as an ordinary directory, or None.

    Creates the missing directories and a probe file and a probe subdirectory in ``path`` (then deletes the
    probes): the only test that works as root and on pseudo file systems (``/proc``, ``/sys``). On a refusal
    every directory it made is removed again; on success ``path`` exists (empty, if it did not before)."""
    made: list[Path] = []
    try:
        missing = []
        node = path
        while not node.exists() and node != node.parent:
            missing.append(node)
            node = node.parent
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        if not path.is_dir():
            return f"{flag} {str(path)!r} is not a directory; pass a new or empty directory"
        fd, probe = tempfile.mkstemp(prefix=".tandem-probe-", dir=path)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(probe)
        os.rmdir(tempfile.mkdtemp(prefix=".tandem-probe-", dir=path))
    except OSError as e:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        reason = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        return (
            f"{flag} {str(path)!r} cannot be written ({reason}); pass a directory on a writable file "
            "system (not under /proc or /sys)"
        )
    return None
