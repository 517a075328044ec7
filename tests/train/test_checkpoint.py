"""Checkpoints: bitwise resume, atomic writes, latest checkpoint; checkpoints and exports load as HF dirs."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tandem.core.config import TrainConfig
from tandem.core.records import Group, Reward, SegmentBuilder, Trajectory
from tandem.train.checkpoint import atomic_dir, checkpoint_path, latest_checkpoint, read_state
from tandem.train.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    Qwen3ForCausalLM(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(500)} | {"<unk>": 500}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return str(path)


def _config():
    return TrainConfig(lr=1e-2, micro_batch_tokens=16, seed=0, threads=1, kl_coef=0.05)


def _groups(seed):
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(2):
        trajs = []
        for _ in range(4):
            b = SegmentBuilder()
            b.add_context(rng.integers(0, 512, 4).tolist())
            b.add_sampled(rng.integers(0, 512, 3).tolist(), [-6.0] * 3, [0] * 3)
            trajs.append(Trajectory(f"g{gi}", [b.build()], Reward(float(rng.integers(0, 2)))))
        groups.append(Group(f"g{gi}", trajs))
    return groups


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_resume_is_bitwise_identical_to_uninterrupted_run(model_dir, tmp_path):
    a = Trainer(model_dir, _config())
    a.step(_groups(0))
    ck = a.save_checkpoint(checkpoint_path(tmp_path, a.version))
    a.step(_groups(1))
    a.step(_groups(2))

    b = Trainer(model_dir, _config())
    state = b.load_checkpoint(ck)
    assert state["version"] == 1 == b.version
    b.step(_groups(1))
    b.step(_groups(2))
    assert b.version == a.version == 3
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][key], sb[i][key]) for i in sa for key in sa[i])


def test_checkpoint_and_export_are_hf_model_dirs(model_dir, tmp_path):
    t = Trainer(model_dir, _config())
    t.step(_groups(0))
    for path in (t.save_checkpoint(tmp_path / "checkpoints" / "final"), t.export_model(tmp_path / "export")):
        loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        w = _weights(t)
        assert all(torch.equal(v, w[k]) for k, v in loaded.state_dict().items())
        assert AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("w7") == 7
    assert read_state(tmp_path / "checkpoints" / "final")["version"] == 1
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        read_state(tmp_path / "export")


def test_latest_checkpoint_ignores_partial_and_temporary_dirs(model_dir, tmp_path):
    assert latest_checkpoint(tmp_path) is None
    t = Trainer(model_dir, _config())
    t.save_checkpoint(checkpoint_path(tmp_path, 0))
    t.step(_groups(0))
    t.save_checkpoint(checkpoint_path(tmp_path, 1))
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    # an incomplete directory with a higher version, and a crashed temporary, are both ignored
    bad = checkpoint_path(tmp_path, 9)
    bad.mkdir()
    (bad / "trainer_state.json").write_text(json.dumps({"format": 1, "version": 9}))
    (tmp_path / "checkpoints" / ".step_000010.tmp-1").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)


def test_atomic_dir_keeps_previous_checkpoint_on_failure(tmp_path):
    target = tmp_path / "ck"
    with atomic_dir(target) as d:
        (d / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as d:
        (d / "a.txt").write_text("new")
        raise RuntimeError("crash while writing")
    assert (target / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    with atomic_dir(target) as d:  # replacing a complete one works
        (d / "a.txt").write_text("new")
    assert (target / "a.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_the_next_write_removes_what_a_killed_writer_left(tmp_path):
    """A trainer killed while saving left ``.step_N.tmp-PID`` (a whole model copy) for good: the next write
    comes from another process (the resumed run's trainer), which removed only its own pid's temporaries."""
    import subprocess
    import sys

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # fmt: skip
    root = tmp_path / "checkpoints"
    killed = root / f".step_000001.tmp-{gone}"  # killed mid-save
    replaced = root / f".step_000002.old-{gone}"  # killed after putting the new step_000002 in place
    only_copy = root / f".step_000003.old-{gone}"  # killed between the renames: the only complete copy
    running = root / ".step_000004.tmp-1"  # a live writer's (pid 1 always exists)
    for d in (killed, replaced, root / "step_000002", only_copy, running):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
    with atomic_dir(root / "step_000005") as d:
        (d / "a.txt").write_text("new")
    assert not killed.exists() and not replaced.exists()
    assert only_copy.is_dir() and running.is_dir() and (root / "step_000002").is_dir()


def test_loading_a_mismatched_checkpoint_names_the_problem(model_dir, tmp_path):
    other = Qwen3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    src = tmp_path / "other"
    Qwen3ForCausalLM(other).save_pretrained(src)
    ck = Trainer(str(src), _config()).save_checkpoint(tmp_path / "ck")
    trainer = Trainer(model_dir, _config())
    before = _weights(trainer)
    with pytest.raises(ValueError, match="does not match the model"):
        trainer.load_checkpoint(ck)
    after = _weights(trainer)
    assert trainer.version == 0 and all(torch.equal(before[k], after[k]) for k in before)  # left untouched


def test_a_damaged_checkpoint_file_is_refused_naming_it_and_the_earlier_checkpoint(model_dir, tmp_path):
    """Before, 0xFF bytes written into a checkpoint's weights resumed into a NaN model and exited 0."""
    from tandem.train.checkpoint import CheckpointError

    trainer = Trainer(model_dir, _config())
    trainer.save_checkpoint(checkpoint_path(tmp_path, 1))
    trainer.version = 2
    ck = trainer.save_checkpoint(checkpoint_path(tmp_path, 2))
    assert set(read_state(ck)["files"]) >= {"model.safetensors", "optimizer.pt", "config.json"}
    weights = ck / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-64] + b"\xff" * 64)  # inside the last tensor's bytes: the header parses
    fresh = Trainer(model_dir, _config())
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match="model.safetensors does not match the hash .*step_000001"):
        fresh.load_checkpoint(ck)
    assert all(torch.equal(before[k], v) for k, v in _weights(fresh).items())  # left untouched
    weights.write_bytes(intact)
    (ck / "optimizer.pt").write_bytes(b"")  # truncated
    with pytest.raises(CheckpointError, match="optimizer.pt does not match"):
        fresh.load_checkpoint(ck)
    assert fresh.load_checkpoint(checkpoint_path(tmp_path, 1))["version"] == 0  # the earlier one loads


def test_a_resume_trains_with_its_own_optimizer_settings_not_the_saved_ones(model_dir, tmp_path):
    """Before, the restored optimizer state kept the saved lr while config.toml showed the new one."""
    ck = Trainer(model_dir, _config()).save_checkpoint(tmp_path / "ck")
    changed = _config().model_copy(update={"lr": 5e-3, "betas": (0.8, 0.9), "weight_decay": 0.1})
    trainer = Trainer(model_dir, changed)
    trainer.load_checkpoint(ck)
    for group in trainer.optimizer.param_groups:
        assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (5e-3, (0.8, 0.9), 0.1)
