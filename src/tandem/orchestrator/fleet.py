"""The run's engine actors, and which of them are still alive.

Invariants:
- An engine is counted dead only when a call to it raised ``ActorDiedError`` (its process is gone, killed or
  crashed); any other error of a call is raised to the caller as before.
- The run goes on while one engine lives: rollout workers already route around a dead engine and requeue the
  groups whose sessions it ended (``RolloutActor._generate``), and the driver stops calling it (weight
  syncs, stats). When the last engine dies (or hangs), ``gather`` raises ``EngineLostError`` naming each one.
- An engine that does not answer a call within ``answer_within_s`` (``orchestrator.request_timeout_s``) is
  taken as hung (a stopped process, a wedged device): it is killed, so nothing waits on it again (rollout
  workers' calls to it then fail and are requeued). With restarts left (``restarts``, the actors'
  ``max_restarts``) it is killed with its restart allowed and recovered like a crashed one (below; its
  pending call has no result), as hung rollout workers are; without, it is counted lost like a dead one.
  Before, a hung engine was always lost, restarts left or not. Before that, a hung engine
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
- An engine whose process dies while Ray may restart it (``orchestrator.engine_restarts``, the actors'
  ``max_restarts``) is brought back, not lost: a call that finds it restarting (``ActorUnavailableError``),
  or an answer from a new process (``ping``/``stats`` name the process and whether it serves yet), makes the
  fleet wait until it answers (within ``answer_within_s``: a vLLM engine starts in about 35 s), then
  ``rejoin`` (the weight path's: connect it to the weight store and bring it to the run's version, or send
  it the full weights) and tell it to serve; until then its ``generate`` waits, so it never samples from the
  starting weights it loaded. The call that found it has no result for it. Each restart is kept in
  ``restarted``. Restarts used up, Ray answers ``ActorDiedError``: the engine is dead as above. While it
  restarts the fleet calls ``on_progress`` (the driver restarts ``take``'s idle clock with it), so a restart
  longer than ``orchestrator.request_timeout_s`` is not taken for stuck rollouts.
- An engine whose process runs but whose engine cannot serve any more (``ping`` says ``ok: False``: its loop
  was stopped, or a vLLM weight update failed and its old weights could not be restored) would answer every
  request with an error until the run stopped on failed groups: it is killed with its restart allowed and
  recovered as above (or lost, its restarts used up).
- A dead engine's counters stay at their last reading, and a restarted one's new counters are added to its
  old process's last reading, so the run's totals never go backwards.
- Every loss is kept in ``lost`` (one line per engine, saying why), for the progress line, the metrics row
  (``engines_alive``) and the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from tandem.core.errors import TandemError

CHECK_EVERY_S = 5.0
"""While the driver waits for groups, how often it pings the engines (``EngineFleet.check``)."""
PING_S = 10.0
"""How long a late engine has to answer ``ping`` before it is taken as hung (a running process answers in
milliseconds; a loaded 2-core machine in well under a second)."""
RESTART_POLL_S = 0.5
"""How often a restarting engine is asked whether it answers again."""
PROGRESS_EVERY_S = 2.0
"""How often ``on_progress`` is called while an engine restarts."""
TOTALS = ("busy_s", "prefill_tokens", "prefix_hit_tokens", "steps", "tokens_generated")
"""The engines' cumulative counters the run sums (``EngineActor.stats``)."""


class EngineLostError(TandemError):
    """Every engine of the run died."""


class EngineFleet:
    """The engine actors of one run (their order is their index, as in ``tandem-engine-<i>``)."""

    def __init__(self, engines: list, answer_within_s: float = 300.0, restarts: int = 0) -> None:
        self.engines = list(engines)
        self.answer_within_s = answer_within_s
        self.restarts = restarts
        """The most restarts Ray makes of each engine (the actors' ``max_restarts``)."""
        self.rejoin: Callable[[int, Any], None] | None = None
        """Brings a restarted engine (index, actor) to the run's version; set by the weight path."""
        self.on_progress: Callable[[], None] | None = None
        """Called while an engine restarts (at most every ``PROGRESS_EVERY_S``) and once it serves again;
        the driver counts it as progress for ``take``'s idle clock, so a restart (20-40 s) is not taken for
        stuck rollouts."""
        self.trainer_node: str | None = None
        """The Ray node the trainer runs on, once ``place`` was told (a restarted engine is told again)."""
        self.dead: dict[int, str] = {}
        self.lost: list[str] = []
        self.restarted: list[str] = []
        """Each restart of an engine whose process died, one line each."""
        self._last_stats: list[dict[str, Any]] = [{} for _ in self.engines]
        self._base_stats: list[dict[str, float]] = [{} for _ in self.engines]
        """Per engine, the counters of its processes before the current one."""
        self._pid: list[int | None] = [None for _ in self.engines]
        self._incarnation = [0 for _ in self.engines]

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
        restarted: set[int] = set()
        if late and self._kill_unresponsive([i for i, _ in late], restarted):
            late = self._wait([(i, ref) for i, ref in late if i not in restarted])  # may have waited for it
        for i, _ in late:
            if self._hung(i):
                restarted.add(i)
        for i, ref in calls:
            if i in self.dead or i in restarted:  # a restarted engine's call died with its old process
                continue
            try:
                results[i] = ray.get(ref)
            except ActorDiedError as e:
                self._mark_dead(i, e)
            except ActorUnavailableError as e:
                self._recover(i, type(e).__name__)
            except Exception:
                # e.g. a weight sync sent to a restarted process before it was connected: recover it if so
                if not self._restarted_now(i):
                    raise
            else:
                if isinstance(results[i], dict) and self._is_new_process(i, results[i]):
                    del results[i]  # a new process's answer, e.g. its counters from zero
                    self._recover(i, "a new process answered")
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

    def _kill_unresponsive(self, indices: list[int], restarted: set[int] | None = None) -> bool:
        """Ping the engines ``indices``; kill (as hung) those that do not answer within ``PING_S``,
        restarting them when restarts are left (their indices go into ``restarted``), and mark dead those
        found dead. True when any was killed or found dead."""
        pings = {i: self.engines[i].ping.remote() for i in indices}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_S)
        removed = False
        for i, ref in pings.items():
            if ref not in ready:
                if self._hung(i, pinged=True) and restarted is not None:
                    restarted.add(i)
                removed = True
                continue
            try:
                answer = ray.get(ref)
            except ActorDiedError as e:
                self._mark_dead(i, e)
                removed = True
            except ActorUnavailableError as e:
                removed |= not self._recover(i, type(e).__name__)
            else:
                if self._is_new_process(i, answer):
                    removed |= not self._recover(i, "a new process answered")
                elif answer.get("ok") is False:
                    why = answer.get("error") or "its engine stopped"
                    try:
                        ray.kill(self.engines[i], no_restart=False)
                    except Exception:  # noqa: BLE001, S110 - gone already: recovered or found dead below
                        pass
                    removed |= not self._recover(i, f"could not serve: {why}; killed", killed=answer["pid"])
        return removed

    def _is_new_process(self, i: int, answer: dict[str, Any]) -> bool:
        """Whether ``answer`` (of ``ping`` or ``stats``) came from a process of engine ``i`` other than the
        one the fleet knows, or from one that does not serve yet (a restart); records the first pid seen."""
        pid = answer.get("pid")
        if pid is None:
            return False
        if self._pid[i] is None:
            self._pid[i] = pid
        return pid != self._pid[i] or answer.get("serving") is False

    def _restarted_now(self, i: int) -> bool:
        """After a call to engine ``i`` failed: whether its process was restarted (then it is recovered)."""
        try:
            answer = ray.get(self.engines[i].ping.remote(), timeout=PING_S)
        except ActorUnavailableError as e:
            self._recover(i, type(e).__name__)
            return True
        except Exception:  # noqa: BLE001 - the caller raises the call's own error
            return False
        if self._is_new_process(i, answer):
            self._recover(i, "a new process answered")
            return True
        return False

    def place(self, trainer_node: str) -> None:
        """Tell every live engine the trainer's node (``EngineActor.place_loop``: the automatic loop boost
        only away from the trainer); engines restarted later are told in their recovery."""
        self.trainer_node = trainer_node
        live = [e for i, e in enumerate(self.engines) if i not in self.dead]
        ray.get([e.place_loop.remote(trainer_node) for e in live])

    def _recover(self, i: int, cause: str, killed: int | None = None) -> bool:
        """Engine ``i``'s process died and Ray restarts it: wait until it answers, bring it to the run's
        version (``rejoin``) and let it serve. False when it will not come back (then it is dead or, not
        answering within ``answer_within_s``, killed as hung). ``killed``: the pid of a process the fleet
        just killed, whose answers until it is gone are not the restart's."""
        deadline = time.monotonic() + self.answer_within_s
        told = 0.0
        while True:
            if time.monotonic() - told >= PROGRESS_EVERY_S:
                told = time.monotonic()
                self._progress()
            try:
                answer = ray.get(
                    self.engines[i].ping.remote(), timeout=max(deadline - time.monotonic(), 0.01)
                )
                if answer["pid"] != killed:
                    break
                if time.monotonic() >= deadline:  # the killed process still answers: never gone
                    self._mark_hung(i)
                    return False
                time.sleep(RESTART_POLL_S)
            except (ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() >= deadline:
                    self._mark_hung(i)
                    return False
                time.sleep(RESTART_POLL_S)
            except ActorDiedError as e:
                self._mark_dead(i, e)
                return False
        if answer["serving"] and answer["pid"] == self._pid[i] and killed is None:
            return True  # an older call of the dead process, failing late: this one is already back
        if self.rejoin is not None:
            try:
                if self.trainer_node is not None:
                    ray.get(self.engines[i].place_loop.remote(self.trainer_node))
                self.rejoin(i, self.engines[i])
            except ActorDiedError as e:
                self._mark_dead(i, e)
                return False
            except ActorUnavailableError:  # it died again while rejoining
                return self._recover(i, cause)
        else:
            if self.trainer_node is not None:
                ray.get(self.engines[i].place_loop.remote(self.trainer_node))
            ray.get(self.engines[i].resume_serving.remote())
        self._progress()
        last = self._last_stats[i]
        self._base_stats[i] = {k: self._base_stats[i].get(k, 0.0) + float(last.get(k, 0)) for k in TOTALS}
        self._last_stats[i] = {}
        self._pid[i] = answer["pid"]
        self._incarnation[i] += 1
        self.restarted.append(
            f"engine {i} died ({cause}); restarted and brought to the run's version "
            f"({self._incarnation[i]} of orchestrator.engine_restarts={self.restarts})"
        )
        return True

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress()

    def _mark_dead(self, i: int, e: Exception) -> None:
        if i not in self.dead:
            text = str(e).strip()  # Ray's last line says why, in its first sentence
            reason = text.splitlines()[-1].split(". ")[0].rstrip(".") if text else "no reason given"
            self.dead[i] = reason
            self.lost.append(f"engine {i} died ({type(e).__name__}: {reason})")

    def _hung_reason(self, pinged: bool) -> str:
        if pinged:
            return f"did not answer a ping within {PING_S:g} s; killed"
        return f"did not answer within {self.answer_within_s:g} s (orchestrator.request_timeout_s); killed"

    def _hung(self, i: int, pinged: bool = False) -> bool:
        """Engine ``i`` is hung: with restarts left, kill it with its restart allowed and recover it (True
        when it serves again); otherwise kill it for good and count it lost (False)."""
        if i in self.dead:
            return False
        if self._incarnation[i] >= self.restarts:
            self._mark_hung(i, pinged)
            return False
        try:
            ray.kill(self.engines[i], no_restart=False)
        except Exception:  # noqa: BLE001, S110 - gone already: recovered or found dead below
            pass
        reason = self._hung_reason(pinged)  # worded as a hung rollout worker's restart
        return self._recover(i, f"hung: {reason}", killed=self._pid[i])

    def _mark_hung(self, i: int, pinged: bool = False) -> None:
        if i in self.dead:
            return
        reason = self._hung_reason(pinged)
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
        return {
            k: float(
                sum(s.get(k, 0) for s in self._last_stats) + sum(b.get(k, 0.0) for b in self._base_stats)
            )
            for k in TOTALS
        }
