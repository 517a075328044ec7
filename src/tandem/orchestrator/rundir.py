"""What a run directory may be started in: a new run never mixes with an old one, a resume keeps its config.

Invariants:
- A new run (no ``--resume``) refuses a run directory that already holds a run: a checkpoint, or a
  ``metrics.jsonl`` with rows. Starting there would cut the old metrics and leave its later checkpoints
  beside the new ones, which a later ``--resume`` would load (it takes the highest version).
- A resume keeps what the run's recorded ``config.toml`` trained with: a change in ``FIXED_ON_RESUME``
  (model, train, rollout, reward, tasks; ``RESUMABLE`` excepted) is refused naming each field with both
  values, since the checkpoint's weights, optimizer state and data were produced by the recorded settings
  (an lr set on resume was silently overridden by the optimizer's saved one). Infrastructure (how long,
  sync or async, engines, weight transport, sandbox, evaluation) may change. ``engine.kind = "auto"``
  resumes the engine the run recorded, so every session of a run serves with the same engine.
- Nothing is written here; ``config.toml`` is written by the caller only after these checks pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.core.config import RunConfig, load_config
from tandem.core.errors import TandemError

FIXED_ON_RESUME = ("model.", "train.", "rollout.", "reward.", "tasks.")
"""Config sections a ``--resume`` may not change: what the checkpoint's weights and optimizer state were
trained on and with (the run's infrastructure, ``orchestrator``, ``engine``, ``weights``, ``sandbox`` and
``eval``, may change), except the fields of ``RESUMABLE``."""
RESUMABLE = ("train.threads", "train.checkpoint_every")


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


def check_run_dir(cfg: RunConfig, run_dir: Path, resume: bool) -> RunConfig:
    """The config to run in ``run_dir`` (see module invariants), or ``TandemError`` saying what to do."""
    if not resume:
        held = previous_run(run_dir)
        if held is not None:
            raise TandemError(
                f"run dir {str(run_dir)!r} already holds a run ({held}); starting a new one there would mix "
                "the two. Pass --resume to continue it, choose a new --run-dir, or remove that directory"
            )
        return cfg
    recorded = run_dir / "config.toml"
    if not recorded.is_file():
        return cfg  # nothing to keep (the caller refuses a resume without a checkpoint)
    saved = load_config(recorded)
    if cfg.engine.kind == "auto":
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kind": saved.engine.kind})})
    changed = [
        f"{key} ({_shown(old)} -> {_shown(new)})"
        for key, old, new in config_diff(saved, cfg)
        if key.startswith(FIXED_ON_RESUME) and key not in RESUMABLE
    ]
    if changed:
        raise TandemError(
            f"--resume with settings that differ from the run's {recorded}: {'; '.join(changed)}. A resume "
            f"continues the recorded run: the sections {', '.join(FIXED_ON_RESUME)} may not change (but "
            f"{', '.join(RESUMABLE)} may); drop those --set/--preset/--config changes, or start a new run "
            "in a new --run-dir"
        )
    return cfg


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
