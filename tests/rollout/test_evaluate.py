import math

import pytest

from tandem.rollout.evaluate import pass_at_k


def test_pass_at_k_matches_the_closed_form():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(4, 1, 5)
