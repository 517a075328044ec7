"""The trained tokenizer: offline HF loading, special tokens, byte-level round trip, Jinja template."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tandem.model.chat import SPECIAL_TOKENS, render_text
from tandem.model.tokenizer import train_tokenizer

from .conftest import TOOLS, session


def test_loads_offline_with_eos_pad_and_special_ids(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert len(tok) == 600
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    for s in SPECIAL_TOKENS:
        assert tok.encode(s, add_special_tokens=False) == [tok.convert_tokens_to_ids(s)]
    assert (
        json.loads((tok_dir / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )


@pytest.mark.parametrize("text", ["def f(x):\n    return x  # ok\n", "Ünïcode 🙂 \t\r\n", "", "    \n\n  x"])
def test_round_trip(tok_dir, text):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_no_bos_eos_added(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert 0 not in tok.encode("hello world")


def test_jinja_template_matches_python_renderer(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    msgs = session()
    for tools in (TOOLS, []):
        for gen in (True, False):
            got = tok.apply_chat_template(
                msgs, tools=tools or None, tokenize=False, add_generation_prompt=gen
            )
            assert got == render_text(msgs, tools, add_generation_prompt=gen)
    no_system = msgs[1:3]
    got = tok.apply_chat_template(no_system, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got == render_text(no_system, TOOLS)
    assert got.startswith("<|im_start|>system\n# Tools\nread_file(path): Read a workspace file.\n")


def test_training_is_deterministic():
    texts = ["def f(x):\n    return x + 1\n" * 50, "hello world " * 100]
    a = train_tokenizer(texts, vocab_size=300).to_str()
    b = train_tokenizer(texts, vocab_size=300).to_str()
    assert a == b


def test_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(["x"], vocab_size=100)
