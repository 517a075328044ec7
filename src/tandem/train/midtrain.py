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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.core import stopping

CHECKPOINT = "checkpoint/state.pt"


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


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a crash mid-save leaves the previous checkpoint intact


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
        state = torch.load(ckpt_path, weights_only=False)
        if state["settings"] != s.to_dict() or state["data_fingerprint"] != fp:
            raise ValueError(
                f"--resume: checkpoint {ckpt_path} was made with other settings or data "
                f"({state['settings']}, data {state['data_fingerprint']}) than this run ({s.to_dict()}, data "
                f"{fp}); use the same preset and options, or a fresh --out"
            )
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        step, prior_wall = int(state["step"]), float(state["wall_s"])
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
