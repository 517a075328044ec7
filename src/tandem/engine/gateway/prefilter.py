"""How many tokens a chat request needs at least, known before anything is tokenized.

The gateway refuses a request whose prompt cannot fit the context before it renders and tokenizes it on
the event loop (8 MiB of text had held the loop 6.5 s; 200 000 empty messages, 6.6 MB, 2.9 s, while every
other session waited).

Invariants:
- ``PromptFloor.tokens(body)`` never exceeds the number of prompt tokens the chat format renders for a
  valid request with that body: it is the text's characters over the longest token's characters
  (``prompt_chars``: only what the template renders) plus, for every message, tool call and tool, the
  fewest tokens the template adds for one (measured once from the chat format itself, less the tokens of
  the one-character names the measurement used, and for a message two more, for its content's edges
  merging with the template's text), but at most ``CAP`` each. A session's history is its recorded ids
  plus new messages: the assistant turns' text is what the model's tokens decoded to, so the bound holds
  when the client sends back what it was sent.
- Counting walks the decoded JSON iteratively (no recursion on deep nesting) and ignores anything
  malformed; ``parse_chat_request`` reports that afterwards, naming the field.
"""

from __future__ import annotations

from typing import Any

from tandem.core.generation import ChatFormat
from tandem.engine.gateway.protocol import parse_chat_request

CAP = 2  # tokens counted at most per message, tool call or tool: a session's recorded turn is the model's
# own tokens, which may spell a tool call more tightly than the template (open and close markers at least)


def longest_token_chars(tokenizer: Any) -> int | None:
    """An upper bound on the characters of text one token stands for: its longest vocabulary entry (a
    byte-level entry has a character per byte, and a character takes at least one byte); None when the
    tokenizer does not list its vocabulary."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    return max(8, max(map(len, vocab), default=0)) if vocab else None


def _strings(value: Any) -> int:
    """Characters in every string of a decoded JSON value (iterative: JSON nests deep)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def prompt_chars(body: Any) -> int:
    """A lower bound on the characters the chat template renders from a request body: message contents (text
    parts), tool calls' names and arguments, and each tool's name, parameter names and description (what
    ``tandem.model.chat.tool_line`` shows). Counted before anything is tokenized."""
    if not isinstance(body, dict):
        return 0
    total = 0
    for m in body.get("messages") if isinstance(body.get("messages"), list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        for call in m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                total += _strings(fn.get("name")) + _strings(fn.get("arguments"))
    for tool in body.get("tools") if isinstance(body.get("tools"), list) else []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            total += _strings(fn.get("name")) + _strings(fn.get("description"))
            total += sum(len(k) for k in props) if isinstance(props, dict) else 0
    return total


def _items(body: Any, key: str) -> list[Any]:
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, list) else []


def prompt_parts(body: Any) -> tuple[int, int, int]:
    """Messages, assistant tool calls and tools a request body lists (malformed entries included)."""
    messages = _items(body, "messages")
    calls = sum(len(_items(m, "tool_calls")) for m in messages)
    return len(messages), calls, len(_items(body, "tools"))


class PromptFloor:
    """A lower bound on a request's prompt tokens for one chat format (see module invariants)."""

    def __init__(self, chat_format: ChatFormat, tokenizer: Any) -> None:
        self.longest = longest_token_chars(tokenizer)
        self.per_message, self.per_call, self.per_tool = _template_costs(chat_format)

    def tokens(self, body: Any) -> int:
        messages, calls, tools = prompt_parts(body)
        text = prompt_chars(body) // self.longest if self.longest else 0
        return text + messages * self.per_message + calls * self.per_call + tools * self.per_tool


def _rendered(chat_format: ChatFormat, body: dict[str, Any]) -> int | None:
    try:
        req = parse_chat_request(body, max_n=1, max_tokens_limit=1 << 30)
        return len(chat_format.render_prompt(req.messages, req.tools))
    except Exception:  # noqa: BLE001 - a shape this chat format does not take costs nothing here
        return None


def _added(chat_format: ChatFormat, one: dict[str, Any], two: dict[str, Any], margin: int) -> int:
    """Tokens ``two`` renders beyond ``one``, less ``margin`` (the measurement's own names); 0 if unknown."""
    a, b = _rendered(chat_format, one), _rendered(chat_format, two)
    return max(0, b - a - margin) if a is not None and b is not None else 0


def _template_costs(chat_format: ChatFormat) -> tuple[int, int, int]:
    """Fewest tokens the template adds per message (over roles), per assistant tool call and per tool."""
    user = {"role": "user", "content": ""}
    per_message = []
    for role in ("system", "user", "assistant", "tool"):
        m = (
            {"role": role, "content": ""}
            if role != "tool"
            else {"role": "tool", "content": "", "tool_call_id": "c"}
        )
        per_message.append(_added(chat_format, {"messages": [user, m]}, {"messages": [user, m, m]}, margin=2))

    def call(name: str) -> dict[str, Any]:
        return {"id": name, "type": "function", "function": {"name": name, "arguments": "{}"}}

    def asst(*names: str) -> dict[str, Any]:
        return {
            "messages": [user, {"role": "assistant", "content": "", "tool_calls": [call(n) for n in names]}]
        }

    def tool(name: str) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
        }

    per_call = _added(chat_format, asst("a"), asst("a", "b"), margin=3)  # "b" and "{}": at most 3 tokens
    per_tool = _added(
        chat_format,
        {"messages": [user], "tools": [tool("a")]},
        {"messages": [user], "tools": [tool("a"), tool("b")]},
        1,
    )
    return min(min(per_message), CAP), min(per_call, CAP), min(per_tool, CAP)
