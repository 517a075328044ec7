"""Mid-training (continual pre-training): next-token prediction over packed token-id documents, resumable.

Invariants:
- Packing is a pure function of ``(documents, eos_id, seq_len, seed)``: documents are shuffled, each is
  followed by ``eos_id``, the stream is cut into ``seq_len`` rows (the ragged tail is dropped).
- Which rows form the batch of step ``s`` is a pure function of ``(s, rows, batch_size, seed)`` (one fresh
  permutation per epoch), and the learning rate is a pure function of ``s`` (linear warmup, cosine decay to
  ``min_lr_ratio * lr``). So a checkpoint needs only weights, optimizer state, step and RNG state, and
  ``resume`` continues bit for bit the same trajectory as an uninterrupted run (same threads, same machine).
- Every token is trained on (no loss masking): transcripts teach the tool format, the observations and the
  prompt formats alike; the loss crosses document boundaries as in ordinary pre-training.
- ``<out>/metrics.jsonl`` holds one line per finished step; a resumed run first drops lines past the
  checkpoint, so the file always describes one trajectory.
- A checkpoint is replaced atomically: a save that fails (a full disk) keeps the previous one, leaves no
  partial file and raises :class:`CheckpointWriteError`; a resume from a file that is not a whole
  checkpoint of this model is a ``ValueError`` naming it, before anything in ``<out>`` changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.core import stopping
from tandem.core.errors import TandemError

CHECKPOINT = "checkpoint/state.pt"
CHECKPOINT_KEYS = ("model", "optimizer", "step", "wall_s", "torch_rng", "settings", "data_fingerprint")
"""What a checkpoint holds (a dict saved by ``torch.save``); a resume refuses a file without all of them."""


class CheckpointWriteError(TandemError):
    """A checkpoint or the finished model could not be written (a full disk, most often); the message names
    the file, what is kept and what to do. Nothing half-written is left behind."""


@dataclass
class MidtrainSettings:
    """Optimisation settings of one mid-training run (all recorded in the recipe)."""

    steps: int = 300
    seq_len: int = 1024
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pack(documents: Iterable[list[int]], eos_id: int, seq_len: int, seed: int) -> np.ndarray:
    """Shuffle documents, join them each followed by ``eos_id`` and cut into ``[rows, seq_len]`` int64."""
    docs = [list(d) for d in documents]
    order = np.random.default_rng(seed).permutation(len(docs))
    stream: list[int] = []
    for i in order:
        stream.extend(docs[i])
        stream.append(eos_id)
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one row of seq_len={seq_len}")
    return np.asarray(stream[: rows * seq_len], np.int64).reshape(rows, seq_len)


def batch_rows(step: int, n_rows: int, batch_size: int, seed: int) -> np.ndarray:
    """Row indices of step ``step``'s batch: consecutive slices of a per-epoch permutation."""
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(g, n_rows)
        out.append(np.random.default_rng([seed, epoch]).permutation(n_rows)[pos])
    return np.asarray(out, np.int64)


def lr_at(step: int, s: MidtrainSettings) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio * lr``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    t = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def fingerprint(rows: np.ndarray) -> str:
    return hashlib.sha256(rows.tobytes()).hexdigest()[:16]


def _free_mib(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB free there"
    except OSError:
        return "free space unknown"


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a failure (a full disk: torch says "unexpected pos") leaves the
    previous checkpoint as it was, removes the partial file (it held the room the next save needs) and
    raises :class:`CheckpointWriteError` instead of torch's RuntimeError."""
    import torch

    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        tmp.replace(path)  # atomic: a crash mid-save leaves the previous checkpoint intact
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        kept = (
            "the previous checkpoint there is kept: free disk space and continue with --resume"
            if path.is_file()
            else "no checkpoint was kept: free disk space and start again"
        )
        raise CheckpointWriteError(
            f"could not write the checkpoint {path} ({type(e).__name__}: {e}; {_free_mib(path.parent)}); "
            + kept
        ) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``; a file ``torch.load`` cannot read, or that is not a dict holding every
    ``CHECKPOINT_KEYS``, raises ``ValueError`` naming the file (a damaged archive member or another program's
    archive had raised an unpickling error or a KeyError traceback)."""
    import torch

    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged archive
        raise ValueError(
            f"--resume: {path} cannot be read as a checkpoint ({type(e).__name__}: {e}); it is damaged: "
            "start again in a new --out without --resume"
        ) from e
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"--resume: {path} is not a mid-training checkpoint (it lacks {', '.join(missing)}); start "
            "again in a new --out without --resume"
        )
    return state


def _metrics_through(path: Path, step: int) -> list[str]:
    """The lines of ``path`` (``metrics.jsonl``) for steps up to ``step``, the checkpoint's.

    A last line that does not parse is a write torn by an interruption and is dropped; any other line
    that is not a JSON object with an integer ``step`` raises ``ValueError`` naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume: cannot read {path} ({e}); move it away to resume without it") from e
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            at = row["step"]
            if isinstance(at, bool) or not isinstance(at, int):
                raise TypeError("step is not an integer")
        except (ValueError, KeyError, TypeError) as e:
            if number == len(lines):
                break  # torn by the interruption this run resumes from
            raise ValueError(
                f"--resume: {path} line {number} is not a metrics row ({e}); repair or remove that line "
                f"(or move the file away) and resume again"
            ) from e
        if at <= step:
            kept.append(line)
    return kept


def midtrain(
    model: Any,
    rows: np.ndarray,
    settings: MidtrainSettings,
    out_dir: str | Path,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``model`` on ``rows`` (from ``pack``) in place; return a summary (final loss, steps, times).

    ``resume`` restores ``<out_dir>/checkpoint/state.pt`` (its settings and data fingerprint must match).
    ``stop_after`` ends this invocation after that many total steps (checkpointing first) without changing
    the schedule, as an interruption would. Inside ``tandem.core.stopping.stop_on_signals`` a stop signal
    (Ctrl-C, SIGTERM, SIGHUP) does the same at the end of the running step (``stopped_by`` names it); a
    resume then continues the same trajectory.
    """
    import torch

    s = settings
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, metrics_path = out / CHECKPOINT, out / "metrics.jsonl"
    fp = fingerprint(rows)
    opt = torch.optim.AdamW(
        model.parameters(), lr=s.lr, betas=(s.beta1, s.beta2), weight_decay=s.weight_decay, foreach=False
    )
    step, prior_wall = 0, 0.0
    if resume:
        if not ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; run without --resume first")
        state = _load_checkpoint(ckpt_path)
        if state["settings"] != s.to_dict() or state["data_fingerprint"] != fp:
            raise ValueError(
                f"--resume: checkpoint {ckpt_path} was made with other settings or data "
                f"({state['settings']}, data {state['data_fingerprint']}) than this run ({s.to_dict()}, data "
                f"{fp}); use the same preset and options, or a fresh --out"
            )
        try:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
            step, prior_wall = int(state["step"]), float(state["wall_s"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--resume: {ckpt_path} does not fit this model ({type(e).__name__}: {e}); start again in a "
                "new --out without --resume"
            ) from e
        kept = _metrics_through(metrics_path, step) if metrics_path.is_file() else []
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    else:
        metrics_path.write_text("")
        torch.manual_seed(s.seed)

    def checkpoint(at: int, wall: float) -> None:
        _save_checkpoint(
            ckpt_path,
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": at,
                "wall_s": wall,
                "torch_rng": torch.get_rng_state(),
                "settings": s.to_dict(),
                "data_fingerprint": fp,
            },
        )

    model.train()
    end = s.steps if stop_after is None else min(s.steps, stop_after)
    t0, last_loss = time.monotonic(), float("nan")
    tokens_per_step = s.batch_size * s.seq_len
    with metrics_path.open("a") as mf, stopping.deferred() as stop:
        while step < end:
            lr = lr_at(step, s)
            for g in opt.param_groups:
                g["lr"] = lr
            x = torch.from_numpy(rows[batch_rows(step, len(rows), s.batch_size, s.seed)])
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip if s.grad_clip > 0 else 1e30)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            last_loss = float(loss.item())
            wall = prior_wall + time.monotonic() - t0
            rec = {
                "step": step,
                "loss": last_loss,
                "lr": lr,
                "grad_norm": float(gn),
                "tokens": step * tokens_per_step,
                "wall_s": round(wall, 3),
            }
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            if progress:
                rate = (step * tokens_per_step) / max(wall, 1e-9)
                eta = (s.steps - step) * tokens_per_step / max(rate, 1e-9)
                print(
                    f"midtrain step {step}/{s.steps} loss {last_loss:.4f} lr {lr:.2e} "
                    f"{rate:,.0f} tok/s eta {eta / 60:.1f} min",
                    file=sys.stderr,
                    flush=True,
                )
            saved = step % s.checkpoint_every == 0 or step == end
            if saved:
                checkpoint(step, wall)
            if stop is not None and stop.signum is not None:  # a stop signal: end at this step boundary
                if not saved:
                    checkpoint(step, wall)
                break
    model.eval()
    return {
        "steps_done": step,
        "final_loss": last_loss,
        "wall_s": prior_wall + time.monotonic() - t0,
        "rows": int(len(rows)),
        "tokens_seen": step * tokens_per_step,
        "data_fingerprint": fp,
        "finished": step >= s.steps,
        "stopped_by": stop.name if stop is not None and stop.signum is not None else None,
    }
