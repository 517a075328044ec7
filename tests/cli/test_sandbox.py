"""`tandem sandbox run` limits (src/tandem/cli/sandbox.py): --memory, --pids, --max-output; real bwrap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.cli.sandbox import app
from tandem.sandbox import bwrap_available

runner = CliRunner()
needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")


@needs_bwrap
def test_memory_bomb_is_killed_and_reported(tmp_path: Path) -> None:
    (tmp_path / "bomb.py").write_text("a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n")
    args = [
        "run",
        "--workspace",
        str(tmp_path),
        "--memory",
        "64",
        "--timeout",
        "20",
        "--",
        "python3",
        "bomb.py",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code != 0 and r.exit_code != 124
    assert "out of memory or processes (limits: 64 MB" in r.stderr


@needs_bwrap
def test_max_output_truncates_with_marker(tmp_path: Path) -> None:
    r = runner.invoke(
        app,
        [
            "run",
            "--workspace",
            str(tmp_path),
            "--max-output",
            "100",
            "--",
            "python3",
            "-c",
            "print('x' * 5000)",
        ],
    )
    assert r.exit_code == 0
    assert r.stdout.startswith("x" * 100 + "\n[... output truncated at 100 bytes ...]")
    assert r.stdout.count("x") == 100


@needs_bwrap
def test_pids_limit_applies(tmp_path: Path) -> None:
    script = (
        "import os\nn = 0\ntry:\n    for _ in range(50):\n        if os.fork() == 0:\n"
        "            os.pause()\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n"
    )
    (tmp_path / "fork.py").write_text(script)
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "--pids", "8", "--", "python3", "fork.py"])
    assert r.exit_code == 0 and int(r.stdout) < 8


@needs_bwrap
def test_cpus_option_runs_the_command_under_its_quota(tmp_path: Path) -> None:
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "--cpus", "0.5", "--", "python3", "-c", "1"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--memory", "0"),
        ("--pids", "-1"),
        ("--max-output", "0"),
        ("--memory", "lots"),
        ("--timeout", "inf"),
        ("--cpus", "0"),
        ("--cpus", "nan"),
        ("--cpus", "2000"),
    ],
)
def test_bad_limits_exit_2_naming_the_flag(tmp_path: Path, flag: str, value: str) -> None:
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), flag, value, "--", "true"])
    assert r.exit_code == 2 and flag in r.stderr


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--timeout", "1e300", "--timeout must be <= 604800"),  # was an OverflowError traceback
        ("--memory", "9999999999999", "--memory must be <= 16777216"),  # was bwrap's "--size ... is limited"
        ("--pids", "99999999", "--pids must be <= 4194304"),  # was exit 125 "ulimit: ... cannot modify limit"
        ("--memory", "8", "--memory must be at least 16 MB"),  # was "libm.so.6: failed to map segment"
        ("--max-output", "2000000000", "--max-output must be <= 1073741824"),  # was a traceback
        ("--pids", "1", "--pids must be at least 3"),  # was exit 1 "bwrap: Creating new namespace failed"
        ("--pids", "2", "--pids must be at least 3"),  # was "tandem-exec: 1: Cannot fork"
    ],
)
def test_limits_past_what_the_kernel_takes_exit_2(tmp_path: Path, flag: str, value: str, needle: str) -> None:
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), flag, value, "--", "true"])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {needle}"), r.output


def test_an_unknown_option_is_refused_not_run_as_the_command(tmp_path: Path) -> None:
    """Before: `--memroy 64 -- true` ran `--memroy` in the sandbox (exit 127, "--memroy: not found")."""
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "--memroy", "64", "--", "true"])
    assert r.exit_code == 2 and r.stderr.startswith("error: no such option '--memroy'"), r.output


def test_workspace_with_a_named_pipe_exits_2_naming_it(tmp_path: Path) -> None:
    """Before: a shutil.Error traceback from copying the workspace ("`pipe` is a named pipe")."""
    import os

    (tmp_path / "a.txt").write_text("hi")
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "sub" / "pipe")
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "--", "true"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --workspace"), r.output
    assert "sub/pipe" in r.stderr and "named pipe" in r.stderr


TANDEM = [sys.executable, "-c", "import sys; from tandem.cli.main import app; sys.argv[0] = 'tandem'; app()"]


def test_workspace_holding_the_temp_dir_exits_2_before_copying(tmp_path: Path) -> None:
    """Before: the copy of a workspace holding the temp dir (where that copy is made; `--workspace /` holds
    /tmp) copied its own copy until the paths were too long, then printed a shutil.Error of every path."""
    (tmp_path / "a.txt").write_text("hi")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run(
        [*TANDEM, "sandbox", "run", "--workspace", str(tmp_path), "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,  # only detects a hang
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: --workspace {str(tmp_path)!r} holds the temp dir"), r.stderr
    assert r.stderr.count("\n") == 1 and list(tmp.iterdir()) == []


def test_workspace_on_a_kernel_file_system_exits_2() -> None:
    """Before: `--workspace /proc` never started its command (the copy blocked reading /proc/kmsg)."""
    r = subprocess.run(
        [*TANDEM, "sandbox", "run", "--workspace", "/proc", "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,  # only detects a hang
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "error: --workspace '/proc' is on a proc file system (kernel files, which can block or never end "
        "when read, not data to copy); pass a directory of ordinary files\n"
    )
