"""Policy-gradient objectives over a packed batch.

Every objective has the same signature: per-token tensors of equal shape (current ``logprobs`` with grad,
``old_logprobs`` recomputed before the update, ``advantages``, ``loss_mask``), the clip range, an optional
reference, and ``num_tokens``: the number of sampled tokens of the *whole optimizer step*. It returns
``(loss, metrics)``.

Invariants:
- Only tokens with ``loss_mask == 1`` (sampled by the policy) contribute to the loss or the metrics; values
  at other positions may be anything finite or not (they are replaced before any arithmetic).
- Token-level aggregation: the loss is ``sum(per_token_loss * mask) / num_tokens``. When a step is split into
  micro-batches, passing the step's total ``num_tokens`` to every call makes the sum of the micro-batch losses
  (and of their gradients) equal to the loss of the whole step computed at once.
- ``metrics`` are plain floats, means over this call's sampled tokens (``metrics["tokens"]`` is their count,
  so callers can combine calls with a token-weighted average).
"""

from __future__ import annotations

import torch


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from samples of p, with ``log_ratio = log q - log p``: unbiased
    and always >= 0 (http://joschu.net/blog/kl-approx.html)."""
    return torch.expm1(log_ratio) - log_ratio


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss: PPO-clipped surrogate with group-relative advantages, token-level aggregation, optional KL.

    Per sampled token ``t`` with ratio ``rho_t = exp(logprobs_t - old_logprobs_t)`` and advantage ``A_t``::

        l_t = -min(rho_t * A_t, clip(rho_t, 1 - clip_eps, 1 + clip_eps) * A_t) + kl_coef * k3_t
        k3_t = exp(ref_t - logprobs_t) - (ref_t - logprobs_t) - 1        (only when ref_logprobs is given)
        loss = sum_t l_t / num_tokens

    References:
    - GRPO, group-relative advantages and the k3 KL penalty to a reference policy: Shao et al. 2024,
      "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", arXiv:2402.03300.
    - Clipped surrogate objective: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
      arXiv:1707.06347.
    - Token-level normalisation over the whole step (every sampled token weighs the same, however long its
      sequence): Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
      arXiv:2503.14476.

    ``num_tokens`` is the number of sampled tokens of the whole optimizer step (all micro-batches); when None
    it defaults to this call's ``loss_mask.sum()``. Metrics (means over this call's sampled tokens):
    ``clip_frac`` (tokens where the clipped branch is active and its gradient is zero), ``ratio_mean``,
    ``approx_kl`` (k3 estimate of KL(old || new) from the sampled tokens), ``kl_ref`` (when a reference is
    given), ``pg_loss``, ``tokens``.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape):
        raise ValueError(
            "grpo_loss inputs must have equal shapes, got logprobs "
            f"{tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)}, advantages "
            f"{tuple(advantages.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    mask = loss_mask.to(torch.bool)
    local = int(mask.sum())
    denom = float(local if num_tokens is None else num_tokens)
    if denom <= 0:
        raise ValueError(f"num_tokens must be > 0 (sampled tokens in the step), got {denom}")
    fmask = mask.to(logprobs.dtype)
    zeros = torch.zeros_like(logprobs)
    # torch.where before arithmetic: NaN at unsampled positions must not leak into the sum or its gradient.
    lp = torch.where(mask, logprobs, zeros)
    old = torch.where(mask, old_logprobs.to(logprobs.dtype), zeros)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zeros)

    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    pg = -torch.minimum(surr1, surr2)
    per_token = pg
    kl_ref = None
    if ref_logprobs is not None and kl_coef != 0.0:
        ref = torch.where(mask, ref_logprobs.to(logprobs.dtype), zeros)
        kl_ref = _k3(ref - lp)
        per_token = per_token + kl_coef * kl_ref
    loss = (per_token * fmask).sum() / denom

    with torch.no_grad():
        n = max(local, 1)
        clipped = ((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        metrics = {
            "pg_loss": float((pg * fmask).sum()) / n,
            "clip_frac": float((clipped & mask).sum()) / n,
            "ratio_mean": float((ratio * fmask).sum()) / n,
            "approx_kl": float((_k3(log_ratio) * fmask).sum()) / n,
            "tokens": float(local),
        }
        if kl_ref is not None:
            metrics["kl_ref"] = float((kl_ref * fmask).sum()) / n
    return loss, metrics
