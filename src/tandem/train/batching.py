"""Packing segments into micro-batches, and per-token logprobs of a packed row.

A micro-batch is ONE row (batch size 1) holding several sequences back to back, with ``position_ids`` that
restart at 0 for each sequence. transformers 5.x (``masking_utils.find_packed_sequence_indices``) turns such
position ids into a block-diagonal causal mask for sdpa/eager/flex (and varlen kernels for flash attention),
so attention never crosses sequences. It does so only when ``attention_mask is None`` and there is no KV
cache, hence :func:`token_logprobs` always calls the model with ``use_cache=False`` and no attention mask.

Invariants:
- Every sequence (one segment) lies wholly inside one micro-batch; a micro-batch holds at most
  ``micro_batch_tokens`` tokens unless it holds a single longer sequence alone.
- Per-token arrays are aligned with ``input_ids``: position ``i`` of ``loss_mask``/``sampler_logprobs``/
  ``advantages`` describes token ``i``. Token ``i`` with ``loss_mask == 1`` was sampled by the policy, so its
  logprob comes from the logits at position ``i - 1`` of the same sequence.
- A token with ``loss_mask == 1`` but a NaN sampler logprob was not sampled (e.g. injected by a harness): its
  loss_mask is set to 0.
- The first token of every sequence has nothing to condition on inside its sequence: its logprob is 0 and its
  loss_mask is forced to 0 (a segment never starts with a sampled token in practice).
- Packing is deterministic: same inputs, same micro-batches (first-fit decreasing, ties in input order).
- MoE routes travel with their tokens: a row holds ``routed_experts [L, moe_layers, top_k]`` when any of its
  segments has routes (``routes_known`` is False on the tokens of segments without, whose rows are filler),
  else None. ``routes_scored`` marks the tokens whose routing can change a trained logprob: known routes
  before the last trained token of their sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.records import Segment


@dataclass
class SequenceInput:
    """One sequence to pack: a segment, the advantage of its trajectory, and where it came from."""

    segment: Segment
    advantage: float
    group: int = 0
    trajectory: int = 0


@dataclass
class MicroBatch:
    """One packed row: ``input_ids``/``position_ids`` are ``[1, L]``; per-token tensors are ``[L]``."""

    input_ids: torch.Tensor  # int64 [1, L]
    position_ids: torch.Tensor  # int64 [1, L]
    loss_mask: torch.Tensor  # float32 [L]
    advantages: torch.Tensor  # float32 [L]
    sampler_logprobs: torch.Tensor  # float32 [L], NaN where not sampled
    versions: torch.Tensor  # int64 [L], the policy version that sampled each token, -1 where not sampled
    seq_index: torch.Tensor  # int64 [L], index into the list of packed sequences
    seq_ids: list[int]  # the sequences in this row, in order
    sampler_logmass: torch.Tensor | None = None  # float32 [L], top-p kept log mass; None: all 0
    temperature: torch.Tensor | None = None  # float32 [L], sampling temperature of each token; None: all 1
    routed_experts: torch.Tensor | None = None  # int64 [L, moe_layers, top_k], the sampler's expert ids
    routes_known: torch.Tensor | None = None  # bool [L], False where a segment had no routes (filler)
    routes_scored: torch.Tensor | None = None  # bool [L], known routes before a later trained token

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())


def plan_micro_batches(lengths: list[int], micro_batch_tokens: int) -> list[list[int]]:
    """Assign sequence indices to micro-batches (first-fit decreasing). Too-long sequences go alone."""
    if micro_batch_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be > 0, got {micro_batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max(micro_batch_tokens - n, 0))
    # Within a row keep input order: makes rows easy to read and independent of the fit order.
    return [sorted(b) for b in bins]


def pack(sequences: list[SequenceInput], micro_batch_tokens: int) -> list[MicroBatch]:
    """Pack sequences into micro-batches of at most ``micro_batch_tokens`` tokens (see module invariants)."""
    for k, s in enumerate(sequences):
        if len(s.segment) == 0:
            raise ValueError(f"sequence {k} (group {s.group}, trajectory {s.trajectory}) is empty; drop it")
    plan = plan_micro_batches([len(s.segment) for s in sequences], micro_batch_tokens)
    out = []
    for seq_ids in plan:
        ids, pos, mask, adv, slp, vers, sidx, lmass, temp = [], [], [], [], [], [], [], [], []
        for k in seq_ids:
            seg = sequences[k].segment
            n = len(seg)
            m = seg.loss_mask.astype(np.float32).copy()
            m[~np.isfinite(seg.sampler_logprobs)] = 0.0  # no sampler logprob: not sampled, never trained
            m[0] = 0.0
            ids.append(seg.token_ids.astype(np.int64))
            pos.append(np.arange(n, dtype=np.int64))
            mask.append(m)
            adv.append(np.full(n, sequences[k].advantage, np.float32))
            slp.append(seg.sampler_logprobs.astype(np.float32))
            vers.append(seg.versions.astype(np.int64))
            sidx.append(np.full(n, k, np.int64))
            lmass.append(seg.sampler_logmass if seg.sampler_logmass is not None else np.zeros(n, np.float32))
            temp.append(
                seg.sampler_temperature if seg.sampler_temperature is not None else np.ones(n, np.float32)
            )
        logmass = np.concatenate(lmass).astype(np.float32)
        temperature = np.concatenate(temp).astype(np.float32)
        routes = _pack_routes([sequences[k].segment for k in seq_ids], mask)
        out.append(
            MicroBatch(
                input_ids=torch.from_numpy(np.concatenate(ids))[None],
                position_ids=torch.from_numpy(np.concatenate(pos))[None],
                loss_mask=torch.from_numpy(np.concatenate(mask)),
                advantages=torch.from_numpy(np.concatenate(adv)),
                sampler_logprobs=torch.from_numpy(np.concatenate(slp)),
                versions=torch.from_numpy(np.concatenate(vers)),
                seq_index=torch.from_numpy(np.concatenate(sidx)),
                seq_ids=list(seq_ids),
                sampler_logmass=torch.from_numpy(logmass) if logmass.any() else None,
                temperature=torch.from_numpy(temperature) if (temperature != 1.0).any() else None,
                **routes,
            )
        )
    return out


def _pack_routes(segments: list[Segment], masks: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """The routing fields of one row (see module invariants); empty when no segment has routes."""
    given = [None if s.routed_experts is None else np.asarray(s.routed_experts) for s in segments]
    shapes = {r.shape[1:] for r in given if r is not None}
    if not shapes:
        return {}
    if any(len(sh) != 2 for sh in shapes):
        raise ValueError(f"routed_experts must be [tokens, moe_layers, top_k], got shapes {sorted(shapes)}")
    if len(shapes) > 1:
        raise ValueError(
            f"segments packed together have routes of different [layers, top_k]: {sorted(shapes)}"
        )
    layers, k = shapes.pop()
    rows, known, scored = [], [], []
    for seg, r, m in zip(segments, given, masks, strict=True):
        n = len(seg)
        if r is not None and r.shape[0] != n:
            raise ValueError(
                f"routed_experts has shape {r.shape}, the segment has {n} tokens; expected ({n}, ...)"
            )
        has = r is not None
        rows.append(r.astype(np.int64) if has else np.broadcast_to(np.arange(k), (n, layers, k)))
        known.append(np.full(n, has))
        trained = np.flatnonzero(m)
        scored.append(np.arange(n) < (trained[-1] if len(trained) and has else 0))
    return {
        "routed_experts": torch.from_numpy(np.ascontiguousarray(np.concatenate(rows), dtype=np.int64)),
        "routes_known": torch.from_numpy(np.concatenate(known)),
        "routes_scored": torch.from_numpy(np.concatenate(scored)),
    }


@dataclass
class LogprobOutput:
    """Per-token logprobs ``[L]`` (0 at each sequence's first token) and, if asked, entropies ``[L]``."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


def place_logprobs(mb: MicroBatch, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs ``[L]`` from next-token ones ``lp`` ``[L-1]`` (position i predicts token i+1):
    0 for a sequence's first token (no in-sequence context), minus the sampler's top-p log mass where
    sampled. Also returns ``first`` ``[L-1]`` (token i+1 starts a new sequence)."""
    first = mb.position_ids[0, 1:] == 0
    lp = torch.where(first, torch.zeros_like(lp), lp)
    lp = torch.cat([lp.new_zeros(1), lp])
    if mb.sampler_logmass is not None:
        lp = lp - torch.where(mb.loss_mask > 0, mb.sampler_logmass, torch.zeros_like(mb.sampler_logmass))
    return lp, first


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, with_entropy: bool = False) -> LogprobOutput:
    """Logprob of every token of a packed row given the tokens before it in the same sequence.

    ``out[i] = log_softmax(logits[i - 1] / T[i])[input_ids[i]] - logmass[i]`` for tokens that are not the
    first of their sequence, 0 for first tokens (the logits of the previous sequence's last token never
    cross into the next one); ``T`` and ``logmass`` are the row's sampling temperatures and top-p kept log
    masses (1 and 0 when the row has none), so the result is the same quantity as the sampler's logprob.
    Differentiable unless called under ``torch.no_grad``. The entropy (no grad) of the distribution that
    produced each sampled token is computed from the same logits when ``with_entropy`` (0 elsewhere).
    """
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits[0, :-1]
    logits = logits.float()
    if mb.temperature is not None:
        logits = logits / mb.temperature[1:, None]
    targets = mb.input_ids[0, 1:]
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets[:, None])[:, 0] - lse
    lp, first = place_logprobs(mb, lp)
    ent = None
    if with_entropy:
        with torch.no_grad():  # only at sampled positions: [sampled, V] instead of [L, V]
            sel = (mb.loss_mask[1:] > 0) & ~first
            logp = logits[sel] - lse[sel][:, None]
            ent = torch.zeros(mb.num_tokens, dtype=logits.dtype)
            ent[1:][sel] = -(logp.exp() * logp).sum(-1)
    return LogprobOutput(lp, ent)
