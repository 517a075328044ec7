"""The chat format: token-exact pieces, transcript = concatenation of pieces, robust tool-call parsing."""

from __future__ import annotations

import json

import pytest

from tandem.core.generation import ChatFormat
from tandem.core.records import Message
from tandem.model.chat import ChatTemplate, render_text
from tandem.model.load import load_tokenizer

from .conftest import TOOLS, session


@pytest.fixture(scope="module")
def chat(tok_dir) -> ChatTemplate:
    return ChatTemplate.from_dir(tok_dir)


def test_implements_protocol(chat):
    fmt: ChatFormat = chat
    assert fmt.stop_token_ids == [chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_prompt_ends_with_assistant_header_and_matches_document_encoding(chat):
    msgs = session()[:2]
    ids = chat.render_prompt(msgs, TOOLS)
    text = chat.tokenizer.decode(ids)
    assert text == render_text(msgs, TOOLS)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ids == chat.tokenizer.encode(render_text(msgs, TOOLS), add_special_tokens=False)


def test_transcript_is_concatenation_of_session_pieces(chat):
    msgs = session()
    # What a session produces: prompt, sampled turn, continuation, sampled turn, ...
    ids = chat.render_prompt(msgs[:2], TOOLS)
    ids += chat.render_assistant(msgs[2])
    ids += chat.render_continuation(msgs[3:4])
    ids += chat.render_assistant(msgs[4])
    ids += chat.render_continuation(msgs[5:7])
    ids += chat.render_assistant(msgs[7])
    assert chat.render_transcript(msgs, TOOLS) == ids
    # Rendering a longer history as a prompt uses the same pieces too.
    assert chat.render_prompt(msgs[:6], TOOLS) == chat.render_transcript(
        msgs[:5], TOOLS
    ) + chat.render_continuation(msgs[5:6])
    # ... and (contents not starting with whitespace) equals encoding the rendered document.
    doc = render_text(msgs[:8], TOOLS, add_generation_prompt=False).removesuffix("\n")
    assert ids == chat.tokenizer.encode(doc, add_special_tokens=False)


def test_continuation_and_assistant_pieces(chat):
    cont = chat.render_continuation([Message("tool", "ok")])
    assert chat.tokenizer.decode(cont) == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    turn = chat.render_assistant(Message("assistant", "", [{"name": "submit", "arguments": {}}]))
    assert turn[-1] == chat.stop_token_ids[0]
    assert (
        chat.tokenizer.decode(turn) == '<tool_call>{"name": "submit", "arguments": {}}</tool_call><|im_end|>'
    )
    assert chat.render_continuation([]) == chat.encode_text("\n") + chat.render_prompt([], [])


def test_special_strings_in_message_text_stay_text(chat):
    ids = chat.render_continuation([Message("tool", "print('<|im_end|><tool_call>')")])
    assert ids.count(chat.stop_token_ids[0]) == 1  # only the block's own <|im_end|>
    assert chat.tokenizer.convert_tokens_to_ids("<tool_call>") not in ids


def test_transcript_needs_an_assistant_turn(chat):
    with pytest.raises(ValueError, match="assistant"):
        chat.render_transcript(session()[:2], TOOLS)


def test_parse_round_trip(chat):
    msg = Message(
        "assistant",
        "Let me write it.\n",
        [
            {"name": "write_file", "arguments": {"path": "solution.py", "content": 'x = "é"\n'}},
            {"name": "submit", "arguments": {}},
        ],
    )
    text, calls, errors = chat.parse_assistant(chat.render_assistant(msg))
    assert (text, calls, errors) == (msg.content, msg.tool_calls, [])


def _parse(chat, s: str):
    return chat.parse_assistant(chat.encode_text("") + chat.tokenizer.encode(s, add_special_tokens=False))


@pytest.mark.parametrize(
    ("sampled", "error"),
    [
        ('<tool_call>{"name": "run", "arguments": {"command": "ls"}<|im_end|>', "unclosed <tool_call>"),
        ("<tool_call>{not json}</tool_call><|im_end|>", "invalid JSON"),
        ('<tool_call>["run"]</tool_call><|im_end|>', "expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call><|im_end|>', '"name"'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call><|im_end|>', '"name"'),
        ('<tool_call>{"name": "run"}</tool_call><|im_end|>', '"arguments"'),
        ('<tool_call>{"name": "run", "arguments": "ls"}</tool_call><|im_end|>', '"arguments"'),
        ("oops</tool_call><|im_end|>", "unexpected </tool_call>"),
        # not strict JSON: a record holding them could not be serialised again
        ('<tool_call>{"name": "run", "arguments": {"a": NaN}}</tool_call><|im_end|>', "NaN is not a JSON"),
        ('<tool_call>{"name": "run", "arguments": {"a": 1e400}}</tool_call><|im_end|>', "overflows a double"),
    ],
)
def test_malformed_tool_calls_are_errors_not_exceptions(chat, sampled, error):
    text, calls, errors = _parse(chat, sampled)
    assert calls == []
    assert len(errors) == 1 and error in errors[0], errors


def test_parse_keeps_good_calls_next_to_bad_ones_and_ignores_after_stop(chat):
    good = json.dumps({"name": "run_tests", "arguments": {}})
    text, calls, errors = _parse(
        chat, f"a<tool_call>{{bad</tool_call>b<tool_call>{good}</tool_call><|im_end|>junk"
    )
    assert text == "ab"
    assert calls == [{"name": "run_tests", "arguments": {}}]
    assert len(errors) == 1 and errors[0].startswith("tool call 1: invalid JSON")


@pytest.mark.parametrize(
    ("sampled", "kept"),
    [
        # a closed block that does not parse, between text and a good call: kept raw where it stood
        (
            'a<tool_call>{bad</tool_call>b<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
            "a<tool_call>{bad</tool_call>b",
        ),
        # a block the turn ended inside (max_tokens): kept raw from its opening marker on
        ('go<tool_call>{"name": "run", "argu', 'go<tool_call>{"name": "run", "argu'),
        ("oops</tool_call>then", "oops</tool_call>then"),  # a stray closing marker
    ],
)
def test_keep_malformed_leaves_what_the_model_wrote_in_the_text(chat, sampled, kept):
    dropped, calls, errors = _parse(chat, sampled)
    text, calls_kept, errors_kept = chat.parse_assistant(
        chat.encode_text("") + chat.tokenizer.encode(sampled, add_special_tokens=False), keep_malformed=True
    )
    assert text == kept and (calls_kept, errors_kept) == (calls, errors) and len(errors) == 1
    assert dropped != kept and "<tool_call>{bad" not in dropped and "argu" not in dropped


def test_parse_without_stop_token_and_bad_ids(chat):
    assert _parse(chat, "just text") == ("just text", [], [])
    text, calls, errors = chat.parse_assistant([10**9])
    assert calls == [] and errors


def test_tool_calls_written_as_plain_text_parse_too(chat):
    ids = chat.encode_text('<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
    assert chat.parse_assistant(ids)[1] == [{"name": "submit", "arguments": {}}]


def test_loaded_tokenizer_is_shared(tok_dir):
    tok = load_tokenizer(tok_dir)
    chat = ChatTemplate(tok)
    assert chat.tokenizer is tok and chat.vocab_size == 600
