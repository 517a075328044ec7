"""Trainer on a real tiny Qwen3: learning a rewarded token, publish seam, edge cases of a step, every loss and
off-policy correction, mismatch metrics."""

import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tandem.core.config import TrainConfig
from tandem.core.records import Group, Reward, SegmentBuilder, Trajectory
from tandem.train.trainer import Trainer

VOCAB = 512
REWARDED = 256  # reward 1 when the first sampled token id is < REWARDED (about half the mass at init)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


def _config(**kw):
    base = dict(lr=1e-2, micro_batch_tokens=64, seed=0, threads=1)
    base.update(kw)
    return TrainConfig(**base)


PROMPTS = [[11, 22, 33], [44, 55, 66, 77], [88, 99]]


def sample_groups(model, version, G=8, n_new=2, seed=0):
    """Sample G completions per prompt from the model itself with plain torch (temperature 1)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for pi, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt] * G)
        lps = []
        with torch.no_grad():
            for _ in range(n_new):
                logp = torch.log_softmax(model(ids, use_cache=False).logits[:, -1].float(), -1)
                tok = torch.multinomial(logp.exp(), 1, generator=gen)
                lps.append(logp.gather(-1, tok)[:, 0])
                ids = torch.cat([ids, tok], 1)
        trajs = []
        for g in range(G):
            b = SegmentBuilder()
            b.add_context(prompt)
            new = ids[g, len(prompt) :].tolist()
            b.add_sampled(new, [float(lp[g]) for lp in lps], [version] * n_new)
            trajs.append(Trajectory(f"p{pi}", [b.build()], Reward(1.0 if new[0] < REWARDED else 0.0)))
        groups.append(Group(f"p{pi}", trajs))
    return groups


def rewarded_mass(model):
    with torch.no_grad():
        probs = [torch.softmax(model(torch.tensor([p])).logits[0, -1], -1)[:REWARDED].sum() for p in PROMPTS]
    return float(torch.stack(probs).mean())


def test_steps_increase_probability_of_rewarded_tokens(model_dir):
    trainer = Trainer(model_dir, _config(lr=3e-2))
    before = rewarded_mass(trainer.model)
    for step in range(4):
        m = trainer.step(sample_groups(trainer.model, trainer.version, seed=step))
        assert m["updated"] == 1 and m["version"] == step + 1 == trainer.version
        assert m["groups"] == 3 and m["samples"] == 24 and m["sampled_tokens"] == 48
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
        # sampler logprobs came from the same weights: the trainer recomputes them (almost) exactly
        assert m["mismatch_kl"] < 1e-6
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["clip_frac"] == 0.0
    after = rewarded_mass(trainer.model)
    assert before < 0.55 and after > before + 0.2, (before, after)  # ~0.50 -> ~0.85


def test_micro_batch_size_does_not_change_the_step(model_dir):
    groups = sample_groups(Trainer(model_dir, _config()).model, 0)
    small = Trainer(model_dir, _config(micro_batch_tokens=8)).step(groups)
    big = Trainer(model_dir, _config(micro_batch_tokens=4096)).step(groups)
    assert small["micro_batches"] > big["micro_batches"] == 1
    assert small["loss"] == pytest.approx(big["loss"], abs=1e-6)
    assert small["grad_norm"] == pytest.approx(big["grad_norm"], rel=1e-5)


def test_ppo_epochs_and_mini_batches(model_dir):
    """epochs x mini_batches updates per step; the first update equals a one-update step on its own groups;
    later updates see ratios != 1 (the old logprobs are from before the first update)."""
    groups = sample_groups(Trainer(model_dir, _config()).model, 0)
    ppo = Trainer(model_dir, _config(lr=3e-2, epochs=2, mini_batches=2))
    m = ppo.step(groups)
    assert m["updates"] == 4 and m["updated"] == 1 and m["version"] == 1
    assert m["ratio_mean"] != pytest.approx(1.0, abs=1e-6) and m["approx_kl"] > 0
    assert m["mismatch_kl"] < 1e-6  # the no-grad pre-pass reproduces the sampler's logprobs

    # One epoch, two mini-batches: the first update uses groups 0 and 2 (round-robin), exactly like a
    # single-update step on those groups alone.
    split = Trainer(model_dir, _config(lr=3e-2, mini_batches=2))
    alone = Trainer(model_dir, _config(lr=3e-2))
    first = [groups[0], groups[2]]
    split_first = _params_after_first_update(split, groups)
    alone.step(first)
    for a, b in zip(split_first, alone.params, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)


def _params_after_first_update(trainer, groups):
    snapshots = []
    original = trainer._optimizer_step

    def record(metrics):
        norm = original(metrics)
        if not snapshots:
            snapshots.append([p.detach().clone() for p in trainer.params])
        return norm

    trainer._optimizer_step = record
    m = trainer.step(groups)
    assert m["updates"] == 2
    return snapshots[0]


def _fixed_group(rewards, sampled=True):
    trajs = []
    for i, r in enumerate(rewards):
        b = SegmentBuilder()
        b.add_context([1, 2, 3 + i])
        if sampled:
            b.add_sampled([7, 8], [-6.0, -6.0], [0, 0])
        trajs.append(Trajectory("t", [b.build()], Reward(r)))
    return Group("t", trajs)


def test_edge_cases_empty_no_tokens_and_zero_variance(model_dir):
    trainer = Trainer(model_dir, _config())
    with pytest.raises(ValueError, match="empty list of groups"):
        trainer.step([])
    before = {k: v.copy() for k, v in trainer.publish_state().items()}
    m = trainer.step([_fixed_group([1, 1, 1]), _fixed_group([0, 1], sampled=False)])
    assert m["updated"] == 0 and m["zero_adv_groups"] == 1 and m["skipped_groups"] == 1
    assert m["dropped_samples"] == 3 and m["tokens"] == 0 and trainer.version == 1
    after = trainer.publish_state()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # no signal: weights unchanged
    m = trainer.step([_fixed_group([1, 0, 0.5]), _fixed_group([1, 1])])
    # the 0.5 trajectory has advantage 0 and is dropped, but its tokens still count in the denominator
    assert m["updated"] == 1 and m["dropped_samples"] == 3 and m["sampled_tokens"] == 10
    assert m["trained_tokens"] == 4 and m["zero_adv_groups"] == 1


def _truncated_group(last_sampled=True):
    """Rewards [1, 0, 0]; the last trajectory is flagged truncated (with its tokens, or none sampled)."""
    g = _fixed_group([1, 0, 0])
    if not last_sampled:
        b = SegmentBuilder()
        b.add_context([1, 2, 5, 7, 8])
        g.trajectories[2] = Trajectory("t", [b.build()], Reward(0))
    g.trajectories[2].flags["truncated"] = True
    return g


def test_mask_truncated_trains_as_if_the_truncated_tokens_were_never_sampled(model_dir):
    """Overlong filtering: the truncated trajectory keeps its reward in the advantages (the others' update
    is the one of a 3-sample group), but none of its tokens is trained or in the denominator."""
    masked = Trainer(model_dir, _config())  # on by default
    m = masked.step([_truncated_group()])
    assert m["truncated_masked_samples"] == 1 and m["dropped_samples"] == 1
    assert m["trained_tokens"] == 4 and m["sampled_tokens"] == 6 and m["updated"] == 1
    unsampled = Trainer(model_dir, _config(mask_truncated=False))
    u = unsampled.step([_truncated_group(last_sampled=False)])
    assert u["truncated_masked_samples"] == 0 and u["trained_tokens"] == 4
    a, b = masked.publish_state(), unsampled.publish_state()
    assert all(np.array_equal(a[k], b[k]) for k in a)  # bit-identical updates
    plain = Trainer(model_dir, _config(mask_truncated=False)).step([_truncated_group()])  # off: flag ignored
    assert plain["truncated_masked_samples"] == 0 and plain["trained_tokens"] == 6


def test_kl_to_reference_keeps_zero_advantage_samples(model_dir):
    trainer = Trainer(model_dir, _config(kl_coef=0.1))
    m = trainer.step([_fixed_group([1, 0, 0.5])])
    assert m["dropped_samples"] == 0 and m["trained_tokens"] == 6 and m["kl_ref"] == pytest.approx(0.0)
    m = trainer.step([_fixed_group([1, 0, 0.5])])
    assert m["kl_ref"] > 0  # the policy moved away from the reference


def test_publish_state_names_and_values(model_dir):
    trainer = Trainer(model_dir, _config())
    trainer.step(sample_groups(trainer.model, 0))
    sd = trainer.model.state_dict()
    pub = trainer.publish_state()
    assert set(pub) | set(trainer.tied_names) == set(sd)
    assert trainer.tied_names == {"lm_head.weight": "model.embed_tokens.weight"}
    for name, arr in pub.items():
        assert arr.dtype == np.float32 and np.array_equal(arr, sd[name].numpy())
    # published arrays are copies: a later step does not change them
    snapshot = {k: v.copy() for k, v in pub.items()}
    trainer.step(sample_groups(trainer.model, 1, seed=1))
    assert all(np.array_equal(snapshot[k], pub[k]) for k in pub)


def test_publish_bfloat16_as_uint16_bits(model_dir):
    trainer = Trainer(model_dir, _config(), publish_dtype="bfloat16")
    pub = trainer.publish_state()
    sd = trainer.model.state_dict()
    for name, arr in pub.items():
        assert arr.dtype == np.uint16
        torch.testing.assert_close(torch.from_numpy(arr).view(torch.bfloat16), sd[name].to(torch.bfloat16))
    with pytest.raises(ValueError, match="publish_dtype"):
        Trainer(model_dir, _config(), publish_dtype="float16")


MISMATCH_KEYS = (
    "mismatch_kl", "mismatch_kl_k1", "mismatch_kl_k3", "mismatch_abs_dlogp_mean", "mismatch_abs_dlogp_max",
    "mismatch_ratio_out_frac", "mismatch_ess", "mismatch_tokens", "mismatch_kl_k3_same_version",
    "mismatch_abs_dlogp_max_same_version", "mismatch_same_version_tokens",
)  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        dict(loss="grpo"),
        dict(loss="dapo"),
        dict(loss="gspo"),
        dict(loss="cispo"),
        dict(is_correction="tis"),
        dict(is_correction="mask_seq"),
        dict(is_correction="mask_geo"),
        dict(loss="gspo", is_correction="icepop"),
    ],
)
def test_each_loss_and_correction_runs_a_step_and_mismatch_is_zero(model_dir, kw):
    trainer = Trainer(model_dir, _config(**kw))
    groups = sample_groups(trainer.model, 0)
    m = trainer.step(groups)
    assert m["updated"] == 1 and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    # sampler logprobs came from the same weights: every mismatch metric is ~0 and nothing is masked
    assert all(k in m for k in MISMATCH_KEYS)
    assert m["mismatch_kl_k3"] == m["mismatch_kl"] < 1e-6 and abs(m["mismatch_kl_k1"]) < 1e-5
    assert m["mismatch_abs_dlogp_max"] < 1e-4 and m["mismatch_ratio_out_frac"] == 0.0
    assert m["mismatch_ess"] == pytest.approx(1.0, abs=1e-6) and m["is_masked_frac"] == 0.0
    assert m["mismatch_same_version_tokens"] == m["mismatch_tokens"]  # all sampled by version 0
    assert m["mismatch_kl_k3_same_version"] == pytest.approx(m["mismatch_kl_k3"], rel=1e-9, abs=1e-15)
    pairs = m["mismatch_pairs"]
    assert 0 < len(pairs) <= m["mismatch_tokens"]
    assert np.allclose(pairs, np.asarray(pairs)[:, ::-1], atol=1e-4)  # p_sampler ~ p_trainer


def test_mismatch_metrics_and_icepop_on_perturbed_sampler_logprobs(model_dir):
    groups = sample_groups(Trainer(model_dir, _config()).model, 0)
    seg = groups[0].trajectories[0].segments[0]
    seg.sampler_logprobs[seg.loss_mask > 0] += 1.0  # 2 tokens: p_trainer / p_sampler = e^-1 ~ 0.37 < 0.5
    m = Trainer(model_dir, _config(is_correction="icepop")).step(groups)
    # icepop forwards every trajectory (48 sampled tokens) and masks the 2 perturbed ones
    assert m["mismatch_tokens"] == 48 and m["trained_tokens"] == 48
    assert m["mismatch_ratio_out_frac"] == pytest.approx(2 / 48)
    assert m["is_masked_frac"] == pytest.approx(2 / 48)
    assert m["mismatch_kl_k1"] == pytest.approx(2 / 48, rel=1e-3)  # mean(log p_sampler - log p_trainer)
    k3 = math.exp(-1) - 1 - (-1)  # w - 1 - log w with log w = -1
    assert m["mismatch_kl_k3"] == pytest.approx(2 * k3 / 48, rel=1e-3)
    assert m["mismatch_abs_dlogp_max"] == pytest.approx(1.0, abs=1e-4)
    w = np.array([math.exp(-1)] * 2 + [1.0] * 46)
    assert m["mismatch_ess"] == pytest.approx(w.sum() ** 2 / (48 * (w**2).sum()), rel=1e-4)


def test_tokens_of_an_older_version_are_left_out_of_the_same_version_mismatch(model_dir):
    """In an async run a token's sampler logprob may come from an older version: the policy's move since
    then shows in the overall mismatch, and only tokens the trainer's own version sampled in the
    same-version one (the numerical disagreement alone)."""
    trainer = Trainer(model_dir, _config())
    trainer.step(sample_groups(trainer.model, 0))  # now at version 1
    groups = sample_groups(trainer.model, 1, seed=1)  # sampled by the weights the trainer holds
    seg = groups[0].trajectories[0].segments[0]
    sampled = seg.loss_mask > 0
    seg.sampler_logprobs[sampled] += 1.0  # as if version 0 had given these 2 tokens more probability
    seg.versions[sampled] = 0
    m = trainer.step(groups)
    assert m["mismatch_tokens"] == 48 and m["mismatch_same_version_tokens"] == 46
    assert m["mismatch_abs_dlogp_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["mismatch_kl_k3"] == pytest.approx(2 * (math.exp(-1) - 1 + 1) / 48, rel=1e-3)
    assert m["mismatch_abs_dlogp_max_same_version"] < 1e-4 and m["mismatch_kl_k3_same_version"] < 1e-6


def test_masking_normalises_like_grpo_when_nothing_is_masked_and_dapo_filters_groups(model_dir):
    groups = [_fixed_group([1, 1, 1]), _fixed_group([1, 0])]  # 6 zero-advantage tokens + 4 with signal
    grpo = Trainer(model_dir, _config()).step(groups)
    # icepop forwards the zero-advantage trajectories too, to count their unmasked tokens: the same gradient
    ice = Trainer(model_dir, _config(is_correction="icepop")).step(groups)
    assert ice["is_masked_frac"] == 0.0 and ice["trained_tokens"] == 10 and grpo["trained_tokens"] == 4
    assert ice["grad_norm"] == pytest.approx(grpo["grad_norm"], rel=1e-5)
    # DAPO leaves the zero-variance group out of the batch and the denominator: 4 tokens instead of 10
    dapo = Trainer(model_dir, _config(loss="dapo")).step(groups)
    assert dapo["zero_adv_groups"] == 1 and dapo["dropped_samples"] == 3 and dapo["sampled_tokens"] == 10
    assert dapo["grad_norm"] == pytest.approx(grpo["grad_norm"] * 10 / 4, rel=1e-5)
