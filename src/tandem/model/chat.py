"""The chat format: ChatML with Hermes/Qwen-style ``<tool_call>{json}</tool_call>`` blocks, token-exact.

Text layout (``render_text``; the Jinja ``CHAT_TEMPLATE`` renders the same text)::

    <|im_start|>system\\n{system}\\n\\n# Tools\\n{name(arg, ...): description, one per line}<|im_end|>\\n
    <|im_start|>user\\n{text}<|im_end|>\\n
    <|im_start|>assistant\\n{text}<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n{text}<|im_end|>\\n
    <|im_start|>assistant\\n

Invariants (``ChatTemplate``):
- Ids are built piecewise: special tokens are inserted as ids, the text between two special tokens is encoded
  on its own with special-token matching disabled (message text can never produce a control token).
- A session's ids are exactly ``render_prompt(first) + sampled turn + render_continuation(new) + sampled turn
  + ...``; ``render_transcript`` (what mid-training trains on) is built from the very same pieces, with
  ``render_assistant`` standing in for each sampled turn, so training and RL see identical tokenizations.
- A sampled turn ends with the stop token ``<|im_end|>`` (part of the sampled ids); ``render_continuation``
  starts with the ``\\n`` that follows it and ends with the next assistant header.
- ``parse_assistant`` never raises: malformed tool calls become error strings.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from tandem.core.errors import ModelLoadError

EOT, IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
)
SPECIAL_TOKENS = [EOT, IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE]

# Jinja equivalent of render_text, for AutoTokenizer.apply_chat_template (HF sets trim_blocks/lstrip_blocks).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0, sys='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.sys = messages[0]['content'] -%}{%- set ns.start = 1 -%}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if ns.start == 1 -%}{%- set ns.sys = ns.sys + '\n\n' -%}{%- endif -%}"
    "{%- set ns.sys = ns.sys + '# Tools' -%}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set props = fn.get('parameters', {}).get('properties', {}) -%}"
    "{%- set ns.sys = ns.sys + '\n' + fn['name'] + '(' + (props.keys() | join(', ')) + '): '"
    " + fn.get('description', '') -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if ns.start == 1 or tools -%}{{- '<|im_start|>system\n' + ns.sys + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- for m in messages[ns.start:] -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') -}}"
    "{%- for tc in (m['tool_calls'] or []) if m['tool_calls'] is defined -%}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{{- '<tool_call>' + ({'name': f['name'], 'arguments': f['arguments']} | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def _field(m: Any, name: str, default: Any = None) -> Any:
    return m.get(name, default) if isinstance(m, dict) else getattr(m, name, default)


def tool_line(tool: dict[str, Any]) -> str:
    """One compact line per tool: ``name(arg, ...): description`` from an OpenAI-style function schema."""
    fn = tool.get("function", tool)
    args = ", ".join(fn.get("parameters", {}).get("properties", {}))
    return f"{fn['name']}({args}): {fn.get('description', '')}"


def system_text(messages: list[Any], tools: list[dict[str, Any]]) -> tuple[str | None, int]:
    """The system block's text (None when there is none) and the index of the first non-system message."""
    start = 1 if messages and _field(messages[0], "role") == "system" else 0
    sys = _field(messages[0], "content") if start else None
    if tools:
        head = f"{sys}\n\n" if start else ""
        sys = head + "# Tools\n" + "\n".join(tool_line(t) for t in tools)
    return sys, start


def tool_call_json(call: dict[str, Any]) -> str:
    """The JSON in a ``<tool_call>`` block (from ``{"name","arguments"}`` or OpenAI ``{"function"}``)."""
    f = call.get("function", call)
    return json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False)


def assistant_text(message: Any) -> str:
    """Text of a finished assistant turn after its header, including the final ``<|im_end|>``."""
    calls = "".join(TOOL_OPEN + tool_call_json(c) + TOOL_CLOSE for c in _field(message, "tool_calls") or [])
    return (_field(message, "content") or "") + calls + IM_END


def render_text(messages: list[Any], tools: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The whole conversation as text (used to train the tokenizer and to check the Jinja template)."""
    sys, start = system_text(messages, tools)
    out = [] if sys is None else [f"{IM_START}system\n{sys}{IM_END}\n"]
    for m in messages[start:]:
        role = _field(m, "role")
        body = assistant_text(m) if role == "assistant" else (_field(m, "content") or "") + IM_END
        out.append(f"{IM_START}{role}\n{body}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class ChatTemplate:
    """``tandem.core.generation.ChatFormat`` over an HF fast tokenizer (see module invariants)."""

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ModelLoadError(
                f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; add tokenizer.json"
            )
        import tokenizers

        self.tokenizer = tokenizer
        # A private copy that treats special-token strings inside message text as plain text.
        self._text_tok = tokenizers.Tokenizer.from_str(backend.to_str())
        self._text_tok.encode_special_tokens = True
        self._special: dict[str, list[int]] = {}
        for s in SPECIAL_TOKENS:
            tid = tokenizer.convert_tokens_to_ids(s)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                self._special[s] = [tid]
            elif s in (IM_START, IM_END):
                raise ModelLoadError(
                    f"tokenizer has no single token {s!r}; tandem's chat format needs <|im_start|> and "
                    "<|im_end|> as tokens (use a ChatML tokenizer such as Qwen's or the shipped tandem-base)"
                )
            else:  # e.g. a ChatML tokenizer without tool tags: spell them as text
                self._special[s] = self._text(s)
        self.im_end_id = self._special[IM_END][0]
        self.stop_token_ids: list[int] = [self.im_end_id]
        eot = self._special[EOT]
        self.eos_token_id: int = eot[0] if len(eot) == 1 else (tokenizer.eos_token_id or self.im_end_id)
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        from tandem.model.load import load_tokenizer

        return cls(load_tokenizer(path))

    def _text(self, text: str) -> list[int]:
        return list(self._text_tok.encode(text, add_special_tokens=False).ids) if text else []

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text (special-token strings in it stay plain text)."""
        return self._text(text)

    def _ids(self, text: str) -> list[int]:
        """Encode a string of template text: special-token strings become their ids, the rest plain text."""
        out: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if part in self._special:
                out.extend(self._special[part])
            elif part:
                out.extend(self._text(part))
        return out

    def _block(self, role: str, content: str) -> list[int]:
        return self._special[IM_START] + self._text(f"{role}\n{content}") + self._special[IM_END]

    def _header(self) -> list[int]:
        return self._special[IM_START] + self._text("assistant\n")

    def render_assistant(self, message: Any) -> list[int]:
        """Ids of a finished assistant turn after its header, ending with ``<|im_end|>`` (as if sampled)."""
        out = self._text(_field(message, "content") or "")
        for call in _field(message, "tool_calls") or []:
            out += self._special[TOOL_OPEN] + self._text(tool_call_json(call)) + self._special[TOOL_CLOSE]
        return out + self._special[IM_END]

    def render_continuation(self, messages: list[Any]) -> list[int]:
        """Ids to append after a sampled ``<|im_end|>``: ``\\n``, the new (tool/user) blocks, next header."""
        out: list[int] = []
        for m in messages:
            out += self._text("\n") + self._block(_field(m, "role"), _field(m, "content") or "")
        return out + self._text("\n") + self._header()

    def _pieces(self, messages: list[Any], tools: list[dict[str, Any]]) -> list[list[int]]:
        """The session's pieces: opening prompt, then alternately assistant turns and continuations."""
        sys, start = system_text(messages, tools)
        first: list[int] = []
        if sys is not None:
            first += self._block("system", sys) + self._text("\n")
        i = start
        while i < len(messages) and _field(messages[i], "role") != "assistant":
            m = messages[i]
            first += self._block(_field(m, "role"), _field(m, "content") or "") + self._text("\n")
            i += 1
        pieces = [first + self._header()]
        while i < len(messages):
            pieces.append(self.render_assistant(messages[i]))
            j = i + 1
            while j < len(messages) and _field(messages[j], "role") != "assistant":
                j += 1
            pieces.append(self.render_continuation(messages[i + 1 : j]))
            i = j
        return pieces

    def render_prompt(self, messages: list[Any], tools: list[dict[str, Any]]) -> list[int]:
        """Ids of the conversation so far, ending with the assistant header (``<|im_start|>assistant\\n``)."""
        return [t for p in self._pieces(messages, tools) for t in p]

    def render_transcript(self, messages: list[Any], tools: list[dict[str, Any]]) -> list[int]:
        """Ids of a finished session for training: the same pieces, up to the last assistant ``<|im_end|>``.

        Messages after the last assistant turn are dropped (nothing is sampled after them).
        """
        pieces = self._pieces(messages, tools)
        if len(pieces) == 1:
            raise ValueError("render_transcript needs at least one assistant message")
        return [t for p in pieces[:-1] for t in p]

    def parse_assistant(
        self, token_ids: list[int], *, keep_malformed: bool = False
    ) -> tuple[str, list[dict[str, Any]], list[str]]:
        """Text, tool calls ``{"name", "arguments"}`` and parse errors of one sampled turn; never raises.

        The text is what lies outside ``<tool_call>`` blocks. A block that does not parse, or one left
        open at the turn's end, is an error; with ``keep_malformed`` its raw text (markers included)
        stays in the text where it stood, so a client sees what the model wrote, as vLLM's tool parsers
        give it; without, it is dropped (the built-in harness answers the error as a tool message)."""
        errors: list[str] = []
        bad = [t for t in token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            return "", [], [f"sampled ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})"]
        try:
            text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        except Exception as e:  # out-of-range ids and the like
            return "", [], [f"could not decode the sampled ids: {e}"]
        cut = text.find(IM_END)
        if cut >= 0:
            text = text[:cut]
        text = text.replace(EOT, "")
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        pos = blocks = 0
        while True:
            open_at = text.find(TOOL_OPEN, pos)
            stray = text.find(TOOL_CLOSE, pos)
            if stray >= 0 and (open_at < 0 or stray < open_at):
                errors.append(f"unexpected {TOOL_CLOSE} without a matching {TOOL_OPEN} at char {stray}")
                kept.append(text[pos : stray + len(TOOL_CLOSE)] if keep_malformed else text[pos:stray])
                pos = stray + len(TOOL_CLOSE)
                continue
            if open_at < 0:
                kept.append(text[pos:])
                break
            kept.append(text[pos:open_at])
            start = open_at + len(TOOL_OPEN)
            close_at = text.find(TOOL_CLOSE, start)
            if close_at < 0:
                errors.append(f"unclosed {TOOL_OPEN} at char {open_at}: {_snip(text[start:])}")
                if keep_malformed:
                    kept.append(text[open_at:])
                break
            body = text[start:close_at]
            pos = close_at + len(TOOL_CLOSE)
            blocks += 1
            call, err = _parse_call(body)
            if err:
                errors.append(f"tool call {blocks}: {err}")
                if keep_malformed:
                    kept.append(text[open_at:pos])
            else:
                calls.append(call)
        return "".join(kept), calls, errors


def _snip(s: str, n: int = 80) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


def _parse_call(body: str) -> tuple[dict[str, Any], str | None]:
    """A tool call's ``{"name", "arguments"}`` object, or the reason it is malformed. Strict JSON: ``NaN``,
    ``Infinity`` and numbers that overflow a double are malformed, so a parsed call always serialises again
    (a session record holding one could not be written as JSON)."""
    try:
        obj = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return {}, f"invalid JSON ({e}): {_snip(body)}"
    if not isinstance(obj, dict):
        return {}, f"expected a JSON object with name and arguments, got {_snip(body)}"
    name, args = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str) or not name:
        return {}, f'missing or non-string "name": {_snip(body)}'
    if not isinstance(args, dict):
        return {}, f'"arguments" of {name!r} must be a JSON object, got {_snip(json.dumps(args))}'
    return {"name": name, "arguments": args}, None
