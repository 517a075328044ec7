"""Batched sampling with temperature and top-p, returning the sampler's own logprob of each token.

Semantics (what ``Completion.logprobs`` means):
- ``temperature > 0``: logits are divided by the temperature, then top-p keeps, in order of decreasing
  probability, every token whose preceding cumulative mass is below ``top_p`` (so at least one token, and the
  token that crosses ``top_p`` is kept); the kept set is renormalised. The logprob is log p(token) under that
  renormalised distribution, which is exactly the distribution the token was drawn from. The kept set's
  log mass under the temperature-scaled full distribution (``logmass``, <= 0; 0 without truncation) is
  returned too: ``log p_full(token) - logmass`` is the sampled logprob, so a trainer that recomputes
  ``log p_full`` with its own weights gets the same quantity by subtracting it.
- ``temperature == 0``: greedy (argmax); the distribution is a point mass, so the logprob is 0.0 (and the
  logmass 0.0).

Top logprobs (``sample(..., top_k=k)``, only computed when asked): per row, the ``k`` tokens ranked first by
the temperature-scaled logits (raw logits for greedy), each with its logprob under the distribution the
sampled logprob refers to: ``log_softmax(logits / T)`` renormalised over the top-p set (``-inf`` outside
it); for greedy, the point mass (0.0 for the argmax, which is always listed, ``-inf`` for the rest). Rows are
sorted by that logprob, descending; the sampled token's entry, when listed, is bitwise its logprob.

Randomness: one uniform number per sampled token, drawn from the session's own ``torch.Generator`` and
turned into a token by inverse-CDF search, so a session's samples do not depend on which other sessions
share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UniformStream:
    """Uniforms in (0, 1] from a seeded ``torch.Generator``, drawn in blocks to keep per-step cost low."""

    BLOCK = 256

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        self.buf: list[float] = []
        self.i = 0

    def next(self) -> float:
        if self.i >= len(self.buf):
            self.buf = (1.0 - torch.rand(self.BLOCK, generator=self.gen, dtype=torch.float64)).tolist()
            self.i = 0
        u = self.buf[self.i]
        self.i += 1
        return u


@dataclass
class TopLogprobs:
    """The ``k`` listed alternatives of each row: ``token_ids`` [n, k] int64, ``logprobs`` [n, k] float32."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits [n, V] float32; temperature, top_p, uniforms [n] (uniforms in (0, 1]).
    Returns (tokens [n] int64, logprobs [n] float32, logmass [n] float32) per the module semantics.
    """
    tokens, lps, logmass, _ = sample_top(logits, temperature, top_p, uniforms, 0)
    return tokens, lps, logmass


def sample_top(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TopLogprobs | None]:
    """``sample`` plus the ``top_k`` most likely tokens of each row and their logprobs (module semantics);
    ``top_k == 0``: None, and nothing beyond ``sample``'s work is done."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    logmass = torch.zeros(logits.shape[0], dtype=logp.dtype)
    if bool((top_p < 1.0).any()):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        before = p.cumsum(dim=-1) - p  # mass strictly before each token in sorted order
        drop_sorted = before >= top_p.unsqueeze(1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        kept = logp.masked_fill(drop, float("-inf"))
        logmass = torch.logsumexp(kept, dim=-1)
        logp = kept - logmass.unsqueeze(1)
    cdf = logp.exp().cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[1] - 1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    lps = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    lps = torch.where(greedy, torch.zeros_like(lps), lps)
    logmass = torch.where(greedy, torch.zeros_like(logmass), logmass)
    top = _top(scaled, logp, greedy, tokens, top_k) if top_k > 0 else None
    return tokens, lps, logmass, top


def _top(
    scaled: torch.Tensor, logp: torch.Tensor, greedy: torch.Tensor, tokens: torch.Tensor, k: int
) -> TopLogprobs:
    rank = scaled
    if bool(greedy.any()):  # the argmax is listed even when it ties with other tokens
        rank = scaled.clone()
        rows = greedy.nonzero().squeeze(1)
        rank[rows, tokens[rows]] = float("inf")
    ids = rank.topk(min(k, rank.shape[1]), dim=-1).indices
    vals = logp.gather(1, ids)
    point = torch.where(ids == tokens.unsqueeze(1), 0.0, float("-inf")).to(vals.dtype)
    vals = torch.where(greedy.unsqueeze(1), point, vals)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return TopLogprobs(ids.gather(1, order), vals)
