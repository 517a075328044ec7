"""Parsing and validating OpenAI chat completion requests into tandem's terms.

Invariants:
- ``parse_chat_request`` either returns a fully checked ``ChatRequest`` or raises ``BadRequest`` whose
  ``param`` names the offending field the way OpenAI does (``messages[2].role``, ``tools[0].function.name``,
  ``max_tokens``); nothing a client sends makes it raise anything else.
- Messages are normalised to ``tandem.core.records.Message``: roles ``system`` (``developer`` is an alias),
  ``user``, ``assistant``, ``tool``; content is text (text parts are joined; other part types are
  rejected); assistant tool calls become ``{"name", "arguments"}`` with ``arguments`` a parsed JSON object
  (the form ``ChatFormat.parse_assistant`` returns, so a history can be compared with what the model made).
- ``tool_choice`` "required" needs tools and a named function must be one of them (enforced by forcing the
  turn's start, ``tandem.engine.gateway.forcing``); ``top_logprobs`` (0-20, at most the engine's
  ``max_top_logprobs``) needs ``logprobs=true`` when above 0, as OpenAI's API does.
- Sampling fields are range-checked here; limits that depend on the prompt length (the context) are checked
  by the caller once the prompt is rendered. Sampling controls the gateway does not apply (``NEUTRAL``:
  penalties, ``logit_bias``, ``top_k``, ``min_p``, ``best_of``, a ``response_format`` other than text) are
  accepted only at their neutral values and otherwise refused naming the field, never silently ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from tandem.core.records import Message

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_STOP = 4
MAX_SESSION_ID = 256


class BadRequest(Exception):
    """A 400 answer: ``message`` says what was wrong and what to do, ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass
class ChatRequest:
    """A validated request (see module invariants)."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls in the output come back as ``tool_calls`` (not with ``tool_choice="none"``)."""
        return self.tool_choice != "none"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _content(value: Any, param: str, *, required: bool) -> str:
    if value is None:
        if required:
            raise BadRequest(f"{param} is required for this role", param)
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            p = f"{param}[{j}]"
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"{p} has type {kind!r}; only text parts {{'type': 'text', 'text': ...}} are supported", p
                )
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{param} must be a string or a list of text parts, got {type(value).__name__}", param)


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"{param} must be a list, got {type(value).__name__}", param)
    calls = []
    for j, call in enumerate(value):
        p = f"{param}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise BadRequest(f"{p} must be an object with a 'function' object", p)
        if call.get("type", "function") != "function":
            raise BadRequest(f"{p}.type must be 'function', got {call.get('type')!r}", f"{p}.type")
        fn = call["function"]
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{p}.function.name must be a non-empty string", f"{p}.function.name")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError) as e:
                raise BadRequest(
                    f"{p}.function.arguments is not valid JSON ({e})", f"{p}.function.arguments"
                ) from None
        if not isinstance(args, dict):
            raise BadRequest(f"{p}.function.arguments must encode a JSON object", f"{p}.function.arguments")
        calls.append({"name": name, "arguments": args})
    return calls


def parse_messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of message objects", "messages")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{p} must be an object with 'role' and 'content'", p)
        role = ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
        if role is None:
            raise BadRequest(
                f"{p}.role {m.get('role')!r} is not supported; use one of system, developer, user, "
                "assistant, tool",
                f"{p}.role",
            )
        calls = _tool_calls(m.get("tool_calls"), f"{p}.tool_calls") if role == "assistant" else []
        if role != "assistant" and m.get("tool_calls"):
            raise BadRequest(f"{p}.tool_calls is only allowed on assistant messages", f"{p}.tool_calls")
        content = _content(m.get("content"), f"{p}.content", required=role != "assistant")
        name = m.get("name")
        out.append(Message(role, content, calls, name if isinstance(name, str) else None))
    return out


def parse_tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"tools must be a list, got {type(value).__name__}", "tools")
    tools, seen = [], set()
    for i, t in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise BadRequest(f"{p} must be {{'type': 'function', 'function': {{...}}}}", f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{p}.function must be an object with a name", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise BadRequest(
                f"{p}.function.name {name!r} must be 1-64 characters of letters, digits, '_' or '-'",
                f"{p}.function.name",
            )
        if name in seen:
            raise BadRequest(f"{p}.function.name {name!r} is defined twice", f"{p}.function.name")
        seen.add(name)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise BadRequest(f"{p}.function.description must be a string", f"{p}.function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        pp = f"{p}.function.parameters"
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise BadRequest(f"{pp} must be a JSON Schema object with type 'object'", pp)
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise BadRequest(
                f"{pp}.properties must map argument names to JSON Schema objects", f"{pp}.properties"
            )
        required = params.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise BadRequest(f"{pp}.required must list names defined in properties", f"{pp}.required")
        tools.append(
            {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}
        )
    return tools


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value is None:
        return "auto"
    names = {t["function"]["name"] for t in tools}
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs at least one tool in tools", "tool_choice")
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
    ):
        name = value["function"].get("name")
        if name not in names:
            raise BadRequest(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise BadRequest(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_num(v) or v != v or (v <= lo if lo_open else v < lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise BadRequest(f"{key}={v!r} is out of range; it must be a number in {interval}", key)
    return float(v)


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {v!r}", key)
    return v


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "top_k": (0, -1),
    "min_p": (0,),
    "best_of": (1,),
    "response_format": ({"type": "text"},),
}
"""Sampling controls the gateway does not apply, with the values that leave sampling unchanged (or null).
Any other value is refused: training's importance ratios assume each token was sampled from the model's
own distribution at the request's temperature (and top-p), which a penalty, a bias, a top-k or min-p cut,
best-of selection or a constrained format would change without the recorded logprobs saying so."""


def _refuse_unapplied(body: dict[str, Any]) -> None:
    for key, neutral in NEUTRAL.items():
        v = body.get(key)
        if v is None or any(type(v) is not bool and v == x for x in neutral):
            continue
        shown = " or ".join(json.dumps(x) for x in neutral)
        sent = json.dumps(v)
        sent = sent if len(sent) <= 80 else sent[:77] + "..."  # a large logit_bias is not echoed whole
        raise BadRequest(
            f"{key}={sent} is not supported: this gateway samples from the model's own distribution "
            f"(temperature and top_p only), which training assumes; send {key}={shown} or omit it",
            key,
        )


def parse_chat_request(
    body: Any, *, max_n: int, max_tokens_limit: int, max_top_logprobs: int = 0
) -> ChatRequest:
    """Validate a decoded JSON body (see module invariants). ``max_tokens_limit`` is the engine's context."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None)
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    _refuse_unapplied(body)
    req = ChatRequest(
        messages=messages, tools=tools, tool_choice=_tool_choice(body.get("tool_choice"), tools)
    )
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0, lo_open=False)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(key)
    if mt is not None:
        if not _is_int(mt) or not 1 <= mt < max_tokens_limit:
            raise BadRequest(
                f"{key}={mt!r} is out of range; it must be an integer in [1, {max_tokens_limit - 1}] "
                f"(the context holds {max_tokens_limit} tokens including the prompt)",
                key,
            )
        req.max_tokens = mt
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= max_n:
        raise BadRequest(f"n={n!r} is out of range; it must be an integer in [1, {max_n}]", "n")
    req.n = n
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    req.stop = list(stops)
    req.stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        req.include_usage = bool(opts.get("include_usage"))
    req.logprobs = _flag(body, "logprobs")
    tl = body.get("top_logprobs")
    if tl is not None:
        if not _is_int(tl) or not 0 <= tl <= 20:
            raise BadRequest(f"top_logprobs={tl!r} must be an integer in [0, 20]", "top_logprobs")
        if tl > max_top_logprobs:
            raise BadRequest(
                f"top_logprobs={tl} is not available: this engine reports at most {max_top_logprobs} "
                f"alternatives per token; send top_logprobs <= {max_top_logprobs}",
                "top_logprobs",
            )
        if tl > 0 and not req.logprobs:
            raise BadRequest(f"top_logprobs={tl} needs logprobs=true", "top_logprobs")
        req.top_logprobs = tl
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
    req.seed = seed
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_SESSION_ID):
        raise BadRequest(f"user must be a string of at most {MAX_SESSION_ID} characters", "user")
    req.user = user or None
    req.ignore_eos = _flag(body, "ignore_eos")
    req.return_token_ids = _flag(body, "return_token_ids")
    return req
