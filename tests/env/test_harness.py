"""The harness with a scripted policy standing in for the model: real chat format, sandbox and reward."""

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from tandem.core.config import RewardConfig, SandboxConfig
from tandem.core.generation import Completion, SamplingParams
from tandem.core.records import Message
from tandem.env.expert import expert_transcript
from tandem.env.harness import TRUNCATION_CAUSES, WALL_TIME_UP, run_session
from tandem.env.tasks import TOOLS, generate_task

MODEL = Path(__file__).resolve().parents[2] / "models" / "tandem-base"


@pytest.fixture(scope="module")
def chat():
    from tandem.model import load_chat_format

    return load_chat_format(MODEL)


def scripted(chat, replies, version=5):
    """A generate function that 'samples' the given assistant messages in order, recording the prompts."""
    queue = list(replies)
    prompts = []

    async def generate(request):
        prompts.append(list(request.prompt_ids))
        ids = chat.render_assistant(queue.pop(0))
        return Completion(ids, [-0.25] * len(ids), [version] * len(ids), "stop")

    return generate, prompts


def run(task, generate, chat, **sandbox_kw):
    return asyncio.run(
        run_session(task, generate, chat, SamplingParams(), SandboxConfig(**sandbox_kw), RewardConfig())
    )


def test_expert_session_is_token_exact_and_scored(chat):
    task = generate_task("train", 3, 0, 1)
    messages = expert_transcript(task, random.Random(1))
    replies = [m for m in messages if m.role == "assistant"]
    generate, prompts = scripted(chat, replies)
    traj = run(task, generate, chat)
    seg = traj.segments[0]
    assert seg.token_ids.tolist() == chat.render_transcript(messages, TOOLS)
    # every prompt the engine saw is a prefix of the final token ids (nothing re-tokenized)
    for p in prompts:
        assert seg.token_ids[: len(p)].tolist() == p
    sampled = seg.loss_mask.astype(bool)
    assert sampled.sum() == sum(len(chat.render_assistant(m)) for m in replies)
    assert np.all(seg.versions[sampled] == 5) and np.all(seg.versions[~sampled] == -1)
    assert np.all(np.isnan(seg.sampler_logprobs[~sampled]))
    assert traj.flags["submitted"] and not traj.flags["truncated"]
    assert not any(traj.flags[f"truncated_{cause}"] for cause in TRUNCATION_CAUSES)
    # the transcript's tool observations are exactly what the harness produced
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert tool_msgs == [m.content for m in messages if m.role == "tool"]
    assert traj.reward.components["tests_total"] == task.meta["hidden_total"]


def test_reference_solution_gets_full_reward_and_garbage_gets_zero(chat):
    task = generate_task("train", 4, 0, 2)
    good = [
        Message(
            "assistant",
            "",
            [{"name": "write_file", "arguments": {"path": "solution.py", "content": task.meta["solution"]}}],
        ),
        Message("assistant", "", [{"name": "submit", "arguments": {}}]),
    ]
    traj = run(task, scripted(chat, good)[0], chat)
    assert traj.reward.value == 1.0 and traj.flags["submitted"]

    garbage = [
        Message("assistant", "<tool_call>{not json"),
        Message("assistant", "hello"),
        Message("assistant", "", [{"name": "rm_rf", "arguments": {}}]),
    ]
    traj = run(task, scripted(chat, garbage * 3)[0], chat)
    assert traj.reward.value == 0.0
    assert traj.tool_stats["malformed_calls"] >= 1 and traj.tool_stats["no_tool_call"] >= 1
    assert traj.tool_stats["tool_errors"] >= 1
    said = [m.content for m in traj.messages if m.role == "assistant"]
    assert said[0] == "<tool_call>{not json"  # the transcript keeps what the model wrote
    assert traj.flags["truncated"] and not traj.flags["submitted"]


def test_hanging_command_is_killed_at_its_timeout(chat):
    task = generate_task("train", 5, 0, 1)
    replies = [
        Message("assistant", "", [{"name": "run", "arguments": {"command": "sleep 60"}}]),
        Message("assistant", "", [{"name": "submit", "arguments": {}}]),
    ]
    traj = run(task, scripted(chat, replies)[0], chat, timeout_s=1.0)
    observation = [m.content for m in traj.messages if m.role == "tool"][0]
    assert "timed out" in observation
    assert traj.timings["tools_s"] < 30


def test_tool_calls_stop_at_the_sessions_wall_time(chat):
    """A probe's turn of 4 x `sleep 9.8` then one of 12 `run_tests` against a hanging solution kept a
    60 s session running 170 s: the wall time was checked only before each generation. Now each call gets
    what is left of it, and calls past it are not run."""
    import dataclasses

    task = generate_task("train", 5, 0, 1)
    task = dataclasses.replace(task, limits=dataclasses.replace(task.limits, wall_time_s=3.0))
    sleep = {"name": "run", "arguments": {"command": "sleep 9"}}
    replies = [Message("assistant", "", [sleep] * 4), Message("assistant", "", [sleep])]
    traj = run(task, scripted(chat, replies)[0], chat, timeout_s=10.0)
    observations = [m.content for m in traj.messages if m.role == "tool"]
    assert "timed out" in observations[0] and observations[1:] == [WALL_TIME_UP]
    assert traj.flags["truncated"] and traj.tool_stats["turns"] == 1 and traj.tool_stats["tool_calls"] == 1
    assert causes(traj) == ["time"]
    assert traj.timings["tools_s"] < 9  # the first sleep was cut at the session's 3 s


def causes(traj):
    return [c for c in TRUNCATION_CAUSES if traj.flags[f"truncated_{c}"]]


def test_each_truncation_names_the_limit_that_ended_it(chat):
    """`truncated` says a limit ended the session; `truncated_<cause>` says which one, so a run's report can
    tell a turn limit from a token budget from a turn cut at `rollout.max_new_tokens`."""
    import dataclasses

    base = generate_task("train", 3, 0, 1)
    prompt_len = len(chat.render_prompt(base.prompt, TOOLS))

    def limited(**kw):
        return dataclasses.replace(base, limits=dataclasses.replace(base.limits, **kw))

    async def cut(request):  # a turn that ran out of tokens before its end token
        ids = chat.render_assistant(Message("assistant", "thinking " * 50))[:8]
        return Completion(ids, [-0.25] * len(ids), [1] * len(ids), "length")

    silent = [Message("assistant", "hello")] * 3
    traj = run(limited(max_turns=2, max_tokens=8192), scripted(chat, silent)[0], chat)
    assert causes(traj) == ["turns"] and traj.tool_stats["turns"] == 2

    traj = run(limited(max_tokens=8192), cut, chat)  # room left: the turn hit max_new_tokens
    assert causes(traj) == ["turn_cut"] and traj.flags["truncated"]

    traj = run(limited(max_tokens=prompt_len + 8), cut, chat)  # the budget's last 8 tokens
    assert causes(traj) == ["tokens"]

    reply = Message("assistant", "", [{"name": "run", "arguments": {"command": "echo hi"}}])
    fits = prompt_len + len(chat.render_assistant(reply)) + 1  # the reply fits, its observation does not
    traj = run(limited(max_tokens=fits), scripted(chat, [reply, reply])[0], chat)
    assert causes(traj) == ["tokens"] and traj.tool_stats["turns"] == 1


def test_engine_error_ends_the_session_with_zero_reward(chat):
    task = generate_task("train", 6, 0, 1)

    async def broken(request):
        return Completion([], [], [], "error", "engine stopped")

    traj = run(task, broken, chat)
    assert traj.flags["engine_error"] and traj.reward.value == 0.0


def _write(path, content):
    return {"name": "write_file", "arguments": {"path": path, "content": content}}


def test_test_edit_is_flagged_and_diff_stored(chat):
    from tandem.env.tasks import SOLUTION_FILE, VISIBLE_TEST_FILE

    task = generate_task("train", 3, 0, 1)
    replies = [
        # write_file refuses protected paths; a shell command does not
        Message(
            "assistant", "", [{"name": "run", "arguments": {"command": f"echo x > {VISIBLE_TEST_FILE}"}}]
        ),
        Message(
            "assistant",
            "",
            [_write(SOLUTION_FILE, task.meta["solution"])],
        ),
        Message("assistant", "", [{"name": "submit", "arguments": {}}]),
    ]
    generate, _ = scripted(chat, replies)
    traj = run(task, generate, chat)
    assert traj.flags["tests_edited"] is True
    assert traj.reward.components["tests_edited"] == 1.0
    assert traj.reward.value == 1.0  # the visible test was restored for grading; no penalty by default
    assert f"--- a/{VISIBLE_TEST_FILE}\n+++ b/{VISIBLE_TEST_FILE}\n" in traj.diff and "+x\n" in traj.diff
    assert f"+++ b/{SOLUTION_FILE}" in traj.diff
