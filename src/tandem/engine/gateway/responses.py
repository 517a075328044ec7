"""Engine completions to OpenAI chat completion responses (JSON and SSE chunks).

Invariants:
- ``to_turn`` turns one ``Completion`` into the ``Turn`` a session records and the message the client gets:
  the ``message`` stored in the turn is exactly what the response carries (content text and tool calls with
  parsed arguments), so a client that sends the history back unchanged matches the record.
- Tool calls come from ``ChatFormat.parse_assistant``. A malformed call (invalid JSON, no name, a block
  left open when ``max_tokens`` cut the turn) is counted and stays in the content as the raw text the model
  wrote, markers included (``keep_malformed``; what vLLM's tool parsers return), so a harness sees the
  failed attempt and can answer it, as the built-in harness does with an error message; its tokens stay in
  the record either way. With no tools in the request or ``tool_choice="none"`` nothing is parsed: the
  content is the raw decoded turn.
- A stop string cuts the turn's tokens after the first token whose text completes it (token ids, logprobs,
  versions and top-p log masses alike, so the record holds exactly the tokens up to that one) and the content
  before the stop string; the finish reason is then "stop".
- finish_reason: "length" when the engine hit ``max_tokens`` or the context; else "tool_calls" when the
  message has tool calls; else "stop".
- Forced ids (``tool_choice`` "required" or named, ``tandem.engine.gateway.forcing``) start the turn's text:
  the message is parsed from forced + sampled ids; they are not sampled, so they have no logprobs and count
  as prompt tokens (``prompt_token_ids`` ends with them, ``token_ids`` and ``completion_tokens`` are the
  sampled ones only). Stop strings are matched in the sampled text.
- Logprobs: the sampler's own logprob of every returned sampled token (the trailing end-of-turn token
  excluded). With ``top_logprobs = k`` each entry lists the engine's k alternatives (``{token, logprob,
  bytes}``, most likely first) under the same distribution (``tandem.engine.sampling``: after temperature
  and top-p; greedy is a point mass); a token that distribution excludes has logprob ``-inf``, sent as
  ``-9999.0`` (OpenAI's value for it; JSON has no infinity).
- Streaming (``head``, ``delta``, ``tail``): a role chunk per choice first, content chunks as the gateway
  gets them (``tandem.engine.gateway.stream``), then per choice the content not yet sent, one chunk per tool
  call (sent whole once the turn is done, never as content), and a finish chunk with the turn's logprobs;
  then the optional usage chunk, the ``tandem`` session chunk and ``data: [DONE]``. The concatenated content
  deltas equal the non-streamed message content.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from tandem.core.generation import ChatFormat, Completion
from tandem.core.records import Message
from tandem.engine.gateway.protocol import ChatRequest
from tandem.engine.gateway.sessions import Turn

Decode = Callable[[list[int]], str]


def _stop_cut(ids: list[int], stops: list[str], decode: Decode) -> int | None:
    """Tokens to keep so the text just completes the first stop string, or None when none occurs."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:  # smallest prefix whose text contains a stop string
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def to_turn(
    c: Completion, req: ChatRequest, chat: ChatFormat, decode: Decode, forced: list[int] | None = None
) -> tuple[Turn, str]:
    """The recorded turn and the OpenAI finish reason of one completion (see module invariants);
    ``forced``: the ids the turn was forced to start with (prompt side, not in ``c``)."""
    forced = list(forced or [])
    ids, lps, vers = list(c.token_ids), list(c.logprobs), list(c.versions)
    logmass = list(c.logmass) if getattr(c, "logmass", None) else None
    top_ids, top_lps = getattr(c, "top_token_ids", None), getattr(c, "top_logprobs", None)
    stop_ids = set(chat.stop_token_ids)
    cut = _stop_cut(ids, req.stop, decode)
    if cut is not None:
        ids, lps, vers = ids[:cut], lps[:cut], vers[:cut]
        logmass = logmass[:cut] if logmass is not None else None
        top_ids = top_ids[:cut] if top_ids is not None else None
        top_lps = top_lps[:cut] if top_lps is not None else None
    ended = bool(ids) and ids[-1] in stop_ids
    body = ids[:-1] if ended else ids
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    if req.parse_tools:
        text, calls, errors = chat.parse_assistant(forced + ids, keep_malformed=True)
    else:
        text = decode(body)
    if cut is not None:
        at = [i for i in (text.find(s) for s in req.stop) if i >= 0]
        text = text[: min(at)] if at else text
        finish = "stop"
    elif c.finish_reason == "length":
        finish = "length"
    else:
        finish = "tool_calls" if calls else "stop"
    routed = getattr(c, "routed_experts", None)
    msg = Message("assistant", text, calls)
    turn = Turn(
        ids,
        lps,
        vers,
        msg,
        ended,
        malformed_calls=len(errors),
        logmass=logmass,
        temperature=req.temperature,
        routed_experts=routed,
        forced=forced,
        top_token_ids=top_ids,
        top_logprobs=top_lps,
    )
    return turn, finish


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _tool_calls_json(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": _call_id(),
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]


def _finite(lp: float) -> float:
    return lp if lp > -9999.0 else -9999.0


def _entry(tid: int, lp: float, decode: Decode) -> dict[str, Any]:
    tok = decode([tid])
    return {"token": tok, "logprob": _finite(lp), "bytes": list(tok.encode())}


def _logprobs_json(turn: Turn, decode: Decode) -> dict[str, Any]:
    n = len(turn.token_ids) - int(turn.ended)
    content = []
    for j, (tid, lp) in enumerate(zip(turn.token_ids[:n], turn.logprobs[:n], strict=True)):
        top = []
        if turn.top_token_ids is not None and turn.top_logprobs is not None:
            pairs = zip(turn.top_token_ids[j], turn.top_logprobs[j], strict=True)
            top = [_entry(t, x, decode) for t, x in pairs]
        content.append({**_entry(tid, lp, decode), "top_logprobs": top})
    return {"content": content, "refusal": None}


class ResponseBuilder:
    """Builds the JSON body (or the SSE chunks) of one request's answer."""

    def __init__(
        self, req: ChatRequest, model: str, prompt_ids: list[int], version: int, decode: Decode
    ) -> None:
        self.req, self.model, self.prompt_ids, self.decode = req, model, prompt_ids, decode
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.fingerprint = f"tandem-v{version}"

    def _usage(self, turns: list[Turn]) -> dict[str, int]:
        done = sum(len(t.token_ids) for t in turns)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": done,
            "total_tokens": len(self.prompt_ids) + done,
        }

    def _message(self, turn: Turn) -> dict[str, Any]:
        m = turn.message
        msg: dict[str, Any] = {"role": "assistant", "content": m.content or (None if m.tool_calls else "")}
        if m.tool_calls:
            msg["tool_calls"] = _tool_calls_json(m.tool_calls)
        return msg

    def completion(
        self, turns: list[Turn], finishes: list[str], extra: dict[str, Any] | None
    ) -> dict[str, Any]:
        choices = []
        for i, (turn, finish) in enumerate(zip(turns, finishes, strict=True)):
            choice: dict[str, Any] = {
                "index": i,
                "message": self._message(turn),
                "logprobs": _logprobs_json(turn, self.decode) if self.req.logprobs else None,
                "finish_reason": finish,
            }
            if self.req.return_token_ids:
                choice["token_ids"] = list(turn.token_ids)
            choices.append(choice)
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self._usage(turns),
        }
        if self.req.return_token_ids:
            out["prompt_token_ids"] = list(self.prompt_ids)
        if extra:
            out["tandem"] = extra
        return out

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            **more,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    @staticmethod
    def _choice(i: int, delta: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None, **kw}

    def head(self, i: int) -> str:
        """The first chunk of choice ``i`` (its role)."""
        return self._chunk([self._choice(i, {"role": "assistant", "content": ""})])

    def delta(self, i: int, text: str) -> str:
        """A content chunk of choice ``i``."""
        return self._chunk([self._choice(i, {"content": text})])

    def tail(
        self, turns: list[Turn], finishes: list[str], extra: dict[str, Any] | None, sent: list[str]
    ) -> Iterator[str]:
        """The chunks after the streamed content ``sent[i]`` of each choice (see module invariants)."""
        for i, (turn, finish) in enumerate(zip(turns, finishes, strict=True)):
            msg = self._message(turn)

            def ch(delta: dict[str, Any], i: int = i, **kw: Any) -> dict[str, Any]:
                return self._choice(i, delta, **kw)

            content = turn.message.content or ""
            rest = content[len(sent[i]) :] if content.startswith(sent[i]) else ""
            if rest:
                yield self._chunk([ch({"content": rest})])
            for k, call in enumerate(msg.get("tool_calls", [])):
                yield self._chunk([ch({"tool_calls": [{"index": k, **call}]})])
            lp = _logprobs_json(turn, self.decode) if self.req.logprobs else None
            last = ch({}, finish_reason=finish, logprobs=lp)  # all of the turn's logprobs, in one chunk
            if self.req.return_token_ids:
                last["token_ids"] = list(turn.token_ids)
            yield self._chunk([last])
        if self.req.include_usage:
            yield self._chunk([], usage=self._usage(turns))
        if extra:
            yield self._chunk([], tandem=extra)
        yield "data: [DONE]\n\n"
