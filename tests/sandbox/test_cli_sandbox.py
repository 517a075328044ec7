"""`tandem sandbox run` (src/tandem/cli/sandbox.py): output passthrough and exit statuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.cli.sandbox import app
from tandem.sandbox import bwrap_available

runner = CliRunner()
needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine")


@needs_bwrap
def test_run_passes_output_and_status(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n")
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "--", "python3", "a.py"])
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "sh", "-c", "echo x > a.py; cat a.py"])
    assert (r.exit_code, r.stdout) == (0, "x\n")
    assert (tmp_path / "a.py").read_text().startswith("import sys")


@needs_bwrap
def test_run_timeout_exits_124(tmp_path: Path) -> None:
    r = runner.invoke(app, ["run", "--workspace", str(tmp_path), "--timeout", "0.5", "--", "sleep", "100"])
    assert r.exit_code == 124 and "timed out" in r.stderr


def test_run_plain_backend(tmp_path: Path) -> None:
    r = runner.invoke(
        app, ["run", "--workspace", str(tmp_path), "--backend", "plain", "--", "sh", "-c", "exit 5"]
    )
    assert r.exit_code == 5


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--workspace", "/nonexistent/tandem-ws", "--", "true"],
        ["run", "--workspace", "{tmp}", "--"],
        ["run", "--workspace", "{tmp}"],
        ["run", "--", "true"],
        ["run", "--workspace", "{tmp}", "--backend", "docker", "--", "true"],
        ["run", "--workspace", "{tmp}", "--timeout", "0", "--", "true"],
    ],
)
def test_bad_input_exits_2(tmp_path: Path, args: list[str]) -> None:
    r = runner.invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.exit_code == 2 and "error:" in r.stderr
