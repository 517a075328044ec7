"""Policy-gradient objectives over a packed batch, and off-policy corrections against the sampler.

Every objective has the same signature: per-token tensors of equal shape (current ``logprobs`` with grad,
``old_logprobs`` recomputed before the update, ``advantages``, ``loss_mask``), the clip range (``clip_eps``
below 1, ``clip_eps_high`` above; None: symmetric), an optional reference, ``num_tokens`` (the denominator:
the sampled tokens of the *whole optimizer update*), and, keyword-only, the sampler's logprobs, the sequence
index of every token (``MicroBatch.seq_index``) and an off-policy :class:`Correction`. It returns
``(loss, metrics)``. :data:`LOSS_FUNCTIONS` maps the config names (``train.loss``) to them.

Invariants:
- Only tokens with ``loss_mask == 1`` (sampled by the policy) and, when ``sampler_logprobs`` is given, a
  finite sampler logprob contribute to the loss or the metrics; values at other positions may be anything
  finite or not (they are replaced before any arithmetic). A token without a sampler logprob was not sampled:
  it is never trained and never corrected.
- Token-level aggregation: the loss is ``sum(per_token_loss * kept) / num_tokens``. When a step is split into
  micro-batches, passing the update's total ``num_tokens`` to every call makes the sum of the micro-batch
  losses (and of their gradients) equal to the loss of the whole update computed at once.
- Normalisation after masking: a masking correction (``mask_seq``, ``mask_geo``, ``icepop``) removes tokens
  from the update; the right denominator is then the number of *unmasked* sampled tokens of the update (a
  rejected token is as if never sampled). Without ``num_tokens`` a call uses its own unmasked count; callers
  that split an update pass that count for the whole update (the trainer sums each micro-batch's loss and
  divides the gradient by it once all micro-batches are seen, see ``Trainer``). Rejected tokens kept in the
  denominator would silently shrink the step (the bug fixed in slime PR #657, following verl #3915).
  ``masked_tokens`` and ``masked_frac`` in the metrics report what was removed. Truncated IS (``tis``)
  reweights and never masks.
- ``metrics`` are plain floats, means over this call's kept (unmasked) sampled tokens (``metrics["tokens"]``
  is their count, so callers can combine calls with a token-weighted average).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

LOSSES = ("grpo", "dapo", "gspo", "cispo")
CORRECTIONS = ("none", "tis", "mask_seq", "mask_geo", "icepop")
MASKING_CORRECTIONS = ("mask_seq", "mask_geo", "icepop")


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from samples of p, with ``log_ratio = log q - log p``: unbiased
    and always >= 0 (http://joschu.net/blog/kl-approx.html)."""
    return torch.expm1(log_ratio) - log_ratio


@dataclass(frozen=True)
class Correction:
    """Off-policy correction of the trainer's update for the sampler/trainer mismatch.

    The ratio is ``w_t = p_old_trainer(t) / p_sampler(t)`` on sampled tokens (no gradient flows through it):

    - ``none``: no correction.
    - ``tis``: token-level truncated importance sampling, the per-token loss is multiplied by
      ``min(w_t, clip)`` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
      Training", https://fengyao.notion.site/off-policy-rl; cap C = 2 as in verl's rollout-correction
      presets).
    - ``mask_seq``: sequence-level masked IS, drop every token of a sequence whose product ratio
      ``prod_t w_t`` lies outside ``band`` (verl rollout correction "seq mask"; Liu et al. 2025, "When Speed
      Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch").
    - ``mask_geo``: the same with the geometric-mean ratio ``exp(mean_t log w_t)`` (length-independent).
    - ``icepop``: drop single tokens whose ``w_t`` lies outside ``band`` (IcePop; Ling Team 2025, "Every Step
      Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model", arXiv:2510.18855; band
      [0.5, 5]).

    Bands are inclusive and compared in log space (no overflow for long sequences).
    """

    kind: str = "none"
    clip: float = 2.0
    band: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self) -> None:
        if self.kind not in CORRECTIONS:
            raise ValueError(f"correction kind must be one of {CORRECTIONS}, got {self.kind!r}")
        if not self.clip > 0:
            raise ValueError(f"the truncated-IS cap must be > 0, got {self.clip}")
        lo, hi = self.band
        if not 0 < lo < hi:
            raise ValueError(f"the correction band must satisfy 0 < low < high, got {self.band}")

    @property
    def masks(self) -> bool:
        """True when the correction removes tokens (the loss denominator then changes)."""
        return self.kind in MASKING_CORRECTIONS


NO_CORRECTION = Correction()


def _per_sequence(
    values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor | None, who: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inverse, sums, counts)``: each token's compact sequence id, and per sequence the sum of ``values``
    over masked-in tokens and their count (differentiable through ``values``)."""
    if seq_index is None:
        raise ValueError(f"{who} needs seq_index (MicroBatch.seq_index): it works on whole sequences")
    inverse = torch.unique(seq_index, return_inverse=True)[1]
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    fmask = mask.to(values.dtype)
    sums = values.new_zeros(n).index_add(0, inverse, values * fmask)
    counts = values.new_zeros(n).index_add(0, inverse, fmask)
    return inverse, sums, counts


def off_policy_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(weight, keep)`` of a correction (see :class:`Correction`), both without gradient.

    ``mask`` (bool) selects sampled tokens; ``weight`` multiplies the per-token loss (None: all ones) and
    ``keep`` (bool) is ``mask`` minus the tokens the correction removes."""
    with torch.no_grad():
        if correction.kind == "none":
            return None, mask
        zeros = torch.zeros_like(old_logprobs)
        log_w = torch.where(mask, old_logprobs, zeros) - torch.where(mask, sampler_logprobs, zeros)
        lo, hi = (math.log(b) for b in correction.band)
        if correction.kind == "tis":
            return torch.exp(log_w).clamp(max=correction.clip), mask
        if correction.kind == "icepop":
            return None, mask & (log_w >= lo) & (log_w <= hi)
        inverse, sums, counts = _per_sequence(log_w, mask, seq_index, f"correction {correction.kind!r}")
        stat = sums if correction.kind == "mask_seq" else sums / counts.clamp(min=1)
        ok = (stat >= lo) & (stat <= hi)
        return None, mask & ok[inverse]


@dataclass
class _Prepared:
    lp: torch.Tensor  # logprobs, 0 outside the mask (keeps grad)
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor  # bool: sampled tokens
    keep: torch.Tensor  # bool: sampled tokens the correction keeps
    weight: torch.Tensor | None  # truncated-IS weight, None when there is none
    local: int  # sampled tokens of this call
    kept: int  # of which kept
    denom: float
    low: float
    high: float


def _prepare(
    who: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    num_tokens: float | None,
    sampler_logprobs: torch.Tensor | None,
    seq_index: torch.Tensor | None,
    correction: Correction | None,
) -> _Prepared:
    shapes = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    shapes["loss_mask"] = loss_mask
    if sampler_logprobs is not None:
        shapes["sampler_logprobs"] = sampler_logprobs
    if seq_index is not None:
        shapes["seq_index"] = seq_index
    if len({tuple(t.shape) for t in shapes.values()}) != 1:
        raise ValueError(
            f"{who} inputs must have equal shapes, got "
            + ", ".join(f"{k} {tuple(v.shape)}" for k, v in shapes.items())
        )
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or high <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps} (low) and {high} (high)")
    correction = correction or NO_CORRECTION
    if correction.kind != "none" and sampler_logprobs is None:
        raise ValueError(f"correction {correction.kind!r} needs sampler_logprobs")
    mask = loss_mask.to(torch.bool)
    if sampler_logprobs is not None:
        mask = mask & torch.isfinite(sampler_logprobs)
    local = int(mask.sum())
    denom = float(local if num_tokens is None else num_tokens)
    if denom <= 0:
        raise ValueError(f"num_tokens must be > 0 (sampled tokens in the step), got {denom}")
    zeros = torch.zeros_like(logprobs)
    # torch.where before arithmetic: NaN at unsampled positions must not leak into the sum or its gradient.
    lp = torch.where(mask, logprobs, zeros)
    old = torch.where(mask, old_logprobs.to(logprobs.dtype), zeros)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zeros)
    weight, keep = None, mask
    if sampler_logprobs is not None:
        slp = sampler_logprobs.to(logprobs.dtype)
        weight, keep = off_policy_weights(old, slp, mask, correction, seq_index)
    kept = int(keep.sum()) if correction.masks else local
    if num_tokens is None and correction.masks:
        denom = float(max(kept, 1))  # normalise by the unmasked tokens; all masked: loss 0, no gradient
    return _Prepared(lp, old, adv, mask, keep, weight, local, kept, denom, clip_eps, high)


def _finish(
    p: _Prepared,
    pg: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    correction: Correction | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Add the KL penalty, apply the correction, aggregate token-level, and compute the metrics."""
    fkeep = p.keep.to(p.lp.dtype)
    per_token = pg
    kl_ref = None
    if ref_logprobs is not None and kl_coef != 0.0:
        ref = torch.where(p.mask, ref_logprobs.to(p.lp.dtype), torch.zeros_like(p.lp))
        kl_ref = _k3(ref - p.lp)
        per_token = per_token + kl_coef * kl_ref
    if p.weight is not None:
        per_token = per_token * p.weight
    loss = (per_token * fkeep).sum() / p.denom

    with torch.no_grad():
        n = max(p.kept, 1)
        metrics = {
            "pg_loss": float((pg * fkeep).sum()) / n,
            "clip_frac": float((clipped & p.keep).sum()) / n,
            "ratio_mean": float((ratio * fkeep).sum()) / n,
            "approx_kl": float((_k3(p.lp - p.old) * fkeep).sum()) / n,
            "tokens": float(p.kept),
        }
        if kl_ref is not None:
            metrics["kl_ref"] = float((kl_ref * fkeep).sum()) / n
        if correction is not None and correction.kind != "none":
            metrics["masked_tokens"] = float(p.local - p.kept)
            metrics["masked_frac"] = (p.local - p.kept) / max(p.local, 1)
            if p.weight is not None:
                metrics["is_weight_mean"] = float((p.weight * fkeep).sum()) / n
                metrics["is_clipped_frac"] = float(((p.weight >= correction.clip) & p.keep).sum()) / n
    return loss, metrics


def _ppo_clip(
    who: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    num_tokens: float | None,
    clip_eps_high: float | None,
    sampler_logprobs: torch.Tensor | None,
    seq_index: torch.Tensor | None,
    correction: Correction | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    p = _prepare(
        who, logprobs, old_logprobs, advantages, loss_mask, clip_eps, clip_eps_high, num_tokens,
        sampler_logprobs, seq_index, correction,
    )  # fmt: skip
    log_ratio = p.lp - p.old
    ratio = torch.exp(log_ratio)
    surr1 = ratio * p.adv
    surr2 = torch.clamp(ratio, 1.0 - p.low, 1.0 + p.high) * p.adv
    pg = -torch.minimum(surr1, surr2)
    with torch.no_grad():
        clipped = ((ratio > 1.0 + p.high) & (p.adv > 0)) | ((ratio < 1.0 - p.low) & (p.adv < 0))
    return _finish(p, pg, ratio, clipped, ref_logprobs, kl_coef, correction)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
    *,
    clip_eps_high: float | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    correction: Correction | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss: PPO-clipped surrogate with group-relative advantages, token-level aggregation, optional KL.

    Per sampled token ``t`` with ratio ``rho_t = exp(logprobs_t - old_logprobs_t)`` and advantage ``A_t``::

        l_t = -min(rho_t * A_t, clip(rho_t, 1 - clip_eps, 1 + clip_eps_high) * A_t) + kl_coef * k3_t
        k3_t = exp(ref_t - logprobs_t) - (ref_t - logprobs_t) - 1        (only when ref_logprobs is given)
        loss = sum_t w_t * l_t / num_tokens        (w_t: the correction's weight or mask, 1 without one)

    References:
    - GRPO, group-relative advantages and the k3 KL penalty to a reference policy: Shao et al. 2024,
      "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", arXiv:2402.03300.
    - Clipped surrogate objective: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
      arXiv:1707.06347.
    - Token-level normalisation over the whole step (every sampled token weighs the same, however long its
      sequence): Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
      arXiv:2503.14476.

    ``num_tokens`` is the number of sampled tokens of the whole optimizer step (all micro-batches); when None
    it defaults to this call's ``loss_mask.sum()`` (unmasked tokens, see the module invariants). Metrics
    (means over this call's kept sampled tokens): ``clip_frac`` (tokens where the clipped branch is active and
    its gradient is zero), ``ratio_mean``, ``approx_kl`` (k3 estimate of KL(old || new) from the sampled
    tokens), ``kl_ref`` (when a reference is given), ``pg_loss``, ``tokens``; with a correction also
    ``masked_tokens``, ``masked_frac`` and, for truncated IS, ``is_weight_mean`` and ``is_clipped_frac``.
    """
    return _ppo_clip(
        "grpo_loss", logprobs, old_logprobs, advantages, loss_mask, clip_eps, ref_logprobs, kl_coef,
        num_tokens, clip_eps_high, sampler_logprobs, seq_index, correction,
    )  # fmt: skip


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
    *,
    clip_eps_high: float | None = 0.28,
    sampler_logprobs: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    correction: Correction | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO loss: the PPO-clipped surrogate with decoupled clip ranges ("clip-higher") and token-level
    normalisation (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476; the paper uses ``clip_eps = 0.2`` and ``clip_eps_high = 0.28``)::

        l_t = -min(rho_t * A_t, clip(rho_t, 1 - clip_eps, 1 + clip_eps_high) * A_t)
        loss = sum_t l_t / num_tokens       (num_tokens: sampled tokens of the update, each token weighs 1)

    A larger upper clip lets low-probability tokens with positive advantage grow (against entropy collapse).
    DAPO's dynamic sampling (groups whose rewards all agree carry no signal and are left out of the batch)
    happens in the trainer: with ``train.loss = "dapo"`` zero-variance groups are not trained and not counted
    in the denominator; the batch is not refilled by over-sampling (``zero_adv_groups`` says how many were
    left out). The overlong-reward shaping of the paper is not implemented. Metrics as :func:`grpo_loss`.
    """
    return _ppo_clip(
        "dapo_loss", logprobs, old_logprobs, advantages, loss_mask, clip_eps, ref_logprobs, kl_coef,
        num_tokens, clip_eps_high, sampler_logprobs, seq_index, correction,
    )  # fmt: skip


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
    *,
    clip_eps_high: float | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    correction: Correction | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO loss: the clipped surrogate on a *sequence-level* ratio (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv:2507.18071; the paper clips at ``3e-4`` below and ``4e-4`` above).

    For sequence ``i`` (tokens sharing a ``seq_index``) with kept sampled tokens ``T_i``::

        s_i = exp(mean_{t in T_i} (logprobs_t - old_logprobs_t))      (the geometric mean of the token ratios)
        l_t = -min(s_i * A_t, clip(s_i, 1 - clip_eps, 1 + clip_eps_high) * A_t)       for t in T_i
        loss = sum_t l_t / num_tokens

    Clipping is per sequence: a clipped sequence gives no gradient to any of its tokens. Aggregation is
    token-level like the other objectives, so a sequence weighs by its length (the paper averages over
    sequences; token-level keeps the micro-batch decomposition exact and matches GSPO-token with a constant
    advantage per sequence up to that weighting). ``seq_index`` is required; every sequence must lie in one
    call (true for packed micro-batches). ``ratio_mean`` and ``clip_frac`` are token means of ``s_i``.
    """
    p = _prepare(
        "gspo_loss", logprobs, old_logprobs, advantages, loss_mask, clip_eps, clip_eps_high, num_tokens,
        sampler_logprobs, seq_index, correction,
    )  # fmt: skip
    inverse, sums, counts = _per_sequence(p.lp - p.old, p.keep, seq_index, "gspo_loss")
    seq_ratio = torch.exp(sums / counts.clamp(min=1))
    s = seq_ratio[inverse]
    surr1 = s * p.adv
    surr2 = torch.clamp(s, 1.0 - p.low, 1.0 + p.high) * p.adv
    pg = -torch.minimum(surr1, surr2)
    with torch.no_grad():
        clipped = ((s > 1.0 + p.high) & (p.adv > 0)) | ((s < 1.0 - p.low) & (p.adv < 0))
    return _finish(p, pg, s.detach(), clipped, ref_logprobs, kl_coef, correction)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
    *,
    clip_eps_high: float | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    correction: Correction | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO loss: REINFORCE with a clipped, stop-gradient importance weight (MiniMax 2025, "MiniMax-M1:
    Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585, section 3.1)::

        l_t = -sg(clip(rho_t, 1 - clip_eps, 1 + clip_eps_high)) * A_t * logprobs_t
        loss = sum_t l_t / num_tokens

    Unlike PPO clipping, no token loses its gradient: the clip only bounds the weight, so rare tokens with a
    large ratio still contribute (bounded) updates. The paper sets no lower bound (a large ``clip_eps``, e.g.
    1.0) and tunes only the upper one. ``clip_frac`` counts tokens whose weight was clipped (either side).
    """
    p = _prepare(
        "cispo_loss", logprobs, old_logprobs, advantages, loss_mask, clip_eps, clip_eps_high, num_tokens,
        sampler_logprobs, seq_index, correction,
    )  # fmt: skip
    ratio = torch.exp(p.lp - p.old)
    w = torch.clamp(ratio, 1.0 - p.low, 1.0 + p.high).detach()
    pg = -w * p.adv * p.lp
    with torch.no_grad():
        clipped = (ratio > 1.0 + p.high) | (ratio < 1.0 - p.low)
    return _finish(p, pg, ratio.detach(), clipped, ref_logprobs, kl_coef, correction)


class LossFunction(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        clip_eps: float,
        ref_logprobs: torch.Tensor | None = None,
        kl_coef: float = 0.0,
        num_tokens: float | None = None,
        *,
        clip_eps_high: float | None = None,
        sampler_logprobs: torch.Tensor | None = None,
        seq_index: torch.Tensor | None = None,
        correction: Correction | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


LOSS_FUNCTIONS: dict[str, LossFunction] = {
    "grpo": grpo_loss, "dapo": dapo_loss, "gspo": gspo_loss, "cispo": cispo_loss,
}  # fmt: skip
"""``train.loss`` name -> objective."""

PAPER_CLIP: dict[str, tuple[float | None, float | None]] = {
    "grpo": (None, None), "dapo": (None, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, None),
}  # fmt: skip
"""Each objective's clip range from its paper, (below, above); None: ``train.clip_eps``."""


def clip_range(loss: str, clip_eps: float, low: float | None, high: float | None) -> tuple[float, float]:
    """The clip range ``(below, above)`` a loss uses: explicit ``low``/``high`` (``train.clip_eps_low``/
    ``clip_eps_high``) win, then the paper's value (:data:`PAPER_CLIP`), then ``clip_eps``."""
    if loss not in PAPER_CLIP:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    paper_low, paper_high = PAPER_CLIP[loss]
    lo = low if low is not None else paper_low if paper_low is not None else clip_eps
    hi = high if high is not None else paper_high if paper_high is not None else clip_eps
    return lo, hi
