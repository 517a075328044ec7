"""The entropy lower bound of a weight delta: ``H(p) + p * H(change)`` bits per parameter.

``p`` is the fraction of elements whose bits changed and ``H(change)`` the empirical entropy of the changes:
``key(cur) - key(prev)`` in ordered-key space for float16/bfloat16/float32 (mostly +-1 ulp), the unsigned
difference of the bit patterns for other dtypes up to 8 bytes, and the XOR pattern beyond that. For a dict of
tensors the bound is pooled over all elements (one ``p``, one change histogram), as the issue defines it;
``per_tensor=True`` sums each tensor's own bound instead (lower, since entropy is concave).
"""

from __future__ import annotations

import numpy as np

from tandem.weights.blob import key_spec
from tandem.weights.tables import entropy_bits


def _keys(bits: np.ndarray, sign: int, mask: int) -> np.ndarray:
    b = bits.astype(np.int64)
    return np.where(b & sign, b ^ mask, b | sign)


def change_values(prev: np.ndarray, cur: np.ndarray) -> tuple[int, np.ndarray | None, np.ndarray]:
    """(number of elements, distinct change values, their counts) of one tensor pair; the values are None
    for dtypes wider than 8 bytes (their XOR patterns are counted but not merged across tensors)."""
    n = int(prev.size)
    spec = key_spec(prev.dtype)
    p = np.require(prev, requirements="C").reshape(-1)
    c = np.require(cur, requirements="C").reshape(-1)
    if spec is not None:
        pb, cb = p.view(spec.bits_dtype), c.view(spec.bits_dtype)
        idx = np.flatnonzero(pb != cb)
        d = _keys(cb[idx], spec.sign, spec.mask) - _keys(pb[idx], spec.sign, spec.mask)
        return n, *np.unique(d, return_counts=True)
    size = prev.dtype.itemsize
    if size in (1, 2, 4, 8):
        u = np.dtype(f"<u{size}")
        pb, cb = p.view(np.uint8).view(u), c.view(np.uint8).view(u)
        idx = np.flatnonzero(pb != cb)
        return n, *np.unique((cb[idx] - pb[idx]).astype(np.int64), return_counts=True)
    rows_p, rows_c = p.view(np.uint8).reshape(n, size), c.view(np.uint8).reshape(n, size)
    changed = (rows_p != rows_c).any(axis=1)
    x = np.bitwise_xor(rows_p[changed], rows_c[changed])
    return n, None, (np.unique(x, axis=0, return_counts=True)[1] if x.shape[0] else np.zeros(0, np.int64))


def bound_bits(n: int, counts: np.ndarray) -> float:
    """Total bits of the bound for ``n`` elements whose changes have these histogram counts."""
    k = int(counts.sum())
    if n == 0 or k == 0:
        return 0.0
    return entropy_bits(np.array([k, n - k])) + entropy_bits(counts)


Tensors = np.ndarray | dict[str, np.ndarray]


def entropy_bound_bits(prev: Tensors, cur: Tensors, per_tensor: bool = False) -> float:
    """The bound in bits per parameter for one tensor pair or two dicts of tensors (same names)."""
    if isinstance(prev, np.ndarray) and isinstance(cur, np.ndarray):
        n, _, counts = change_values(prev, cur)
        return bound_bits(n, counts) / n if n else 0.0
    if isinstance(prev, np.ndarray) or isinstance(cur, np.ndarray) or set(prev) != set(cur):
        raise ValueError("entropy_bound_bits needs two arrays or two dicts with the same tensor names")
    parts = [change_values(prev[k], cur[k]) for k in sorted(prev)]
    total = sum(n for n, _, _ in parts)
    if total == 0:
        return 0.0
    if per_tensor:
        return sum(bound_bits(n, c) for n, _, c in parts) / total
    return bound_bits(total, _merged_counts(parts)) / total


def _merged_counts(parts: list[tuple[int, np.ndarray | None, np.ndarray]]) -> np.ndarray:
    """One histogram over all tensors: counts of the same change value are added together."""
    vals = [v for _, v, _ in parts if v is not None]
    cnts = [c for _, v, c in parts if v is not None]
    wide = [c for _, v, c in parts if v is None]
    if not vals:
        return np.concatenate(wide) if wide else np.zeros(0, np.int64)
    values, inverse = np.unique(np.concatenate(vals), return_inverse=True)
    merged = np.bincount(inverse, weights=np.concatenate(cnts), minlength=values.shape[0]).astype(np.int64)
    return np.concatenate([merged, *wide])
