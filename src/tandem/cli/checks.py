"""Option checks shared by commands that run long (``tandem midtrain``, ``serve``, ``train``, ``eval``): each
returns the message of the one ``error:`` line a refusal prints, or None, before anything is loaded or
trained.

Invariants: a check never leaves anything behind when it refuses (``writable_dir_problem`` removes the
directories it made and its probe files); the messages name the option, the value and what to do.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tandem.core.config import MAX_THREADS

GIB = 2**30


def threads_problem(flag: str, value: int) -> str | None:
    """Why ``value`` cannot be a torch thread count, or None."""
    if value < 1:
        return f"{flag} must be >= 1, got {value}"
    if value > MAX_THREADS:
        return f"{flag} must be <= {MAX_THREADS} (more threads than any machine has cores), got {value}"
    return None


def writable_dir_problem(flag: str, path: Path, keep: bool = True) -> str | None:
    """Why ``path`` cannot be made (if missing) and written as an ordinary directory, or None.

    Creates the missing directories and a probe file and a probe subdirectory in ``path`` (then deletes the
    probes): the only test that works as root and on pseudo file systems (``/proc``, ``/sys``). On a refusal
    every directory it made is removed again; on success ``path`` exists (empty, if it did not before),
    unless ``keep`` is False: then what it made is removed on success too (a check before other checks,
    which must leave nothing behind when they refuse)."""
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
        if not keep:
            for d in reversed(made):
                d.rmdir()
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


def kv_cache_bytes(path: Path, slots: int, seq_len: int, dtype: str) -> int | None:
    """Bytes of the KV cache an engine preallocates for ``slots`` sequences of ``seq_len`` tokens of the model
    in ``path`` (keys and values, every layer), from its config.json; None when config.json does not say
    (the model loader then names what is wrong with it)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        layers = int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, AttributeError):
        return None
    return 2 * layers * slots * kv_heads * seq_len * head_dim * (4 if dtype == "float32" else 2)


def kv_memory_problem(
    path: Path, max_batch: tuple[str, int], max_parked: tuple[str, int], max_seq_len: tuple[str, int],
    dtype: str, engines: int = 1,
) -> str | None:  # fmt: skip
    """Why ``engines`` KV caches of these sizes (each ``(option name, value)``) cannot fit this machine's
    physical memory, or None: a cache past a C long crashed in ``torch.zeros``, and a smaller one past memory
    failed to allocate inside an engine (in a run: an actor's traceback after Ray had started)."""
    one = kv_cache_bytes(path, max_batch[1] + max_parked[1], max_seq_len[1], dtype)
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if one is None or one * engines <= have:
        return None
    caches = (
        f"{engines} KV caches (one per engine) of {one / GIB:.3g} GiB each"
        if engines > 1
        else f"a KV cache of {one / GIB:.3g} GiB"
    )
    return (
        f"{max_batch[0]} ({max_batch[1]}) + {max_parked[0]} ({max_parked[1]}) sequences of "
        f"{max_seq_len[0]} ({max_seq_len[1]}) tokens need {caches} for this model in {dtype}, more than this "
        f"machine's {have / GIB:.3g} GiB of memory; lower them"
    )
