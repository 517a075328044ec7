"""Rollout worker: runs the G sessions of a task concurrently and returns them as a ``Group``.

Invariants: a group holds exactly ``group_size`` trajectories of the same task, or the call raises (the
caller requeues the task); sessions of one group share nothing but the task; every session's sampling seed
is distinct so the group explores. With ``rollout.harness_command`` the sessions are runs of that external
harness through this worker's gateway (``tandem.rollout.external``); the harness chooses its own sampling
parameters.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from tandem.core.config import RunConfig
from tandem.core.generation import ChatFormat, SamplingParams
from tandem.core.records import Group, Task, TaskLimits
from tandem.env.harness import GenerateFn, run_session

MAX_TASK_ATTEMPTS = 3  # failed groups of one task after which the stream drops it


class TaskStream:
    """An endless, deterministic stream of training-split tasks of ``tasks.source`` from index
    ``tasks.train_start`` on (builtin: cycling over the configured levels; see
    ``tandem.env.sources.task_at``).

    Requeued tasks (from failed groups) are served before new ones; a task whose groups failed
    ``MAX_TASK_ATTEMPTS`` times is dropped instead (its failure is deterministic, e.g. a prompt longer
    than the engine's context, and requeueing it forever would starve the stream).

    Worker ``i`` of ``n`` draws the indices ``train_start + i + k * n``, from the first of them at or past
    ``cursor`` on. ``cursor`` (the index past the last new task drawn) is where the stream goes on: a resumed
    run starts its workers at the cursor its checkpoint saved, and a restarted worker its own stream at the
    cursor it last reported (``skip_to``), so neither trains on the tasks from the start again. Indices
    below a cursor that no worker drew are skipped, never drawn twice.
    """

    def __init__(self, cfg: RunConfig, worker_index: int = 0, num_workers: int = 1, cursor: int = 0) -> None:
        self._cfg = cfg
        self._first = cfg.tasks.train_start + worker_index
        self._stride = num_workers
        self._next = self._first
        self.cursor = cfg.tasks.train_start
        """The index past the last new task this stream drew (where it goes on; see the class docstring)."""
        self._requeued: list[Task] = []
        self._failures: dict[str, int] = {}  # task id -> failed groups so far
        self.skip_to(cursor)

    def skip_to(self, cursor: int) -> None:
        """Go on from the first of this stream's indices at or past ``cursor`` (never back)."""
        if cursor > self._next:
            self._next += -(-(cursor - self._next) // self._stride) * self._stride
        self.cursor = max(self.cursor, cursor)

    def requeue(self, task: Task) -> bool:
        """Serve ``task`` again next; False (and not requeued) once it has failed ``MAX_TASK_ATTEMPTS``
        times."""
        n = self._failures[task.id] = self._failures.get(task.id, 0) + 1
        if n >= MAX_TASK_ATTEMPTS:
            return False
        self._requeued.append(task)
        return True

    def __next__(self) -> Task:
        from tandem.env.sources import task_at

        if self._requeued:
            return self._requeued.pop(0)
        index, self._next = self._next, self._next + self._stride
        self.cursor = max(self.cursor, index + 1)
        return apply_limits(task_at(self._cfg.tasks, "train", index), self._cfg)

    def __iter__(self) -> TaskStream:
        return self


def apply_limits(task: Task, cfg: RunConfig) -> Task:
    """Give a task the session limits of the run config."""
    task.limits = TaskLimits(cfg.tasks.max_turns, cfg.tasks.max_tokens, cfg.tasks.wall_time_s)
    return task


class RolloutWorker:
    """Runs groups of sessions with one generate function and chat format."""

    def __init__(self, generate: GenerateFn, chat: ChatFormat, cfg: RunConfig, seed: int = 0) -> None:
        self.generate = generate
        self.chat = chat
        self.cfg = cfg
        self._seeds = itertools.count(seed * 1_000_003 + 1)
        self._external: Any = None

    def external(self) -> Any:
        """The external-harness gateway of this worker (started on first use, in the running loop)."""
        if self._external is None:
            from tandem.rollout.external import ExternalHarness

            self._external = ExternalHarness(self.generate, self.chat, self.cfg)
        return self._external

    def close(self) -> None:
        """Stop the external-harness gateway, if one was started."""
        if self._external is not None:
            self._external.close()
            self._external = None

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            seed=next(self._seeds),
        )

    async def run_group(
        self, task: Task, group_size: int | None = None, temperature: float | None = None
    ) -> Group:
        """Run ``group_size`` sessions of ``task`` concurrently."""
        n = self.cfg.rollout.group_size if group_size is None else group_size
        if self.cfg.rollout.harness_command:
            harness = self.external()
            trajectories = await asyncio.gather(*(harness.run_session(task, temperature) for _ in range(n)))
            return Group(task.id, list(trajectories))
        sessions = [
            run_session(
                task,
                self.generate,
                self.chat,
                self.sampling(temperature),
                self.cfg.sandbox,
                self.cfg.reward,
            )
            for _ in range(n)
        ]
        trajectories = await asyncio.gather(*sessions)
        return Group(task.id, list(trajectories))
