"""Building and loading models: preset sizes, any local HF dir loads offline, clear ModelLoadErrors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.core.errors import ModelLoadError
from tandem.model.build import build_model, num_params, qwen3_config
from tandem.model.chat import ChatTemplate
from tandem.model.load import load_chat_format, load_model, load_tokenizer


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


SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tandem-base"


def test_the_generic_tokenizer_loads_without_auto_and_is_the_same_tokenizer(tmp_path):
    """``load_tokenizer`` skips ``AutoTokenizer`` (and so torch) for the generic fast tokenizer; the result
    tokenizes exactly as ``AutoTokenizer``'s does."""
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(SHIPPED), AutoTokenizer.from_pretrained(str(SHIPPED), local_files_only=True)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.all_special_ids == auto.all_special_ids
    assert ours.init_kwargs == auto.init_kwargs
    sources = sorted((SHIPPED.parents[1] / "src" / "tandem" / "model").glob("*.py"))
    text = "".join(p.read_text() for p in sources)
    pieces = [text[i : i + 97 + i % 400] for i in range(0, len(text), 997)]
    pieces += ["<|im_start|>user\nÜnïcode 🙂 中文<|im_end|>", "<tool_call>{}</tool_call><|endoftext|>"]
    for piece in pieces:
        ids = auto.encode(piece)
        assert ours.encode(piece) == ids and ours.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(ours).render_prompt(chat, []) == ChatTemplate(auto).render_prompt(chat, [])
    # in a fresh process: no torch, no model registry
    code = (
        "import sys; from tandem.model.load import load_tokenizer; "
        f"load_tokenizer({str(SHIPPED)!r}); "
        "print('torch' in sys.modules, 'transformers.models.auto.modeling_auto' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    # no class named: AutoTokenizer, which then picks config.json's model type's tokenizer (not the same one)
    other = tmp_path / "other"
    shutil.copytree(SHIPPED, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    del cfg["tokenizer_class"]
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    by_type = AutoTokenizer.from_pretrained(str(other), local_files_only=True)
    assert type(load_tokenizer(other)) is type(by_type) is not type(auto)
    (other / "tokenizer_config.json").write_text("{not json")  # unreadable: AutoTokenizer's own error
    with pytest.raises(ModelLoadError, match="could not load the tokenizer"):
        load_tokenizer(other)
