"""Reward: hidden tests in a fresh sandbox; reference scores 1, bugs and bad code 0, never raising."""

from __future__ import annotations

import pytest

from tandem.core.config import RewardConfig, SandboxConfig
from tandem.env.reward import parse_result, score, scoring_files, workspace_diff
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
    # a built-in task's hidden tests are all fail-to-pass; none must keep passing
    assert f.components["f2p_fraction"] == f.components["pass_fraction"] and f.components["p2p_fraction"] == 1


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
    assert r.components["f2p_fraction"] == r.components["p2p_fraction"] == 0.0  # not graded


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


def _forged(task) -> str:
    n = task.meta["hidden_total"]
    return f"print('RESULT passed={n} total={n}', flush=True)\n"


@pytest.mark.parametrize(
    "make",
    [
        # at import: forge the line with the right total and leave with status 0
        lambda t: t.meta["bugs"][0] + "import os\n" + _forged(t) + "os._exit(0)\n",
        # at call time, from inside solve
        lambda t: "import os\ndef solve(*a):\n    " + _forged(t).strip() + "\n    os._exit(0)\n",
    ],
    ids=["import-exit", "call-exit"],
)
def test_forged_result_and_exit_zero_scores_zero(task, sbx, make) -> None:
    r = score(task, _files(task, make(task)), ALL, sbx)
    assert r.value == 0.0 and r.components["all_passed"] == 0.0


def test_solution_cannot_reach_the_grader_stdout_memory_or_file(task, sbx) -> None:
    probe = task.meta["solution"] + (
        "import os, sys\n"
        "for p in (f'/proc/{os.getppid()}/fd/1', f'/proc/{os.getppid()}/mem', '_hidden_test.py'):\n"
        "    try:\n        open(p, 'rb' if p.endswith('.py') else 'wb').close()\n        print('OPENED', p)\n"
        "    except OSError:\n        print('DENIED', p)\n"
    )
    from tandem.sandbox import create_sandbox

    with create_sandbox(scoring_files(task, _files(task, probe)), sbx) as sb:
        r = sb.exec(list(task.test_command))
    assert r.exit_code == 0 and r.stderr.count("DENIED") == 3 and "OPENED" not in r.stderr, r.stderr
    assert r.stdout.rstrip().endswith(
        f"RESULT passed={task.meta['hidden_total']} total={task.meta['hidden_total']}"
    )


def test_garbage_and_flood_do_not_change_the_score(task, sbx) -> None:
    noise = (
        "import sys\nprint('RESULT passed=0 total=1\\n' + 'garbage \\x00 ' * 50)\nprint('y' * 2_000_000)\n"
    )
    noise += "sys.stderr.write('e' * 2_000_000)\n"
    ref = score(task, _files(task, task.meta["solution"] + noise), ALL, sbx)
    assert ref.value == 1.0 and ref.components["exit_code"] == 0
    loud = task.meta["bugs"][0] + noise
    assert (
        score(task, _files(task, loud), FRAC, sbx).value
        == score(task, _files(task, task.meta["bugs"][0]), FRAC, sbx).value
    )


def test_test_edits_are_flagged_and_penalised_never_below_zero(task, sbx) -> None:
    ok = _files(task, task.meta["solution"])
    clean = score(task, ok, RewardConfig(test_edit_penalty=0.3), sbx)
    assert clean.value == 1.0 and clean.components["tests_edited"] == 0.0
    for files in (
        {**ok, VISIBLE_TEST_FILE: "print('RESULT passed=2 total=2')\n"},
        {k: v for k, v in ok.items() if k != VISIBLE_TEST_FILE},
        {**ok, f"sub/{HIDDEN_TEST_FILE}": "x"},
    ):
        r = score(task, files, RewardConfig(test_edit_penalty=0.3), sbx)
        assert r.components["tests_edited"] == 1.0 and r.value == pytest.approx(0.7)
        assert r.components["test_edit_penalty"] == pytest.approx(0.3)
    bad = {**_files(task, "def solve(*a):\n    return None\n"), VISIBLE_TEST_FILE: "x"}
    r = score(task, bad, RewardConfig(test_edit_penalty=0.3), sbx)
    assert r.value == 0.0 and r.components["tests_edited"] == 1.0 and r.components["test_edit_penalty"] == 0.0
    with pytest.raises(ValueError):
        RewardConfig(test_edit_penalty=-1.0)


def test_workspace_diff() -> None:
    d = workspace_diff({"a.py": "x\ny\n", "gone.py": "z\n"}, {"a.py": "x\nY\n", "new.py": "n"})
    assert "--- a/a.py\n+++ b/a.py\n" in d and "-y\n+Y\n" in d
    assert "--- a/gone.py\n+++ /dev/null\n" in d and "--- /dev/null\n+++ b/new.py\n" in d
    assert "+n\n\\ No newline at end of file\n" in d
    assert workspace_diff({"a": "1"}, {"a": "1"}) == ""


def test_workspace_diff_is_bounded() -> None:
    """A probe rewrote a protected test to 15 MiB: a 17 million character diff and 3.4 s of difflib."""
    from tandem.env.reward import DIFF_FILE_MAX_CHARS, DIFF_MAX_CHARS

    lines = "".join(f"line {i}\n" for i in range(30))
    big = lines + "".join(f"{i}\n" for i in range(2_000_000))
    d = workspace_diff({"t.py": lines, "s.py": "a\n"}, {"t.py": big, "s.py": "b\n"})
    assert f"diff of t.py omitted: {len(lines)} -> {len(big)} characters (over {DIFF_FILE_MAX_CHARS})" in d
    assert "-a\n+b\n" in d and len(d) < 1000  # the small file is still diffed
    many = {f"f{i}.py": "x" * 1000 + "\n" for i in range(2000)}  # 2 MB of small files
    d = workspace_diff({}, many)
    assert len(d) <= DIFF_MAX_CHARS + 100 and d.endswith(f"[diff cut at {DIFF_MAX_CHARS} characters]\n")


def test_hidden_tests_never_appear_in_the_agent_workspace() -> None:
    from tandem.env.humaneval import get_task as humaneval_task
    from tandem.sandbox import create_sandbox

    tasks = [generate_task(s, i, 0, lv) for s in ("train", "heldout") for lv in (1, 2, 3) for i in (0, 1)]
    tasks += [humaneval_task(f"humaneval:HumanEval/{n}") for n in (0, 32, 163)]
    for t in tasks:
        assert not set(t.hidden_tests) & set(t.workspace), t.id
        for hidden in t.hidden_tests.values():
            assert all(hidden not in content for content in t.workspace.values()), t.id
    cfg = SandboxConfig(backend="bwrap" if bwrap_available() else "plain")
    for t in (tasks[0], tasks[-1]):
        with create_sandbox(t.workspace, cfg) as sb:  # what the agent's sandbox holds
            assert set(sb.snapshot()) == set(t.workspace)
            assert "No such file" in sb.exec(["cat", HIDDEN_TEST_FILE]).stderr
