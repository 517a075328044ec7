"""The entropy bound H(p) + p*H(change) (``tandem.weights.bound``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.weights.bound import entropy_bound_bits


def h(p: float) -> float:
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def test_bound_of_a_known_distribution():
    n = 100_000
    prev = np.zeros(n, np.float32)
    cur = prev.copy()
    cur[: n // 10] = np.float32(1e-45)  # one ulp up from +0.0
    cur[n // 10 : n // 5] = np.float32(-0.0)  # one step down (-0.0 sorts just below +0.0)
    expect = h(0.2) + 0.2 * 1.0  # two equally likely changes: one bit each
    assert entropy_bound_bits(prev, cur) == pytest.approx(expect, rel=1e-9)
    assert entropy_bound_bits(prev, prev) == 0.0
    assert entropy_bound_bits(np.zeros(0, np.float32), np.zeros(0, np.float32)) == 0.0


def test_pooled_bound_merges_change_values_across_tensors():
    a = np.zeros(1000, np.uint16) + 0x3C00
    b = a.copy()
    b[:100] += 1
    pooled = entropy_bound_bits({"x": a, "y": a}, {"x": b, "y": b})
    assert pooled == pytest.approx(h(0.1), rel=1e-9)  # one change value everywhere: H(change) = 0
    per_tensor = entropy_bound_bits({"x": a, "y": a.copy()}, {"x": b, "y": a.copy()}, per_tensor=True)
    assert per_tensor == pytest.approx(h(0.1) / 2, rel=1e-9)
    with pytest.raises(ValueError, match="same tensor names"):
        entropy_bound_bits({"x": a}, {"z": b})


def test_other_dtypes_count_changed_elements():
    prev = np.arange(10, dtype=np.int64)
    cur = prev.copy()
    cur[3] = 99
    assert entropy_bound_bits(prev, cur) == pytest.approx(h(0.1), rel=1e-9)
    c128 = np.zeros(4, np.complex128)
    assert entropy_bound_bits(c128, c128 + 1j) == 0.0  # all four change the same way
