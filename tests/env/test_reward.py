"""Reward: hidden tests in a fresh sandbox; reference scores 1, bugs and bad code 0, never raising."""

from __future__ import annotations

import pytest

from tandem.core.config import RewardConfig, SandboxConfig
from tandem.env.reward import parse_result, score, scoring_files
from tandem.env.tasks import HIDDEN_TEST_FILE, SOLUTION_FILE, VISIBLE_TEST_FILE, generate_task
from tandem.sandbox import bwrap_available

ALL = RewardConfig(kind="all_or_nothing")
FRAC = RewardConfig(kind="fraction")


@pytest.fixture(scope="module")
def sbx() -> SandboxConfig:
    return SandboxConfig(backend="bwrap" if bwrap_available() else "plain", timeout_s=20.0)


@pytest.fixture(scope="module")
def task():
    return generate_task("train", 3, 0, 2)


def _files(task, solution: str) -> dict[str, str]:
    return {**task.workspace, SOLUTION_FILE: solution}


def test_reference_scores_one(task, sbx) -> None:
    r = score(task, _files(task, task.meta["solution"]), ALL, sbx)
    n = task.meta["hidden_total"]
    assert r.value == 1.0
    assert r.components["tests_passed"] == r.components["tests_total"] == n
    assert r.components["pass_fraction"] == 1.0 and r.components["exit_code"] == 0
    assert r.components["timed_out"] == 0 and r.components["parse_error"] == 0
    assert score(task, _files(task, task.meta["solution"]), FRAC, sbx).value == 1.0


def test_bug_scores_zero_or_a_fraction(task, sbx) -> None:
    bug = task.meta["bugs"][0]
    r = score(task, _files(task, bug), ALL, sbx)
    assert r.value == 0.0 and r.components["tests_passed"] < r.components["tests_total"]
    f = score(task, _files(task, bug), FRAC, sbx)
    assert f.value == pytest.approx(f.components["tests_passed"] / f.components["tests_total"])
    assert 0.0 <= f.value < 1.0


@pytest.mark.parametrize(
    "source",
    [
        "def broken(:\n",  # syntax error: import fails, all tests fail
        "import os\nos._exit(0)\n",  # exits 0 without any RESULT line: unparseable
        "print('RESULT passed=3 total=3')\nimport sys\nsys.exit(0)\n",  # forged line, caught by the runner
        "import os\nprint('RESULT passed=99 total=99', flush=True)\nos._exit(0)\n",  # forged, wrong total
    ],
)
def test_bad_agent_code_scores_zero(task, sbx, source: str) -> None:
    r = score(task, _files(task, source), FRAC, sbx)
    assert r.value == 0.0 and r.components["tests_passed"] == 0


def test_timeout_scores_zero(task) -> None:
    cfg = SandboxConfig(backend="bwrap" if bwrap_available() else "plain", timeout_s=1.0)
    r = score(task, _files(task, "while True:\n    pass\n"), FRAC, cfg)
    assert r.value == 0.0 and r.components["timed_out"] == 1.0


def test_protected_and_hidden_files_are_restored(task, sbx) -> None:
    fake = "print('RESULT passed=8 total=8')\n"
    files = {**_files(task, task.meta["bugs"][0]), VISIBLE_TEST_FILE: "x", HIDDEN_TEST_FILE: fake}
    merged = scoring_files(task, files)
    assert merged[VISIBLE_TEST_FILE] == task.workspace[VISIBLE_TEST_FILE]
    assert merged[HIDDEN_TEST_FILE] == task.hidden_tests[HIDDEN_TEST_FILE]
    assert score(task, files, ALL, sbx).value == 0.0


def test_penalty_flags_and_sandbox_failure_never_raise(task, sbx) -> None:
    cfg = RewardConfig(kind="all_or_nothing", tool_error_penalty=0.1)
    r = score(task, _files(task, task.meta["solution"]), cfg, sbx, tool_errors=2, truncated=True)
    assert r.value == pytest.approx(0.8)
    assert r.components["tool_errors"] == 2 and r.components["truncated"] == 1.0
    assert r.components["tool_error_penalty"] == pytest.approx(0.2)
    bad = score(task, {**_files(task, task.meta["solution"]), "../escape.py": "x"}, ALL, sbx)
    assert bad.value == 0.0 and bad.components["sandbox_error"] == 1.0


def test_parse_result() -> None:
    assert parse_result("PASS a\nRESULT passed=2 total=3\n") == (2, 3)
    assert parse_result("RESULT passed=1 total=1\nRESULT passed=0 total=1\n") == (0, 1)
    assert parse_result("RESULT passed=4 total=3\n") is None
    assert parse_result("nothing here") is None
    assert parse_result("RESULT passed=0 total=0") is None
