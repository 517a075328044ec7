"""Rollouts by an external harness: any program that speaks the OpenAI API, run once per rollout.

This module is the gateway half (the worker's gateway over its generate function); the sandbox, the run of
the command and the grading are ``tandem.env.external.run_external_session``.

``rollout.harness_command`` names the program. For each rollout tandem creates the task's sandbox with one
door out, to a gateway (``tandem.engine.gateway``) that this worker serves on 127.0.0.1 over its own generate
function, and runs the command in it with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (a random key of this
rollout's own: a gateway tenant key, see ``tandem.engine.gateway.tenants``, allowed
``rollout.harness_max_concurrent`` requests in flight, ``rollout.harness_max_sessions`` sessions and the
task's ``max_turns`` requests in all, sampled at the run's settings unless ``rollout.harness_sampling`` is
"harness", and revoked as soon as the harness exits, which cancels what it still has in flight),
``TANDEM_SESSION`` (the session id the harness sends as ``X-Tandem-Session``) and
``TANDEM_TASK`` (the task's user prompt) in its environment and the workspace as its working directory. When
the command ends, the workspace is graded exactly like a built-in session's (fresh sandbox, hidden tests) and
the gateway's token-exact record of the session becomes the trajectory.

Invariants:
- The trajectory's tokens are the gateway's record: ids the engine consumed and produced, never
  re-tokenized. The reward is posted back to the gateway session too.
- A harness that exits non-zero, crashes or hangs past ``tasks.wall_time_s`` (then its whole process tree
  is killed) yields a trajectory with ``flags["harness_failed"]`` and reward 0; nothing raises, the run goes
  on. A harness that never called the gateway yields an empty record (``flags["no_requests"]``).
- ``rollout.harness_mounts`` (host paths) and, with ``rollout.harness_site_packages``, this interpreter's
  site-packages are bound read-only at their own paths (and put on ``PYTHONPATH``) so the harness can
  import its libraries (the sandbox's Python is the system's); nothing else of the host is visible.
"""

from __future__ import annotations

import asyncio
import secrets
import sysconfig
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tandem.core.config import RunConfig
from tandem.core.generation import Completion, GenerationRequest
from tandem.core.records import Task, Trajectory
from tandem.engine.gateway.tenants import Sampling
from tandem.env.harness import GenerateFn


class GenerateEngine:
    """The gateway's engine protocol over an async generate function running on ``loop``."""

    def __init__(self, generate: GenerateFn, loop: asyncio.AbstractEventLoop, max_seq_len: int) -> None:
        self._generate = generate
        self._loop = loop
        self.max_seq_len = max_seq_len
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        fut = asyncio.run_coroutine_threadsafe(self._generate(request), self._loop)

        def note(f: Future[Completion]) -> None:
            if not f.cancelled() and f.exception() is None and f.result().versions:
                self._version = max(self._version, max(f.result().versions))

        fut.add_done_callback(note)
        return fut

    def health(self) -> dict[str, Any]:
        return {"ok": not self._loop.is_closed()}


class ExternalHarness:
    """A gateway on 127.0.0.1 for this worker, and rollouts of ``rollout.harness_command`` through it."""

    def __init__(self, generate: GenerateFn, chat: Any, cfg: RunConfig) -> None:
        from tandem.engine.gateway import GatewayConfig, GatewayServer, create_app

        self.cfg = cfg
        self.api_key = secrets.token_urlsafe(24)
        engine = GenerateEngine(generate, asyncio.get_running_loop(), cfg.engine.max_seq_len)
        gw_config = GatewayConfig(
            api_key=self.api_key,
            max_concurrent=max(64, 4 * cfg.rollout.group_size * cfg.rollout.groups_in_flight),
            max_sessions=4096,
        )
        self.app = create_app(engine, chat, chat.tokenizer, gw_config)
        self.server = GatewayServer(self.app).start()
        self.url = f"{self.server.url}/v1"

    def close(self) -> None:
        self.server.stop()

    def _run(self, task: Task, session_id: str, temperature: float | None) -> Trajectory:
        from tandem.env.external import run_external_session

        r = self.cfg.rollout
        mounts = [str(Path(m).resolve()) for m in r.harness_mounts]
        if r.harness_site_packages:
            mounts.append(sysconfig.get_paths()["purelib"])
        sessions = self.app.state.gateway.sessions

        def record(sid: str) -> Trajectory | None:
            session = sessions.get(sid)
            return session.trajectory() if session is not None else None

        tenants = self.app.state.gateway.tenants
        key = secrets.token_urlsafe(24)  # this rollout's own key, revoked once its harness has exited
        sampling = None
        if r.harness_sampling == "run":
            temperature = r.temperature if temperature is None else temperature
            sampling = Sampling(temperature, r.top_p, r.max_new_tokens)
        tenant = tenants.add(
            key, session_id, r.harness_max_concurrent, r.harness_max_sessions, task.limits.max_turns, sampling
        )
        try:
            traj = run_external_session(
                task,
                list(r.harness_command),
                self.url,
                key,
                session_id,
                mounts,
                self.cfg.sandbox,
                self.cfg.reward,
                record,
                harness_done=lambda: tenants.revoke(key),
            )
        finally:
            tenants.revoke(key)  # idempotent
        traj.flags["harness_sampling_overridden"] = tenant.sampling_overridden > 0
        session = sessions.get(session_id)
        if session is not None:  # the outcome, for GET /v1/tandem/sessions/ID
            session.reward = traj.reward
        return traj

    async def run_session(self, task: Task, temperature: float | None = None) -> Trajectory:
        """One rollout of the external harness on ``task`` (sampled at ``temperature``, default the run's
        ``rollout.temperature``, when ``rollout.harness_sampling`` is "run")."""
        return await asyncio.to_thread(self._run, task, f"rollout-{uuid.uuid4().hex}", temperature)
