"""The agent harness: one multi-turn tool-calling session of a task, token-exact.

Invariants:
- The trajectory's token ids are exactly the ids the engine consumed and produced: the prompt and every
  observation are rendered once by the chat format and appended; sampled turns are appended as sampled.
  Nothing is ever re-tokenized.
- ``loss_mask`` is 1 only on sampled tokens; observations and prompts carry NaN logprobs and version -1.
- A malformed tool call, a missing tool call, a failing tool or an engine error never raises: it becomes an
  error observation (or ends the session) and a counted statistic. The transcript's assistant message keeps
  a malformed call's raw text (``keep_malformed``), as the gateway returns it, so ``samples.jsonl`` shows
  what the model wrote. A session an engine or sandbox error
  ended has the ``engine_error``/``sandbox_error`` flag and, as its last message, the reason
  (``session_error``). The sandbox is always closed (its
  teardown runs on the sandbox reaper). It is created while the engine writes the first turn, so its
  start latency is hidden; a sandbox that cannot start ends the session at the first tool call.
- A session ended by a limit has ``flags["truncated"]`` and exactly one of the ``TRUNCATION_CAUSES`` flags
  (``truncated_<cause>``): ``turns`` (``tasks.max_turns``), ``tokens`` (the session's ``tasks.max_tokens``
  budget: no room left, a turn cut at what was left of it, or an observation that would not fit), ``turn_cut``
  (a turn reached ``rollout.max_new_tokens`` with room left in the budget) or ``time``
  (``tasks.wall_time_s``). An untruncated session has all of them False.
- Scoring happens in a fresh sandbox on a snapshot of the agent's workspace (see ``tandem.env.reward``).
- The trajectory carries the agent's full diff against ``task.workspace`` (``Trajectory.diff``) and
  ``flags["tests_edited"]`` (a protected file changed or a file named like a hidden test added).
- MoE routing: when the engine reports ``Completion.routed_experts``, the segment's ``routed_experts`` are
  those of the last turn (its prompt is the whole segment so far, so they cover every token up to its last
  sampled one). Observation tokens appended after the last turn were never forwarded by the engine; their
  rows hold experts ``0..top_k-1`` as filler (they condition no sampled token, so replay and the routing
  agreement metric never depend on them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from tandem.core.config import RewardConfig, SandboxConfig
from tandem.core.generation import ChatFormat, Completion, GenerationRequest, SamplingParams
from tandem.core.records import Message, Reward, SegmentBuilder, Task, Trajectory

GenerateFn = Callable[[GenerationRequest], Awaitable[Completion]]
ENGINE_ERROR = "engine error: "  # the last message of a session an engine error ended, then the reason
SANDBOX_ERROR = "sandbox error: "  # likewise for a sandbox that could not start
WALL_TIME_UP = "error: the session's time limit (tasks.wall_time_s) is reached; this call was not run"
HARNESS_ERROR = "harness error: "  # likewise for an external harness that failed (``tandem.env.external``)
NO_REQUESTS = (
    "the harness made no requests to the gateway (does it send them to $OPENAI_BASE_URL with the session in "
    "$TANDEM_SESSION?)"
)
ERROR_FLAGS = ("engine_error", "sandbox_error", "no_requests")
TRUNCATION_CAUSES = ("turns", "tokens", "turn_cut", "time")
"""Why a truncated session ended (``flags["truncated_<cause>"]``, see the module invariants)."""


def session_error(trajectory: Trajectory) -> str | None:
    """Why the session left nothing to grade or train on: an engine or sandbox error, or an external harness
    none of whose requests reached the gateway; the reason its last message gives (``engine error: ...``,
    ``sandbox error: ...``, ``harness error: exit N: <output tail>``) or ``NO_REQUESTS``. None for every
    other session, including a harness that failed or timed out after sampling turns (reward 0, trained
    on)."""
    flagged = [f for f in ERROR_FLAGS if trajectory.flags.get(f)]
    if not flagged:
        return None
    for m in reversed(trajectory.messages):
        if isinstance(m.content, str) and m.content.startswith((ENGINE_ERROR, SANDBOX_ERROR, HARNESS_ERROR)):
            return m.content
    return NO_REQUESTS if flagged == ["no_requests"] else flagged[0].replace("_", " ")


def segment_routes(routes: Any, covered: int, length: int) -> np.ndarray | None:
    """The segment's ``[length, layers, top_k]`` routes from a completion's routes over its first ``covered``
    tokens (filler rows after them, see module invariants); None when there are none or they do not cover
    exactly ``covered`` tokens."""
    if routes is None:
        return None
    r = np.asarray(routes)
    if r.ndim != 3 or len(r) != covered or covered > length:
        return None
    if r.dtype not in (np.uint8, np.int16):  # e.g. a list from another engine: store compactly
        r = r.astype(np.uint8 if r.size == 0 or (r.min() >= 0 and r.max() < 256) else np.int16)
    filler = np.broadcast_to(np.arange(r.shape[2], dtype=r.dtype), (length - covered, *r.shape[1:]))
    return np.concatenate([r, filler])


NO_TOOL_CALL = "error: your reply contained no tool call; reply with a <tool_call> (for example submit)"


async def run_session(
    task: Task,
    generate: GenerateFn,
    chat: ChatFormat,
    sampling: SamplingParams,
    sandbox_config: SandboxConfig,
    reward_config: RewardConfig,
    tools: list[dict[str, Any]] | None = None,
) -> Trajectory:
    """Run one session of ``task`` against ``generate`` and score it; never raises for agent behaviour."""
    from tandem.env.reward import score, tests_edited, workspace_diff
    from tandem.env.tasks import TOOLS
    from tandem.env.tools import execute_tool
    from tandem.sandbox import create_sandbox

    tools = TOOLS if tools is None else tools
    limits = task.limits
    started = time.monotonic()
    stats = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "malformed_calls": 0, "no_tool_call": 0}
    flags = {
        "submitted": False,
        "truncated": False,
        "engine_error": False,
        "sandbox_error": False,
        "tests_edited": False,
        "limit_violation": False,
        "symlinks_ignored": False,
        "snapshot_limited": False,
        **{f"truncated_{cause}": False for cause in TRUNCATION_CAUSES},
    }

    def truncate(cause: str) -> None:
        flags["truncated"] = True
        flags[f"truncated_{cause}"] = True

    timings = {"generate_s": 0.0, "tools_s": 0.0, "score_s": 0.0}
    messages: list[Message] = list(task.prompt)
    builder = SegmentBuilder()
    builder.add_context(chat.render_prompt(task.prompt, tools))
    routes: Any = None  # of the last turn, over its first ``covered`` tokens
    covered = 0
    files: dict[str, str] = dict(task.workspace)

    # The sandbox starts while the engine writes the first turn: its start latency is hidden.
    starting: asyncio.Future[Any] | None = asyncio.ensure_future(
        asyncio.to_thread(create_sandbox, task.workspace, sandbox_config)
    )
    sandbox = None

    async def ready() -> bool:
        """Wait for the sandbox once; False (and the sandbox_error flag) when it could not start."""
        nonlocal starting, sandbox
        if starting is not None:
            fut, starting = starting, None
            try:
                sandbox = await fut
            except Exception as e:  # noqa: BLE001 - a sandbox failure ends this session, not the run
                flags["sandbox_error"] = True
                messages.append(Message("tool", f"{SANDBOX_ERROR}{e}"))
        return sandbox is not None

    try:
        while True:
            if stats["turns"] >= limits.max_turns:
                truncate("turns")
                break
            budget = limits.max_tokens - len(builder)
            if budget <= 0:
                truncate("tokens")
                break
            if time.monotonic() - started > limits.wall_time_s:
                truncate("time")
                break
            params = dataclasses.replace(
                sampling,
                max_new_tokens=min(sampling.max_new_tokens, budget),
                stop_token_ids=list(chat.stop_token_ids),
            )
            t0 = time.monotonic()
            completion = await generate(GenerationRequest(list(builder.ids), params, task.id))
            timings["generate_s"] += time.monotonic() - t0
            if completion.finish_reason == "error":
                flags["engine_error"] = True
                messages.append(Message("tool", f"{ENGINE_ERROR}{completion.error or 'no reason given'}"))
                break
            builder.add_sampled(
                completion.token_ids,
                completion.logprobs,
                completion.versions,
                completion.logmass or None,
                params.temperature,
            )
            routes, covered = completion.routed_experts, len(builder)
            stats["turns"] += 1
            text, calls, errors = chat.parse_assistant(completion.token_ids, keep_malformed=True)
            messages.append(Message("assistant", text, calls))
            if completion.finish_reason != "stop":
                # The turn was cut before its end token: the context cannot continue token-exactly.
                truncate("tokens" if params.max_new_tokens < sampling.max_new_tokens else "turn_cut")
                break
            observations: list[Message] = []
            for err in errors:
                stats["malformed_calls"] += 1
                observations.append(Message("tool", f"error: {err}"))
            if not calls and not errors:
                stats["no_tool_call"] += 1
                observations.append(Message("tool", NO_TOOL_CALL))
            if not await ready():
                break
            t0 = time.monotonic()
            for call in calls:
                left = limits.wall_time_s - (time.monotonic() - started)
                if left <= 0:  # the session's time is up: later calls of this turn are not run
                    observations.append(Message("tool", WALL_TIME_UP))
                    truncate("time")
                    break
                stats["tool_calls"] += 1
                timeout = min(sandbox.config.timeout_s, left)
                result = await asyncio.to_thread(execute_tool, sandbox, task, call, timeout)
                if result.error:
                    stats["tool_errors"] += 1
                observations.append(Message("tool", result.content, name=str(call.get("name", ""))))
                if result.submitted:
                    flags["submitted"] = True
                    break
            timings["tools_s"] += time.monotonic() - t0
            messages.extend(observations)
            if flags["submitted"] or flags["truncated"]:
                break
            continuation = chat.render_continuation(observations)
            if len(builder) + len(continuation) >= limits.max_tokens:
                truncate("tokens")
                break
            builder.add_context(continuation)
        if await ready():
            try:
                files = await asyncio.to_thread(sandbox.snapshot)
            except Exception as e:  # noqa: BLE001 - what the policy left fails this session, not its group
                flags["sandbox_error"] = True
                reason = f"reading the workspace: {type(e).__name__}: {e}"
                messages.append(Message("tool", f"{SANDBOX_ERROR}{reason}"))
            else:
                flags["symlinks_ignored"] = bool(sandbox.snapshot_skipped_symlinks)
                flags["snapshot_limited"] = bool(sandbox.snapshot_limits)
    finally:
        if starting is not None:  # cancelled or failed before the sandbox was needed: still close it
            try:
                sandbox = await starting
            except BaseException:  # noqa: BLE001 - it never started; nothing to close
                sandbox = None
        if sandbox is not None:
            await asyncio.to_thread(sandbox.close, False)  # teardown goes to the reaper

    t0 = time.monotonic()
    if flags["engine_error"] or flags["sandbox_error"]:
        reward = Reward(0.0, {"engine_error": float(flags["engine_error"])})
    else:
        reward = await asyncio.to_thread(
            score,
            task,
            files,
            reward_config,
            sandbox_config,
            stats["malformed_calls"] + stats["no_tool_call"],
            flags["truncated"],
        )
    timings["score_s"] = time.monotonic() - t0
    flags["tests_edited"] = tests_edited(task, files)
    diff = await asyncio.to_thread(workspace_diff, task.workspace, files)  # off the rollouts' event loop
    flags["limit_violation"] = bool(reward.components.get("limit_violation"))
    timings["total_s"] = time.monotonic() - started
    segment = builder.build()
    segment.routed_experts = segment_routes(routes, covered, len(segment))
    return Trajectory(
        task_id=task.id,
        segments=[segment],
        reward=reward,
        flags=flags,
        timings=timings,
        tool_stats=stats,
        messages=messages,
        diff=diff,
    )
