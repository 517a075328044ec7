"""`tandem midtrain` refusals (src/tandem/cli/midtrain.py): every bad --out, --threads, --steps or checkpoint
is one `error:` line and exit status 2, before anything is built or written."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tandem.cli.midtrain import app  # the same function `tandem midtrain` mounts (tandem.cli.main)

runner = CliRunner()


def _refused(*args: str) -> str:
    res = runner.invoke(app, ["--preset", "smoke", *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    return res.output


def test_unwritable_out_is_refused_before_training(tmp_path: Path) -> None:
    """Before: `/proc/x` gave "error: [Errno 2] No such file or directory", `/sys/x` and a path under a file
    a PermissionError / NotADirectoryError traceback."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out in ("/proc/tandem-no-such/model", "/sys/tandem-no-such", str(a_file / "model")):
        msg = _refused("--out", out)
        assert f"--out {out!r}" in msg and "writable" in msg, msg
    assert a_file.read_text() == "x"


def test_bad_numbers_and_presets_are_refused_and_create_nothing(tmp_path: Path) -> None:
    """Before, --threads past a C long was "error: Overflow when unpacking long" after the tokenizer was
    trained into --out (and --threads 100000 crashed the process)."""
    out = tmp_path / "model"
    for args, needle in (
        (["--threads", "99999999999999999999"], "--threads must be <= 1024"),
        (["--threads", "100000"], "--threads must be <= 1024"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--stop-after", "0"], "--stop-after must be >= 1"),
        (["--preset", "bogus"], "--preset 'bogus' is unknown"),
    ):
        assert needle in _refused("--out", str(out), *args)
        assert not out.exists()


def test_resume_from_a_damaged_checkpoint_is_refused(tmp_path: Path) -> None:
    """Before: "error: invalid literal for int() with base 10: 'arbage\\n'" (after training a tokenizer)."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.pt").write_text("garbage\n")
    msg = _refused("--resume", "--out", str(tmp_path))
    assert "checkpoint/state.pt" in msg and "not a checkpoint" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
