"""Task sources: the one place that turns ``(tasks.source, split, n)`` into tasks.

Invariants:
- ``builtin`` selection is exactly what training and evaluation used before sources existed:
  ``task_at`` is ``generate_task("train", i, seed, levels[i % len(levels)])`` and ``tasks_for`` is
  ``task_split(split, seed, levels, n)``, byte for byte.
- ``humaneval`` ignores seed and levels; both splits are the same 164 problems (see ``tandem.env.humaneval``),
  ``tasks_for`` takes the first ``min(n, 164)`` and ``task_at`` cycles over them.
- ``repo`` ignores seed and levels; its splits are disjoint fixed lists (see ``tandem.env.repos``),
  ``tasks_for`` takes the first ``min(n, len(split))`` and ``task_at`` cycles over the split.
- Every task id returned here rebuilds with ``tandem.env.tasks.get_task``.
"""

from __future__ import annotations

from typing import Any

from tandem.core.config import TaskConfig
from tandem.core.records import Task, TaskLimits
from tandem.env import humaneval, repos
from tandem.env.families import FAMILIES_BY_LEVEL
from tandem.env.tasks import HELDOUT_FRACTION, generate_task, task_split

SOURCES = ("builtin", "humaneval", "repo")
SPLITS = ("train", "heldout")


def _check(source: str, split: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"task source {source!r} is unknown; choose one of {', '.join(SOURCES)}")
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


def tasks_for(config: TaskConfig, split: str, n: int, limits: TaskLimits | None = None) -> list[Task]:
    """``n`` tasks of ``split`` from ``config.source`` (fewer when the source has fewer), deterministic."""
    _check(config.source, split)
    if config.source == "humaneval":
        return humaneval.task_list(n, limits)
    if config.source == "repo":
        return repos.task_list(split, n, limits)
    return task_split(split, config.seed, config.levels, n, limits)


def task_at(config: TaskConfig, split: str, index: int, limits: TaskLimits | None = None) -> Task:
    """The ``index``-th task of an endless stream over ``split`` of ``config.source``."""
    _check(config.source, split)
    if config.source == "humaneval":
        return humaneval.task_at(index, limits)
    if config.source == "repo":
        return repos.task_at(split, index, limits)
    levels = config.levels
    return generate_task(split, index, config.seed, levels[index % len(levels)], limits)


def describe() -> dict[str, Any]:
    """Every source with its task counts per split (None: unbounded) and per level."""
    n_he = len(humaneval.problems())
    return {
        "builtin": {
            "kind": "procedural",
            "id_format": "builtin:<split>:s<seed>:l<level>:<index>",
            "splits": {"train": None, "heldout": None},
            "heldout_fraction": HELDOUT_FRACTION,
            "families_per_level": {str(lv): len(f) for lv, f in sorted(FAMILIES_BY_LEVEL.items())},
        },
        "humaneval": {
            "kind": "fixed",
            "id_format": "humaneval:HumanEval/<n>",
            "splits": {"train": n_he, "heldout": n_he},
            "tasks": n_he,
        },
        "repo": repos.describe(),
    }
