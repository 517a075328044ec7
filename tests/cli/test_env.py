"""`tandem env list` / `tandem env try`: counts, grading a solution through the sandbox, bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tandem.cli.env import app
from tandem.env.tasks import VISIBLE_TEST_FILE, get_task

runner = CliRunner()


def _canonical(tmp_path: Path, n: int = 0) -> Path:
    path = tmp_path / "solution.py"
    path.write_text(get_task(f"humaneval:HumanEval/{n}").meta["solution"])
    return path


def test_list_counts_humaneval() -> None:
    res = runner.invoke(app, ["list", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["humaneval"]["tasks"] == 164
    assert info["humaneval"]["splits"] == {"train": 164, "heldout": 164}
    assert set(info["builtin"]["families_per_level"]) == {"1", "2", "3"}
    text = runner.invoke(app, ["list"])
    assert text.exit_code == 0 and "heldout=164" in text.output


def test_try_canonical_file_scores_one(tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["try", "humaneval:HumanEval/2", "--solution", str(_canonical(tmp_path, 2)), "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out) == {"task", "reward", "components", "flags"}
    assert out["task"] == "humaneval:HumanEval/2" and out["reward"] == 1.0
    assert not any(out["flags"].values())


def test_try_dir_that_edits_tests_is_flagged_and_restored(tmp_path: Path) -> None:
    _canonical(tmp_path)
    (tmp_path / VISIBLE_TEST_FILE).write_text("print('RESULT passed=1 total=1')\n")
    res = runner.invoke(app, ["try", "humaneval:HumanEval/0", "--solution", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["reward"] == 1.0 and out["flags"]["tests_edited"] is True


def test_try_builtin_task_stub_scores_zero(tmp_path: Path) -> None:
    task_id = "builtin:heldout:s0:l1:0"
    stub = tmp_path / "stub.py"
    stub.write_text(get_task(task_id).workspace["solution.py"])
    res = runner.invoke(app, ["try", task_id, "--solution", str(stub), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["reward"] == 0.0


def test_bad_input_exits_2_with_a_message(tmp_path: Path) -> None:
    sol = _canonical(tmp_path)
    res = runner.invoke(app, ["try", "humaneval:HumanEval/999", "--solution", str(sol)])
    assert res.exit_code == 2 and "error:" in res.output and "humaneval:HumanEval/999" in res.output
    res = runner.invoke(app, ["try", "bogus", "--solution", str(sol)])
    assert res.exit_code == 2 and "'bogus'" in res.output
    missing = tmp_path / "nope.py"
    res = runner.invoke(app, ["try", "humaneval:HumanEval/0", "--solution", str(missing)])
    assert res.exit_code == 2 and str(missing) in res.output
    binary = tmp_path / "bin.py"
    binary.write_bytes(b"\xff\xfe\x00")
    res = runner.invoke(app, ["try", "humaneval:HumanEval/0", "--solution", str(binary)])
    assert res.exit_code == 2 and "unreadable" in res.output
    res = runner.invoke(app, ["try", "humaneval:HumanEval/0"])
    assert res.exit_code == 2 and "--solution" in res.output
