"""The request side every tandem engine shares: a queue of pending requests behind one condition variable.

Invariants:
- ``submit`` never blocks on the model: it queues a ``Pending`` (the request, its future and its submission
  number, from which a request without a seed derives its own) and wakes the engine's loop; a stopped engine
  resolves the future at once with an error completion; an engine never started starts on first submit.
  ``generate(requests)`` queues its whole list under one hold of the lock, so the loop never sees part of it
  (before, each request was queued apart, and a caller's thread descheduled for longer than
  ``gather_idle_ms`` between two of them had the first ones started alone).
- A future is resolved exactly once with a ``Completion`` (``resolve`` ignores futures the caller cancelled
  or that are already resolved); errors are ``Completion(finish_reason="error")`` (``error_completion``),
  never exceptions. An iteration that raises fails the active sessions and every request it took from the
  queue, so no request is left unanswered. A queued request whose future its caller cancelled is dropped
  when its turn comes, never generated (counted in ``stats()["cancelled"]``); a running one is stopped at
  the engine's next step (the built-in engine retires it, vLLM aborts it).
- ``health`` reads the queue and the active sessions under the same lock the loop uses.
- Idle bursts are gathered (``EngineConfig.gather_idle_ms`` / ``gather_idle_max_ms``): when requests reach an
  idle engine (no session running, no weight update queued), the loop holds them back until (a) as many are
  queued as sessions finished a turn with their KV kept (``_expect_return``) within the last
  ``gather_idle_max_ms`` before the wait began, or, when none did, no new request has arrived for
  ``gather_idle_ms``; or (b) ``gather_idle_max_ms`` passed since the last of those sessions finished (since
  the wait began when none did); or (c) the batch is full, a weight update is queued or the engine stops.
  Requests that reach a busy engine are never held. Why: an HTTP harness answers a lockstep group one
  response at a time and sends the next turns back spread out; admitting the first ones at once starts
  decode steps whose Python work then competes (GIL, cores) with the server still handling the rest, which
  spreads them further and leaves a tail of small decode batches. ``gather_idle_max_ms = 0`` turns this
  off.
- Token streaming (``streams_tokens``): ``submit(request, on_tokens=f)`` has the engine call ``f(ids)`` from
  its loop thread with the ids each step sampled for that request, in order, before its future resolves
  (the concatenated calls are the completion's ``token_ids``). ``f`` must return at once (the gateway only
  hands the ids to its event loop with ``call_soon_threadsafe``); an exception it raises is swallowed and
  stops further calls, never the request. Without ``on_tokens`` nothing is done per token.
- The loop thread runs ``loop_boost()`` niceness levels above its process where permitted
  (``EngineConfig.loop_priority_boost``; None picks by host: ``AUTO_LOOP_PRIORITY_BOOST`` unless
  ``set_beside_trainer(True)`` says a trainer shares the host, then 0). ``set_beside_trainer`` applies to a
  running loop at once; ``health()["loop_nice"]`` is the niceness the loop thread has (None before it runs).

An engine using ``RequestFront`` calls ``_init_front`` and provides ``config.max_batch``, ``_updates``
(list of queued weight updates), ``_version``, ``_iteration(updates, admitted)`` (apply the updates, admit the
requests, advance the active sessions one step) and ``_fail_active(msg)``; ``start()`` runs ``_loop`` in a
thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from tandem.core.config import AUTO_LOOP_PRIORITY_BOOST
from tandem.core.generation import Completion, GenerationRequest
from tandem.core.procs import boost_thread_priority


@dataclass
class Pending:
    """A request waiting for the engine's loop."""

    request: GenerationRequest
    future: Future
    number: int
    on_tokens: Callable[[list[int]], None] | None = None


def resolve(fut: Future, completion: Completion) -> None:
    """Set ``fut``'s result unless the caller cancelled it or it is already resolved."""
    try:
        fut.set_result(completion)
    except InvalidStateError:  # cancelled by the caller, or resolved before
        pass


def notify(pending: Any, ids: list[int]) -> None:
    """Hand ``ids`` to ``pending.on_tokens`` if set (see module invariants: a failing observer is dropped)."""
    f = pending.on_tokens
    if f is None or not ids:
        return
    try:
        f(list(ids))
    except Exception:  # noqa: BLE001 - the observer's problem, never the request's
        pending.on_tokens = None


def error_completion(msg: str) -> Completion:
    """The completion of a request that failed with ``msg``."""
    return Completion([], [], [], "error", msg)


class RequestFront:
    """``submit``, ``generate`` and ``health`` over the engine's queue (see module invariants)."""

    config: Any
    _updates: list[Any]
    _cv: Any
    _queue: Any
    _active: Any
    _stopped: bool
    _running: bool
    _submitted: int
    _version: int

    def _init_front(self, active: Any) -> None:
        """The request side's state: lock, empty queue, ``active`` (the engine's container of running
        sessions), flags, submission counter, start time and the counters every engine reports."""
        self._cv = threading.Condition()
        self._queue: collections.deque[Pending] = collections.deque()
        self._active = active
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopped = False
        self._submitted = 0
        self._last_submit = 0.0
        self._recent_finishes: collections.deque[float] = collections.deque(maxlen=4096)
        self._t0 = time.monotonic()
        self._loop_nice: int | None = None  # the loop thread's niceness once it runs (loop_priority_boost)
        self._loop_tid: int | None = None  # its native thread id, once it runs
        self._beside_trainer = False  # a trainer shares this engine's host (set_beside_trainer)
        self._stats: dict[str, float] = {
            "busy_s": 0.0,
            "tokens_generated": 0,
            "prefill_tokens": 0,
            "prefix_hit_tokens": 0,
            "steps": 0,
            "cancelled": 0,
            # ``time.monotonic()`` when ``tokens_generated`` last grew (0.0 before the first token): a rate
            # measured between two readings' step ends counts whole steps, not a fraction of one at each end
            "last_token_at": 0.0,
        }

    _thread_name = "tandem-engine"
    streams_tokens = True  # ``submit`` takes ``on_tokens`` and the engine calls it (see module invariants)

    def start(self) -> None:
        """Start the loop thread (no-op when it runs)."""
        with self._cv:
            if self._running:
                return
            self._running, self._stopped = True, False
            self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        """The loop thread: ``_loop_setup``, then ``_serve`` until the engine stops; at exit it forgets its
        thread id (which a later thread may be given: ``set_beside_trainer`` must never renice that one)."""
        self._loop_setup()
        try:
            self._serve()
        finally:
            with self._cv:
                if self._loop_tid == threading.get_native_id():  # not a loop started after this one's stop
                    self._loop_tid = None

    def _serve(self) -> None:
        """Wait for work; take the queued weight updates and as many requests as ``config.max_batch`` has
        room for; run one ``_iteration``. An exception fails the active sessions, never the loop."""
        while True:
            with self._cv:
                while self._running and not (self._queue or self._updates or self._active):
                    self._cv.wait()
                if not self._running:
                    return
                self._gather_burst()
                if not self._running:  # stopped while a burst gathered
                    return
                updates, self._updates = self._updates, []
                room = self.config.max_batch - len(self._active)
                admitted = []
                while self._queue and len(admitted) < room:
                    item = self._queue.popleft()
                    if item.future.cancelled():  # its caller gave up (e.g. a revoked rollout): never run
                        self._stats["cancelled"] += 1
                        continue
                    admitted.append(item)
            t0 = time.perf_counter()
            try:
                self._iteration(updates, admitted)
            except Exception as e:  # noqa: BLE001 - a bug must not kill the engine; fail the sessions
                msg = f"engine error: {type(e).__name__}: {e}"
                self._fail_active(msg)
                for item in admitted:  # taken from the queue, maybe not yet active: never left unanswered
                    resolve(item.future, error_completion(msg))
            with self._cv:
                self._stats["busy_s"] += time.perf_counter() - t0

    def _gather_burst(self) -> None:
        """Idle engine, requests queued: hold them back (under ``_cv``, whose wait releases the lock) so a
        burst starts as one batch; see the module invariants for when the wait ends."""
        window = self.config.gather_idle_max_ms / 1000
        if window <= 0 or self._active or self._updates or not self._queue:
            self._recent_finishes.clear()
            return
        now = time.monotonic()
        recent = [t for t in self._recent_finishes if t >= now - window]
        self._recent_finishes.clear()
        expected = min(len(recent), self.config.max_batch)
        deadline = (recent[-1] if recent else now) + window
        gap = self.config.gather_idle_ms / 1000
        while self._running and not self._updates and len(self._queue) < self.config.max_batch:
            if expected and len(self._queue) >= expected:
                return  # the sessions that just finished a turn are back
            wake = deadline if expected else min(deadline, self._last_submit + gap)
            now = time.monotonic()
            if now >= wake:
                return
            self._cv.wait(wake - now)

    def _expect_return(self) -> None:
        """Note (from the loop thread) that a session just finished a turn and may come back with its next
        one (its KV was kept for it): an idle engine waits for such sessions (see ``_gather_burst``)."""
        self._recent_finishes.append(time.monotonic())

    def _loop_setup(self) -> None:
        """Runs once in the loop thread before the first iteration: raises the thread's priority by
        ``loop_boost()`` where permitted (``loop_nice`` records what it got)."""
        with self._cv:
            self._loop_tid = threading.get_native_id()
            self._loop_nice = boost_thread_priority(self._loop_tid, self.loop_boost())

    def loop_boost(self) -> int:
        """The niceness levels the loop thread is meant to run above its process: the configured
        ``loop_priority_boost``, or when that is None, ``AUTO_LOOP_PRIORITY_BOOST`` with no trainer on this
        host and 0 beside one."""
        boost = getattr(getattr(self, "config", None), "loop_priority_boost", 0)
        if boost is None:
            return 0 if self._beside_trainer else AUTO_LOOP_PRIORITY_BOOST
        return int(boost)

    def set_beside_trainer(self, beside: bool) -> int | None:
        """Record whether a trainer runs on this engine's host; a running loop's thread gets its
        ``loop_boost()`` at once (which changes only with ``loop_priority_boost=None``). Returns
        ``loop_nice``."""
        with self._cv:
            self._beside_trainer = bool(beside)
            if self._loop_tid is not None:
                self._loop_nice = boost_thread_priority(self._loop_tid, self.loop_boost())
            return self._loop_nice

    def _refusal(self) -> str:
        """Why a stopped engine refuses a request (an engine that cannot be started again says why)."""
        return "engine stopped; call start() to serve again"

    def _iteration(self, updates: list[Any], admitted: list[Pending]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _fail_active(self, msg: str) -> None:  # pragma: no cover - provided by the engine
        raise NotImplementedError

    def submit(
        self, request: GenerationRequest, on_tokens: Callable[[list[int]], None] | None = None
    ) -> Future:
        """Queue one request; the future resolves to its Completion. Starts the loop if never started.
        ``on_tokens`` observes the sampled ids step by step (see module invariants)."""
        return self._submit_all([(request, on_tokens)])[0]

    def _submit_all(
        self, items: list[tuple[GenerationRequest, Callable[[list[int]], None] | None]]
    ) -> list[Future]:
        """Queue every request under one hold of the lock, so the loop sees them all at once. An empty list
        queues nothing, starts nothing and leaves the gathering clock (``_last_submit``) as it was."""
        futures: list[Future] = [Future() for _ in items]
        if not futures:
            return futures
        with self._cv:
            if self._stopped:
                for fut in futures:
                    resolve(fut, error_completion(self._refusal()))
                return futures
            for (request, on_tokens), fut in zip(items, futures, strict=True):
                self._queue.append(Pending(request, fut, self._submitted, on_tokens))
                self._submitted += 1
            self._last_submit = time.monotonic()
            self._cv.notify_all()
            start = not self._running
        if start:
            self.start()
        return futures

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Submit all as one burst (queued under one hold of the lock: an idle loop admits them together, up
        to ``max_batch``, however the caller's thread is scheduled), wait for all (in order)."""
        futures = self._submit_all([(r, None) for r in requests])
        return [f.result() for f in futures]

    def health(self) -> dict[str, Any]:
        with self._cv:
            return {
                "ok": not self._stopped,
                "version": self._version,
                "active": len(self._active),
                "queued": len(self._queue),
                "loop_nice": self._loop_nice,
            }
