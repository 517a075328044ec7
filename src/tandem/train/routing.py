"""Trainer-side MoE routing: Routing Replay (R2, R3) and sampler-vs-trainer routing agreement.

R3 ("Stabilizing MoE RL by Aligning Training and Inference Routers", arXiv 2510.11370): the trainer's
forward and backward send every token to the experts the sampler chose for it (``Segment.routed_experts``),
mixing them with the trainer's own router softmax gathered at those experts (renormalised when the model
does), so the router keeps its gradient while the expert choice matches inference (``tandem.model.moe``).

R2 (the "Routing Replay" of GSPO / Qwen3 RL, called R2 in the R3 paper above, which compares both): the
trainer records the experts its *own* router picks in the step's first forward, under the pre-update ("old")
weights (the pass that yields the old logprobs and the mismatch metrics), and replays them in every later
forward and backward of that step (all mini-batches and epochs), so each PPO ratio pi_new / pi_old compares
the same expert choice even after updates moved the router. It needs no routes from the sampler (works with
any engine) but does not align the trainer with the sampler. With one update per step (``epochs =
mini_batches = 1``) the old pass is the only forward, so R2 replays nothing.

Invariants:
- ``TrainerRouting`` is built once per trainer; ``router_replay = "r3"`` or ``"r2"`` on a model without
  top-k routers is refused there with the reason. Hooks sit on the policy model only (the KL reference model
  routes itself).
- R2: ``begin_step`` forgets the previous step's records; a forward with ``old=True`` records the routers'
  own choice for that micro-batch (nothing replayed); every other forward of the step replays that record
  for all tokens of the row (a forward of a micro-batch with no record is a RuntimeError).
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
import torch

from tandem.core.records import Segment
from tandem.model.moe import MoeShape, RouterHooks, moe_shape
from tandem.train.batching import MicroBatch

MODES = ("off", "r3", "r2")
"""Values of ``train.router_replay``."""


class TrainerRouting:
    """Routing hooks of one trainer's policy model (see module invariants)."""

    def __init__(self, model: Any, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"train.router_replay must be one of {', '.join(MODES)}, got {mode!r}")
        self.shape: MoeShape | None = moe_shape(model)
        if mode != "off" and self.shape is None:
            raise ValueError(
                f"train.router_replay={mode!r} needs a mixture-of-experts model, but {type(model).__name__} "
                "has no top-k router modules; use train.router_replay='off' for dense models"
            )
        self.mode = mode
        self.replay = mode == "r3"
        self.hooks = RouterHooks(model) if self.shape is not None else None
        self._old: dict[int, tuple[MicroBatch, Any]] = {}  # R2: id(mb) -> (mb, own routes [L, layers, k])

    def begin_step(self) -> None:
        """Forget the routes recorded by the previous step's old pass (R2)."""
        self._old = {}

    def recorded(self, mb: MicroBatch) -> Any:
        """R2: the routes recorded for ``mb`` by this step's old pass (torch int64 ``[L, layers, top_k]``)."""
        rec = self._old.get(id(mb))
        if rec is None or rec[0] is not mb:
            raise RuntimeError(
                "train.router_replay='r2' replays the routes the trainer recorded in the step's old pass, "
                "but this micro-batch had no old-pass forward in the current step"
            )
        return rec[1]

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
    def forward(self, mb: MicroBatch, acc: dict[str, Any] | None = None, old: bool = False) -> Iterator[None]:
        """Run one forward of ``mb`` inside: replays the sampler's routes under r3; under r2 records the
        trainer's own routes when ``old`` (the step's old pass) and replays that record otherwise; with
        ``acc``, accumulates the routing metrics of this forward into it."""
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
        elif self.mode == "r2" and not old:
            hooks.replay = self.recorded(mb)
        try:
            yield
        finally:
            hooks.replay, hooks.replay_mask = None, None
        if self.mode == "r2" and old:
            self._old[id(mb)] = (mb, hooks.own())
        if acc is None:
            return
        acc["route_tokens"] = acc.get("route_tokens", 0) + mb.num_tokens
        if routes is None or mb.routes_scored is None or mb.routes_known is None:
            return
        acc["route_known"] = acc.get("route_known", 0) + int(mb.routes_known.sum())
        own = hooks.own().view(routes.shape)
        sel = mb.routes_scored
        same = (own[sel].sort(-1).values == routes[sel].sort(-1).values).all(-1)  # [scored, layers]
        used = torch.where(mb.routes_known[..., None, None], routes, own) if self.replay else own
        used_same = (used[sel].sort(-1).values == routes[sel].sort(-1).values).all(-1)
        acc["route_used_agree"] = acc.get("route_used_agree", 0) + int(used_same.sum())
        acc["route_agree"] = acc.get("route_agree", 0) + int(same.sum())
        acc["route_pairs"] = acc.get("route_pairs", 0) + int(same.numel())
        acc["route_seen"] = True


def routing_metrics(acc: dict[str, Any]) -> dict[str, float]:
    """``routing_agreement`` (the trainer's own router vs the sampler), ``routing_used_agreement`` (the
    experts the trainer's forward used, replayed ones included, vs the sampler's: 1.0 under r3 when every
    token has routes) and ``routes_recorded_frac`` from the accumulator of ``TrainerRouting.forward``
    (empty when no forwarded segment carried routes)."""
    if not acc.get("route_seen"):
        return {}
    out = {"routes_recorded_frac": acc.get("route_known", 0) / max(acc.get("route_tokens", 0), 1)}
    if acc.get("route_pairs", 0):
        out["routing_agreement"] = acc["route_agree"] / acc["route_pairs"]
        out["routing_used_agreement"] = acc.get("route_used_agree", 0) / acc["route_pairs"]
    return out


__all__ = ["MODES", "TrainerRouting", "routing_metrics"]
