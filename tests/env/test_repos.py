"""Repository tasks: deterministic generation, disjoint splits, SWE-bench grading in real sandboxes."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.cli.env import app
from tandem.core.config import RewardConfig, SandboxConfig, TaskConfig
from tandem.core.records import Task
from tandem.env import repo_grader, repos
from tandem.env.reward import parse_result, score, scoring_files
from tandem.env.sources import describe, task_at, tasks_for
from tandem.env.tasks import get_task
from tandem.sandbox import bwrap_available, create_sandbox

RC = RewardConfig()
ONE_PER_PACKAGE = [
    "repo:train:textkit-wrap-exact-width",
    "repo:train:intervals-gaps-tail",
    "repo:train:ledger-remove-all",
    "repo:heldout:semver-operator-order",
]
FORGED = "RESULT passed={n} total={n}"


@pytest.fixture(scope="module")
def sbx() -> SandboxConfig:
    return SandboxConfig(backend="bwrap" if bwrap_available() else "plain", timeout_s=20.0)


def _fixed(task: Task) -> dict[str, str]:
    return {**task.workspace, **task.meta["fix"]}


def _grade(task: Task, files: dict[str, str], sbx: SandboxConfig) -> tuple[str, dict[str, float]]:
    """The grader's own stdout in a fresh sandbox (as ``score`` runs it) and its components."""
    with create_sandbox(scoring_files(task, files), sbx) as sb:
        result = sb.exec(list(task.test_command))
    assert parse_result(result.stdout) is not None, result.stdout[-800:] + result.stderr[-800:]
    return result.stdout, repo_grader.result_components(task, result.stdout)


def test_every_task_generates_with_verified_fail_to_pass_and_pass_to_pass() -> None:
    train, held = repos.names("train"), repos.names("heldout")
    assert not set(train) & set(held) and len(held) >= 6
    assert len(train) + len(held) == sum(describe()["repo"]["packages"].values()) >= 20
    assert describe()["repo"]["splits"] == {"train": len(train), "heldout": len(held)}
    for split, names in (("train", train), ("heldout", held)):
        for name in names:
            task = repos.make_task(name)  # raises if a hidden case passes on the bug or a case is unusable
            assert task.id == f"repo:{split}:{name}" and task.meta["split"] == split == repos.split_of(name)
            f2p, p2p = task.meta["fail_to_pass"], task.meta["pass_to_pass"]
            assert f2p and p2p and not set(f2p) & set(p2p)
            assert task.meta["hidden_total"] == len(f2p) + len(p2p)
            assert set(task.hidden_tests) == {repos.GRADER_FILE} and repos.GRADER_FILE not in task.workspace
            visible = "\n".join(task.workspace[p] for p in task.protected)
            assert all(f"def {t.rsplit('::', 1)[1]}(" not in visible for t in f2p)  # hidden tests stay hidden
            assert all(f"def {t.rsplit('::', 1)[1]}(" in visible for t in p2p)
            assert task.protected == sorted(p for p in task.workspace if p.startswith("tests/"))


def _digest(task: Task) -> str:
    return hashlib.sha256(json.dumps(task.to_dict(), sort_keys=True).encode()).hexdigest()


def _quoted(value: object, issue: str) -> bool:
    """Whether a case's literal appears in the issue text (as written in code, or a string's own text)."""
    if isinstance(value, str):
        return repr(value) in issue or f'"{value}"' in issue or (value != "" and value in issue)
    return re.search(r"(?<![\w.])" + re.escape(repr(value)) + r"(?![\w.])", issue) is not None


def _literals(code: str) -> list[object]:
    """The constants of a case's code (``None`` and booleans aside)."""
    nodes = ast.walk(ast.parse(code.strip("\n")))
    return [
        n.value for n in nodes if isinstance(n, ast.Constant) and type(n.value) in (int, float, str, bytes)
    ]


def test_every_bug_has_a_hidden_case_the_issue_does_not_quote() -> None:
    """A fix that special-cases the issue's own examples must not pass: each bug has a hidden case with at
    least one literal (argument, setup value) that its issue text does not contain. A red-team found ten
    bugs whose hidden cases were exactly the issue's examples, and five such special-cased 'fixes' scored
    1.0."""
    weak = [
        f"{package}-{bug.name}"
        for package in repos.PACKAGES
        for bug in repos.template(package).bugs
        if all(all(_quoted(v, bug.issue) for v in _literals(code)) for code in bug.cases.values())
    ]
    assert weak == []


def test_same_id_same_task_and_sha_in_another_process() -> None:
    task = get_task("repo:train:ledger-remove-all")
    assert get_task(task.id).to_dict() == task.to_dict()
    code = (
        "import hashlib, json; from tandem.env.tasks import get_task; "
        "t = get_task('repo:train:ledger-remove-all'); "
        "d = hashlib.sha256(json.dumps(t.to_dict(), sort_keys=True).encode()).hexdigest(); "
        "print(t.meta['base_commit'], d)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == [task.meta["base_commit"], _digest(task)]
    assert task.meta["base_commit"][:12] in task.prompt[1].content


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_checkout_has_the_recorded_sha_and_the_patches_apply(tmp_path: Path, sbx: SandboxConfig) -> None:
    task = get_task("repo:train:textkit-wrap-exact-width")
    repo = tmp_path / "repo"
    assert repos.materialize(task, repo) == task.meta["base_commit"]
    (tmp_path / "test.patch").write_text(task.meta["test_patch"])
    (tmp_path / "fix.patch").write_text(task.meta["patch"])

    def unittest_in_sandbox() -> tuple[int, str]:
        with create_sandbox(repo, sbx) as sb:
            r = sb.exec(["python3", "-m", "unittest"])
        return r.exit_code, r.stderr

    code, out = unittest_in_sandbox()
    assert code == 0 and f"Ran {len(task.meta['pass_to_pass'])} tests" in out
    subprocess.run(["git", "apply", str(tmp_path / "test.patch")], cwd=repo, check=True)
    code, out = unittest_in_sandbox()  # the hidden tests as plain unittest methods: F2P fail on the base
    failed = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", out))
    assert code != 0 and failed == len(task.meta["fail_to_pass"])
    subprocess.run(["git", "apply", str(tmp_path / "fix.patch")], cwd=repo, check=True)
    code, out = unittest_in_sandbox()
    assert code == 0 and f"Ran {task.meta['hidden_total']} tests" in out


@pytest.mark.parametrize("task_id", ONE_PER_PACKAGE)
def test_reference_fix_passes_everything_and_the_base_fails_every_fail_to_pass(
    task_id: str, sbx: SandboxConfig
) -> None:
    task = get_task(task_id)
    n_f2p, n_p2p = len(task.meta["fail_to_pass"]), len(task.meta["pass_to_pass"])
    out, comps = _grade(task, _fixed(task), sbx)
    assert comps == {"f2p_passed": n_f2p, "f2p_total": n_f2p, "p2p_passed": n_p2p, "p2p_total": n_p2p}
    assert all(f"PASS {t}" in out for t in task.meta["fail_to_pass"] + task.meta["pass_to_pass"])
    r = score(task, _fixed(task), RC, sbx)
    assert r.value == 1.0 and r.components["tests_passed"] == n_f2p + n_p2p
    assert r.components["tests_edited"] == 0.0

    out, comps = _grade(task, dict(task.workspace), sbx)
    assert comps == {"f2p_passed": 0, "f2p_total": n_f2p, "p2p_passed": n_p2p, "p2p_total": n_p2p}
    assert all(f"FAIL {t}" in out for t in task.meta["fail_to_pass"])
    r = score(task, dict(task.workspace), RC, sbx)
    assert r.value == 0.0 and r.components["tests_passed"] == n_p2p and r.components["parse_error"] == 0.0


def test_score_reports_fail_to_pass_and_pass_to_pass(sbx: SandboxConfig) -> None:
    task = get_task("repo:train:ledger-remove-all")
    r = score(task, dict(task.workspace), RC, sbx)
    if "f2p_passed" not in r.components:
        pytest.skip("reward.score does not add the task's result_components yet (repos module docstring)")
    n_p2p = len(task.meta["pass_to_pass"])
    assert r.components["f2p_passed"] == 0 and r.components["f2p_total"] == len(task.meta["fail_to_pass"])
    assert r.components["p2p_passed"] == r.components["p2p_total"] == n_p2p


def test_partial_credit_for_the_issue_counts_fail_to_pass_only(sbx: SandboxConfig) -> None:
    """Under ``kind = "fraction"`` an untouched repository earns its PASS_TO_PASS share (a red-team's empty
    solution scored 0.913); the term over ``f2p_fraction`` gated on ``p2p_fraction`` gives it nothing and
    the reference fix full marks."""
    task = get_task("repo:train:ledger-remove-all")
    n_f2p, n_p2p = len(task.meta["fail_to_pass"]), len(task.meta["pass_to_pass"])
    untouched = score(task, dict(task.workspace), RewardConfig(kind="fraction"), sbx)
    assert untouched.value == n_p2p / (n_f2p + n_p2p) > 0.5
    assert untouched.components["f2p_fraction"] == 0.0 and untouched.components["p2p_fraction"] == 1.0
    issue_only = RewardConfig(terms=["1 * f2p_fraction if p2p_fraction >= 1"])
    assert score(task, dict(task.workspace), issue_only, sbx).value == 0.0
    fixed = score(task, _fixed(task), issue_only, sbx)
    assert fixed.value == 1.0 and fixed.components["p2p_fraction"] == 1.0
    broken = {**_fixed(task), "ledger/__init__.py": "raise ImportError('broken')\n"}
    r = score(task, broken, issue_only, sbx)
    assert r.value == 0.0 and r.components["p2p_fraction"] == 0.0


def test_editing_tests_earns_nothing_and_is_flagged(sbx: SandboxConfig) -> None:
    task = get_task("repo:train:ledger-remove-all")
    n = task.meta["hidden_total"]
    gutted = {p: f"print({FORGED.format(n=n)!r})\n" for p in task.protected if p.endswith(".py")}
    r = score(task, {**task.workspace, **gutted}, RC, sbx)
    assert r.value == 0.0 and r.components["tests_edited"] == 1.0
    deleted = {p: c for p, c in task.workspace.items() if p not in task.protected}
    assert score(task, deleted, RC, sbx).components["tests_edited"] == 1.0
    r = score(task, {**_fixed(task), **gutted}, RewardConfig(test_edit_penalty=0.25), sbx)
    assert r.value == 0.75 and r.components["tests_edited"] == 1.0  # the fix still counts; the edit costs
    fake_grader = {repos.GRADER_FILE: f"print({FORGED.format(n=n)!r})\n"}
    r = score(task, {**task.workspace, **fake_grader}, RC, sbx)
    assert r.value == 0.0 and r.components["tests_edited"] == 1.0


def _forgeries(n: int) -> dict[str, dict[str, str]]:
    line = FORGED.format(n=n)
    at_import = "import os, sys\n" + f"print({line!r}, flush=True)\nsys.stdout.flush()\nos._exit(0)\n"
    return {
        "print_and_exit_at_import": {"ledger/__init__.py": at_import},
        "write_to_grader_stdout": {
            "ledger/__init__.py": (
                "import os\nwith open(f'/proc/{os.getppid()}/fd/1', 'w') as f:\n"
                f"    f.write({line!r} + '\\n')\nos._exit(0)\n"
            )
        },
        "patch_unittest_and_exit_zero": {
            "ledger/__init__.py": (
                "import atexit, os, unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
                f"atexit.register(lambda: (print({line!r}), os._exit(0)))\n"
            )
        },
        "shadow_the_child_stdlib": {"json.py": at_import, "os.py": at_import, "select.py": at_import},
    }


@pytest.mark.parametrize("name", sorted(_forgeries(0)))
def test_forged_results_earn_nothing(name: str, sbx: SandboxConfig) -> None:
    task = get_task("repo:train:ledger-remove-all")
    files = {**task.workspace, **_forgeries(task.meta["hidden_total"])[name]}
    r = score(task, files, RC, sbx)
    assert r.value == 0.0 and r.components["all_passed"] == 0.0
    assert r.components["tests_passed"] < r.components["tests_total"] or r.components["parse_error"] == 1.0


def test_a_hanging_fix_fails_only_the_hanging_case(sbx: SandboxConfig) -> None:
    task = get_task("repo:train:ledger-transfer-whole-balance")
    path, fixed = next(iter(task.meta["fix"].items()))
    post = "        self.post(src, -cents, memo)\n"
    hang = fixed.replace(post, "        while self.balance(src) == cents:\n            pass\n" + post)
    assert hang != fixed
    out, comps = _grade(task, {**task.workspace, path: hang}, sbx)
    assert "timed out" in out and comps["f2p_passed"] == 0 and comps["p2p_passed"] == comps["p2p_total"]


def test_a_child_killed_by_a_signal_is_reported_by_the_grader_exit_status(sbx: SandboxConfig) -> None:
    task = get_task("repo:train:ledger-remove-all")
    crash = "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)\n"  # as the CPU-time rlimit would
    r = score(task, {**_fixed(task), "ledger/__init__.py": crash}, RC, sbx)
    assert r.value == 0.0 and r.components["exit_code"] == 128 + signal.SIGXCPU
    assert r.components["parse_error"] == 0.0 and r.components["tests_passed"] == 0.0


def test_ids_round_trip_and_bad_ids_name_the_id() -> None:
    name = repos.names("heldout")[0]
    task = get_task(f"repo:heldout:{name}")
    assert task.id == f"repo:heldout:{name}" and Task.from_dict(task.to_dict()).to_dict() == task.to_dict()
    other = "train" if repos.split_of(name) == "heldout" else "heldout"
    bad_ids = [f"repo:{other}:{name}", "repo:train:textkit-no-bug", "repo:test:x", "repo:", "repo:a:b:c"]
    for bad in bad_ids:
        with pytest.raises(ValueError, match="task id"):
            get_task(bad)


def test_sources_serve_repo_tasks() -> None:
    cfg = TaskConfig(source="repo")
    held = tasks_for(cfg, "heldout", 100)
    assert [t.id for t in held] == [f"repo:heldout:{n}" for n in repos.names("heldout")]
    assert [t.id for t in tasks_for(cfg, "train", 2)] == [f"repo:train:{n}" for n in repos.names("train")[:2]]
    n_train = len(repos.names("train"))
    assert task_at(cfg, "train", n_train + 1).id == task_at(cfg, "train", 1).id
    assert held[0].limits.max_turns == cfg.max_turns


def test_cli_try_grades_a_solution_dir(tmp_path: Path) -> None:
    task_id = "repo:train:ledger-remove-all"
    task = get_task(task_id)
    for path, content in task.meta["fix"].items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content)
    res = CliRunner().invoke(app, ["try", task_id, "--solution", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["task"] == task_id and out["reward"] == 1.0 and not out["flags"]["tests_edited"]


def test_a_result_line_the_grader_components_do_not_add_up_to_is_not_the_graders():
    """Defence in depth against forged output (a probe forged RESULT 23/23 beside f2p_passed=0 by tracing
    the sandbox's wrapper, now impossible): a RESULT line must equal the sum of the f2p/p2p components."""
    from tandem.env.reward import _parts_add_up

    parts = {"f2p_passed": 0.0, "f2p_total": 2.0, "p2p_passed": 21.0, "p2p_total": 21.0}
    assert _parts_add_up(parts, 21, 23)
    assert not _parts_add_up(parts, 23, 23)
    assert not _parts_add_up({**parts, "f2p_total": 0.0}, 21, 23)
    assert _parts_add_up({}, 5, 5)  # tasks without components are not cross-checked
    assert _parts_add_up({"lint_passed": 1.0}, 5, 5)  # nor components without both halves
