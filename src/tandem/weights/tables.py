"""Static frequency tables of the delta codec: quantisation, cost estimates, compact serialisation, varints.

Invariants: a ``Table``'s frequencies sum to exactly ``PROB_SCALE`` and every symbol with a nonzero count
gets a frequency >= 1 (``_normalize``); ``parse_table`` rejects any other table (``ValueError``), so a
decoder never builds an inconsistent lookup table. Serialisation is deterministic.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tandem.weights.entropy import ALPHABET, NJIT, PROB_BITS, PROB_SCALE


class Table:
    """A quantised static distribution: ``freq``/``cum`` per symbol, the decode ``lut`` per slot with ``fc``
    (freq | cum << 16), and the encoder rows ``enc[:, s]`` = [x_max, reciprocal, shift, bias, PROB_SCALE -
    freq] of ryg's rANS reciprocal trick, so encoding needs no division. The codec builds the half it needs
    up front, in the constructing thread (``encoding``, ``decoding``), so its worker threads only read it;
    a half not built yet is built on first use."""

    __slots__ = ("freq", "cum", "alphabet", "_fc", "_lut", "_enc")

    def __init__(self, freq: np.ndarray, alphabet: int = ALPHABET) -> None:
        if freq.shape[0] > alphabet or int(freq.sum()) != PROB_SCALE or (freq < 0).any():
            raise ValueError(
                f"corrupt frequency table ({freq.shape[0]} symbols of at most {alphabet}, sum "
                f"{int(freq.sum())}, expected {PROB_SCALE})"
            )
        full = np.zeros(alphabet, np.uint32)
        full[: freq.shape[0]] = freq
        self.freq = full
        self.alphabet = alphabet
        self.cum = np.zeros(alphabet, np.uint32)
        self.cum[1:] = np.cumsum(full[:-1], dtype=np.uint32)
        self._fc: np.ndarray | None = None
        self._lut: np.ndarray | None = None
        self._enc: np.ndarray | None = None

    @classmethod
    def encoding(cls, freq: np.ndarray, alphabet: int = ALPHABET) -> Table:
        """The encoding half of a table from ``plan_table``'s frequencies (trusted: sum ``PROB_SCALE``, none
        negative, at most ``alphabet`` symbols), built in one compiled call."""
        t = cls.__new__(cls)
        t.freq, t.cum, t._enc = _encoding_half(np.ascontiguousarray(freq, np.int64), alphabet, _ENC_ROWS)
        t.alphabet, t._lut, t._fc = alphabet, None, None
        return t

    @classmethod
    def decoding(
        cls, freq: np.ndarray, cum: np.ndarray, lut: np.ndarray, fc: np.ndarray, alphabet: int
    ) -> Table:
        """A table from its already built and checked decoding half (``parse_table``)."""
        t = cls.__new__(cls)
        t.freq, t.cum, t.alphabet, t._lut, t._fc, t._enc = freq, cum, alphabet, lut, fc, None
        return t

    @property
    def fc(self) -> np.ndarray:
        if self._fc is None:
            self._fc = self.freq | (self.cum << np.uint32(16))  # both in one load for the decoders
        return self._fc

    @property
    def lut(self) -> np.ndarray:
        if self._lut is None:
            self._lut = np.repeat(np.arange(self.alphabet, dtype=np.uint8), self.freq)
        return self._lut

    @property
    def enc(self) -> np.ndarray:
        if self._enc is None:
            self._enc = _encoder_table(self.freq, self.cum, _ENC_ROWS)
        return self._enc


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


@njit(**NJIT)
def _encoder_table(freq: np.ndarray, cum: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``Table.enc``: each used symbol's column of ``rows`` (``_ENC_ROWS``) by its frequency, its bias
    including the symbol's start ``cum``; zero columns for unused symbols."""
    enc = np.zeros((5, freq.shape[0]), np.uint64)
    for s in range(freq.shape[0]):
        f = freq[s]
        if f > 0:
            for r in range(5):
                enc[r, s] = rows[r, f]
            enc[3, s] += np.uint64(cum[s])
    return enc


@njit(**NJIT)
def _encoding_half(
    freq: np.ndarray, alphabet: int, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Table.encoding``: freq and cum padded to ``alphabet`` (uint32), and ``_encoder_table``."""
    full, cum = np.zeros(alphabet, np.uint32), np.zeros(alphabet, np.uint32)
    at = 0
    for s in range(freq.shape[0]):
        full[s] = freq[s]
    for s in range(alphabet):
        cum[s] = at
        at += full[s]
    return full, cum, _encoder_table(full, cum, rows)


@njit(**NJIT)
def plan_table(counts: np.ndarray, extra_bits: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """One compiled call for a candidate table: (exact coded bits of symbols with these ``counts``
    (float64) under the quantised table, plus the serialized table's bits, plus ``counts[s] *
    extra_bits[s]`` raw bits; the frequencies (``_normalize``); the serialized bytes (the format
    ``parse_table`` reads))."""
    freq = _normalize(counts)
    buf = np.empty(10 + 10 * freq.shape[0], np.uint8)
    n = _pack_table(freq, buf)
    bits = _cost_bits(counts, freq.astype(np.float64)) + 8.0 * n
    for s in range(min(counts.shape[0], extra_bits.shape[0])):
        bits += counts[s] * extra_bits[s]
    return bits, freq, buf[:n]


@njit(**NJIT)
def _normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to ``PROB_SCALE``, >= 1 for each nonzero count, trimmed after the last used symbol.

    Floor rounding, then the rounding error is given to (or taken from) the symbols where it gains (costs)
    the most (fewest) bits, so the quantised table stays within a fraction of a percent of the entropy."""
    last = -1
    for s in range(counts.shape[0]):
        if counts[s] > 0:
            last = s
    if last < 0:
        return np.full(1, PROB_SCALE, np.int64)
    counts = counts[: last + 1]
    ideal = counts * (PROB_SCALE / counts.sum())
    freq = np.zeros(last + 1, np.int64)
    used = 0
    for s in range(last + 1):
        if counts[s] > 0:
            freq[s] = max(1, np.int64(np.floor(ideal[s])))
            used += 1
    diff = PROB_SCALE - freq.sum()
    if diff > 0:  # hand the rounding surplus to the largest remainders, one unit each (ties: lowest symbol)
        rem = np.where(counts > 0, ideal - freq, -1.0)
        top = np.argsort(-rem, kind="mergesort")[: min(diff, used)]
        for s in top:
            freq[s] += 1
        diff -= top.shape[0]
    freq[np.argmax(freq)] += diff  # what is left (+ or -) goes to the most frequent symbol
    return freq


@njit(**NJIT)
def _cost_bits(counts: np.ndarray, freq: np.ndarray) -> float:
    bits = 0.0
    for s in range(min(counts.shape[0], freq.shape[0])):
        if counts[s] > 0:
            bits -= counts[s] * np.log2(freq[s] / PROB_SCALE)
    return bits


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


def parse_table(
    buf: bytes | memoryview | np.ndarray, pos: int, alphabet: int = ALPHABET
) -> tuple[Table, int]:
    """The table ``plan_table`` serialized at ``pos`` (at most ``alphabet`` symbols), with its decoding half
    built (one compiled call), and the next offset. ``buf`` may be the blob's bytes as a uint8 array."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    n, pos, freq, cum, lut, fc = _read_decode_table(arr, pos, alphabet)
    if n == -1:
        raise ValueError("corrupt frequency table: truncated, or more symbols than the alphabet")
    if n == -2:
        raise ValueError(f"corrupt frequency table (frequencies must sum to {PROB_SCALE})")
    return Table.decoding(freq, cum, lut, fc, alphabet), pos


@njit(**NJIT)
def _read_decode_table(
    buf: np.ndarray, pos: int, alphabet: int
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_unpack_table`` plus the decoding half of a ``Table``: (symbol count, next offset, freq, cum, lut,
    fc); the count is -1 for a truncated table or too many symbols, -2 when the frequencies do not sum to
    ``PROB_SCALE`` (the arrays are then empty)."""
    freq64 = np.zeros(alphabet, np.int64)
    n, pos = _unpack_table(buf, pos, alphabet, freq64)
    empty32, empty8 = np.zeros(0, np.uint32), np.zeros(0, np.uint8)
    if n < 1:
        return -1, pos, empty32, empty32, empty8, empty32
    if freq64.sum() != PROB_SCALE:  # varints are < 2**35 each, so the sum cannot wrap
        return -2, pos, empty32, empty32, empty8, empty32
    freq, cum = freq64.astype(np.uint32), np.zeros(alphabet, np.uint32)
    lut, fc = np.empty(PROB_SCALE, np.uint8), np.empty(alphabet, np.uint32)
    at = 0
    for s in range(alphabet):
        cum[s] = at
        fc[s] = freq[s] | (at << 16)
        for k in range(at, at + freq[s]):
            lut[k] = s
        at += freq[s]
    return n, pos, freq, cum, lut, fc


@njit(**NJIT)
def put_varint(buf: np.ndarray, k: int, v: int) -> int:
    """LEB128 ``v`` (the format of ``write_varint``) at ``buf[k]``; returns the next position."""
    while v >= 0x80:
        buf[k] = (v & 0x7F) | 0x80
        v >>= 7
        k += 1
    buf[k] = v
    return k + 1


@njit(**NJIT)
def _pack_table(freq: np.ndarray, buf: np.ndarray) -> int:
    """A table's serialized bytes into ``buf`` (symbol count, then per symbol its frequency; a zero is
    followed by the length of its zero run - 1; all varints); returns their count."""
    n = freq.shape[0]
    k = put_varint(buf, 0, n)
    i = 0
    while i < n:
        f = freq[i]
        k = put_varint(buf, k, f)
        if f == 0:
            j = i
            while j + 1 < n and freq[j + 1] == 0:
                j += 1
            k = put_varint(buf, k, j - i)
            i = j
        i += 1
    return k


@njit(**NJIT)
def get_varint(buf: np.ndarray, pos: int) -> tuple[int, int]:
    """(value, next offset), or (-1, pos) if truncated or longer than 35 bits."""
    v, shift = 0, 0
    while pos < buf.shape[0] and shift <= 28:
        b = np.int64(buf[pos])
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7
    return -1, pos


@njit(**NJIT)
def _unpack_table(buf: np.ndarray, pos: int, alphabet: int, freq: np.ndarray) -> tuple[int, int]:
    """Read ``_pack_table``'s format at ``pos`` into ``freq``; (symbol count, next offset), or (-1, pos)
    when it is truncated or names more than ``alphabet`` symbols."""
    n, pos = get_varint(buf, pos)
    if n < 1 or n > alphabet:
        return -1, pos
    i = 0
    while i < n:
        f, pos = get_varint(buf, pos)
        if f < 0:
            return -1, pos
        if f == 0:
            run, pos = get_varint(buf, pos)
            if run < 0:
                return -1, pos
            i += run
        else:
            freq[i] = f
        i += 1
    return n, pos
