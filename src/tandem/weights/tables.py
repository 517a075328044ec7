"""Static frequency tables of the delta codec: quantisation, cost estimates, compact serialisation, varints.

Invariants: a ``Table``'s frequencies sum to exactly ``PROB_SCALE`` and every symbol with a nonzero count
gets a frequency >= 1 (``normalize``); ``parse_table`` rejects any other table (``ValueError``), so a
decoder never builds an inconsistent lookup table. Serialisation is deterministic.
"""

from __future__ import annotations

import numpy as np

from tandem.weights.entropy import ALPHABET, PROB_BITS, PROB_SCALE


class Table:
    """A quantised static distribution: ``freq``/``cum`` per symbol, the decode ``lut`` per slot, and the
    encoder rows ``enc[:, s]`` = [x_max, reciprocal, shift, bias, PROB_SCALE - freq] of ryg's rANS
    reciprocal trick, so encoding needs no division."""

    __slots__ = ("freq", "cum", "fc", "lut", "enc")

    def __init__(self, freq: np.ndarray) -> None:
        if freq.shape[0] > ALPHABET or int(freq.sum()) != PROB_SCALE or (freq < 0).any():
            raise ValueError(f"corrupt frequency table (sum {int(freq.sum())}, expected {PROB_SCALE})")
        full = np.zeros(ALPHABET, np.uint32)
        full[: freq.shape[0]] = freq
        self.freq = full
        self.cum = np.zeros(ALPHABET, np.uint32)
        self.cum[1:] = np.cumsum(full[:-1], dtype=np.uint32)
        self.fc = full | (self.cum << np.uint32(16))  # both in one load for the decoders
        self.lut = np.repeat(np.arange(ALPHABET, dtype=np.uint8), full)
        self.enc = np.zeros((5, ALPHABET), np.uint64)
        self.enc[:, full > 0] = _ENC_ROWS[:, full[full > 0]]
        self.enc[3] += self.cum.astype(np.uint64)  # the bias includes the symbol's start
        self.enc[3, full == 0] = 0


def _encoder_rows() -> np.ndarray:
    """[x_max, reciprocal, shift, bias without cum, PROB_SCALE - f] for every frequency f (ryg's rANS;
    x_max = ((RANS_L >> PROB_BITS) << 16) * f, and the reciprocal is exact for states below 2**31)."""
    f = np.arange(PROB_SCALE + 1, dtype=np.uint64)
    f[0] = 1  # unused
    shift = np.array([(int(v) - 1).bit_length() for v in f], np.uint64)
    rcp = ((np.uint64(1) << (shift + np.uint64(31))) + f - np.uint64(1)) // f
    rows = np.stack([f << np.uint64(31 - PROB_BITS), rcp, shift - np.uint64(1), np.zeros_like(f),
                     np.uint64(PROB_SCALE) - f])  # fmt: skip
    rows[1, 1], rows[2, 1], rows[3, 1] = 0xFFFFFFFF, 0, PROB_SCALE - 1  # f == 1 has no reciprocal
    return rows


_ENC_ROWS = _encoder_rows()


def normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to ``PROB_SCALE``, >= 1 for each nonzero count, trimmed after the last used symbol.

    Floor rounding, then the rounding error is given to (or taken from) the symbols where it gains (costs)
    the most (fewest) bits, so the quantised table stays within a fraction of a percent of the entropy."""
    counts = np.asarray(counts, np.float64)
    used = np.flatnonzero(counts)
    if used.size == 0:
        return np.full(1, PROB_SCALE, np.int64)
    counts = counts[: used[-1] + 1]
    ideal = counts * (PROB_SCALE / counts.sum())
    freq = np.where(counts > 0, np.maximum(1, np.floor(ideal)), 0).astype(np.int64)
    diff = PROB_SCALE - int(freq.sum())
    if diff > 0:  # hand the rounding surplus to the largest remainders, one unit each
        rem = np.where(counts > 0, ideal - freq, -1.0)
        top = np.argsort(-rem, kind="stable")[: min(diff, int((counts > 0).sum()))]
        freq[top] += 1
        diff -= top.shape[0]
    freq[int(np.argmax(freq))] += diff  # what is left (+ or -) goes to the most frequent symbol
    return freq


def table_cost_bits(counts: np.ndarray, freq: np.ndarray) -> float:
    """Exact coded size in bits of symbols with these counts under the quantised ``freq``."""
    counts = np.asarray(counts, np.float64)[: freq.shape[0]]
    used = counts > 0
    return float(-(counts[used] * np.log2(freq[used] / PROB_SCALE)).sum())


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical entropy of a histogram, in total bits."""
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    n = c.sum()
    return float(-(c * np.log2(c / n)).sum()) if n else 0.0


def write_varint(out: bytearray, v: int) -> None:
    if v < 0:
        raise ValueError(f"varint must be >= 0, got {v}")
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    v = 0
    shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or corrupt varint in delta blob")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


def serialize_table(freq: np.ndarray, out: bytearray) -> None:
    """Symbol count, then per symbol its frequency; a zero is followed by the length of its zero run - 1."""
    n = int(freq.shape[0])
    write_varint(out, n)
    i = 0
    while i < n:
        f = int(freq[i])
        write_varint(out, f)
        if f == 0:
            j = i
            while j + 1 < n and freq[j + 1] == 0:
                j += 1
            write_varint(out, j - i)
            i = j
        i += 1


def parse_table(buf: bytes | memoryview, pos: int) -> tuple[Table, int]:
    n, pos = read_varint(buf, pos)
    if n < 1 or n > ALPHABET:
        raise ValueError(f"corrupt frequency table: {n} symbols")
    freq = np.zeros(n, np.int64)
    i = 0
    while i < n:
        f, pos = read_varint(buf, pos)
        if f == 0:
            run, pos = read_varint(buf, pos)
            i += run
        else:
            freq[i] = f
        i += 1
    return Table(freq), pos
