"""The loss family and the off-policy corrections on hand-computed examples: known ratios, clipping on both
sides, sequence-level ratios, stop-gradient weights, masking and the normalisation after it, NaN handling."""

import math

import pytest
import torch

from tandem.train.loss import (
    LOSS_FUNCTIONS,
    LOSSES,
    Correction,
    cispo_loss,
    clip_range,
    dapo_loss,
    grpo_loss,
    gspo_loss,
)

# Old logprobs 0, so ratio = exp(logprob). clip_eps = 0.2.
#  t0: ratio 1.5, A=+1 -> min(1.5, 1.2) = 1.2, loss -1.2, clipped (upper side), no gradient
#  t1: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8, loss 0.8, clipped (lower side), no gradient
#  t2: ratio 1.1, A=+2 -> inside the range, loss -2.2, d loss/d logprob = -A * ratio = -2.2
#  t3: ratio 0.5, A=+1 -> min(0.5, 0.8) = 0.5 (the unclipped, pessimistic branch), loss -0.5, grad -0.5
#  t4: not sampled (mask 0), NaN values must be ignored
RATIOS = [1.5, 0.5, 1.1, 0.5, 1.0]
ADV = [1.0, -1.0, 2.0, 1.0, 0.0]
MASK = [1, 1, 1, 1, 0]
EXPECTED_SUM = -1.2 + 0.8 - 2.2 - 0.5


def _inputs():
    lp = torch.tensor([math.log(r) for r in RATIOS], dtype=torch.float32)
    lp[4] = float("nan")
    lp.requires_grad_(True)
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan")])
    return lp, old, torch.tensor(ADV), torch.tensor(MASK, dtype=torch.float32)


def test_hand_computed_loss_gradient_and_metrics():
    lp, old, adv, mask = _inputs()
    loss, m = grpo_loss(lp, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(EXPECTED_SUM / 4, abs=1e-6)
    loss.backward()
    expected_grad = [0.0, 0.0, -2.2 / 4, -0.5 / 4, 0.0]
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx(expected_grad, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5) / 4, abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in RATIOS[:4]) / 4
    assert m["approx_kl"] == pytest.approx(k3, abs=1e-6)
    assert m["tokens"] == 4


def test_normalisation_is_over_the_step_not_the_micro_batch():
    lp, old, adv, mask = _inputs()
    loss, _ = grpo_loss(lp, old, adv, mask, clip_eps=0.2, num_tokens=10)
    assert loss.item() == pytest.approx(EXPECTED_SUM / 10, abs=1e-6)
    # Split into two micro-batches with the step's token count: the sum equals the whole-step loss.
    a, b = slice(0, 2), slice(2, 5)
    la, _ = grpo_loss(lp[a], old[a], adv[a], mask[a], clip_eps=0.2, num_tokens=4)
    lb, _ = grpo_loss(lp[b], old[b], adv[b], mask[b], clip_eps=0.2, num_tokens=4)
    assert (la + lb).item() == pytest.approx(EXPECTED_SUM / 4, abs=1e-6)


def test_k3_kl_to_reference():
    lp, old, adv, mask = _inputs()
    ref = torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan")])
    loss, m = grpo_loss(lp, old, adv, mask, clip_eps=0.2, ref_logprobs=ref, kl_coef=0.1)
    # k3 = exp(ref - lp) - (ref - lp) - 1 = 1/r + log r - 1 per token
    k3 = [1 / r + math.log(r) - 1 for r in RATIOS[:4]]
    assert m["kl_ref"] == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert loss.item() == pytest.approx((EXPECTED_SUM + 0.1 * sum(k3)) / 4, abs=1e-6)
    # kl_coef 0 ignores the reference entirely
    loss0, m0 = grpo_loss(lp, old, adv, mask, clip_eps=0.2, ref_logprobs=ref, kl_coef=0.0)
    assert loss0.item() == pytest.approx(EXPECTED_SUM / 4, abs=1e-6) and "kl_ref" not in m0


def test_identical_policies_give_ratio_one_and_no_clipping():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    loss, m = grpo_loss(lp, lp.clone(), torch.tensor([1.0, -1.0, 0.5]), torch.ones(3), clip_eps=0.2)
    assert loss.item() == pytest.approx(-(1.0 - 1.0 + 0.5) / 3)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == 1.0 and m["approx_kl"] == 0.0


def test_bad_inputs_name_the_problem():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="equal shapes"):
        grpo_loss(x, torch.zeros(2), x, x, clip_eps=0.2)
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(x, x, x, x, clip_eps=0.2)  # nothing sampled and no step count given
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_loss(x, x, x, torch.ones(3), clip_eps=0.0)


# ---------------------------------------------------------------------------------------------- loss family
def _t(values, grad=False):
    t = torch.tensor(values, dtype=torch.float32)
    return t.requires_grad_(True) if grad else t


def test_dapo_clip_higher_hand_computed():
    # Old logprobs 0, ratio = exp(logprob); clip below 0.2, above 0.28 (the paper's): range [0.8, 1.28].
    #  t0: ratio 1.25, A=+1 -> inside (GRPO's 1.2 would clip it): loss -1.25, grad -A*ratio = -1.25
    #  t1: ratio 1.5,  A=+1 -> min(1.5, 1.28) = 1.28: loss -1.28, clipped, grad 0
    #  t2: ratio 0.7,  A=-1 -> min(-0.7, -0.8) = -0.8: loss 0.8, clipped, grad 0
    #  t3: ratio 0.9,  A=-2 -> inside: loss 1.8, grad -A*ratio = 1.8
    # token-level mean: (-1.25 - 1.28 + 0.8 + 1.8) / 4 = 0.07 / 4
    lp = _t([math.log(r) for r in (1.25, 1.5, 0.7, 0.9)], grad=True)
    loss, m = dapo_loss(lp, torch.zeros(4), _t([1, 1, -1, -2]), torch.ones(4), 0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(0.07 / 4, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.25 / 4, 0.0, 0.0, 1.8 / 4], abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)
    # grpo_loss with the symmetric range [0.8, 1.2] clips t0 too: (-1.2 - 1.2 + 0.8 + 1.8) / 4
    g, _ = grpo_loss(lp.detach(), torch.zeros(4), _t([1, 1, -1, -2]), torch.ones(4), 0.2)
    assert g.item() == pytest.approx((-1.2 - 1.2 + 0.8 + 1.8) / 4, abs=1e-6)


def test_gspo_sequence_ratio_hand_computed():
    # Three sequences of a prompt token (not sampled, NaN) and two sampled tokens; old logprobs 0, clip 0.2.
    #  seq 0: log ratios  0.1, -0.1 -> s = exp(mean) = 1,          A=+1: l = -1 per token, grad -A*s/2*2 = -1
    #  seq 1: log ratios  0.3,  0.1 -> s = exp(0.2) = 1.2214028,  A=-1: min(-1.2214, -1.2) = -1.2214 (the
    #         pessimistic, unclipped branch): l = +1.2214028 per token, grad per token -A*s = +1.2214028
    #  seq 2: same ratios, A=+1: min(1.2214, 1.2) = 1.2 (clipped): l = -1.2 per token, no gradient
    # Each token's gradient is -A*s (d s / d lp_t = s / 2, times the 2 tokens sharing s); loss over 6 tokens.
    nan = float("nan")
    lp = _t([nan, 0.1, -0.1, nan, 0.3, 0.1, nan, 0.3, 0.1], grad=True)
    old = _t([nan, 0, 0, nan, 0, 0, nan, 0, 0])
    adv = _t([1, 1, 1, -1, -1, -1, 1, 1, 1])
    mask = _t([0, 1, 1, 0, 1, 1, 0, 1, 1])
    seq = torch.tensor([0, 0, 0, 5, 5, 5, 9, 9, 9])  # ids need not be contiguous (packed rows)
    s = math.exp(0.2)
    loss, m = gspo_loss(lp, old, adv, mask, 0.2, seq_index=seq)
    assert loss.item() == pytest.approx((-2 + 2 * s - 2 * 1.2) / 6, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0, -1 / 6, -1 / 6, 0, s / 6, s / 6, 0, 0, 0], abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 6) and m["tokens"] == 6
    assert m["ratio_mean"] == pytest.approx((2 + 4 * s) / 6, abs=1e-6)
    with pytest.raises(ValueError, match="seq_index"):
        gspo_loss(lp, old, adv, mask, 0.2)


def test_cispo_clipped_stop_gradient_weight_hand_computed():
    # Old logprobs -1; ratios 1.5, 0.5, 1.1; clip 0.2 -> weights sg(clip(r, 0.8, 1.2)) = 1.2, 0.8, 1.1.
    #  t0: lp = -1 + ln 1.5 = -0.5945349, A=+1: l = -1.2 * 1 * lp = 0.7134419, grad -w*A = -1.2
    #  t1: lp = -1 + ln 0.5 = -1.6931472, A=-1: l = -0.8 * -1 * lp = -1.3545177, grad -w*A = 0.8
    #  t2: lp = -1 + ln 1.1 = -0.9046898, A=+2: l = -1.1 * 2 * lp = 1.9903175, grad -w*A = -2.2
    # Unlike PPO, the clipped tokens t0 and t1 keep a (bounded) gradient.
    lp = _t([-1 + math.log(r) for r in (1.5, 0.5, 1.1)], grad=True)
    loss, m = cispo_loss(lp, _t([-1, -1, -1]), _t([1, -1, 2]), torch.ones(3), 0.2)
    assert loss.item() == pytest.approx((0.7134419 - 1.3545177 + 1.9903175) / 3, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.2 / 3, 0.8 / 3, -2.2 / 3], abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------------ off-policy corrections
def _sampler_for(old, ws):
    """Sampler logprobs that make p_old_trainer / p_sampler equal ``ws`` (NaN stays NaN)."""
    return torch.tensor([o - math.log(w) if w == w else float("nan") for o, w in zip(old, ws, strict=True)])


def test_truncated_is_weights_hand_computed_and_nan_sampler_tokens_are_not_trained():
    # Ratio current/old = 1 (lp == old), so each token's loss is -A and its gradient -A, times the weight.
    # w = p_old/p_sampler = 0.5, 1, 3, 1.5 -> TIS weights min(w, 2) = 0.5, 1, 2, 1.5. A = 1, 1, 1, -1.
    # loss = (-0.5 - 1 - 2 + 1.5) / 4 = -0.5; grads -A*w/4 = -0.125, -0.25, -0.5, 0.375.
    # Token 4 has loss_mask 1 but no sampler logprob: not sampled, so not trained and not counted.
    old = [-1.0, -1.0, -1.0, -1.0, -2.0]
    lp = _t(old, grad=True)
    slp = _sampler_for(old, [0.5, 1.0, 3.0, 1.5, float("nan")])
    corr = Correction("tis", clip=2.0)
    loss, m = grpo_loss(lp, _t(old), _t([1, 1, 1, -1, 5]), torch.ones(5), 0.2, sampler_logprobs=slp,
                        correction=corr)  # fmt: skip
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.125, -0.25, -0.5, 0.375, 0.0], abs=1e-6)
    assert m["tokens"] == 4 and m["masked_tokens"] == 0
    assert m["is_weight_mean"] == pytest.approx(1.25, abs=1e-6) and m["is_clipped_frac"] == 0.25


def test_icepop_masks_tokens_and_normalises_by_unmasked_tokens():
    # Band [0.5, 5]: w = 0.4 and 6.0 are outside -> masked; 0.6, 2.0, 4.5 kept. A = 1: loss -1 per kept token.
    # Normalised by the 3 unmasked tokens: loss = -3/3 = -1; grads -1/3 on kept tokens, 0 on masked ones.
    old = [-1.0] * 5
    slp = _sampler_for(old, [0.4, 0.6, 2.0, 4.5, 6.0])
    lp = _t(old, grad=True)
    corr = Correction("icepop", band=(0.5, 5.0))
    loss, m = grpo_loss(lp, _t(old), torch.ones(5), torch.ones(5), 0.2, sampler_logprobs=slp, correction=corr)
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0, -1 / 3, -1 / 3, -1 / 3, 0], abs=1e-6)
    assert m["tokens"] == 3 and m["masked_tokens"] == 2 and m["masked_frac"] == pytest.approx(0.4)
    # Split into micro-batches with the update's unmasked count: the sum equals the whole update.
    a, b = slice(0, 2), slice(2, 5)
    la, _ = grpo_loss(lp[a], _t(old[a]), torch.ones(2), torch.ones(2), 0.2, num_tokens=3,
                      sampler_logprobs=slp[a], correction=corr)  # fmt: skip
    lb, _ = grpo_loss(lp[b], _t(old[b]), torch.ones(3), torch.ones(3), 0.2, num_tokens=3,
                      sampler_logprobs=slp[b], correction=corr)  # fmt: skip
    assert (la + lb).item() == pytest.approx(-1.0, abs=1e-6)


@pytest.mark.parametrize(
    "kind, expected_loss, expected_grad, kept",
    [
        # seq 0 (A=+1): w 2, 2 -> product 4, geometric mean 2: kept by both.
        # seq 1 (A=+2): w 3, 3 -> product 9 (outside [0.5, 5]: masked by mask_seq), geometric mean 3 (kept).
        # seq 2 (A=-1): w 0.3, 0.3 -> product 0.09 and geometric mean 0.3: masked by both.
        # mask_seq keeps 2 tokens: loss (-1 - 1) / 2 = -1, grads -A/2 on seq 0.
        # mask_geo keeps 4 tokens: loss (-1 - 1 - 2 - 2) / 4 = -1.5, grads -A/4 on seqs 0 and 1.
        ("mask_seq", -1.0, [0, -1 / 2, -1 / 2, 0, 0, 0, 0, 0, 0], 2),
        ("mask_geo", -1.5, [0, -1 / 4, -1 / 4, 0, -2 / 4, -2 / 4, 0, 0, 0], 4),
    ],
)
def test_sequence_masking_hand_computed(kind, expected_loss, expected_grad, kept):
    nan = float("nan")
    old = [-1.0] * 9
    slp = _sampler_for(old, [nan, 2, 2, nan, 3, 3, nan, 0.3, 0.3])  # prompt tokens: no sampler logprob
    lp = _t(old, grad=True)
    adv = _t([1, 1, 1, 2, 2, 2, -1, -1, -1])
    mask = _t([0, 1, 1, 0, 1, 1, 0, 1, 1])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    corr = Correction(kind, band=(0.5, 5.0))
    loss, m = grpo_loss(lp, _t(old), adv, mask, 0.2, sampler_logprobs=slp, seq_index=seq, correction=corr)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx(expected_grad, abs=1e-6)
    assert m["tokens"] == kept and m["masked_frac"] == pytest.approx((6 - kept) / 6)
    with pytest.raises(ValueError, match="seq_index"):
        grpo_loss(lp, _t(old), adv, mask, 0.2, sampler_logprobs=slp, correction=corr)


def test_everything_masked_gives_zero_loss_and_no_gradient():
    old = [-1.0, -1.0]
    lp = _t(old, grad=True)
    slp = _sampler_for(old, [10.0, 20.0])
    loss, m = cispo_loss(lp, _t(old), torch.ones(2), torch.ones(2), 0.2, sampler_logprobs=slp,
                         correction=Correction("icepop"))  # fmt: skip
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.tolist() == [0.0, 0.0] and m["masked_frac"] == 1.0


def test_no_correction_with_sampler_logprobs_is_bit_identical():
    lp, old, adv, mask = _inputs()
    slp = torch.tensor([-0.1, -0.2, -0.3, -0.4, float("nan")])
    a, _ = grpo_loss(lp, old, adv, mask, clip_eps=0.2)
    b, _ = grpo_loss(lp, old, adv, mask, clip_eps=0.2, sampler_logprobs=slp, seq_index=torch.zeros(5).long(),
                     correction=Correction("none"))  # fmt: skip
    assert a.item() == b.item()


def test_clip_ranges_and_bad_corrections():
    assert clip_range("grpo", 0.2, None, None) == (0.2, 0.2)
    assert clip_range("dapo", 0.2, None, None) == (0.2, 0.28)
    assert clip_range("gspo", 0.2, None, None) == (3e-4, 4e-4)
    assert clip_range("cispo", 0.2, None, 0.5) == (1.0, 0.5)
    assert clip_range("dapo", 0.2, 0.1, 0.3) == (0.1, 0.3)
    assert set(LOSS_FUNCTIONS) == set(LOSSES)
    with pytest.raises(ValueError, match="band"):
        Correction("icepop", band=(5.0, 0.5))
    with pytest.raises(ValueError, match="kind"):
        Correction("psis")
    with pytest.raises(ValueError, match="sampler_logprobs"):
        grpo_loss(
            torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2), 0.2, correction=Correction("tis")
        )
