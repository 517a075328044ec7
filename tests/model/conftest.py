"""Shared fixtures: a small tandem tokenizer trained once per session on stdlib code and rendered chats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.model.chat import render_text
from tandem.model.tokenizer import save_tokenizer, train_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a workspace file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a workspace file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def session() -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Implement `add(a, b)` in solution.py."},
        {
            "role": "assistant",
            "content": "Reading first.",
            "tool_calls": [{"name": "read_file", "arguments": {"path": "solution.py"}}],
        },
        {"role": "tool", "content": "def add(a, b):\n    raise NotImplementedError\n"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "name": "write_file",
                    "arguments": {"path": "solution.py", "content": "def add(a, b):\n    return a + b\n"},
                }
            ],
        },
        {"role": "tool", "content": "wrote 31 chars to solution.py"},
        {"role": "user", "content": "Ünïcode ok? 🙂"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "submit", "arguments": {}}]},
        {"role": "tool", "content": "submitted"},
    ]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    texts = [f.read_text() for f in sorted(lib.glob("*.py"))[:6]]
    texts += [render_text(session(), TOOLS)] * 20
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(texts, vocab_size=600), out)
    return out
