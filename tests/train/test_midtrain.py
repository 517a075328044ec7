"""Mid-training: packing, batch order and schedule are pure; `midtrain --preset smoke` end to end; resume."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tandem.cli.midtrain import app, run_midtrain
from tandem.model.load import load_chat_format, load_model
from tandem.train.midtrain import MidtrainSettings, batch_rows, lr_at, pack


def test_pack_is_deterministic_and_separates_documents():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    a = pack(docs, eos_id=0, seq_len=4, seed=0)
    assert a.shape == (3, 4) and np.array_equal(a, pack(docs, 0, 4, 0))
    order = np.random.default_rng(0).permutation(len(docs))
    stream = [t for i in order for t in docs[i] + [0]]  # each document followed by eos
    assert a.ravel().tolist() == stream[:12]  # the ragged tail (2 of 14 tokens) is dropped
    with pytest.raises(ValueError, match="seq_len=100"):
        pack(docs, 0, 100, 0)


def test_batches_cover_each_row_once_per_epoch():
    seen = np.concatenate([batch_rows(s, 10, 5, seed=1) for s in range(2)])
    assert sorted(seen.tolist()) == list(range(10))
    assert np.array_equal(batch_rows(3, 10, 5, 1), batch_rows(3, 10, 5, 1))


def test_lr_schedule():
    s = MidtrainSettings(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, s) == pytest.approx(0.1) and lr_at(9, s) == pytest.approx(1.0)
    assert lr_at(10, s) == pytest.approx(1.0) and lr_at(100, s) == pytest.approx(0.1)
    assert all(lr_at(i, s) >= lr_at(i + 1, s) for i in range(10, 100))


def test_cli_smoke_end_to_end(tmp_path):
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["--preset", "smoke", "--out", str(out), "--threads", "1"])
    assert res.exit_code == 0, res.output
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "recipe.json",
        "metrics.jsonl",
    ):
        assert (out / f).is_file(), f
    assert not (out / "checkpoint").exists()
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["finished"] and recipe["steps_done"] == 6 and np.isfinite(recipe["final_loss"])
    assert recipe["corpus"]["transcripts"] == 12 and recipe["corpus"]["code_tokens"] > 0
    assert {"torch", "transformers"} <= set(recipe["versions"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 7))
    model, tok = load_model(out)
    chat = load_chat_format(out)
    assert (
        model.config.vocab_size == len(tok) and chat.stop_token_ids[0] in model.generation_config.eos_token_id
    )


def test_bad_preset_exits_2(tmp_path):
    res = CliRunner().invoke(app, ["--preset", "huge", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "huge" in res.output


def test_resume_continues_the_same_trajectory(tmp_path):
    full = run_midtrain("smoke", tmp_path / "full", threads=1, progress=False)
    part = run_midtrain("smoke", tmp_path / "part", threads=1, stop_after=3, progress=False)
    assert not part["finished"] and (tmp_path / "part" / "checkpoint" / "state.pt").is_file()
    metrics = tmp_path / "part" / "metrics.jsonl"
    good = metrics.read_text()
    rows = good.splitlines()
    metrics.write_text("\n".join([rows[0], "{not json", *rows[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not a metrics row"):
        run_midtrain("smoke", tmp_path / "part", resume=True, threads=1, progress=False)
    assert metrics.read_text().splitlines()[1] == "{not json"  # refused before anything was rewritten
    metrics.write_text(good + '{"step": 4, "lo')  # a line torn by the interruption is dropped
    resumed = run_midtrain("smoke", tmp_path / "part", resume=True, threads=1, progress=False)
    assert resumed["finished"]

    def losses(d):
        return [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    assert resumed["final_loss"] == full["final_loss"]
    a, b = (
        load_file(str(tmp_path / "full" / "model.safetensors")),
        load_file(str(tmp_path / "part" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_without_checkpoint_fails(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_midtrain("smoke", tmp_path / "empty", resume=True, threads=1, progress=False)


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_and_resume_continues_the_same_trajectory(
    tmp_path,
):
    """SIGTERM during training: the running step finishes, a checkpoint is written, the command says how to
    continue and exits 143; resuming gives the losses and weights of a run that was never stopped."""
    out = tmp_path / "stopped"
    argv = [sys.executable, "-m", "tandem.cli.main", "midtrain", "--preset", "smoke", "--steps", "400",
            "--threads", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("midtrain step 2/400"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(seen) + err
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    said = r"stopped by SIGTERM \(checkpointed\) at step (\d+); continue with --resume --out (\S+)"
    m = re.search(said, err)
    assert m, err[-3000:]
    at = int(m.group(1))
    assert m.group(2) == str(out)
    assert 2 <= at < 400 and (out / "checkpoint" / "state.pt").is_file()
    rows = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, at + 1))

    until = at + 2
    resumed = run_midtrain("smoke", out, resume=True, steps=400, threads=1, stop_after=until, progress=False)
    never = run_midtrain("smoke", tmp_path / "never", steps=400, threads=1, stop_after=until, progress=False)
    assert resumed["steps_done"] == never["steps_done"] == until and resumed["stopped_by"] is None

    def losses(d):
        return [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert losses(out) == losses(tmp_path / "never")
