"""The policy-gradient trainer: groups in, one optimizer step, weights out through one publish seam.

The objective is ``train.loss`` (GRPO, DAPO, GSPO or CISPO, see ``tandem.train.loss``), optionally with an
off-policy correction against the sampler's logprobs (``train.is_correction``).

Invariants:
- Master weights and optimizer state are float32 (AdamW with ``TrainConfig`` lr/betas/weight_decay). The model
  runs in eval mode (no dropout). With the default one optimizer step per batch (``epochs = mini_batches =
  1``) the old logprobs (the trainer's own, under the pre-update weights) are the detached logprobs of the
  gradient forward itself: every ratio is exactly 1 and PPO clipping is inactive for this single step; no
  second pass. With ``epochs * mini_batches > 1`` a step is PPO proper: old logprobs from one no-grad pass
  before the first update, then ``epochs`` passes over ``mini_batches`` mini-batches of whole groups, one
  optimizer update each, each normalised over its own groups' sampled tokens.
- ``version`` is the number of ``step`` calls applied to the starting weights (0 = the base model, or what a
  checkpoint recorded). Every successful ``step`` increments it by exactly one, also when no trajectory
  carried signal; then the optimizer is not stepped (weights unchanged) and ``metrics["updated"] == 0``.
- Loss normalisation is token-level over the update: the denominator is the number of sampled tokens of all
  trajectories of all (non-empty) groups of the mini-batch (the whole step when ``mini_batches == 1``).
  Trajectories with zero advantage are dropped before the forward only when ``kl_coef == 0`` (then their
  gradient is exactly zero) and no masking correction is on, so dropping is a pure compute saving and never
  changes the update. With a masking correction (``mask_seq``, ``mask_geo``, ``icepop``) every trajectory is
  forwarded and the denominator is the number of *unmasked* sampled tokens of the update (masked tokens count
  as never sampled); ``is_masked_frac`` reports the share removed. With ``loss = "dapo"`` zero-variance groups
  (all rewards equal) are left out of the batch and of the denominator (DAPO's dynamic sampling, without
  refilling the batch). With ``mask_truncated`` a trajectory flagged ``truncated`` keeps its reward in the
  group's advantages but is not trained and its tokens leave the denominator (``truncated_masked_samples``
  counts them; they are also in ``dropped_samples``). A token with ``loss_mask == 1`` but no (finite)
  sampler logprob is never trained.
- Mismatch metrics, every step, over the sampled tokens that were forwarded, from the trainer's old
  (pre-update) logprobs and the sampler's: ``mismatch_kl_k1`` (mean of log p_sampler - log p_trainer, an
  unbiased estimate of KL(sampler || trainer) that can be negative), ``mismatch_kl_k3`` (= ``mismatch_kl``,
  mean of w - 1 - log w with w = p_trainer / p_sampler, >= 0), ``mismatch_abs_dlogp_mean``/``_max``,
  ``mismatch_ratio_out_frac`` (w outside ``MISMATCH_BAND``), ``mismatch_ess`` ((sum w)^2 / (n sum w^2), in
  (0, 1]; 1 when nothing was measured) and ``mismatch_tokens``. The sampler's logprob of a token is the one
  of the version that sampled it, up to ``orchestrator.max_staleness`` versions behind the trainer's, so in an
  async run these numbers add how far the policy moved since then to the numerical disagreement. Over only
  the tokens sampled by the version the trainer holds (numerics alone): ``mismatch_kl_k3_same_version``,
  ``mismatch_abs_dlogp_max_same_version`` and their count ``mismatch_same_version_tokens`` (both 0.0 when
  the count is 0, as in a step whose every token is stale). ``mismatch_pairs`` holds a deterministic,
  evenly spaced subsample of ``[p_sampler, p_trainer]`` pairs for the report (not a number: the run loop
  keeps it out of ``metrics.jsonl``).
- ``publish_state`` is the one seam through which weights leave the trainer: a dict of fresh numpy arrays
  (never views of live parameters) by HF state-dict name; tied weights appear once.
- Same checkpoint + same groups => bitwise the same next weights (model, optimizer, version, RNG restored).
- ``train.deterministic``: every policy forward (not the KL reference's) runs through
  ``tandem.train.deterministic`` (batch-invariant, the built-in engine's ops; parameters read through the
  publish dtype's rounding, gradient straight through to the fp32 masters), so with the engine's weights
  the mismatch metrics are exactly 0.
- MoE (``tandem.train.routing``): segments' ``routed_experts`` are validated before any forward (shape
  ``[tokens, moe_layers, top_k]`` of the model, else ValueError naming the shape); with
  ``train.router_replay = "r3"`` every policy forward (old-logprob pass and gradient passes) replays them;
  with ``"r2"`` the trainer records its own routes in the step's old pass (pre-update weights: the no-grad
  pass, or the single gradient pass) and every later forward/backward of the step replays those;
  ``routing_agreement`` (own router vs sampler), ``routing_used_agreement`` (experts used, replay included,
  vs sampler) and ``routes_recorded_frac`` are measured in the same pass as the mismatch metrics.

Global state: the constructor calls ``torch.manual_seed(config.seed)`` and
``torch.set_num_threads(config.threads)``; ``load_checkpoint`` restores the torch, numpy and Python global RNG
states. Nothing else global is touched.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tandem.core.config import TrainConfig
from tandem.core.errors import ModelLoadError
from tandem.core.records import Group, Segment
from tandem.train.advantages import group_advantages, is_zero_variance
from tandem.train.batching import LogprobOutput, MicroBatch, SequenceInput, pack, token_logprobs
from tandem.train.checkpoint import atomic_dir, read_state, verify_files, write_state
from tandem.train.deterministic import DeterministicLogprobs
from tandem.train.loss import LOSS_FUNCTIONS, Correction, clip_range
from tandem.train.routing import TrainerRouting, routing_metrics

log = logging.getLogger(__name__)

PUBLISH_DTYPES = ("float32", "bfloat16")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
"""Files copied verbatim from the base model directory into every exported model and checkpoint."""


def load_causal_lm(path: str | Path) -> PreTrainedModel:
    """Load a local HF causal LM in float32 (master weights)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model path {p} has no config.json; pass a local HF model directory")
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model from {p}: {e}") from e
    return model


def _split_mini_batches(
    chunks: list[tuple[list[SequenceInput], int]], mini_batches: int
) -> list[tuple[list[SequenceInput], int]]:
    """Deal groups round-robin into at most ``mini_batches`` mini-batches of (sequences, sampled tokens);
    mini-batches without a sequence to train on are left out."""
    out: list[tuple[list[SequenceInput], int]] = []
    for k in range(mini_batches):
        part = chunks[k::mini_batches]
        seqs = [s for group_seqs, _ in part for s in group_seqs]
        if seqs:
            out.append((seqs, sum(n for _, n in part)))
    return out


def _sampled_count(seg: Segment) -> int:
    """Sampled tokens that can be trained on: loss_mask 1 and a sampler logprob (a token without one was not
    sampled), except a segment's first token (no context; see batching)."""
    if len(seg) <= 1:
        return 0
    return int(((seg.loss_mask[1:] > 0) & np.isfinite(seg.sampler_logprobs[1:])).sum())


MISMATCH_BAND = (0.5, 2.0)
"""Tokens whose ratio p_trainer / p_sampler falls outside this band count in ``mismatch_ratio_out_frac``."""
MISMATCH_PAIRS = 2000
"""Most (p_sampler, p_trainer) pairs a step returns for the report's scatter plot."""


def _new_acc() -> dict[str, Any]:
    return {"ent": 0.0, "mis": 0.0, "mis_n": 0, "k1": 0.0, "abs": 0.0, "abs_max": 0.0, "out": 0, "w": 0.0,
            "w2": 0.0, "pairs": [], "same_mis": 0.0, "same_n": 0, "same_abs_max": 0.0}  # fmt: skip


def _mismatch_metrics(acc: dict[str, Any]) -> dict[str, Any]:
    """Sampler-vs-trainer mismatch over the sampled tokens seen by ``Trainer._observe`` (see ``Trainer``)."""
    n = acc["mis_n"]
    pairs: list[list[float]] = []
    if acc["pairs"]:
        allp = torch.cat(acc["pairs"]).numpy()
        idx = np.linspace(0, len(allp) - 1, min(len(allp), MISMATCH_PAIRS)).round().astype(np.int64)
        idx = np.unique(idx)
        pairs = allp[idx].tolist()
    return {
        "mismatch_kl": acc["mis"] / max(n, 1),
        "mismatch_kl_k1": acc["k1"] / max(n, 1),
        "mismatch_kl_k3": acc["mis"] / max(n, 1),
        "mismatch_abs_dlogp_mean": acc["abs"] / max(n, 1),
        "mismatch_abs_dlogp_max": acc["abs_max"],
        "mismatch_ratio_out_frac": acc["out"] / max(n, 1),
        "mismatch_ess": acc["w"] ** 2 / (n * acc["w2"]) if n and acc["w2"] > 0 else 1.0,
        "mismatch_tokens": n,
        "mismatch_kl_k3_same_version": acc["same_mis"] / max(acc["same_n"], 1),
        "mismatch_abs_dlogp_max_same_version": acc["same_abs_max"],
        "mismatch_same_version_tokens": acc["same_n"],
        "mismatch_pairs": pairs,
    }


class Trainer:
    """Policy-gradient trainer over a local HF causal LM (see module invariants).

    ``publish_dtype`` is "float32" (arrays are float32) or "bfloat16" (numpy has no bfloat16: arrays are
    ``uint16`` holding the bfloat16 bit patterns; ``torch.from_numpy(a).view(torch.bfloat16)`` recovers them).
    """

    def __init__(self, model_path: str, config: TrainConfig, publish_dtype: str = "float32") -> None:
        if publish_dtype not in PUBLISH_DTYPES:
            raise ValueError(f"publish_dtype must be one of {PUBLISH_DTYPES}, got {publish_dtype!r}")
        self.model_path = Path(model_path)
        self.config = config
        self.publish_dtype = publish_dtype
        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.model = load_causal_lm(self.model_path)
        self.model.eval()
        self.routing = TrainerRouting(self.model, config.router_replay)
        # train.deterministic: the policy's logprobs through the batch-invariant forward the engine uses.
        hooks = self.routing.hooks
        self._det = (
            DeterministicLogprobs(self.model, publish_dtype, hooks.process if hooks is not None else None)
            if config.deterministic
            else None
        )
        self.ref_model: PreTrainedModel | None = None
        if config.kl_coef != 0.0:
            self.ref_model = load_causal_lm(self.model_path)  # the initial policy, also after a resume
            self.ref_model.eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay
        )
        self.loss_fn = LOSS_FUNCTIONS[config.loss]
        self.clip_low, self.clip_high = clip_range(
            config.loss, config.clip_eps, config.clip_eps_low, config.clip_eps_high
        )
        self.correction = Correction(config.is_correction, config.is_clip, tuple(config.icepop_band))
        self.version = 0
        self._publish_names, self.tied_names = self._plan_publish()

    # ------------------------------------------------------------------ training
    def step(self, groups: list[Group]) -> dict[str, Any]:
        """One training step on these groups (``epochs * mini_batches`` optimizer updates); returns metrics
        (see the class invariants for edge cases). Every value is a number except ``mismatch_pairs``, a
        deterministic subsample (at most ``MISMATCH_PAIRS``) of ``[p_sampler, p_trainer]`` token pairs."""
        if not groups:
            raise ValueError("Trainer.step got an empty list of groups; pass at least one Group")
        t0 = time.perf_counter()
        cfg = self.config
        for gi, g in enumerate(groups):  # bad routes fail the step before anything changes
            for ti, t in enumerate(g.trajectories):
                for si, seg in enumerate(t.segments):
                    self.routing.check(seg, f"group {gi} ({g.task_id}) trajectory {ti} segment {si}")
        # Dropping zero-advantage trajectories is free only when their tokens can change nothing else: no KL
        # term, and no masking correction (whose denominator needs each trajectory's unmasked token count).
        drop_zero = cfg.kl_coef == 0.0 and not self.correction.masks
        chunks: list[tuple[list[SequenceInput], int]] = []  # per non-empty group: its sequences, sampled
        rewards: list[float] = []
        total_sampled = samples = zero_groups = skipped_groups = dropped = truncated_masked = 0
        for gi, g in enumerate(groups):
            r = g.rewards()
            rewards.extend(r.tolist())
            counts = [sum(_sampled_count(s) for s in t.segments) for t in g.trajectories]
            if sum(counts) == 0:
                skipped_groups += 1
                continue
            zero_var = is_zero_variance(r)
            zero_groups += int(zero_var)
            if zero_var and cfg.loss == "dapo":  # DAPO dynamic sampling: out of the batch and the denominator
                samples += len(counts)
                total_sampled += sum(counts)
                dropped += len(counts)
                continue
            adv = group_advantages(r)
            group_seqs: list[SequenceInput] = []
            group_sampled = 0
            for ti, t in enumerate(g.trajectories):
                samples += 1
                total_sampled += counts[ti]
                if cfg.mask_truncated and t.flags.get("truncated", False):  # overlong filtering
                    truncated_masked += 1
                    dropped += 1
                    continue
                group_sampled += counts[ti]
                if counts[ti] == 0 or (drop_zero and adv[ti] == 0.0):
                    dropped += 1
                    continue
                for seg in t.segments:
                    if _sampled_count(seg):
                        group_seqs.append(SequenceInput(seg, float(adv[ti]), gi, ti))
            chunks.append((group_seqs, group_sampled))
        rw = np.asarray(rewards, np.float64)
        metrics: dict[str, Any] = {
            "loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0,
            "entropy": 0.0, "mismatch_kl": 0.0, "tokens": 0, "sampled_tokens": total_sampled,
            "trained_tokens": 0, "samples": samples, "dropped_samples": dropped, "groups": len(groups),
            "zero_adv_groups": zero_groups, "skipped_groups": skipped_groups, "micro_batches": 0,
            "truncated_masked_samples": truncated_masked,
            "reward_mean": float(rw.mean()) if rw.size else 0.0,
            "reward_std": float(rw.std()) if rw.size else 0.0, "updated": 0, "updates": 0,
            **_mismatch_metrics(_new_acc()), "is_masked_frac": 0.0,
        }  # fmt: skip
        mini = _split_mini_batches(chunks, cfg.mini_batches)
        if mini:
            self._update(mini, metrics)
        self.version += 1
        metrics["version"] = self.version
        metrics["step_time_s"] = time.perf_counter() - t0
        return metrics

    def _update(self, mini: list[tuple[list[SequenceInput], int]], metrics: dict[str, Any]) -> None:
        """``epochs`` passes over the mini-batches, one optimizer update per mini-batch."""
        cfg = self.config
        packed = [(pack(seqs, cfg.micro_batch_tokens), n) for seqs, n in mini]
        single = cfg.epochs == 1 and len(packed) == 1
        acc = _new_acc()
        self.routing.begin_step()
        olds: list[list[torch.Tensor]] = []
        v = self.version  # the weights' version until this step's first update
        if not single:
            # Old logprobs under the weights before the first update, from a no-grad pass.
            with torch.no_grad():
                for mbs, _ in packed:
                    olds.append([self._observe(self._logprobs(m, True, acc, True), m, acc, v) for m in mbs])
        weighted = {"clip_frac": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0, "kl_ref": 0.0}
        if self.correction.kind == "tis":
            weighted.update(is_weight_mean=0.0, is_clipped_frac=0.0)
        masks = self.correction.masks
        w_tokens = loss_sum = norm_sum = masked = 0.0
        updates = 0
        for _ in range(cfg.epochs):
            for k, (mbs, n) in enumerate(packed):
                self.optimizer.zero_grad(set_to_none=True)
                # A masking correction makes the denominator the update's unmasked tokens, known only once
                # every micro-batch was seen: sum the losses, then divide the gradient (tandem.train.loss).
                denom = 1.0 if masks else n
                kept = update_loss = 0.0
                for j, mb in enumerate(mbs):
                    out = self._logprobs(mb, single, acc if single else None, old=single)
                    lp = out.logprobs
                    # With one update per step the old logprobs equal this forward pass exactly, so they are
                    # taken from it (detached) instead of from a second, bit-identical no-grad pass.
                    old = self._observe(out, mb, acc, v) if single else olds[k][j]
                    ref = None
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref = token_logprobs(self.ref_model, mb).logprobs
                    loss, m = self.loss_fn(
                        lp, old, mb.advantages, mb.loss_mask, self.clip_low, ref_logprobs=ref,
                        kl_coef=cfg.kl_coef, num_tokens=denom, clip_eps_high=self.clip_high,
                        sampler_logprobs=mb.sampler_logprobs, seq_index=mb.seq_index,
                        correction=self.correction,
                    )  # fmt: skip
                    loss.backward()
                    update_loss += float(loss.detach())
                    kept += m["tokens"]
                    masked += m.get("masked_tokens", 0.0)
                    w_tokens += m["tokens"]
                    for key in weighted:
                        weighted[key] += m.get(key, 0.0) * m["tokens"]
                if masks:
                    if kept == 0:  # every token of the update was masked: nothing to learn from
                        self.optimizer.zero_grad(set_to_none=True)
                        continue
                    for p in self.params:
                        if p.grad is not None:
                            p.grad.div_(kept)
                    update_loss /= kept
                loss_sum += update_loss
                norm_sum += self._optimizer_step(metrics)
                updates += 1
        if self.ref_model is None:
            del weighted["kl_ref"]
        trained = sum(mb.num_sampled for mbs, _ in packed for mb in mbs)
        n = max(trained, 1)
        metrics.update({k: v / max(w_tokens, 1.0) for k, v in weighted.items()})
        metrics.update(_mismatch_metrics(acc))
        metrics.update(routing_metrics(acc))
        metrics.update(
            loss=loss_sum / max(updates, 1),
            grad_norm=norm_sum / max(updates, 1),
            tokens=sum(mb.num_tokens for mbs, _ in packed for mb in mbs),
            trained_tokens=trained,
            micro_batches=sum(len(mbs) for mbs, _ in packed),
            entropy=acc["ent"] / n,
            updates=updates,
            is_masked_frac=masked / max(masked + w_tokens, 1.0),
        )

    def _logprobs(
        self, mb: MicroBatch, with_entropy: bool, acc: dict[str, Any] | None, old: bool = False
    ) -> LogprobOutput:
        """The policy's token logprobs of ``mb`` (sampler routes replayed under r3; under r2 own routes
        recorded when ``old``, the step's old pass, and replayed otherwise; routing metrics into ``acc``)."""
        with self.routing.forward(mb, acc, old):
            if self._det is not None:
                return self._det(mb, with_entropy=with_entropy)
            return token_logprobs(self.model, mb, with_entropy=with_entropy)

    @staticmethod
    def _observe(out: LogprobOutput, mb: MicroBatch, acc: dict[str, Any], version: int) -> torch.Tensor:
        """Accumulate entropy and trainer-vs-sampler mismatch of a forward under the weights of ``version``
        (separately, too, over the tokens sampled at that same version); return detached logprobs."""
        old = out.logprobs.detach()
        if out.entropy is not None:
            acc["ent"] += float((out.entropy.detach() * mb.loss_mask).sum())
        ok = (mb.loss_mask > 0) & torch.isfinite(mb.sampler_logprobs)
        log_ratio = old[ok] - mb.sampler_logprobs[ok]  # log p_trainer - log p_sampler
        acc["mis"] += float((torch.expm1(log_ratio) - log_ratio).sum())
        acc["mis_n"] += int(ok.sum())
        lr64 = log_ratio.double()
        w = torch.exp(lr64)  # importance weight p_trainer / p_sampler
        acc["k1"] -= float(lr64.sum())
        acc["abs"] += float(lr64.abs().sum())
        if lr64.numel():
            acc["abs_max"] = max(acc["abs_max"], float(lr64.abs().max()))
        acc["out"] += int(((w < MISMATCH_BAND[0]) | (w > MISMATCH_BAND[1])).sum())
        same = (mb.versions[ok] == version).to(torch.float64)  # sampled by the weights the trainer holds
        if (n_same := int(same.sum())) > 0:
            acc["same_mis"] += float(((torch.expm1(lr64) - lr64) * same).sum())
            acc["same_n"] += n_same
            acc["same_abs_max"] = max(acc["same_abs_max"], float((lr64.abs() * same).max()))
        acc["w"] += float(w.sum())
        acc["w2"] += float((w * w).sum())
        acc["pairs"].append(torch.stack([mb.sampler_logprobs[ok].double().exp(), old[ok].double().exp()], 1))
        return old

    def _optimizer_step(self, metrics: dict[str, float]) -> float:
        """Clip, step (unless the gradient is not finite) and clear; returns the pre-clip grad norm."""
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            metrics["updated"] = 1
        else:  # one bad batch must not destroy the weights: skip it and say so
            log.warning("non-finite grad norm %s at version %d: update skipped", grad_norm, self.version)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ------------------------------------------------------------------ publishing
    def _plan_publish(self) -> tuple[list[str], dict[str, str]]:
        names: list[str] = []
        tied: dict[str, str] = {}
        seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key in seen:
                tied[name] = seen[key]
            else:
                seen[key] = name
                names.append(name)
        return names, tied

    def publish_state(self) -> dict[str, np.ndarray]:
        """All parameters and persistent buffers by HF state-dict name, as fresh numpy arrays in the publish
        dtype (bfloat16 as uint16 bit patterns, see the class docstring). Tied weights appear once, under the
        first name in state-dict order; ``self.tied_names`` maps each omitted name to the published one."""
        sd = self.model.state_dict()
        out: dict[str, np.ndarray] = {}
        with torch.no_grad():
            for name in self._publish_names:
                t = sd[name].detach()
                if t.is_floating_point():
                    if self.publish_dtype == "bfloat16":
                        out[name] = t.to(torch.bfloat16).contiguous().view(torch.uint16).numpy().copy()
                    else:
                        out[name] = t.to(torch.float32).contiguous().numpy().copy()
                else:
                    out[name] = t.contiguous().numpy().copy()
        return out

    # ------------------------------------------------------------------ checkpoints
    def _write_model_dir(self, path: Path) -> None:
        self.model.save_pretrained(path)
        for name in TOKENIZER_FILES:
            src = self.model_path / name
            if src.is_file():
                shutil.copy2(src, path / name)

    def export_model(self, path: str | Path) -> Path:
        """Atomically write an HF model directory (float32 weights, config, base model tokenizer files)."""
        with atomic_dir(path) as tmp:
            self._write_model_dir(tmp)
        return Path(path)

    def save_checkpoint(self, path: str | Path, run_state: dict[str, Any] | None = None) -> Path:
        """Atomically write a resumable checkpoint that is also a loadable HF model directory. ``run_state``
        (JSON values, e.g. the run's ``task_cursor``) is kept in ``trainer_state.json`` beside the trainer's
        own state, for the run that resumes from it."""
        with atomic_dir(path) as tmp:
            self._write_model_dir(tmp)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
            np_state = np.random.get_state(legacy=False)
            np_state["state"]["key"] = np_state["state"]["key"].tolist()
            py_state = random.getstate()
            (tmp / "rng.json").write_text(json.dumps({"numpy": np_state, "python": py_state}))
            write_state(
                tmp,
                {
                    "version": self.version,
                    "base_model": str(self.model_path),
                    "publish_dtype": self.publish_dtype,
                    "config": self.config.model_dump(mode="json"),
                    **(run_state or {}),
                },
            )
        return Path(path)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore model, optimizer, version and RNG states written by ``save_checkpoint``.

        Everything is read and checked before anything is changed: a mismatched checkpoint raises and leaves
        the trainer as it was."""
        path = Path(path)
        state = read_state(path)
        verify_files(path, state)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(path / f)))
        own = self.model.state_dict()
        missing = [k for k in own if k not in sd and k not in self.tied_names]
        unexpected = [k for k in sd if k not in own]
        shapes = [k for k in sd if k in own and sd[k].shape != own[k].shape]
        if missing or unexpected or shapes:
            raise ValueError(
                f"checkpoint {path} does not match the model from {self.model_path}: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shape {shapes[:5]}; resume with the run's base model"
            )
        optim_state = torch.load(path / "optimizer.pt", weights_only=True)
        rng = torch.load(path / "rng.pt", weights_only=True)
        rj = json.loads((path / "rng.json").read_text())
        self.model.load_state_dict(sd, strict=False)
        self.optimizer.load_state_dict(optim_state)
        for group in self.optimizer.param_groups:  # this run's settings, not the saved ones (a resume may
            group["lr"] = self.config.lr  # change them: the run prints what differs)
            group["betas"] = tuple(self.config.betas)
            group["weight_decay"] = self.config.weight_decay
        torch.set_rng_state(rng["torch"])
        np_state = rj["numpy"]
        np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
        np.random.set_state(np_state)
        py = rj["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        self.version = int(state["version"])
        if state.get("config") != self.config.model_dump(mode="json"):
            log.warning("resuming %s with a different train config than it was saved with", path)
        return state
