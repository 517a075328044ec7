"""grpo_loss on a hand-computed example: known ratios, clipping on both sides, token-level normalisation."""

import math

import pytest
import torch

from tandem.train.loss import grpo_loss

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
