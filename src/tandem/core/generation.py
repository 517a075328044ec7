"""Generation requests and completions: what rollout workers send to engines and get back.

Invariants: ``Completion.token_ids``, ``logprobs`` and ``versions`` have equal length; ``versions[i]`` is the
policy version whose weights sampled token ``i`` (a session can span a weight update); ``logprobs[i]`` is the
sampler's log-probability of token ``i`` under the distribution it actually sampled from (after temperature
and top-p), so the trainer can compare it with its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

MIN_TEMPERATURE = 1e-3
"""The smallest sampling temperature above 0 (greedy) an engine accepts: below about 1e-37 the scaled logits
overflow float32 (garbage tokens with NaN logprobs), and far above that the trainer's recomputed ratios at the
recorded temperature are already dominated by rounding. Engines, the gateway and the run config refuse
``0 < temperature < MIN_TEMPERATURE`` naming the field."""
VLLM_MAX_TEMPERATURE = 2.0
"""The highest sampling temperature vLLM accepts (its ``SamplingParams`` refuses more); also the top of the
gateway's range, as in OpenAI's API."""


@dataclass
class SamplingParams:
    """How to sample one completion."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    """Alternatives to report per sampled token (0: none, nothing computed). Engines without them
    (``max_top_logprobs`` 0 or absent) ignore it."""


@dataclass
class GenerationRequest:
    """A prompt given as exact token ids plus sampling parameters."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""


@dataclass
class Completion:
    """Sampled token ids with their sampler logprobs and per-token policy versions."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    logmass: list[float] | None = None
    """Per token, the log of the probability mass the sampler kept (top-p); ``log p_full - logmass`` is the
    token's logprob. None (or all 0.0): nothing was truncated."""
    routed_experts: Any = None
    """MoE models on an engine that reports routing: int array [prompt + sampled tokens, moe_layers, top_k]
    of the experts each token was routed to (for router replay in training); None otherwise."""
    top_token_ids: list[list[int]] | None = None
    """With ``SamplingParams.top_logprobs = k > 0`` on an engine that reports them: per sampled token, the
    ``k`` most likely token ids, most likely first; None otherwise."""
    top_logprobs: list[list[float]] | None = None
    """Their logprobs under the same distribution as ``logprobs`` (parallel to ``top_token_ids``), so the
    sampled token's entry, when it is among them, equals its ``logprobs`` value."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ChatFormat(Protocol):
    """Turns messages into exact token ids and sampled tokens back into messages (see tandem.model).

    ``render_prompt`` returns the ids of the whole conversation so far ending with the assistant header.
    ``render_continuation`` returns the ids to append after a finished assistant turn for the given new
    (tool or user) messages, ending with the next assistant header. ``parse_assistant`` returns the text and
    the tool calls of one sampled assistant turn plus a list of parse errors (malformed calls); with
    ``keep_malformed`` the raw text of a malformed or unclosed call stays in the text instead of being
    dropped.
    """

    stop_token_ids: list[int]

    def render_prompt(self, messages: list[Any], tools: list[dict[str, Any]]) -> list[int]: ...

    def render_continuation(self, messages: list[Any]) -> list[int]: ...

    def parse_assistant(
        self, token_ids: list[int], *, keep_malformed: bool = False
    ) -> tuple[str, list[dict[str, Any]], list[str]]: ...
