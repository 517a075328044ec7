"""``tool_choice`` enforcement: the ids an assistant turn is forced to start with.

Invariants:
- ``"auto"`` and ``"none"`` force nothing. ``"required"`` forces the chat format's tool-call opening (the ids
  ``render_assistant`` puts before a call's JSON: ``<tool_call>``). A named function forces that opening plus
  the ids of ``{"name": "<name>", "arguments":``, the call's JSON as ``tool_call_json`` spells it, cut before
  the space that precedes the arguments object: in the byte-level BPE that space starts the next token
  (`` {"``), so the forced ids are exactly the first ids the chat format's own encoding of such a call has,
  and the model continues in its usual tokenization.
- Forced ids are prompt side: the engine gets ``prompt + forced`` and samples the rest; they are not
  sampled (recorded with ``loss_mask`` 0 by ``tandem.engine.gateway.sessions``), have no logprobs and do not
  count as completion tokens, but they are part of the turn's text, so the message (content, tool calls)
  is parsed from ``forced + sampled``.
- Enforcement is of the start only: the model writes the arguments and closes the call itself; a call it
  leaves malformed is treated like any malformed call: no tool call, its raw text (forced start included)
  in the content, counted in the session's ``malformed_calls``.
"""

from __future__ import annotations

from typing import Any

from tandem.core.records import Message
from tandem.model.chat import tool_call_json


class ForcingUnsupported(ValueError):
    """The chat format lacks what forcing needs (``render_assistant`` and ``encode_text``)."""


def forced_prefix(chat: Any, tool_choice: str | dict[str, Any]) -> list[int]:
    """The forced start of the assistant turn for ``tool_choice`` (see module invariants)."""
    if not isinstance(tool_choice, dict) and tool_choice != "required":
        return []
    render, encode = getattr(chat, "render_assistant", None), getattr(chat, "encode_text", None)
    if render is None or encode is None:
        raise ForcingUnsupported(
            f"this gateway's chat format ({type(chat).__name__}) cannot force a tool call; use tool_choice "
            "'auto' or 'none'"
        )
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else "f"
    call = {"name": name, "arguments": {}}
    text = tool_call_json(call)  # {"name": "<name>", "arguments": {}}
    ids, body = list(render(Message("assistant", "", [call]))), list(encode(text))
    at = next((k for k in range(len(ids) - len(body) + 1) if ids[k : k + len(body)] == body), None)
    if at is None:  # the chat format does not encode the call's JSON on its own
        raise ForcingUnsupported(
            f"this gateway's chat format ({type(chat).__name__}) does not render tool calls as "
            "<tool_call>{json}</tool_call>; use tool_choice 'auto' or 'none'"
        )
    opening = ids[:at]
    if not isinstance(tool_choice, dict):
        return opening
    return opening + list(encode(text[: text.rindex(" {}}")]))
