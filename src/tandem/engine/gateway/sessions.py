"""Session records of the gateway: the exact token ids of each harness conversation, as a trajectory.

A session is one conversation, named by the client (``X-Tandem-Session`` header or the ``user`` field). Its
record is a list of ``Segment``s (design section 3), built as the conversation goes:

Invariants:
- Token ids are never re-derived from text. The first request of a segment renders its messages once with
  ``ChatFormat.render_prompt``; each later request that *extends* the recorded conversation reuses the
  recorded ids as they are and appends only ``ChatFormat.render_continuation(new messages)`` (``loss_mask``
  0, NaN logprob, version -1), then the sampled turn (``loss_mask`` 1, the sampler's logprobs and versions).
  The prompt sent to the engine is exactly the segment's ids at that point (plus the turn's forced ids).
- "Extends" means: same tools; every earlier message equal in what the chat format renders (role, content,
  tool calls); the recorded last assistant message equal to what the model produced (with ``n > 1``, any one
  of that turn's choices; the chosen one then replaces choice 0 in the record; when several choices have the
  same message, e.g. the same malformed call, the lowest index wins); no assistant message among
  the new ones (the model did not produce it). Otherwise the current segment is closed, a new one starts
  from ``render_prompt`` of the full request, and ``segment_reasons`` records why (edited, reordered,
  truncated history, changed tools, foreign assistant turn).
- Forced ids (``tool_choice`` "required" or a named function, ``tandem.engine.gateway.forcing``) are the
  start of the assistant turn that the model did not sample: they are recorded right after the prompt as
  context (``loss_mask`` 0, NaN logprob, version -1), then the sampled ids. The turn's message is parsed from
  forced + sampled ids, so a history that sends it back matches and the next request reuses the recorded ids
  (forced ones included) unchanged. The prompt the engine saw is the recorded ids up to the sampled ones.
- A sampled turn that ended without the end-of-turn token (``max_tokens`` reached, a stop string, or
  ``ignore_eos``) is kept as sampled; if the conversation continues, the end-of-turn token is appended as
  context (``loss_mask`` 0) before the continuation, exactly what the chat format puts after a turn.
- Sampled tokens are recorded like the built-in harness records them (``SegmentBuilder.add_sampled``): the
  sampler's logprobs, versions, top-p log masses (``sampler_logmass``) and temperature
  (``sampler_temperature``), so the trainer recomputes the same sampled quantity for either source.
- A record changes only on a successful generation (``commit``); ``plan`` has no side effects. The caller
  holds ``Session.lock`` from ``plan`` to ``commit`` so requests of one session apply in order: it takes the
  session with ``SessionStore.acquire`` and gives it back with ``SessionStore.release``.
- ``SessionStore`` keeps at most ``max_sessions`` sessions, evicting the least recently used (counted), but
  never a busy one (``Session.holders`` > 0: a request holds or waits for its lock), nor removing it when
  its first request failed, so the session a request holds is always the one the store names by its id (its
  turn is never committed to an orphan, and one id never runs two requests at once). When every other
  session is busy, the store holds more than ``max_sessions`` (at most one extra per request in flight) until
  a later ``open`` evicts them once idle.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.core.generation import ChatFormat
from tandem.core.records import Message, Reward, Segment, SegmentBuilder, Trajectory


@dataclass
class Turn:
    """One sampled choice of an assistant turn: its tokens and the message the client got back."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    message: Message
    ended: bool  # the last token is the end-of-turn token
    malformed_calls: int = 0
    logmass: list[float] | None = None  # per token, log of the top-p mass kept (None: nothing truncated)
    temperature: float = 1.0  # the temperature it was sampled at
    routed_experts: np.ndarray | None = (
        None  # [prompt + turn tokens, moe_layers, top_k] when the engine has it
    )
    forced: list[int] = field(default_factory=list)  # turn start given, not sampled (recorded as context)
    top_token_ids: list[list[int]] | None = None  # per sampled token, the engine's top alternatives
    top_logprobs: list[list[float]] | None = None


@dataclass
class Plan:
    """What one request does to its session: the prompt to generate from and how it joins the record."""

    prompt_ids: list[int]
    new_segment: bool
    reason: str | None  # why a new segment starts (None: the session's first segment, or no new segment)
    context_ids: list[int]  # appended before the sampled turn when continuing (the whole prompt otherwise)
    swap: Turn | None = None  # the alternate choice of the last turn that the history picked
    tools_key: str = ""


def tools_key(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True, ensure_ascii=False)


def _key(m: Message) -> tuple[str, str, list[dict[str, Any]]]:
    """What the chat format renders of a message (``name`` and tool-call ids are not rendered)."""
    return (m.role, m.content or "", m.tool_calls)


def _jsonable(a: np.ndarray) -> list[Any]:
    if a.dtype.kind == "f":
        return [None if math.isnan(x) else x for x in a.tolist()]
    return a.tolist()


@dataclass
class Session:
    """The record of one conversation (see module invariants)."""

    id: str
    segments: list[Segment] = field(default_factory=list)
    builder: SegmentBuilder | None = None
    routed_experts: np.ndarray | None = None  # of the current segment, when the engine reports them
    turn_start: int = 0  # index in builder where the last sampled turn starts
    messages: list[Message] = field(default_factory=list)  # conversation of the current segment so far
    tools_key: str = ""
    last: Turn | None = None
    alternates: list[Turn] = field(default_factory=list)
    reasons: list[dict[str, Any]] = field(default_factory=list)
    reward: Reward | None = None
    stats: dict[str, int] = field(
        default_factory=lambda: {
            "requests": 0,
            "turns": 0,
            "tool_calls": 0,
            "malformed_calls": 0,
            "new_segments": 0,
            "unended_turns": 0,
        }
    )
    generate_s: float = 0.0
    created: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    holders: int = 0  # requests holding or waiting for ``lock`` (see ``SessionStore``)

    @property
    def empty(self) -> bool:
        """Nothing recorded yet (no request of this session has committed)."""
        return self.last is None and not self.segments

    # ---- matching ---------------------------------------------------------------------------------

    def _mismatch(self, messages: list[Message], key: str) -> tuple[str | None, Turn | None]:
        assert self.last is not None
        recorded = self.messages
        if key != self.tools_key:
            return "the request's tools differ from the tools this segment was rendered with", None
        for i in range(min(len(recorded) - 1, len(messages))):
            if _key(messages[i]) != _key(recorded[i]):
                return (
                    f"messages[{i}] ({messages[i].role}) differs from the recorded history (edited or "
                    "reordered)",
                    None,
                )
        if len(messages) < len(recorded):
            return (
                f"the history has {len(messages)} messages but the session recorded {len(recorded)} "
                "(truncated, or an earlier turn is being regenerated)",
                None,
            )
        i = len(recorded) - 1
        swap = None
        if _key(messages[i]) != _key(self.last.message):
            swap = next((t for t in self.alternates if _key(t.message) == _key(messages[i])), None)
            if swap is None:
                return (
                    f"messages[{i}] ({messages[i].role}) is not the assistant turn the model produced "
                    "(edited or replaced)",
                    None,
                )
        for j, m in enumerate(messages[len(recorded) :], start=len(recorded)):
            if m.role == "assistant":
                return (
                    f"messages[{j}] is an assistant message the model did not produce in this session",
                    None,
                )
        return None, swap

    def plan(
        self, messages: list[Message], tools: list[dict[str, Any]], chat: ChatFormat, end_of_turn: int
    ) -> Plan:
        """How ``messages`` join this record; no side effects."""
        key = tools_key(tools)
        if self.builder is None or self.last is None:
            ids = chat.render_prompt(messages, tools)
            return Plan(ids, True, None, ids, None, key)
        reason, swap = self._mismatch(messages, key)
        if reason is not None:
            ids = chat.render_prompt(messages, tools)
            return Plan(ids, True, reason, ids, None, key)
        last = swap or self.last
        if swap:
            base = self.builder.ids[: self.turn_start] + swap.forced + swap.token_ids
        else:
            base = list(self.builder.ids)
        ctx = ([] if last.ended else [end_of_turn]) + chat.render_continuation(messages[len(self.messages) :])
        return Plan(base + ctx, False, None, ctx, swap, key)

    # ---- recording --------------------------------------------------------------------------------

    def _close_segment(self) -> None:
        if self.builder is not None and len(self.builder):
            seg = self.builder.build()
            if self.routed_experts is not None and len(self.routed_experts) == len(seg):
                seg.routed_experts = self.routed_experts
            self.segments.append(seg)
        self.builder, self.routed_experts = None, None

    def commit(self, plan: Plan, messages: list[Message], choices: list[Turn], generate_s: float) -> None:
        """Record a successful generation: ``choices[0]`` continues the record, the rest are alternates."""
        first = choices[0]
        if plan.new_segment:
            self._close_segment()
            if plan.reason is not None:
                self.reasons.append(
                    {"segment": len(self.segments), "request": self.stats["requests"], "reason": plan.reason}
                )
                self.stats["new_segments"] += 1
            self.builder = SegmentBuilder()
            self.builder.add_context(plan.prompt_ids)
        else:
            b = self.builder
            assert b is not None
            if plan.swap is not None:
                for arr in (b.ids, b.mask, b.logprobs, b.versions, b.logmass, b.temperature):
                    del arr[self.turn_start :]
                t = plan.swap
                b.add_context(t.forced)
                b.add_sampled(t.token_ids, t.logprobs, t.versions, t.logmass, t.temperature)
            b.add_context(plan.context_ids)
        b = self.builder
        assert b is not None and b.ids == plan.prompt_ids, "the prompt sent must be the recorded ids"
        self.turn_start = len(b)
        b.add_context(first.forced)
        b.add_sampled(first.token_ids, first.logprobs, first.versions, first.logmass, first.temperature)
        self.routed_experts = first.routed_experts
        self.messages = [*messages, first.message]
        self.last, self.alternates, self.tools_key = first, choices[1:], plan.tools_key
        self.stats["requests"] += 1
        self.stats["turns"] += 1
        self.stats["tool_calls"] += len(first.message.tool_calls)
        self.stats["malformed_calls"] += first.malformed_calls
        self.stats["unended_turns"] += int(not first.ended)
        self.generate_s += generate_s

    def trajectory(self) -> Trajectory:
        """The record as a ``Trajectory`` (reward 0 with ``flags["reward_attached"]`` False until posted)."""
        segments = list(self.segments)
        if self.builder is not None and len(self.builder):
            seg = self.builder.build()
            if self.routed_experts is not None and len(self.routed_experts) == len(seg):
                seg.routed_experts = self.routed_experts
            segments.append(seg)
        flags = {
            "reward_attached": self.reward is not None,
            "truncated": self.last is not None and not self.last.ended,
        }
        return Trajectory(
            task_id=self.id,
            segments=segments,
            reward=self.reward or Reward(0.0),
            flags=flags,
            timings={"generate_s": self.generate_s, "created_unix": self.created},
            tool_stats=dict(self.stats),
            messages=list(self.messages),
        )

    def to_json(self) -> dict[str, Any]:
        """The trajectory as JSON values (NaN logprobs become null) plus ``session_id`` and
        ``segment_reasons``; ``Trajectory.from_dict`` reads it back."""
        d = self.trajectory().to_dict()
        d["segments"] = [{k: _jsonable(np.asarray(v)) for k, v in s.items()} for s in d["segments"]]
        d["session_id"] = self.id
        d["segment_reasons"] = list(self.reasons)
        return d


class SessionStore:
    """At most ``max_sessions`` idle sessions, least recently used evicted first (counted in ``evicted``);
    busy sessions are never evicted (see module invariants)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def open(self, sid: str) -> Session:
        """The session named ``sid`` (created if new), marked as most recently used; evicts idle sessions
        (least recently used first, never ``sid``) while there are more than ``max_sessions``."""
        s = self._sessions.get(sid)
        if s is None:
            s = self._sessions[sid] = Session(sid)
        self._sessions.move_to_end(sid)
        over = len(self._sessions) - self.max_sessions
        if over > 0:
            idle = (k for k, x in self._sessions.items() if x.holders == 0 and k != sid)
            for k in list(itertools.islice(idle, over)):
                del self._sessions[k]
                self.evicted += 1
        return s

    async def acquire(self, sid: str) -> Session:
        """The session named ``sid`` with its lock held by the caller, who must ``release`` it. It counts as
        busy from the call on (waiting included), so it stays the store's session ``sid`` throughout."""
        s = self.open(sid)
        s.holders += 1
        try:
            await s.lock.acquire()
        except BaseException:  # cancelled while waiting
            s.holders -= 1
            self._forget_if_unused(s)
            raise
        return s

    def release(self, s: Session) -> None:
        """Give back a session from ``acquire``; one that recorded nothing (its first request failed or was
        skipped) and that no other request holds or waits for is forgotten, leaving no empty record."""
        s.holders -= 1
        self._forget_if_unused(s)
        s.lock.release()

    def _forget_if_unused(self, s: Session) -> None:
        if s.holders == 0 and s.empty and self._sessions.get(s.id) is s:
            del self._sessions[s.id]
