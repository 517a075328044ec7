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
  blocked the driver's next weight sync or stats call for ever.
- A dead engine's counters stay at their last reading, so the run's totals never go backwards.
- Every loss is kept in ``lost`` (one line per engine, saying why), for the progress line, the metrics row
  (``engines_alive``) and the report.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorDiedError

from tandem.core.errors import TandemError

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
        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.answer_within_s) if refs else ([], [])
        done = set(ready)
        for i, ref in calls:
            if ref not in done:  # module invariants: hung, killed
                self._mark_hung(i)
                continue
            try:
                results[i] = ray.get(ref)
            except ActorDiedError as e:
                self._mark_dead(i, e)
        if not self.live():
            raise EngineLostError("every engine died: " + "; ".join(self.lost))
        return results

    def _mark_dead(self, i: int, e: Exception) -> None:
        if i not in self.dead:
            text = str(e).strip()  # Ray's last line says why, in its first sentence
            reason = text.splitlines()[-1].split(". ")[0].rstrip(".") if text else "no reason given"
            self.dead[i] = reason
            self.lost.append(f"engine {i} died ({type(e).__name__}: {reason})")

    def _mark_hung(self, i: int) -> None:
        if i in self.dead:
            return
        reason = f"did not answer within {self.answer_within_s:g} s (orchestrator.request_timeout_s); killed"
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
