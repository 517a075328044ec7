"""Parsing and validating OpenAI chat completion requests into tandem's terms.

Invariants:
- ``parse_chat_request`` either returns a fully checked ``ChatRequest`` or raises ``BadRequest`` whose
  ``param`` names the offending field the way OpenAI does (``messages[2].role``, ``tools[0].function.name``,
  ``max_tokens``); nothing a client sends makes it raise anything else.
- Messages are normalised to ``tandem.core.records.Message``: roles ``system`` (``developer`` is an alias),
  ``user``, ``assistant``, ``tool``; content is text (text parts are joined; other part types are
  rejected); assistant tool calls become ``{"name", "arguments"}`` with ``arguments`` a parsed JSON object
  (the form ``ChatFormat.parse_assistant`` returns, so a history can be compared with what the model made).
- Tool calls are parsed out of the output only when the request has tools and ``tool_choice`` is not
  "none" (``ChatRequest.parse_tools``). ``tool_choice`` "required" needs tools and a named function must
  be one of them (enforced by forcing the turn's start, ``tandem.engine.gateway.forcing``);
  ``top_logprobs`` (0-20, at most the engine's ``max_top_logprobs``) needs ``logprobs=true`` when above 0,
  as OpenAI's API does.
- Sampling fields are range-checked here; limits that depend on the prompt length (the context) are checked
  by the caller once the prompt is rendered. Sampling controls the gateway does not apply (``NEUTRAL``:
  penalties, ``logit_bias``, ``top_k``, ``min_p``, ``best_of``, a ``response_format`` other than text) are
  accepted only at their neutral values and otherwise refused naming the field, never silently ignored.
  ``temperature`` is 0 (greedy) or in ``[MIN_TEMPERATURE, 2]``: the engines refuse anything in between.
- JSON text (the body, ``decode_json``; a tool call's ``arguments`` string) is decoded strictly: every
  string, keys included, must be encodable as UTF-8 (no lone UTF-16 surrogates such as ``"\\ud800"``) and
  every number finite (no ``NaN``, ``Infinity``, nor ``1e400``, which overflows a double), checked on the
  whole value before anything looks at it, so nothing generated, stored or answered later can fail on it;
  the 400 names the JSON path of the first offending value.
- A session id (``X-Tandem-Session`` or ``user``, ``session_id``) is a path segment of
  ``/v1/tandem/sessions/{id}``: 1-``MAX_SESSION_ID`` characters, no ``/``, not ``.`` or ``..``; anything else
  is refused up front, since its record could never be read or rewarded.
- ``parse_reward`` checks a reward body: a finite ``value`` and at most ``MAX_REWARD_COMPONENTS``
  ``components`` (an object of finite numbers, or absent/null) with names of at most
  ``MAX_COMPONENT_NAME`` characters.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from tandem.core.generation import MIN_TEMPERATURE
from tandem.core.records import Message, Reward

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_STOP = 4
MAX_SESSION_ID = 256
MAX_COMPONENT_NAME = 128  # characters of a reward component's name (metrics and reports show it)
MAX_REWARD_COMPONENTS = 256


class BadRequest(Exception):
    """A 400 answer: ``message`` says what was wrong and what to do, ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(s: str) -> str:
    at = next(i for i, c in enumerate(s) if 0xD800 <= ord(c) <= 0xDFFF)
    return f"a lone UTF-16 surrogate ({s[at]!r} at character {at}), which is not text"


def _bad_value(root: Any) -> tuple[str, str] | None:
    """The first value of decoded JSON that cannot be stored or sent back: ``(path, what is wrong)``, the
    path relative to ``root`` (``".messages[0].content"``, "" for the root). Iterative: no depth limit."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not _utf8(v):
                return path, f"contains {_surrogate(v)}"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return path, f"is {v!r}: JSON numbers must be finite (no NaN or Infinity, at most ~1.8e308)"
        elif isinstance(v, dict):
            for k in v:
                if not _utf8(k):
                    return path, f"has a key that contains {_surrogate(k)}"
            stack.extend((x, f"{path}.{k}") for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _storable(value: Any) -> bool:
    """Fast path of ``_bad_value`` (one C pass, ~3x faster): True when ``value`` re-encodes as strict JSON
    in UTF-8; False when it does not (or nests too deep to tell), and ``_bad_value`` then finds why."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return False
    return True


def decode_json(raw: bytes | str, param: str | None = None) -> Any:
    """``raw`` decoded as strict JSON (see module invariants), or ``BadRequest``. ``param`` names the field
    that holds the text (None: the text is the request body, and a bad value's path is the param)."""
    what = param or "the request body"
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"{what} is not valid JSON: {e}", param) from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits()
        raise BadRequest(
            f"{what} is not valid JSON here: it has an integer of more than {sys.get_int_max_str_digits()} "
            "digits, the limit of this server's JSON decoder; send fewer digits",
            param,
        ) from None
    bad = None if _storable(value) else _bad_value(value)
    if bad is not None:
        path, problem = bad
        where = f"{param}{path}" if param else path.lstrip(".") or what
        raise BadRequest(
            f"{where} {problem}; send valid UTF-8 text and finite numbers", param or path.lstrip(".") or None
        )
    return value


def session_id(value: Any, param: str) -> str | None:
    """The session id ``value`` names (None when absent or empty), or ``BadRequest`` naming ``param``: an
    id is a path segment of ``/v1/tandem/sessions/{id}`` (see module invariants)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{param} must be a string, got {type(value).__name__}", param)
    if len(value) > MAX_SESSION_ID:
        raise BadRequest(
            f"{param} is {len(value)} characters; a session id is at most {MAX_SESSION_ID} characters", param
        )
    if "/" in value or value in (".", ".."):
        raise BadRequest(
            f"{param}={_shown(value)} cannot name a session: '/' is not allowed in a session id, nor are "
            "the ids '.' and '..', since the id is a path segment of /v1/tandem/sessions/{id}; use e.g. "
            "letters, digits, '-', '_', ':'",
            param,
        )
    return value


def _shown(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters (a large value is not echoed whole)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _finite(v: Any) -> float | None:
    """``v`` as a float when it is a finite real number (bools excluded), else None (10**400 included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def parse_reward(body: Any) -> Reward:
    """A ``Reward`` from a ``POST .../reward`` body (see module invariants), or ``BadRequest``."""
    value = _finite(body.get("value")) if isinstance(body, dict) else None
    if value is None:
        got = body.get("value") if isinstance(body, dict) else body
        raise BadRequest(f"value must be a finite number, got {_shown(got)}", "value")
    comps = body.get("components")
    if comps is None:
        comps = {}
    if not isinstance(comps, dict):
        raise BadRequest(
            f"components must be an object mapping names to finite numbers (or null), got {_shown(comps)}",
            "components",
        )
    if len(comps) > MAX_REWARD_COMPONENTS:
        raise BadRequest(
            f"components has {len(comps)} entries; at most {MAX_REWARD_COMPONENTS} are kept per reward",
            "components",
        )
    out = {}
    for k, v in comps.items():
        if len(k) > MAX_COMPONENT_NAME:
            raise BadRequest(
                f"components has a name of {len(k)} characters; names are at most {MAX_COMPONENT_NAME}",
                "components",
            )
        f = _finite(v)
        if f is None:
            raise BadRequest(
                f"components[{_shown(k)}] must be a finite number, got {_shown(v)}", "components"
            )
        out[k] = f
    return Reward(value, out)


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
        """Whether tool calls in the output come back as ``tool_calls``: only when the request offers tools
        and ``tool_choice`` is not "none" (as OpenAI's API: no tools, no tool calls); otherwise the content
        is the raw decoded turn, tool-call markup included."""
        return bool(self.tools) and self.tool_choice != "none"


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
            args = decode_json(args, f"{p}.function.arguments") if args.strip() else {}
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
        if not isinstance(required, list) or any(not isinstance(r, str) or r not in props for r in required):
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
        if not isinstance(name, str) or name not in names:
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
        raise BadRequest(f"{key}={_shown(v)} is out of range; it must be a number in {interval}", key)
    return float(v)


def _flag(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    """``body[key]`` as a bool (absent or null: False); anything but true/false is refused naming ``param``
    (default ``key``), never read by truthiness (``"false"`` is not false)."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{param or key} must be true or false, got {_shown(v)}", param or key)
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
    if 0.0 < req.temperature < MIN_TEMPERATURE:
        raise BadRequest(
            f"temperature={body['temperature']!r} is too small to sample at (scaled logits overflow); send 0 "
            f"for greedy decoding or a temperature >= {MIN_TEMPERATURE}",
            "temperature",
        )
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(key)
    if mt is not None:
        if not _is_int(mt) or not 1 <= mt < max_tokens_limit:
            raise BadRequest(
                f"{key}={_shown(mt)} is out of range; it must be an integer in [1, {max_tokens_limit - 1}] "
                f"(the context holds {max_tokens_limit} tokens including the prompt)",
                key,
            )
        req.max_tokens = mt
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= max_n:
        raise BadRequest(f"n={_shown(n)} is out of range; it must be an integer in [1, {max_n}]", "n")
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
        req.include_usage = _flag(opts, "include_usage", "stream_options.include_usage")
    req.logprobs = _flag(body, "logprobs")
    tl = body.get("top_logprobs")
    if tl is not None:
        if not _is_int(tl) or not 0 <= tl <= 20:
            raise BadRequest(f"top_logprobs={_shown(tl)} must be an integer in [0, 20]", "top_logprobs")
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
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"user must be a string, got {type(user).__name__}", "user")
    req.user = user or None  # checked as a session id only when it names the session (no header)
    req.ignore_eos = _flag(body, "ignore_eos")
    req.return_token_ids = _flag(body, "return_token_ids")
    return req
