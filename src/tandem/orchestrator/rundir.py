"""What a run directory may be started in: a new run never mixes with an old one; a resume says what changed.

Invariants:
- A new run (no ``--resume``) refuses a run directory that already holds a run: a checkpoint, or a
  ``metrics.jsonl`` with rows. Starting there would cut the old metrics and leave its later checkpoints
  beside the new ones, which a later ``--resume`` would load (it takes the highest version).
- A resume reports every field in which its config differs from the run's recorded ``config.toml``
  (``field (old -> new)``), which the run prints before it starts: a change is the user's to make (more
  steps, another mode, a new lr: the trainer applies the config's lr, betas and weight decay over the
  optimizer state it restores), never a silent one. ``tandem train --resume`` without ``--preset`` or
  ``--config`` starts from the recorded file, so a plain resume changes nothing. ``engine.kind = "auto"``
  resumes the engine the run recorded.
- Nothing is written here; ``config.toml`` is written by the caller only after these checks pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.core.config import RunConfig, load_config
from tandem.core.errors import TandemError


def previous_run(run_dir: Path) -> str | None:
    """What in ``run_dir`` shows an earlier run (for the refusal), or None when there is none."""
    from tandem.train.checkpoint import list_checkpoints

    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        return f"{len(checkpoints)} checkpoint(s), the latest {checkpoints[-1][1].name}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return "metrics.jsonl with rows"
    return None


def check_run_dir(cfg: RunConfig, run_dir: Path, resume: bool) -> tuple[RunConfig, list[str]]:
    """The config to run in ``run_dir`` and, for a resume, how it differs from the recorded one (each
    ``field (old -> new)``, for the caller to print), or ``TandemError`` saying what to do."""
    if not resume:
        held = previous_run(run_dir)
        if held is not None:
            raise TandemError(
                f"run dir {str(run_dir)!r} already holds a run ({held}); starting a new one there would mix "
                "the two. Pass --resume to continue it, choose a new --run-dir, or remove that directory"
            )
        return cfg, []
    recorded = run_dir / "config.toml"
    if not recorded.is_file():
        return cfg, []  # nothing to compare (the caller refuses a resume without a checkpoint)
    try:
        saved = load_config(recorded)
    except TandemError as e:  # e.g. written by a tandem with other fields: compare nothing, say so
        return cfg, [f"the recorded {recorded} could not be read ({e}); nothing compared"]
    if cfg.engine.kind == "auto":
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kind": saved.engine.kind})})
    return cfg, [f"{key} ({_shown(old)} -> {_shown(new)})" for key, old, new in config_diff(saved, cfg)]


def config_diff(a: RunConfig, b: RunConfig) -> list[tuple[str, Any, Any]]:
    """``(section.field, value in a, value in b)`` for every field whose values differ."""
    da, db = a.model_dump(), b.model_dump()
    return [
        (f"{section}.{key}", value, db[section].get(key))
        for section, fields in da.items()
        for key, value in fields.items()
        if db[section].get(key) != value
    ]


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
