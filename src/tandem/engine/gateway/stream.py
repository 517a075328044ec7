"""Incremental content of one streamed choice: the text that is stable as its tokens arrive.

Invariants:
- ``ContentStream.push(ids)`` returns the new content text since the last call, and the concatenation of
  what it returned (``sent``) is always a prefix of the content the finished turn would have if it ended
  now. Held back until later tokens settle it: trailing U+FFFD (a UTF-8 character split across tokens),
  a trailing piece that could be the start of a chat-format marker (``<tool_call>``, ``</tool_call>``,
  ``<|im_end|>``, ``<|endoftext|>``; relevant when a tokenizer spells them as text) or of a stop string.
- Content is what ``tandem.engine.gateway.responses.to_turn`` makes of forced + sampled ids: with tools
  parsed, the text outside well-formed ``<tool_call>`` blocks, a malformed block's raw text streamed once
  its closing marker settles it (a block still open is never streamed: its call is sent whole at the end,
  or, when the turn ends with it still open or it does not parse, its raw text in the last content chunk),
  else the raw decoded text. Once the sampled text contains a stop string nothing more is
  streamed: the gateway cuts the turn there after generation (the engine does not know stop strings).
- The prefix property needs a decode under which the text of a prefix of the ids is a prefix of the text
  of all of them, up to a split trailing character (byte-level BPE without ``clean_up_tokenization_spaces``,
  as the shipped tokenizer); where it fails, streaming pauses (nothing wrong is sent) and the content that
  cannot follow what was sent is not streamed at all.
- It decodes all ids so far on every push (decoding a prefix is what keeps multi-byte characters and BPE
  merges right); cost is quadratic in the turn's length, negligible at chat-turn lengths.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.core.generation import ChatFormat
from tandem.engine.gateway.protocol import ChatRequest
from tandem.model.chat import EOT, IM_END, TOOL_CLOSE, TOOL_OPEN

_MARKERS = (TOOL_OPEN, TOOL_CLOSE, IM_END, EOT)


def _held(text: str, words: tuple[str, ...] | list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``words``."""
    best = 0
    for w in words:
        for n in range(min(len(w) - 1, len(text)), best, -1):
            if text.endswith(w[:n]):
                best = n
                break
    return best


class ContentStream:
    """The streamed content of one choice (see module invariants)."""

    def __init__(
        self, forced: list[int], req: ChatRequest, chat: ChatFormat, decode: Callable[[list[int]], str]
    ) -> None:
        self.forced, self.req, self.chat, self.decode = list(forced), req, chat, decode
        self.sampled: list[int] = []
        self.sent = ""
        self.frozen = False
        self._stop_ids = set(chat.stop_token_ids)

    def push(self, ids: list[int]) -> str:
        """Take newly sampled ``ids``; return the content text that became stable ("" if none)."""
        self.sampled.extend(int(t) for t in ids)
        if self.frozen or not ids:
            return ""
        stops = self.req.stop
        if stops and any(s in self.decode(self.sampled) for s in stops):
            self.frozen = True
            return ""
        if self.req.parse_tools:
            text, _, _ = self.chat.parse_assistant(self.forced + self.sampled, keep_malformed=True)
            opened = text.rfind(TOOL_OPEN)
            if opened >= 0 and text.find(TOOL_CLOSE, opened) < 0:  # a block still open: not settled yet
                text = text[:opened]
            text = text.rstrip("\ufffd")
            text = text[: len(text) - _held(text, _MARKERS)]
        else:
            body = self.sampled[:-1] if self.sampled[-1] in self._stop_ids else self.sampled
            text = self.decode(body).rstrip("\ufffd")
        if stops:
            at = [i for i in (text.find(s) for s in stops) if i >= 0]
            if at:  # a stop string formed in the content only (e.g. around a removed block)
                text, self.frozen = text[: min(at)], True
            else:
                text = text[: len(text) - _held(text, stops)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
