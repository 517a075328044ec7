"""Building and loading models: preset sizes, any local HF dir loads offline, clear ModelLoadErrors."""

from __future__ import annotations

import shutil

import pytest
import torch

from tandem.core.errors import ModelLoadError
from tandem.model.build import build_model, num_params, qwen3_config
from tandem.model.chat import ChatTemplate
from tandem.model.load import load_chat_format, load_model


@pytest.fixture(scope="module")
def model_dir(tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    shutil.copytree(tok_dir, out, dirs_exist_ok=True)
    build_model(qwen3_config("smoke", vocab_size=600), seed=1).save_pretrained(str(out))
    return out


def test_default_preset_size():
    cfg = qwen3_config("default", vocab_size=4096)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (
        256,
        6,
        2,
        True,
    )
    with torch.device("meta"):
        n = num_params(build_model(cfg))
    assert 5_000_000 < n < 30_000_000


def test_build_is_seeded():
    cfg = qwen3_config("smoke", vocab_size=300)
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_unknown_preset():
    with pytest.raises(ValueError, match="'huge'"):
        qwen3_config("huge")


def test_load_model_and_chat_format(model_dir):
    model, tok = load_model(model_dir)
    assert model.dtype == torch.float32 and not model.training and len(tok) == 600
    model16, _ = load_model(model_dir, dtype="bfloat16")
    assert model16.dtype == torch.bfloat16
    chat = load_chat_format(model_dir)
    assert isinstance(chat, ChatTemplate)
    ids = chat.render_prompt([{"role": "user", "content": "hi"}], [])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 600)


def test_missing_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*--model .*--set model.path=DIR"):
        load_model(tmp_path / "nope")


def test_missing_files(model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json.*unreadable"):
        load_model(d)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_chat_format(d)


def test_bad_dtype(model_dir):
    with pytest.raises(ModelLoadError, match="float16"):
        load_model(model_dir, dtype="float16")
