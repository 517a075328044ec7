"""Atomic checkpoint directories and finding the latest one of a run.

Layout of a run: ``<run_dir>/checkpoints/step_000010/``, ``.../step_000020/``, ``.../final/``. Each checkpoint
directory is itself a loadable HF model directory (``config.json``, ``model.safetensors``, tokenizer files)
plus the trainer's resumable state (``trainer_state.json``, ``optimizer.pt``, ``rng.pt``), so
``tandem eval --model run/checkpoints/final`` and ``tandem train --resume`` both work on it.

Invariants:
- A checkpoint directory exists under its final name only when complete: it is written to a hidden temporary
  sibling and renamed into place; ``trainer_state.json`` (carrying ``"complete": true``) is written last.
- ``trainer_state.json`` records the BLAKE3 hash of every other file; loading verifies them first
  (``verify_files``), so a damaged checkpoint is refused naming the file instead of resuming into NaN weights.
- Replacing an existing checkpoint of the same name never leaves a moment with neither the old nor the new one
  complete on disk except between two renames; a crash leaves at most a hidden ``.tmp``/``.old`` sibling that
  :func:`latest_checkpoint` ignores and the next write cleans up, also when the crashed writer was another
  process (a trainer killed mid-save, then a resumed run): a sibling is removed once its writer's pid is
  gone, and an ``.old`` one only when the checkpoint it replaced is in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3

from tandem.core.errors import TandemError
from tandem.core.procs import pid_alive


class CheckpointError(TandemError, ValueError):
    """A checkpoint's files do not match what was written (see ``verify_files``)."""


class IncompleteCheckpointError(CheckpointError):
    """A readable state without ``"complete": true``: a checkpoint that was never finished, which
    ``list_checkpoints`` skips (every other damage to a state is refused)."""


STATE_FILE = "trainer_state.json"
FORMAT = 1
"""Version of the checkpoint format written by this module."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, version: int) -> Path:
    """Directory of the checkpoint of policy version ``version`` in a run."""
    return checkpoints_dir(run_dir) / f"step_{version:06d}"


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory; on normal exit rename it to ``target`` (replacing it)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    for p in (tmp, old):
        if p.exists():
            shutil.rmtree(p)
    _remove_dead_writers(target.parent)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        if target.exists():
            os.rename(target, old)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            os.rename(old, target)  # put the previous checkpoint back
        raise
    shutil.rmtree(old, ignore_errors=True)


_SIBLING = re.compile(r"\.(.+)\.(tmp|old)-(\d+)")


def _remove_dead_writers(parent: Path) -> None:
    """Remove the ``.NAME.tmp-PID``/``.NAME.old-PID`` siblings in ``parent`` whose writer (PID, on this
    host: a run's checkpoints are written by its one trainer) is gone; an ``.old`` one only when NAME is
    in place, since between the two renames it is the only complete copy."""
    for p in parent.iterdir():
        m = _SIBLING.fullmatch(p.name)
        if m is None or not p.is_dir() or pid_alive(int(m.group(3))):
            continue
        if m.group(2) == "old" and not (parent / m.group(1)).is_dir():
            continue
        shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_state(ckpt_dir: str | Path, state: dict[str, Any]) -> None:
    """Write ``trainer_state.json`` (call last: its presence with ``complete`` marks the checkpoint whole),
    with the BLAKE3 hash of every other file of the checkpoint (``files``, checked by ``verify_files``)."""
    data = {"format": FORMAT, **state, "files": _file_hashes(Path(ckpt_dir)), "complete": True}
    path = Path(ckpt_dir) / STATE_FILE
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """Read and check ``trainer_state.json`` of a checkpoint directory: ``FileNotFoundError`` when there is
    none, ``CheckpointError`` naming the file when it is unreadable, not a complete state of this format, or
    lacks an integer ``version``."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{ckpt_dir} is not a trainer checkpoint (no {STATE_FILE}); pass a directory written by "
            "Trainer.save_checkpoint, e.g. <run_dir>/checkpoints/step_000010"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # truncated, not UTF-8, not JSON: it was damaged after it was written
        raise CheckpointError(
            f"{path} cannot be read ({type(e).__name__}: {e}){_move_hint(Path(ckpt_dir))}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(data).__name__}, not an object{_move_hint(Path(ckpt_dir))}"
        )
    if not data.get("complete"):
        raise IncompleteCheckpointError(f"checkpoint {ckpt_dir} is incomplete{_move_hint(Path(ckpt_dir))}")
    if data.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has format {data.get('format')!r}, this tandem reads {FORMAT}"
        )
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise CheckpointError(
            f"{path}: version {version!r} is not a non-negative integer{_move_hint(Path(ckpt_dir))}"
        )
    if not isinstance(data.get("files", {}), dict):
        raise CheckpointError(f"{path}: 'files' is not an object{_move_hint(Path(ckpt_dir))}")
    return data


def _move_hint(ckpt_dir: Path) -> str:
    """What to do about a damaged checkpoint: resume from the run's latest earlier one."""
    root = ckpt_dir.parent
    earlier = sorted(
        p.name for p in root.iterdir() if p.is_dir() and p != ckpt_dir and not p.name.startswith(".")
    )
    if not earlier:
        return "; no other checkpoint of this run exists"
    return f"; move {ckpt_dir.name} out of {root} to resume from an earlier checkpoint ({', '.join(earlier)})"


def _file_hashes(ckpt_dir: Path) -> dict[str, str]:
    out = {}
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file() and p.name != STATE_FILE:
            out[p.relative_to(ckpt_dir).as_posix()] = _hash(p)
    return out


def _hash(path: Path) -> str:
    h = blake3.blake3(max_threads=4)
    h.update_mmap(path)  # streamed: a large optimizer state is never read into memory whole
    return h.hexdigest()


def verify_files(ckpt_dir: str | Path, state: dict[str, Any]) -> None:
    """Check every file the checkpoint recorded against its hash (checkpoints written before hashes were
    recorded have nothing to check); a missing, truncated or damaged file raises ``CheckpointError`` naming
    it and the run's earlier checkpoints."""
    ckpt_dir = Path(ckpt_dir)
    for name, want in state.get("files", {}).items():
        p = ckpt_dir / name
        try:
            got = _hash(p)
        except OSError as e:  # a missing file has strerror; others may not (it had said "(None)")
            problem = f"cannot be read ({e.strerror or type(e).__name__})"
        else:
            if got == want:
                continue
            problem = "does not match the hash recorded when it was written (damaged or truncated)"
        raise CheckpointError(f"checkpoint {ckpt_dir}: {name} {problem}{_move_hint(ckpt_dir)}")


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds a readable, complete checkpoint."""
    try:
        read_state(path)
    except (OSError, ValueError):
        return False
    return True


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as ``(version, path)``, oldest first (hidden temporaries and directories
    without a ``trainer_state.json`` or with an incomplete one are ignored; a checkpoint whose state is
    damaged raises ``CheckpointError`` naming it)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(".") or not p.is_dir() or not (p / STATE_FILE).is_file():
            continue  # a hidden temporary, or not a checkpoint at all
        try:  # a damaged state is refused (CheckpointError), never skipped: skipping the latest had resumed
            version = read_state(p)["version"]  # from an earlier one silently, repeating its steps in metrics
        except IncompleteCheckpointError:
            continue
        # step_* and `final` can hold the same version (same weights); order ties deterministically.
        found.append((version, p.name == "final", p))
    found.sort(key=lambda t: (t[0], t[1], t[2].name))
    return [(v, p) for v, _, p in found]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Path of the complete checkpoint with the highest version under ``<run_dir>/checkpoints``, or None."""
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None
