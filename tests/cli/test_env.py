"""`tandem env list` / `tandem env try`: counts, grading a solution through the sandbox, bad input exits 2."""

from __future__ import annotations

import json
import os
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


def _refused(args: list[str], *needles: str) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    for needle in needles:
        assert needle in res.output, res.output
    return res.output


def test_try_dir_past_the_snapshot_caps_is_refused(tmp_path: Path) -> None:
    """Before, a directory solution was read whole (a 30 MB file, any number of files, a walk of `/`) though
    the snapshot grading stands for keeps at most sandbox.file_mb per file and 16 MiB in all."""
    from tandem.cli.env import SOLUTION_MAX_ENTRIES
    from tandem.sandbox.base import SNAPSHOT_MAX_BYTES

    task = "humaneval:HumanEval/0"
    big = tmp_path / "big"
    big.mkdir()
    _canonical(big)
    (big / "data.txt").write_text("x" * (2 * 2**20))
    _refused(
        ["try", task, "--solution", str(big), "--set", "sandbox.file_mb=1"],
        str(big / "data.txt"), "sandbox.file_mb=1",
    )  # fmt: skip
    many_mb = tmp_path / "many_mb"
    many_mb.mkdir()
    for i in range(SNAPSHOT_MAX_BYTES // 2**20 + 1):
        (many_mb / f"part{i:02d}.txt").write_text("y" * 2**20)
    _refused(["try", task, "--solution", str(many_mb)], str(many_mb), "16 MiB")
    many = tmp_path / "many"
    many.mkdir()
    for i in range(SOLUTION_MAX_ENTRIES + 1):
        (many / f"f{i}").touch()
    _refused(["try", task, "--solution", str(many)], str(many), str(SOLUTION_MAX_ENTRIES))


def test_try_file_past_the_cap_or_not_a_file_is_refused(tmp_path: Path) -> None:
    """Before, /dev/null was reported as "does not exist" and a file of any size was read whole."""
    task = "humaneval:HumanEval/0"
    big = tmp_path / "solution.py"
    big.write_text("#" * (2 * 2**20))
    _refused(
        ["try", task, "--solution", str(big), "--set", "sandbox.file_mb=1"], str(big), "sandbox.file_mb=1"
    )
    _refused(["try", task, "--solution", "/dev/null"], "'/dev/null'", "not a regular file")


def test_try_solution_on_a_kernel_file_system_is_refused() -> None:
    """Before: `--solution /proc` ended in "TypeError: object of type 'NoneType' has no len()" (a /proc file
    with nothing to read yet), and `--solution /proc/kmsg` was read, as root taking the kernel's log messages
    from the system's logger, and graded as a solution."""
    task = "humaneval:HumanEval/0"
    for path, kind in (
        ("/proc", "proc"),
        ("/proc/kmsg", "proc"),
        ("/proc/self/status", "proc"),
        ("/sys", "sysfs"),
    ):
        _refused(["try", task, "--solution", path], f"--solution {path!r} is on a {kind} file system")


def test_try_dir_skips_names_that_are_not_utf8_as_a_snapshot_does(tmp_path: Path) -> None:
    """Before: a file whose name is not UTF-8 beside a correct solution.py made the grading a sandbox error
    ("UnicodeEncodeError: ... surrogates not allowed"), reward 0; a session's snapshot skips such names."""
    sol = tmp_path / "sol"
    sol.mkdir()
    _canonical(sol)
    (sol / "notes").mkdir()
    for name in (b"bad\xff.py", b"notes/caf\xe9.txt"):
        with open(os.fsencode(sol) + b"/" + name, "w") as f:
            f.write("x = 1\n")
    res = runner.invoke(app, ["try", "humaneval:HumanEval/0", "--solution", str(sol), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.splitlines()[-1])
    assert out["reward"] == 1.0 and out["flags"]["sandbox_error"] is False, out


def test_try_dir_never_follows_links_out_of_it(tmp_path: Path) -> None:
    """A correct solution reachable only through a symlinked file or directory is not graded."""
    outside = tmp_path / "outside"
    outside.mkdir()
    _canonical(outside)
    sol = tmp_path / "sol"
    sol.mkdir()
    (sol / "solution.py").symlink_to(outside / "solution.py")
    (sol / "pkg").symlink_to(outside)
    res = runner.invoke(app, ["try", "humaneval:HumanEval/0", "--solution", str(sol), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["reward"] == 0.0 and out["flags"]["symlinks_ignored"] is True


def test_try_unreadable_config_is_refused(tmp_path: Path) -> None:
    """Before: UnicodeDecodeError / ValueError (4300-digit limit) tracebacks from reading --config."""
    sol = _canonical(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[reward]\n# caf\xe9\n")
    digits = tmp_path / "digits.toml"
    digits.write_text("[sandbox]\nmemory_mb = " + "9" * 5000 + "\n")
    for cfg, needle in ((latin1, "not UTF-8"), (digits, "too long")):
        _refused(
            ["try", "humaneval:HumanEval/0", "--solution", str(sol), "--config", str(cfg)], str(cfg), needle
        )
    huge = "sandbox.memory_mb=" + "9" * 5000
    _refused(["try", "humaneval:HumanEval/0", "--solution", str(sol), "--set", huge], "--set", "too long")
