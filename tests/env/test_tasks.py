"""Built-in tasks: determinism, disjoint splits, and every family's reference and bugs run for real."""

from __future__ import annotations

import pytest

from tandem.core.config import SandboxConfig
from tandem.core.records import Task
from tandem.env.families import FAMILIES, FAMILIES_BY_LEVEL
from tandem.env.tasks import (
    HIDDEN_TEST_FILE,
    PARAMS_FILE,
    SOLUTION_FILE,
    SYSTEM_PROMPT,
    TOOLS,
    VISIBLE_TEST_FILE,
    generate_task,
    get_task,
    run_test_file_inprocess,
    split_of,
    task_split,
    workspace_modules,
)
from tandem.sandbox import bwrap_available, create_sandbox


def _sandbox_config() -> SandboxConfig:
    return SandboxConfig(backend="bwrap" if bwrap_available() else "plain", timeout_s=60.0)


# Runs every test file of every sub-directory in a forked child of one interpreter (interpreter start-up is
# the slow part on a loaded 2-core machine); prints "<dir> <hidden exit> <visible exit>".
DRIVER = """import os, runpy, sys
for d in sorted(x for x in os.listdir(".") if os.path.isdir(x)):
    codes = []
    for f in ("_hidden_test.py", "test_solution.py"):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.chdir(d)
            sys.path.insert(0, os.getcwd())
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            try:
                runpy.run_path(f, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                code = 2
            os._exit(code)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(d, *codes)
"""


def _tasks_per_family(per_family: int) -> dict[str, list[Task]]:
    found: dict[str, list[Task]] = {f.name: [] for f in FAMILIES}
    for split in ("train", "heldout"):
        for level, fams in FAMILIES_BY_LEVEL.items():
            for i in range(40 * len(fams)):
                t = generate_task(split, i, 3, level)
                if len(found[t.meta["family"]]) < per_family:
                    found[t.meta["family"]].append(t)
    return found


def test_levels_have_six_to_ten_families() -> None:
    assert sorted(FAMILIES_BY_LEVEL) == [1, 2, 3]
    for fams in FAMILIES_BY_LEVEL.values():
        assert 6 <= len(fams) <= 10
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_task_shape() -> None:
    t = generate_task("train", 5, 0, 2)
    name = t.meta["function"]
    assert [m.role for m in t.prompt] == ["system", "user"]
    assert t.prompt[0].content == SYSTEM_PROMPT
    assert t.prompt[1].content.startswith(f"Implement `{name}(")
    assert t.prompt[1].content.endswith("Visible tests are in test_solution.py. Call submit when done.")
    assert set(t.workspace) == {SOLUTION_FILE, VISIBLE_TEST_FILE, PARAMS_FILE}
    assert f"def {name}(" in t.workspace[SOLUTION_FILE]
    assert "raise NotImplementedError" in t.workspace[SOLUTION_FILE]
    assert set(t.hidden_tests) == {HIDDEN_TEST_FILE}
    assert t.test_command == ["python3", "-I", "-S", HIDDEN_TEST_FILE]
    assert t.visible_test_command == ["python3", "-S", VISIBLE_TEST_FILE]
    assert t.protected == [VISIBLE_TEST_FILE, PARAMS_FILE]
    # The parameters live in params.py; the stub, the spec and the reference name them, never their values.
    params = t.meta["params"]
    assert params and t.workspace[PARAMS_FILE] == "".join(f"{k} = {v!r}\n" for k, v in sorted(params.items()))
    assert t.workspace[SOLUTION_FILE].startswith(f"from params import {', '.join(sorted(params))}\n")
    assert t.meta["solution"].startswith(f"from params import {', '.join(sorted(params))}\n")
    assert "params.py" in t.prompt[1].content
    free = next(t for i in range(200) if not (t := generate_task("train", i, 0, 3)).meta["params"])
    assert set(free.workspace) == {SOLUTION_FILE, VISIBLE_TEST_FILE} and free.protected == [VISIBLE_TEST_FILE]
    assert "import" not in free.meta["solution"]
    assert 6 <= t.meta["hidden_total"] <= 10 and 2 <= t.meta["visible_total"] <= 3
    assert [x["function"]["name"] for x in TOOLS] == ["read_file", "write_file", "run", "run_tests", "submit"]
    # Short enough for a tiny context: prompt plus stub well under the session budget.
    assert len(SYSTEM_PROMPT) + len(t.prompt[1].content) + len(t.workspace[SOLUTION_FILE]) < 600


def test_deterministic_and_regenerable_from_id() -> None:
    for split in ("train", "heldout"):
        for level in (1, 2, 3):
            a = generate_task(split, 7, 11, level)
            assert a.to_dict() == generate_task(split, 7, 11, level).to_dict()
            assert get_task(a.id).to_dict() == a.to_dict()
    tasks = task_split("train", 1, [1, 3], 6)
    assert [t.meta["level"] for t in tasks] == [1, 3, 1, 3, 1, 3]
    assert [t.to_dict() for t in tasks] == [t.to_dict() for t in task_split("train", 1, [1, 3], 6)]
    with pytest.raises(ValueError, match="task id"):
        get_task("nonsense")
    with pytest.raises(ValueError, match="split"):
        generate_task("test", 0, 0, 1)
    with pytest.raises(ValueError, match="level"):
        generate_task("train", 0, 0, 9)


def test_train_and_heldout_are_disjoint_by_content() -> None:
    train = {t.meta["signature"] for s in (0, 1) for t in task_split("train", s, [1, 2, 3], 450)}
    held = {t.meta["signature"] for s in (0, 1) for t in task_split("heldout", s, [1, 2, 3], 150)}
    assert train and held and not (train & held)
    assert all(split_of(sig) == "train" for sig in train)
    assert all(split_of(sig) == "heldout" for sig in held)
    # Different seeds give different task sets.
    assert (
        task_split("train", 0, [2], 5)[0].meta["signature"]
        != task_split("train", 1, [2], 5)[0].meta["signature"]
    )


def test_every_family_reference_passes_and_every_bug_fails_in_sandbox() -> None:
    """Run the hidden tests of 2 instances per family against the reference and every bug, in one sandbox."""
    files: dict[str, str] = {}
    expect: dict[str, int] = {}
    for fam, tasks in _tasks_per_family(2).items():
        assert len(tasks) == 2, fam
        for k, t in enumerate(tasks):
            assert t.meta["bugs"], f"{fam}: no bug variant fails the hidden tests"
            for j, src in enumerate([t.meta["solution"], *t.meta["bugs"]]):
                d = f"{fam}_{k}_{j}"
                files[f"{d}/{SOLUTION_FILE}"] = src
                files[f"{d}/{HIDDEN_TEST_FILE}"] = t.hidden_tests[HIDDEN_TEST_FILE]
                files[f"{d}/{VISIBLE_TEST_FILE}"] = t.workspace[VISIBLE_TEST_FILE]
                if PARAMS_FILE in t.workspace:
                    files[f"{d}/{PARAMS_FILE}"] = t.workspace[PARAMS_FILE]
                expect[d] = 0 if j == 0 else 1
    with create_sandbox({**files, "driver.py": DRIVER}, _sandbox_config()) as sb:
        res = sb.exec(["python3", "driver.py"])
    got = {line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in res.stdout.splitlines()}
    assert set(got) == set(expect), res.stderr
    for d, want in expect.items():
        assert got[d][0] == want, f"{d}: hidden tests exit {got[d][0]}, expected {want}"
        if want == 0:
            assert got[d][1] == 0, f"{d}: reference fails its visible tests"


def test_inprocess_runner_matches_sandbox_and_import_crash_fails_all() -> None:
    tasks = [ts[0] for ts in _tasks_per_family(1).values()][::4]
    assert {PARAMS_FILE in t.workspace for t in tasks} == {True, False}
    cases = [
        (t, t.workspace[VISIBLE_TEST_FILE], s) for t in tasks for s in (t.meta["solution"], t.meta["bugs"][0])
    ]
    cases.append((tasks[0], tasks[0].workspace[VISIBLE_TEST_FILE], tasks[0].workspace[SOLUTION_FILE]))
    crash = "raise ValueError('boom')\n"
    cases.append((tasks[0], tasks[0].hidden_tests[HIDDEN_TEST_FILE], crash))
    with create_sandbox({}, _sandbox_config()) as sb:
        for t, test_src, src in cases:
            sb.write(SOLUTION_FILE, src)
            sb.write(PARAMS_FILE, t.workspace.get(PARAMS_FILE, ""))
            sb.write("t.py", test_src)
            res = sb.exec(["python3", "t.py"])
            assert (res.stdout, res.exit_code) == run_test_file_inprocess(
                test_src, src, workspace_modules(t.workspace)
            )
            assert res.stderr == ""
    out, code = run_test_file_inprocess(tasks[0].hidden_tests[HIDDEN_TEST_FILE], crash)
    n = tasks[0].meta["hidden_total"]
    assert code == 1 and "FAIL import solution: ValueError: boom" in out
    assert out.rstrip().endswith(f"RESULT passed=0 total={n}")
