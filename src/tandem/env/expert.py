"""A scripted, deliberately imperfect expert that produces tool-calling transcripts for mid-training.

Policy per task: (maybe) read solution.py, write either the reference solution (probability
``P_CORRECT[level]``) or a random plausible bug, run the visible tests, and if they fail, with probability
``P_FIX`` rewrite the reference solution and run them again; then submit. The expert therefore often
submits wrong code, and it never fixes a bug the visible tests do not reveal: this imperfection is the
headroom reinforcement learning has to improve on (a model imitating it solves roughly P_CORRECT plus a bit).

Invariants:
- A transcript is ``task.prompt`` followed by alternating assistant messages (content ``""``, exactly one
  entry in ``tool_calls``: ``{"name", "arguments"}``) and tool messages (``name`` = the tool), ending with
  the ``submit`` observation.
- Observations are byte-identical to what ``tandem.env.tools.execute_tool`` returns in a real sandbox: they
  are built with the same formatters, and test output comes from running the actual test file in-process
  (``run_test_file_inprocess``), whose equality with a sandboxed run is checked by the tests.
- ``expert_corpus`` draws only TRAIN-split tasks, so held-out tasks never appear in mid-training data.
- Deterministic: the same task and rng state give the same transcript.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tandem.core.records import Message, Task
from tandem.env.tasks import (
    HIDDEN_TEST_FILE,
    LEVELS,
    SOLUTION_FILE,
    VISIBLE_TEST_FILE,
    generate_task,
    run_test_file_inprocess,
    workspace_modules,
)
from tandem.env.tools import SUBMITTED, format_output, read_message, wrote_message

P_CORRECT: dict[int, float] = {1: 0.45, 2: 0.35, 3: 0.25}
"""Probability that the first written solution is the reference one, per level."""
P_FIX = 0.3
"""Probability of rewriting the reference solution after the visible tests failed."""
P_READ = 0.75
"""Probability of reading solution.py before writing it."""


@dataclass
class ExpertEpisode:
    """One expert session: the transcript and the solution it submitted."""

    messages: list[Message]
    final_solution: str

    def hidden_passed(self, task: Task) -> bool:
        """Whether the submitted solution passes every hidden test (in-process; trusted code only)."""
        _, code = run_test_file_inprocess(
            task.hidden_tests[HIDDEN_TEST_FILE], self.final_solution, workspace_modules(task.workspace)
        )
        return code == 0


def _call(name: str, **arguments: Any) -> Message:
    return Message("assistant", "", [{"name": name, "arguments": arguments}])


def _obs(name: str, content: str) -> Message:
    return Message("tool", content, name=name)


def expert_episode(task: Task, rng: random.Random) -> ExpertEpisode:
    """Run the scripted policy of the module docstring on ``task``."""
    level = int(task.meta.get("level", 1))
    solution: str = task.meta["solution"]
    bugs: list[str] = list(task.meta.get("bugs", []))
    msgs = list(task.prompt)
    if rng.random() < P_READ:
        msgs += [
            _call("read_file", path=SOLUTION_FILE),
            _obs("read_file", read_message(task.workspace[SOLUTION_FILE])),
        ]
    current = (
        solution
        if not bugs or rng.random() < P_CORRECT.get(level, min(P_CORRECT.values()))
        else rng.choice(bugs)
    )

    modules = workspace_modules(task.workspace)

    def write_and_test(src: str) -> int:
        msgs.extend(
            [
                _call("write_file", path=SOLUTION_FILE, content=src),
                _obs("write_file", wrote_message(SOLUTION_FILE, src)),
            ]
        )
        out, code = run_test_file_inprocess(task.workspace[VISIBLE_TEST_FILE], src, modules)
        msgs.extend([_call("run_tests"), _obs("run_tests", format_output(out, "", code))])
        return code

    if write_and_test(current) != 0 and rng.random() < P_FIX:
        current = solution
        write_and_test(current)
    msgs += [_call("submit"), _obs("submit", SUBMITTED)]
    return ExpertEpisode(msgs, current)


def expert_transcript(task: Task, rng: random.Random) -> list[Message]:
    """The messages of one expert session on ``task`` (prompt included)."""
    return expert_episode(task, rng).messages


def expert_corpus(
    n: int, seed: int = 0, levels: list[int] | tuple[int, ...] = tuple(LEVELS)
) -> Iterator[list[Message]]:
    """``n`` expert transcripts over TRAIN-split tasks, levels interleaved round-robin (deterministic)."""
    if not levels:
        raise ValueError("levels must not be empty; pass e.g. [1, 2, 3]")
    lv = list(levels)
    for i in range(n):
        task = generate_task("train", i // len(lv), seed, lv[i % len(lv)])
        yield expert_transcript(task, random.Random(f"expert:{seed}:{i}"))
