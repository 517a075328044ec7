"""Trainer-side MoE routing: Rollout Routing Replay (R3) and sampler-vs-trainer routing agreement.

R3 ("Stabilizing MoE RL by Aligning Training and Inference Routers", arXiv 2510.11370): the trainer's
forward and backward send every token to the experts the sampler chose for it (``Segment.routed_experts``),
mixing them with the trainer's own router softmax gathered at those experts (renormalised when the model
does), so the router keeps its gradient while the expert choice matches inference (``tandem.model.moe``).

Invariants:
- ``TrainerRouting`` is built once per trainer; ``router_replay = "r3"`` on a model without top-k routers is
  refused there with the reason. Hooks sit on the policy model only (the KL reference model routes itself).
- ``check`` validates a segment's routes before any forward: shape ``[tokens, moe_layers, top_k]`` of the
  model and ids in ``[0, num_experts)``; routes on a dense model are refused too. Errors name the shape.
- Replay uses the routes of a micro-batch row (``MicroBatch.routed_experts``); tokens of segments without
  routes (``routes_known`` False) keep the trainer's own routing and are counted in
  ``routes_recorded_frac``.
- ``routing_agreement`` = fraction of (token, MoE layer) pairs whose top-k expert *set* chosen by the
  trainer's router (before any replay) equals the sampler's, over ``routes_scored`` tokens (those whose
  routing can change a trained logprob), measured in the same pass as the mismatch metrics (pre-update
  weights). Reported only when some forwarded segment carried routes (and had a token to score).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tandem.core.records import Segment
from tandem.model.moe import MoeShape, RouterHooks, moe_shape
from tandem.train.batching import MicroBatch


class TrainerRouting:
    """Routing hooks of one trainer's policy model (see module invariants)."""

    def __init__(self, model: Any, mode: str) -> None:
        if mode not in ("off", "r3"):
            raise ValueError(f"train.router_replay must be 'off' or 'r3', got {mode!r}")
        self.shape: MoeShape | None = moe_shape(model)
        if mode == "r3" and self.shape is None:
            raise ValueError(
                f"train.router_replay='r3' needs a mixture-of-experts model, but {type(model).__name__} has "
                "no top-k router modules; use train.router_replay='off' for dense models"
            )
        self.replay = mode == "r3"
        self.hooks = RouterHooks(model) if self.shape is not None else None

    def check(self, seg: Segment, where: str) -> None:
        """Raise ValueError if ``seg``'s routes do not fit this model (``where`` names the segment)."""
        r = seg.routed_experts
        if r is None:
            return
        r = np.asarray(r)
        if self.shape is None:
            raise ValueError(
                f"{where}: routed_experts of shape {r.shape} but the model has no MoE layers; drop the "
                "routes or train the MoE model that produced them"
            )
        want = (len(seg), self.shape.layers, self.shape.top_k)
        if r.shape != want:
            raise ValueError(
                f"{where}: routed_experts has shape {r.shape}, expected {want} ([tokens, moe_layers, top_k] "
                "of this model); the routes come from a different model or were cut"
            )
        if r.dtype.kind not in "iu":
            raise ValueError(f"{where}: routed_experts has dtype {r.dtype}; expected integer expert ids")
        if r.size and (int(r.min()) < 0 or int(r.max()) >= self.shape.num_experts):
            raise ValueError(
                f"{where}: routed_experts holds expert ids in [{int(r.min())}, {int(r.max())}], outside "
                f"[0, {self.shape.num_experts}) of this model"
            )

    @contextmanager
    def forward(self, mb: MicroBatch, acc: dict[str, Any] | None = None) -> Iterator[None]:
        """Run one forward of ``mb`` inside: replays its routes under r3; with ``acc``, accumulates the
        routing metrics of this forward into it."""
        hooks = self.hooks
        if hooks is None:
            yield
            return
        routes = mb.routed_experts
        hooks.clear()
        if self.replay and routes is not None:
            hooks.replay = routes.view(-1, *routes.shape[-2:])
            known = mb.routes_known
            hooks.replay_mask = None if known is None or bool(known.all()) else known
        try:
            yield
        finally:
            hooks.replay, hooks.replay_mask = None, None
        if acc is None:
            return
        acc["route_tokens"] = acc.get("route_tokens", 0) + mb.num_tokens
        if routes is None or mb.routes_scored is None or mb.routes_known is None:
            return
        acc["route_known"] = acc.get("route_known", 0) + int(mb.routes_known.sum())
        own = hooks.own().view(routes.shape)
        sel = mb.routes_scored
        same = (own[sel].sort(-1).values == routes[sel].sort(-1).values).all(-1)  # [scored, layers]
        acc["route_agree"] = acc.get("route_agree", 0) + int(same.sum())
        acc["route_pairs"] = acc.get("route_pairs", 0) + int(same.numel())
        acc["route_seen"] = True


def routing_metrics(acc: dict[str, Any]) -> dict[str, float]:
    """``routing_agreement`` and ``routes_recorded_frac`` from the accumulator of ``TrainerRouting.forward``
    (empty when no forwarded segment carried routes)."""
    if not acc.get("route_seen"):
        return {}
    out = {"routes_recorded_frac": acc.get("route_known", 0) / max(acc.get("route_tokens", 0), 1)}
    if acc.get("route_pairs", 0):
        out["routing_agreement"] = acc["route_agree"] / acc["route_pairs"]
    return out


__all__ = ["TrainerRouting", "routing_metrics"]
