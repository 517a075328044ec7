"""The run's engine actors, and which of them are still alive.

Invariants:
- An engine is counted dead only when a call to it raised ``ActorDiedError`` (its process is gone, killed or
  crashed); any other error of a call is raised to the caller as before.
- The run goes on while one engine lives: rollout workers already route around a dead engine and requeue the
  groups whose sessions it ended (``RolloutActor._generate``), and the driver stops calling it (weight
  syncs, stats). When the last engine dies (or hangs), ``gather`` raises ``EngineLostError`` naming each one.
- An engine that does not answer a call within ``answer_within_s`` (``orchestrator.request_timeout_s``) is
  taken as hung (a stopped process, a wedged device): it is killed, so nothing waits on it again (rollout
  workers' calls to it then fail and are requeued), and counted lost like a dead one. Before, a hung engine
  blocked the driver's next weight sync or stats call for ever. An engine can also be late only because a
  hung one holds what it waits for (the host share's lock, which a stopped process never releases): so at
  the deadline the late engines are pinged first (``EngineActor.ping``, answered by any running process
  within ``PING_S``); those that do not answer are killed, and if any was, the ones that did get another
  ``answer_within_s`` before they are taken as hung too. Before, one stopped engine holding the share's lock
  took the other engines with it and ended the run. While the driver waits for groups, ``check`` pings every
  live engine the same way each ``CHECK_EVERY_S``: a hung engine holds every group with a session on it, so
  no batch could fill and the driver never reached a call that would find it (the run ended when ``take``
  timed out); once it is killed, the rollout workers' calls to it fail, their groups are requeued and run
  on the live engines, and the driver restarts ``take``'s idle clock (``BufferActor.restart_idle_clock``).
- A dead engine's counters stay at their last reading, so the run's totals never go backwards.
- Every loss is kept in ``lost`` (one line per engine, saying why), for the progress line, the metrics row
  (``engines_alive``) and the report.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorDiedError

from tandem.core.errors import TandemError

CHECK_EVERY_S = 5.0
"""While the driver waits for groups, how often it pings the engines (``EngineFleet.check``)."""
PING_S = 10.0
"""How long a late engine has to answer ``ping`` before it is taken as hung (a running process answers in
milliseconds; a loaded 2-core machine in well under a second)."""
TOTALS = ("busy_s", "prefill_tokens", "prefix_hit_tokens", "steps", "tokens_generated")
"""The engines' cumulative counters the run sums (``EngineActor.stats``)."""


class EngineLostError(TandemError):
    """Every engine of the run died."""


class EngineFleet:
    """The engine actors of one run (their order is their index, as in ``tandem-engine-<i>``)."""

    def __init__(self, engines: list, answer_within_s: float = 300.0) -> None:
        self.engines = list(engines)
        self.answer_within_s = answer_within_s
        self.dead: dict[int, str] = {}
        self.lost: list[str] = []
        self._last_stats: list[dict[str, Any]] = [{} for _ in self.engines]

    def live(self) -> list[tuple[int, Any]]:
        return [(i, e) for i, e in enumerate(self.engines) if i not in self.dead]

    def call(self, method: str, *args: Any) -> list[tuple[int, Any]]:
        """Start ``method(*args)`` on every live engine; the refs, by engine index, for ``gather``."""
        return [(i, getattr(e, method).remote(*args)) for i, e in self.live()]

    def gather(self, calls: list[tuple[int, Any]]) -> dict[int, Any]:
        """The results of ``call``'s refs by engine index; an engine whose call found it dead is marked so and
        left out. Raises ``EngineLostError`` when no engine is left."""
        results: dict[int, Any] = {}
        late = self._wait(calls)
        if late and self._kill_unresponsive([i for i, _ in late]):
            late = self._wait(late)  # the others may have waited for a killed one (module invariants)
        for i, _ in late:
            self._mark_hung(i)
        for i, ref in calls:
            if i in self.dead:
                continue
            try:
                results[i] = ray.get(ref)
            except ActorDiedError as e:
                self._mark_dead(i, e)
        if not self.live():
            raise EngineLostError("every engine died: " + "; ".join(self.lost))
        return results

    def _wait(self, calls: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """Wait up to ``answer_within_s`` for every call; the calls that did not finish."""
        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.answer_within_s) if refs else ([], [])
        done = set(ready)
        return [(i, ref) for i, ref in calls if ref not in done]

    def check(self) -> bool:
        """Ping every live engine; kill those that do not answer within ``PING_S`` (module invariants).
        True when an engine was removed; raises ``EngineLostError`` when none is left."""
        removed = self._kill_unresponsive([i for i, _ in self.live()])
        if not self.live():
            raise EngineLostError("every engine died: " + "; ".join(self.lost))
        return removed

    def _kill_unresponsive(self, indices: list[int]) -> bool:
        """Ping the engines ``indices``; kill (as hung) those that do not answer within ``PING_S`` and mark
        dead those found dead. True when any was killed or found dead."""
        pings = {i: self.engines[i].ping.remote() for i in indices}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_S)
        removed = False
        for i, ref in pings.items():
            if ref not in ready:
                self._mark_hung(i, pinged=True)
                removed = True
                continue
            try:
                ray.get(ref)
            except ActorDiedError as e:
                self._mark_dead(i, e)
                removed = True
        return removed

    def _mark_dead(self, i: int, e: Exception) -> None:
        if i not in self.dead:
            text = str(e).strip()  # Ray's last line says why, in its first sentence
            reason = text.splitlines()[-1].split(". ")[0].rstrip(".") if text else "no reason given"
            self.dead[i] = reason
            self.lost.append(f"engine {i} died ({type(e).__name__}: {reason})")

    def _mark_hung(self, i: int, pinged: bool = False) -> None:
        if i in self.dead:
            return
        reason = (
            f"did not answer a ping within {PING_S:g} s; killed"
            if pinged
            else f"did not answer within {self.answer_within_s:g} s (orchestrator.request_timeout_s); killed"
        )
        self.dead[i] = reason
        self.lost.append(f"engine {i} hung ({reason})")
        try:
            ray.kill(self.engines[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone: nothing left to stop
            pass

    def totals(self) -> dict[str, float]:
        """The engines' cumulative counters, summed (a dead engine's at its last reading): busy seconds,
        prefilled prompt tokens, prompt tokens served from parked KV, decode steps and sampled tokens."""
        for i, stats in self.gather(self.call("stats")).items():
            self._last_stats[i] = stats
        return {k: float(sum(s.get(k, 0) for s in self._last_stats)) for k in TOTALS}
