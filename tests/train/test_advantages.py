"""Group-relative advantages, including zero-variance groups."""

import numpy as np
import pytest

from tandem.core.records import Group, Reward, Segment, Trajectory
from tandem.train.advantages import compute_advantages, group_advantages, is_zero_variance


def test_mean_centred_and_std_normalised():
    adv = group_advantages(np.array([0.0, 1.0, 1.0, 0.0]))
    assert adv.dtype == np.float32
    # mean 0.5, population std 0.5
    np.testing.assert_allclose(adv, np.array([-1, 1, 1, -1]) * 0.5 / (0.5 + 1e-6), rtol=1e-6)
    assert adv.sum() == pytest.approx(0.0, abs=1e-6)


def test_without_std_normalisation():
    adv = group_advantages(np.array([0.0, 0.5, 1.0]), normalize_std=False)
    np.testing.assert_allclose(adv, [-0.5, 0.0, 0.5], atol=1e-7)


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0], [0.3], []])
def test_zero_variance_gives_exact_zeros(rewards):
    adv = group_advantages(np.array(rewards))
    assert adv.shape == (len(rewards),) and np.all(adv == 0.0)
    assert is_zero_variance(np.array(rewards))


def test_inputs_not_modified_and_bad_input_rejected():
    r = np.array([1.0, 2.0, 3.0])
    group_advantages(r)
    assert r.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="finite"):
        group_advantages(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(np.zeros((2, 2)))


def _group(rewards):
    return Group("t", [Trajectory("t", [Segment.empty()], Reward(r)) for r in rewards])


def test_compute_advantages_counts_zero_variance_groups():
    step = compute_advantages([_group([1, 0, 1, 0]), _group([1, 1, 1, 1]), _group([0, 0, 0, 0])])
    assert step.zero_adv_groups == 2
    assert len(step.per_group) == 3 and np.all(step.per_group[1] == 0) and np.any(step.per_group[0] != 0)
