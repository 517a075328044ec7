"""The run's rollout workers, which of them are producing, and what happens when one dies.

Invariants:
- Each live worker runs exactly one ``produce`` call, named in the buffer's credit accounting by a producer
  token ``"<index>.<incarnation>"`` (``BufferActor``); the driver waits on those calls together with the
  buffer's ``take`` (:meth:`RolloutCrew.take`), so a worker's end is seen while the trainer waits for groups.
- A worker whose process dies (the OOM killer, a crash in native code) has the credits of its groups in
  flight reclaimed at once: they return to the pool instead of being lost, so the other workers (and the
  restarted one) fill the batch. Ray restarts the worker's process (``orchestrator.worker_restarts`` times
  per worker: the actor's ``max_restarts``); once it answers again a new ``produce`` starts on it under the
  next incarnation, and the event is kept in ``restarted``. Its task stream goes on from the cursor the
  worker last reported (``take`` pings every worker once per batch, and ``check`` while it waits), not from
  the run's start: only tasks drawn since then, whose groups were in flight and reclaimed, are drawn again.
- ``task_cursor`` is the index past every task a worker reported drawing: a checkpoint saves it, and a
  resumed run's workers go on from it.
- A worker that is dead for good (its restarts used up, killed with ``ray.kill``, or not answering within
  ``restart_wait_s`` of its death) is left out and kept in ``lost``; the run goes on while another worker
  produces and stops with an error naming the worker when none is left.
- A worker whose ``produce`` returns without dying stopped on its own (every engine is dead) or was stopped:
  the run stops, naming it.
- A hung worker (a stopped process, a deadlocked event loop) would hold its groups' credits for ever: while
  the driver waits for groups, ``check`` pings every producing worker, and one that does not answer within
  ``PING_S`` is killed with its restart allowed, so it goes the way of a crashed one (above).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

POLL_S = 0.2
"""How often a restarting worker is asked whether it answers again."""
PING_S = 10.0
"""How long a producing worker has to answer ``ping`` before it is taken as hung."""


class RolloutCrew:
    """The rollout worker actors of one run (their order is their index, as in ``tandem-rollout-<i>``)."""

    def __init__(
        self, workers: list, buffer: Any, restarts: int, restart_wait_s: float, task_cursor: int = 0
    ) -> None:
        self.workers = list(workers)
        self.buffer = buffer
        self.restarts = restarts
        """The most restarts Ray makes of each worker (the actors' ``max_restarts``)."""
        self.restart_wait_s = restart_wait_s
        self.incarnation = [0] * len(workers)
        self.producing: dict[int, Any] = {}
        """Live workers' pending ``produce`` calls, by index."""
        self.lost: list[str] = []
        """Workers the run went on without, one line each."""
        self.restarted: list[str] = []
        """Each restart of a worker whose process died, one line each."""
        self._hung: set[int] = set()
        """Workers killed by ``check`` whose ``produce`` has not ended yet."""
        self.cursors = [task_cursor] * len(workers)
        """Each worker's task-stream cursor as it last reported it (``RolloutActor.ping``)."""
        self._cursor_pings: dict[int, Any] = {}
        """Pings sent by ``take`` and not collected yet, by worker."""

    def token(self, i: int) -> str:
        return f"{i}.{self.incarnation[i]}"

    def start(self) -> None:
        """Start every worker's ``produce``."""
        for i, w in enumerate(self.workers):
            self.producing[i] = w.produce.remote(self.token(i))

    def live(self) -> list[Any]:
        """The workers still producing (every worker before ``start``)."""
        if not self.producing and not self.lost:
            return list(self.workers)
        return [self.workers[i] for i in sorted(self.producing)]

    def take(
        self, n: int, version: int, max_staleness: int, timeout_s: float,
        on_wait: Callable[[], None] | None = None, every_s: float = 5.0,
    ) -> tuple[list, dict[str, Any]]:  # fmt: skip
        """``buffer.take``, while handling the end of any worker's ``produce`` as the module docstring says;
        raises ``RuntimeError`` naming the worker when the run must stop. ``on_wait`` is called each
        ``every_s`` the batch is not there yet (the engine fleet's health check)."""
        ref = self.buffer.take.remote(n, version, max_staleness, timeout_s)
        self._poll_cursors()
        while True:
            ready, _ = ray.wait([ref, *self.producing.values()], num_returns=1, timeout=every_s)
            if not ready:
                if on_wait is not None:
                    on_wait()
                continue
            if ref in ready:
                self._poll_cursors()  # the pings sent above have answered by now (they never wait)
                return ray.get(ref)
            i = next(j for j, r in self.producing.items() if r == ready[0])
            self._ended(i, self.producing.pop(i))

    def check(self) -> bool:
        """Ping every producing worker; kill those that do not answer within ``PING_S``, letting Ray restart
        them (their ``produce`` then ends and ``take`` handles it). True when one was killed."""
        pings = self._ping_producing()
        if not pings:
            return False
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_S)
        killed = False
        for i, ref in pings.items():
            if ref in ready:
                self._note_cursor(i, ref)
            else:
                self._hung.add(i)
                killed = True
                try:
                    ray.kill(self.workers[i], no_restart=False)
                except Exception:  # noqa: BLE001, S110 - already gone: its produce ends either way
                    pass
        return killed

    def task_cursor(self, timeout_s: float = PING_S) -> int:
        """The index past every task the workers drew, as far as they answer within ``timeout_s`` (one that
        does not counts with the cursor it last reported)."""
        pings = self._ping_producing()
        ready = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)[0] if pings else []
        for i, ref in pings.items():
            if ref in ready:
                self._note_cursor(i, ref)
        return max(self.cursors, default=0)

    def _ping_producing(self) -> dict[int, Any]:
        """A ``ping`` to every producing worker not already killed as hung, by index."""
        return {i: self.workers[i].ping.remote() for i in self.producing if i not in self._hung}

    def _poll_cursors(self) -> None:
        """Keep the cursors the workers answered since the last call, and ask the others again; never
        waits (one ping per worker and batch)."""
        for i, ref in list(self._cursor_pings.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self._cursor_pings[i]
                self._note_cursor(i, ref)
        for i in self.producing:
            if i not in self._cursor_pings and i not in self._hung:
                self._cursor_pings[i] = self.workers[i].ping.remote()

    def _note_cursor(self, i: int, ref: Any) -> None:
        try:
            self.cursors[i] = max(self.cursors[i], int(ray.get(ref)))
        except Exception:  # noqa: BLE001, S110 - it died right after answering: its last cursor stands
            pass

    def _ended(self, i: int, ref: Any) -> None:
        try:
            why = ray.get(ref)
        except RayActorError as e:
            reclaimed = ray.get(self.buffer.reclaim.remote(self.token(i)))
            cause = type(e).__name__
            if i in self._hung:
                self._hung.discard(i)
                cause = f"hung: did not answer a ping within {PING_S:g} s; killed"
            if self._restart(i):
                count = f"{self.incarnation[i]} of orchestrator.worker_restarts={self.restarts}"
                self.restarted.append(
                    f"rollout worker {i} died ({cause}; the credits of its {reclaimed} groups in flight went "
                    f"back to the pool); restarted ({count})"
                )
                return
            self.lost.append(f"rollout worker {i} died ({cause}); not restarted")
            if not self.producing:
                raise RuntimeError(f"rollout worker {i} died: {cause}: {e}; no rollout worker is left") from e
            return
        raise RuntimeError(f"rollout worker {i} stopped producing: {why or 'it was stopped'}")

    def _restart(self, i: int) -> bool:
        """Wait until Ray has restarted worker ``i`` and start its next ``produce``; False when it will not
        come back (then it is killed for good, so a late restart never produces unaccounted groups)."""
        if self.incarnation[i] >= self.restarts:
            return False
        worker = self.workers[i]
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            try:
                ray.get(worker.get_errors.remote(), timeout=max(deadline - time.monotonic(), 0.01))
                break
            except (ActorUnavailableError, GetTimeoutError):  # restarting (or slow to start)
                if time.monotonic() >= deadline:
                    ray.kill(worker)
                    return False
                time.sleep(POLL_S)
            except RayActorError:  # dead for good
                return False
        self.incarnation[i] += 1
        self.producing[i] = worker.produce.remote(self.token(i), self.cursors[i])
        return True
