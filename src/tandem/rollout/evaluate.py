"""Held-out evaluation: pass@k with the unbiased estimator of Chen et al. 2021 (HumanEval/Codex paper).

Invariants: a sample passes only if its reward component ``pass_fraction`` is 1 (all hidden tests passed);
an evaluation in which no session could be graded (each ended by an engine or sandbox error) raises
``EvaluationError`` with the first reason instead of reporting pass@1 = 0 (``session_error_rate`` reports
partial failures);
``pass@k`` is the mean over tasks of 1 - C(n-c, k) / C(n, k), defined only for k <= n samples per task.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from tandem.core.errors import TandemError
from tandem.core.records import Task
from tandem.env.harness import session_error
from tandem.rollout.worker import RolloutWorker


class EvaluationError(TandemError, RuntimeError):
    """No session of an evaluation could be graded (every one ended by an engine or sandbox error)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with ``n`` samples of which ``c`` passed."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_passed(reward_components: dict[str, float]) -> bool:
    return reward_components.get("pass_fraction", 0.0) >= 1.0


async def evaluate(
    worker: RolloutWorker,
    tasks: list[Task],
    samples_per_task: int,
    ks: tuple[int, ...] = (1,),
    temperature: float | None = None,
    concurrency: int = 16,
) -> dict[str, Any]:
    """Sample every task ``samples_per_task`` times and report pass@k, per-level pass@1 and session stats."""
    for k in ks:
        if k > samples_per_task:
            raise ValueError(f"pass@{k} needs eval.samples_per_task >= {k}, got {samples_per_task}")
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task):
        async with sem:
            return await worker.run_group(task, samples_per_task, temperature)

    groups = await asyncio.gather(*(one(t) for t in tasks))
    trajs = [t for g in groups for t in g.trajectories]
    errors = [e for t in trajs if (e := session_error(t)) is not None]
    if trajs and len(errors) == len(trajs):
        raise EvaluationError(
            f"every one of the {len(trajs)} evaluation sessions failed before it could be graded, e.g. "
            f"{errors[0]}"
        )
    result: dict[str, Any] = {"n": len(tasks), "samples_per_task": samples_per_task}
    per_task = [(g.task_id, sum(sample_passed(t.reward.components) for t in g.trajectories)) for g in groups]
    for k in ks:
        result[f"pass@{k}"] = sum(pass_at_k(samples_per_task, c, k) for _, c in per_task) / max(1, len(tasks))
    by_level: dict[str, list[float]] = {}
    for task, (_, c) in zip(tasks, per_task, strict=True):
        level = str(task.meta.get("level", "?"))
        by_level.setdefault(level, []).append(c / samples_per_task)
    result["pass@1_by_level"] = {lv: sum(v) / len(v) for lv, v in sorted(by_level.items())}
    result["session_error_rate"] = len(errors) / max(1, len(trajs))
    result["submitted_rate"] = sum(t.flags.get("submitted", False) for t in trajs) / max(1, len(trajs))
    result["malformed_per_session"] = sum(t.tool_stats.get("malformed_calls", 0) for t in trajs) / max(
        1, len(trajs)
    )
    result["mean_reward"] = sum(t.reward.value for t in trajs) / max(1, len(trajs))
    return result
