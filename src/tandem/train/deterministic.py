"""The trainer's deterministic forward (``train.deterministic``): logprobs of a packed micro-batch that are
bitwise equal to the built-in engine's sampler logprobs of the same tokens.

The packed row is unpacked into right-padded sequences (positions restart at 0 per sequence, exactly as the
engine caches them), run through ``tandem.model.deterministic.forward_tokens`` (the same batch-invariant
primitives ``FastRunner`` uses in deterministic mode), and each sampled token's logprob is
``log_softmax(logits / temperature)[token] - logmass``, the sampler's own ops. Differentiable (plain torch
ops); gradients are not batch-invariant (they need not be).

Weights: engines compute in float32 on the weights as published. When the trainer publishes bfloat16 (the
delta transport), the engines hold the bf16 rounding of the fp32 master weights, so this forward reads every
parameter through the same rounding (``RoundTo``: forward = the published values exactly, gradient passed
straight through to the fp32 masters). Then trainer and sampler compute on identical weights and their
logprobs agree bit for bit; the update itself still lands on the fp32 masters.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.model import deterministic as det
from tandem.train.batching import LogprobOutput, MicroBatch, place_logprobs

_TYPES = {"qwen3", "qwen2", "llama", "qwen3_moe"}


def unsupported(model: torch.nn.Module) -> str | None:
    """None if the deterministic forward can run this model, else the reason (the engine's fast path
    covers the same models)."""
    cfg = model.config
    if cfg.model_type not in _TYPES:
        return f"model_type {cfg.model_type!r} is not one of {sorted(_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers are not supported"
    if cfg.model_type == "qwen3_moe" and not all(
        det.is_moe_layer(layer) or hasattr(layer.mlp, "gate_proj") for layer in model.model.layers
    ):
        return "a layer's MLP is neither dense SwiGLU nor top-k routed experts"
    return None


class RoundTo(torch.autograd.Function):
    """``x`` rounded to ``dtype`` and back (the values an engine receives); identity gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


_PUBLISH = {"float32": None, "bfloat16": torch.bfloat16}


class DeterministicLogprobs:
    """``token_logprobs`` of one policy model in deterministic mode (keeps its RoPE table).
    ``publish_dtype``: the precision engines receive the weights in (see the module docstring).
    ``route_fn``: MoE models, called with every layer's routing of the packed row's tokens in packed order
    (the trainer passes its ``RouterHooks.process``, so R3/R2 replay and routing metrics work as with the
    HF forward)."""

    def __init__(
        self, model: torch.nn.Module, publish_dtype: str = "float32", route_fn: det.RouteFn | None = None
    ) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(
                f"train.deterministic cannot run this model: {reason}; set train.deterministic=false"
            )
        self.model = model
        self.route_fn = route_fn
        low = _PUBLISH[publish_dtype]
        self._cast = (lambda t: t) if low is None else (lambda t: RoundTo.apply(t, low))
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def _table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < n:
            size = max(n, int(getattr(self.model.config, "max_position_embeddings", 0) or 0))
            self._rope = det.rope_table(self.model, size)
        return self._rope

    def logits(self, mb: MicroBatch) -> torch.Tensor:
        """Logits ``[L, V]`` of every position of the packed row (each sequence sees only itself)."""
        pos = mb.position_ids[0]
        starts = torch.nonzero(pos == 0)[:, 0].tolist()
        ends = [*starts[1:], mb.num_tokens]
        lens = [e - s for s, e in zip(starts, ends, strict=True)]
        t = max(lens)
        ids = torch.zeros((len(starts), t), dtype=torch.long)
        for j, (s, e) in enumerate(zip(starts, ends, strict=True)):
            ids[j, : e - s] = mb.input_ids[0, s:e]
        seq = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(lens))
        cos, sin = self._table(t)
        out = det.forward_tokens(self.model, ids, cos, sin, self._cast, (seq, pos), self.route_fn)
        return out[seq, pos]

    def __call__(self, mb: MicroBatch, with_entropy: bool = False) -> LogprobOutput:
        """As ``tandem.train.batching.token_logprobs`` (same output contract), with the sampler's ops."""
        logits = self.logits(mb)[:-1]
        n = logits.shape[0]
        temps = mb.temperature[1:] if mb.temperature is not None else torch.ones(n, dtype=torch.float32)
        targets = mb.input_ids[0, 1:]
        lp, first = place_logprobs(mb, det.token_logprob(logits, temps, targets))
        ent = None
        if with_entropy:
            with torch.no_grad():
                sel = (mb.loss_mask[1:] > 0) & ~first
                logp = torch.log_softmax(logits[sel] / temps[sel].unsqueeze(1), dim=-1)
                ent = torch.zeros(mb.num_tokens, dtype=logits.dtype)
                ent[1:][sel] = -(logp.exp() * logp).sum(-1)
        return LogprobOutput(lp, ent)
