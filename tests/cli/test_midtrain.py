"""`tandem midtrain` refusals (src/tandem/cli/midtrain.py): every bad --out, --threads, --steps or checkpoint
is one `error:` line and exit status 2, before anything is built or written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
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


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_stop_signal_during_the_final_save_waits_for_it(tmp_path: Path, monkeypatch) -> None:
    """Before: Ctrl-C while the trained model was being written printed "stopped by SIGINT before training
    started; nothing was trained: remove OUT ... and start again" (exit 130) over a finished run, and left no
    model. Now the save finishes: a whole model, its recipe, no checkpoint left."""
    import os
    import signal

    import transformers

    save = transformers.PreTrainedModel.save_pretrained

    def interrupted_save(self, *args, **kwargs):  # noqa: ANN001, ANN202 - wraps HF's own method
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the save starts
        return save(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted_save)
    out = tmp_path / "model"
    res = runner.invoke(app, ["--preset", "smoke", "--out", str(out), "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.output and "nothing was trained" not in res.output, res.output
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "recipe.json", "tokenizer.json"} <= names, names
    assert "checkpoint" not in names


def test_resume_from_an_archive_that_is_no_checkpoint_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """Before: a zip archive that is not a whole checkpoint of this run (another program's, or one with a
    damaged member) passed the check and failed in torch.load or at `state["settings"]` with a traceback
    (KeyError: 'settings'; _pickle.UnpicklingError: invalid load key)."""
    import torch

    out = tmp_path / "model"
    res = runner.invoke(app, ["--preset", "smoke", "--out", str(out), "--threads", "1", "--stop-after", "3"])
    assert res.exit_code == 0 and "--resume" in res.output, res.output
    ckpt = out / "checkpoint" / "state.pt"
    whole = ckpt.read_bytes()
    damaged = bytearray(whole)
    damaged[2000:6000] = bytes(b ^ 0xFF for b in damaged[2000:6000])  # member data, not the zip directory
    for write in (
        lambda: torch.save({}, ckpt),
        lambda: torch.save([1, 2], ckpt),
        lambda: ckpt.write_bytes(damaged),
    ):
        write()
        before = _files(out)
        res = runner.invoke(app, ["--preset", "smoke", "--resume", "--out", str(out), "--threads", "1"])
        assert res.exit_code == 2, res.output
        msg = res.output.splitlines()[-1]  # after the corpus line: the checkpoint is read after the corpus
        assert msg.startswith("error: --resume: ") and res.output.count("error:") == 1, res.output
        assert str(ckpt) in msg and "--resume" in msg and "new --out" in msg, msg
        assert _files(out) == before  # metrics, tokenizer and checkpoint as they were
    ckpt.write_bytes(whole)
    res = runner.invoke(app, ["--preset", "smoke", "--out", str(out), "--threads", "1", "--resume"])
    assert res.exit_code == 0 and f"wrote {out}" in res.output, res.output


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root")
def test_a_full_disk_while_checkpointing_is_one_error_line_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """Before: a disk that filled up during a checkpoint ended the run with torch's "RuntimeError: [enforce
    fail at inline_container.cc:672] . unexpected pos 687424 vs 687376" traceback, and the partial
    checkpoint/state.tmp stayed, holding the room a resume needs."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(small)], check=True)
    try:
        out = small / "model"  # room for the tokenizer and metrics, not for a checkpoint (~1.2 MB)
        res = runner.invoke(app, ["--preset", "smoke", "--out", str(out), "--threads", "1"])
        assert res.exit_code == 1, res.output
        msg = res.output.splitlines()[-1]  # after the progress lines
        assert msg.startswith(f"error: could not write the checkpoint {out / 'checkpoint' / 'state.pt'} "), (
            msg
        )
        assert "free disk space" in msg and res.output.count("error:") == 1, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        assert not (out / "checkpoint" / "state.tmp").exists()
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)
