"""HumanEval tasks: canonical solutions score 1 in a real sandbox, wrong and forged ones 0, ids round-trip."""

from __future__ import annotations

import pytest

from tandem.core.config import RewardConfig, SandboxConfig, TaskConfig
from tandem.env import humaneval
from tandem.env.reward import score
from tandem.env.sources import task_at, tasks_for
from tandem.env.tasks import HIDDEN_TEST_FILE, SOLUTION_FILE, VISIBLE_TEST_FILE, get_task, task_split
from tandem.sandbox import bwrap_available, create_sandbox

RC = RewardConfig()
FORGED = "RESULT passed=1 total=1"


@pytest.fixture(scope="module")
def sbx() -> SandboxConfig:
    return SandboxConfig(backend="bwrap" if bwrap_available() else "plain", timeout_s=20.0)


def _score(task_id: str, solution: str, sbx: SandboxConfig, **extra: str) -> float:
    task = get_task(task_id)
    return score(task, {**task.workspace, SOLUTION_FILE: solution, **extra}, RC, sbx).value


@pytest.mark.parametrize("n", [0, 2, 10])
def test_canonical_solution_scores_one(n: int, sbx: SandboxConfig) -> None:
    task = get_task(f"humaneval:HumanEval/{n}")
    r = score(task, {**task.workspace, SOLUTION_FILE: task.meta["solution"]}, RC, sbx)
    assert r.value == 1.0
    assert r.components["tests_passed"] == r.components["tests_total"] == 1.0
    assert r.components["exit_code"] == 0.0


def test_stub_and_wrong_solutions_score_zero(sbx: SandboxConfig) -> None:
    task = get_task("humaneval:HumanEval/0")
    assert score(task, dict(task.workspace), RC, sbx).value == 0.0
    wrong = task.workspace[SOLUTION_FILE].replace("raise NotImplementedError", "return False")
    r = score(task, {**task.workspace, SOLUTION_FILE: wrong}, RC, sbx)
    assert r.value == 0.0 and r.components["exit_code"] == 1.0 and r.components["parse_error"] == 0.0
    assert _score("humaneval:HumanEval/0", "this is not python", sbx) == 0.0


FORGERIES = {
    "print_sys_exit": f"import sys\nprint({FORGED!r})\nsys.exit(0)\n",
    "print_os_exit": f"import os\nprint({FORGED!r}, flush=True)\nos._exit(0)\n",
    "forge_on_call": (
        "import os\ndef has_close_elements(numbers, threshold):\n"
        f"    print({FORGED!r}, flush=True)\n    os._exit(0)\n"
    ),
    "write_to_grader_stdout": (
        "import os\nwith open(f'/proc/{os.getppid()}/fd/1', 'w') as f:\n"
        f"    f.write({FORGED!r} + '\\n')\nos._exit(0)\n"
    ),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_result_line_scores_zero(name: str, sbx: SandboxConfig) -> None:
    assert _score("humaneval:HumanEval/0", FORGERIES[name], sbx) == 0.0


def test_workspace_modules_cannot_shadow_the_grader(sbx: SandboxConfig) -> None:
    forge = f"import os\nprint({FORGED!r}, flush=True)\nos._exit(0)\n"
    extra = {"subprocess.py": forge, "ast.py": forge, "sys.py": forge}
    assert (
        _score("humaneval:HumanEval/0", "def has_close_elements(a, b):\n    return 1\n", sbx, **extra) == 0.0
    )


def test_visible_test_passes_on_the_stub_in_a_sandbox(sbx: SandboxConfig) -> None:
    task = get_task("humaneval:HumanEval/2")
    with create_sandbox(task.workspace, sbx) as sb:
        result = sb.exec(list(task.visible_test_command))
    assert result.exit_code == 0 and result.stdout.strip().endswith("RESULT passed=1 total=1")


def test_task_shape_and_round_trip() -> None:
    task = get_task("humaneval:HumanEval/10")
    assert task.id == "humaneval:HumanEval/10"
    assert task.workspace[SOLUTION_FILE].endswith("    raise NotImplementedError\n")
    assert set(task.workspace) == {SOLUTION_FILE, VISIBLE_TEST_FILE}
    assert set(task.hidden_tests) == {HIDDEN_TEST_FILE} and task.protected == [VISIBLE_TEST_FILE]
    assert "check" not in task.workspace[VISIBLE_TEST_FILE]
    assert task.meta["hidden_total"] == 1 and task.meta["function"] == "make_palindrome"
    assert get_task(task.id).to_dict() == task.to_dict()


@pytest.mark.parametrize("bad", ["humaneval:HumanEval/164", "humaneval:0", "humaneval:", "nonsense"])
def test_bad_ids_raise_value_error_naming_the_id(bad: str) -> None:
    with pytest.raises(ValueError, match="task id"):
        get_task(bad)


def test_sources_select_tasks() -> None:
    he = TaskConfig(source="humaneval")
    assert len(humaneval.problems()) == 164
    held = tasks_for(he, "heldout", 500)
    assert len(held) == 164 and held[0].id == "humaneval:HumanEval/0" and held[163].id.endswith("/163")
    assert [t.id for t in tasks_for(he, "train", 3)] == [t.id for t in held[:3]]
    assert task_at(he, "train", 165).id == "humaneval:HumanEval/1"
    builtin = TaskConfig(levels=[1, 3], seed=2)
    assert [t.to_dict() for t in tasks_for(builtin, "heldout", 4)] == [
        t.to_dict() for t in task_split("heldout", 2, [1, 3], 4)
    ]
    with pytest.raises(ValueError, match="split"):
        tasks_for(he, "test", 1)
