"""Scalar entropy-coding steps of the delta codec (numba): log-linear buckets, an LSB-first bit stream,
Golomb codes and static rANS. The per-chunk kernels in ``tandem.weights.kernels`` own every array access.

Invariants:
- Helpers take and return scalars only: numba reference-counts arrays passed to a function, which costs
  more than the coding itself in a hot loop, so kernels read and write their buffers themselves.
- rANS: state in ``[2**15, 2**31)``, 16-bit renormalisation words, probabilities quantised to
  ``PROB_BITS`` (see ``tandem.weights.tables``). States stay below 2**31 because the encoder's reciprocal
  division (ryg's trick) is exact only there. The encoder runs backwards over the symbols and emits words
  towards the start of its buffer; the decoder reads forwards and sees the symbols in their natural order.
  Encoding (in ``kernels``) uses ryg's reciprocal trick (no division).
- Bit stream: bits are packed LSB-first into uint64 words; ``bw_add`` takes at most 56 bits at a time.
- Buckets: ``bucket(v)`` maps any v in [0, 2**38) to a symbol < ``ALPHABET`` plus ``nextra`` raw low bits;
  values below ``DIRECT`` are their own symbol; ``BASE``/``NEXTRA`` invert it.
- Golomb (parameter m >= 1): ``q`` ones, a zero, then a truncated-binary remainder whose long form is
  written high part first, so an LSB-first reader can tell short from long after ``b - 1`` bits.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from tandem.weights import jitcache

# Before the first kernel of the package is decorated (every kernel module imports this one first): a
# cached kernel is used only with the kernel sources it was compiled from (``tandem.weights.jitcache``).
jitcache.install(Path(__file__).parent)

PROB_BITS = 14
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 15  # lower bound of the state; the upper bound is RANS_L << 16 = 2**31
DIRECT = 16  # values below this are their own bucket symbol
MANT_BITS = 2  # sub-buckets per octave = 2**MANT_BITS
ALPHABET = 160  # covers every value below 2**38 (more than any tensor's element count or diff)
GOLOMB_FAST_Q = 24  # quotients below this decode from one 64-bit window

NJIT = {"cache": True, "nogil": True}
U16 = np.uint64(0xFFFF)
SLOT_MASK = np.uint64(PROB_SCALE - 1)
U_RANS_L = np.uint64(RANS_L)


def _bucket_base(sym: int) -> tuple[int, int]:
    if sym < DIRECT:
        return sym, 0
    t = sym - DIRECT
    k = 4 + (t >> MANT_BITS)
    nextra = k - MANT_BITS
    return ((1 << MANT_BITS) | (t & ((1 << MANT_BITS) - 1))) << nextra, nextra


BASE = np.array([_bucket_base(s)[0] for s in range(ALPHABET)], np.int64)
NEXTRA = np.array([_bucket_base(s)[1] for s in range(ALPHABET)], np.int64)


@njit(**NJIT)
def bucket(v: int) -> tuple[int, int, int]:
    """Symbol, number of extra bits, and the extra bits themselves for value ``v >= 0`` (branch-free)."""
    k = 63 - np.int64(leading_zeros(np.uint64(v | 1)))  # floor(log2 v)
    ne = max(k - MANT_BITS, 0)
    big = v >= DIRECT
    sym = DIRECT + (k - 4) * (1 << MANT_BITS) + ((v >> ne) & ((1 << MANT_BITS) - 1))
    ne = ne if big else 0
    return (sym if big else v), ne, v & ((1 << ne) - 1)


# --------------------------------------------------------------------------- bit stream
@njit(**NJIT)
def bw_add(acc: int, nbits: int, v: int, n: int) -> tuple[int, int, int, bool]:
    """Append the low ``n`` (<= 56) bits of ``v`` to the accumulator. Returns (acc, nbits, word, full): when
    ``full`` the caller stores ``word`` as the next output word (storing it unconditionally and advancing by
    ``full`` is also correct, given one spare word)."""
    acc |= np.uint64(v) << np.uint64(nbits)
    nbits += n
    word = acc
    full = nbits >= 64
    if full:
        nbits -= 64
        acc = np.uint64(v) >> np.uint64(n - nbits) if nbits > 0 else np.uint64(0)
    return acc, nbits, word, full


@njit(**NJIT)
def peek(w0: int, w1: int, offset: int) -> int:
    """The 64 bits starting ``offset`` (0..63) bits into word ``w0``, continuing into ``w1``."""
    o = np.uint64(offset)
    return (np.uint64(w0) >> o) | ((np.uint64(w1) << (np.uint64(63) - o)) << np.uint64(1))


@njit(**NJIT)
def low_bits(v: int, n: int) -> int:
    return np.int64(np.uint64(v) & ((np.uint64(1) << np.uint64(n)) - np.uint64(1)))


# --------------------------------------------------------------------------- golomb
@njit(**NJIT)
def golomb_params(m: int) -> tuple[int, int]:
    """(b, u) of the truncated-binary remainder for parameter m: b = ceil(log2 m), u = 2**b - m."""
    b = 0
    while b < 62 and (1 << b) < m:  # bounded: ``1 << 63`` wraps negative, and m > 2**62 looped forever
        b += 1
    return b, (1 << b) - m


@njit(**NJIT)
def golomb_remainder(r: int, b: int, u: int) -> tuple[int, int]:
    """(bits, length) of the truncated-binary remainder ``r``."""
    if b == 0:
        return 0, 0
    if r < u:
        return r, b - 1
    x = r + u
    return (x >> 1) | ((x & 1) << (b - 1)), b


@njit(**NJIT)
def golomb_decode(window: int, m: int, b: int, u: int) -> tuple[int, int]:
    """Decode one value from a 64-bit window; returns (value, bits used), or (-1, ones) when the quotient
    is too long for one window (the caller then consumes ``ones`` ones and continues)."""
    ones = np.int64(trailing_zeros(~np.uint64(window) | (np.uint64(1) << np.uint64(63))))
    if ones >= GOLOMB_FAST_Q:
        return -1, ones
    rest = np.uint64(window) >> np.uint64(ones + 1)
    if b == 0:
        return ones * m, ones + 1
    v = np.int64(rest & ((np.uint64(1) << np.uint64(b - 1)) - np.uint64(1)))
    if v < u:
        return ones * m + v, ones + b
    bit = np.int64((rest >> np.uint64(b - 1)) & np.uint64(1))
    return ones * m + ((v << 1) | bit) - u, ones + 1 + b


def golomb_parameter(p: float) -> int:
    """Optimal Golomb parameter for geometric gaps with change probability ``p`` (Gallager-van Voorhis)."""
    if p >= 0.5:
        return 1
    q = 1.0 - p
    return max(1, math.ceil(math.log(1.0 + q) / -math.log(q)))


# --------------------------------------------------------------------------- rANS
@njit(**NJIT)
def rans_dec(x: int, freq: int, cum: int, nxt: int) -> tuple[int, bool]:
    """Advance the state past the symbol at ``x & SLOT_MASK`` (whose freq/cum are given); when the state
    underflows it takes ``nxt``, the next stream word, and the caller advances (returned flag)."""
    x = np.uint64(freq) * (x >> np.uint64(PROB_BITS)) + (x & SLOT_MASK) - np.uint64(cum)
    low = x < U_RANS_L
    return (((x << np.uint64(16)) | np.uint64(nxt)) if low else x), low
