"""Per-chunk numba kernels of the delta codec, encoder side: find changes and encode them (decoding kernels
are in ``tandem.weights.decode_kernels``).

Model: an element of width W (16 for bf16/fp16, 32 for fp32) is mapped to its ordered key (sign-magnitude ->
monotone unsigned: ``key(-0.0) + 1 == key(+0.0)``, NaN and inf are just bit patterns), and a change is
``d = key(cur) - key(prev)``, zigzag-coded as ``z`` (``z = 0`` means unchanged). Every mapping is a bijection
on W-bit patterns, so decoding is bit-exact for any input, including NaN payloads.

Invariants:
- ``scan_chunk`` lists the positions of at most a fixed number of changes (or reports "too dense");
  ``change_hist`` histograms gap symbols and diff symbols of ``z`` (symbol 0 = unchanged, which sparse
  streams never code, so the same row is the dense histogram).
- Quad chunk (for dense changes, faster than one symbol per element): each element has a class, 0 for
  ``z = 0``, 1 for ``z = 1`` (one step down), 2 for ``z = 2`` (one step up) and 3 for anything else (an
  escape); four consecutive elements make one quad symbol ``c0 | c1 << 2 | c2 << 4 | c3 << 6`` (missing
  elements after the end are class 0). A chunk's part (``codec.quad_part``) is: four little-endian uint32
  (``codec.QUAD_DIRECTORY``), the escape count, the byte lengths of two zstd frames
  (``tandem.weights.zframes``) and the raw bit count; the
  frame of the quads (one byte each); the frame of the escapes' codes (``escape_code``: one byte each, in
  element order); the escapes' raw bits. The class model factorises the dense one exactly; zstd's
  Huffman coder then lands within about 2% of the quads' order-0 entropy.
- Sparse chunk, per change in index order: the gap (unchanged elements since the previous change) as a
  symbol of the gap rANS stream + raw bits, or as a Golomb code in the bit stream; then the diff as a
  symbol of the diff rANS stream + raw bits. Dense chunk, per element ``i``: the diff symbol in rANS stream
  ``i % LANES`` + raw bits. Raw bits of all symbols share one bit stream, in element order. Each rANS
  stream has its own state, so decoders overlap their dependency chains.
- List (a handful of changes): per change in index order, the gap (unchanged elements since the previous
  change) and ``z``, each a LEB128 varint (``encode_list``); no tables, so nothing to build when decoding.
- Kernels do every array access of their hot loops themselves and call only scalar helpers there (see
  ``tandem.weights.entropy``); ``bw_finish`` runs once per stream, after the loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from tandem.weights.entropy import (
    ALPHABET,
    DIRECT,
    NJIT,
    RANS_L,
    U16,
    bucket,
    bw_add,
    golomb_remainder,
)
from tandem.weights.tables import put_varint


@njit(**NJIT)
def bw_finish(bbuf: np.ndarray, w: int, acc: int, nb: int) -> tuple[int, int]:
    """Store a bit stream's last partial word (outside the hot loop, so taking the array costs nothing);
    returns (used words, total bits)."""
    total_bits = w * 64 + nb
    if nb > 0:
        bbuf[w] = acc
        w += 1
    return w, total_bits


# symbol -> change in key space for symbols without raw bits (0 for the others, fixed up separately)
DKEY = np.array([((z >> 1) ^ -(z & 1)) if z < DIRECT else 0 for z in range(ALPHABET)], np.int64)
GAP_TABLE = 0
GAP_GOLOMB = 1
HIST_ROWS = 2  # gap symbols, diff symbols
LANES = 4  # interleaved rANS streams of a dense chunk
QUAD_ALPHABET = 256  # quad symbols: four 2-bit classes
MAX_EXTRA_FREE = 24  # a diff symbol of a key of at most 32 bits carries at most 64 - 24 = 40 raw bits


@njit(**NJIT)
def to_key(u: int, sign: int, mask: int) -> int:
    return u ^ mask if u & sign else u | sign


@njit(**NJIT)
def from_key(k: int, sign: int, mask: int) -> int:
    return k ^ sign if k & sign else k ^ mask


ESC_DIRECT = 224  # a quad escape whose z is below this is its own code byte (see ``escape_code``)
ESC_EXP0 = 7  # escape code ESC_DIRECT + k: z = 2**(k + ESC_EXP0) + that many raw bits


@njit(**NJIT)
def escape_code(z: int) -> tuple[int, int, int]:
    """The code byte of a quad escape's ``z`` (>= 3), its number of raw bits and the bits: ``z`` itself
    below ``ESC_DIRECT``, else ``ESC_DIRECT + floor(log2 z) - ESC_EXP0`` with the bits below ``z``'s top
    one (at most 32 for the 33-bit ``z`` of a 32-bit key, so every code fits a byte). Most escapes are a few
    steps (``z`` in 3..14 for nine in ten of a trained model's), so nearly every code decodes without
    raw bits, and without a branch that mispredicts."""
    if z < ESC_DIRECT:
        return z, 0, 0
    k = 63 - np.int64(leading_zeros(np.uint64(z)))
    return ESC_DIRECT + k - ESC_EXP0, k, z - (np.int64(1) << k)


@njit(**NJIT)
def zigzag(d: int) -> int:
    return (d << 1) ^ (d >> 63)


@njit(**NJIT)
def unzigzag(z: int) -> int:
    return (z >> 1) ^ -(z & 1)


# --------------------------------------------------------------------------- scan
@njit(**NJIT)
def scan_chunk(
    p: np.ndarray, c: np.ndarray, p64: np.ndarray, c64: np.ndarray, width: int, sign: int, mask: int,
    idx_out: np.ndarray, z_out: np.ndarray,
) -> int:  # fmt: skip
    """Store the positions and ``z`` of the changes of one chunk; returns their count, or -1 as soon as
    there are more than ``len(idx_out) - 8``. ``p64``/``c64`` are uint64 views of the first
    ``len(p64) * 64 // width`` elements (empty when not 8-byte aligned): equal words are skipped eight bytes
    at a time, and the lanes of a differing word are compacted without branches."""
    cap = idx_out.shape[0] - 8
    lanes = 64 // width
    lane_mask = np.uint64((1 << width) - 1)
    cnt = 0
    for j in range(p64.shape[0]):
        x = p64[j] ^ c64[j]
        if x != 0:
            base = j * lanes
            for k in range(lanes):
                i = base + k
                idx_out[cnt] = i
                z_out[cnt] = zigzag(to_key(np.int64(c[i]), sign, mask) - to_key(np.int64(p[i]), sign, mask))
                cnt += ((x >> np.uint64(k * width)) & lane_mask) != 0
            if cnt > cap:
                return -1
    for i in range(p64.shape[0] * lanes, p.shape[0]):
        idx_out[cnt] = i
        z_out[cnt] = zigzag(to_key(np.int64(c[i]), sign, mask) - to_key(np.int64(p[i]), sign, mask))
        cnt += p[i] != c[i]
        if cnt > cap:
            return -1
    return cnt


@njit(**NJIT)
def change_hist(idx: np.ndarray, z: np.ndarray, size: int, hist: np.ndarray) -> None:
    """Add one chunk's gap symbols (row 0) and diff symbols (row 1; the unchanged count goes to symbol 0,
    which sparse streams never use, so row 1 is also the dense histogram) to ``hist``."""
    last = -1
    for k in range(idx.shape[0]):
        i = np.int64(idx[k])
        hist[0, bucket(i - last - 1)[0]] += 1
        hist[1, bucket(np.int64(z[k]))[0]] += 1
        last = i
    hist[1, 0] += size - idx.shape[0]


@njit(**NJIT)
def dense_symbols(p: np.ndarray, c: np.ndarray, sign: int, mask: int, syms: np.ndarray) -> None:
    """The diff symbol of every element of one chunk (a branch-free loop that LLVM vectorises)."""
    for i in range(p.shape[0]):
        zz = zigzag(to_key(np.int64(c[i]), sign, mask) - to_key(np.int64(p[i]), sign, mask))
        syms[i] = bucket(zz)[0]


@njit(**NJIT)
def golomb_total_bits(idx: np.ndarray, m: int, b: int, u: int) -> int:
    """Bits of the Golomb codes of the gaps of one chunk's change positions."""
    last = -1
    total = 0
    for k in range(idx.shape[0]):
        gap = np.int64(idx[k]) - last - 1
        last = np.int64(idx[k])
        q = gap // m
        r = gap - q * m
        total += q + 1 + (0 if b == 0 else (b - 1 if r < u else b))
    return total


# --------------------------------------------------------------------------- encode
@njit(**NJIT)
def _encode_lane(syms: np.ndarray, first: int, step: int, enc: np.ndarray, buf: np.ndarray) -> int:
    """rANS-encode ``syms[first::step]`` (backwards) into ``buf`` from its end, then the final state (low word
    first in stream order); returns the first used slot. ``buf`` needs ``len(syms[first::step]) + 3``.
    Written out by hand (unsigned indices, one row per encoder field) because it runs once per symbol."""
    x_max, rcp, shift, bias, cmpl = enc[0], enc[1], enc[2], enc[3], enc[4]
    r = np.uint64(buf.shape[0])
    x = np.uint64(RANS_L)
    count = (syms.shape[0] - first + step - 1) // step if first < syms.shape[0] else 0
    wb, one = np.uint64(16), np.uint64(1)
    for k in range(count - 1, -1, -1):
        s = np.uint64(syms[np.uint64(first + k * step)])
        emit = x >= x_max[s]
        buf[r - one] = x & U16
        x = (x >> wb) if emit else x
        r -= np.uint64(emit)
        q = ((x * rcp[s]) >> np.uint64(32)) >> shift[s]
        x = x + bias[s] + q * cmpl[s]
    buf[r - one] = x >> wb
    buf[r - np.uint64(2)] = x & U16
    return np.int64(r) - 2


@njit(**NJIT)
def encode_sparse_chunk(
    idx: np.ndarray,
    z: np.ndarray,
    gap_mode: int,
    genc: np.ndarray,
    denc: np.ndarray,
    m: int,
    b: int,
    u: int,
    rbuf: np.ndarray,
    bbuf: np.ndarray,
) -> tuple[int, int, int, int]:
    """Returns (first used slot of the gap stream ``rbuf[0]`` (table mode) and of the diff stream
    ``rbuf[1]``, used words of ``bbuf``, total bits). Each rANS stream has its own state, so a decoder runs
    their dependency chains in parallel. ``rbuf`` rows need ``len(idx) + 3`` slots; ``bbuf`` the bits'
    words + 3."""
    n = idx.shape[0]
    gs = np.empty(n, np.uint8)
    ds = np.empty(n, np.uint8)
    w, acc, nb = 0, np.uint64(0), 0
    last = -1
    for k in range(n):
        gap = np.int64(idx[k]) - last - 1
        last = np.int64(idx[k])
        if gap_mode == GAP_TABLE:
            s, ne, ex = bucket(gap)
            gs[k] = s
            acc, nb, word, full = bw_add(acc, nb, ex, ne)
            bbuf[w] = word
            w += full
        else:
            q = gap // m
            rem, rl = golomb_remainder(gap - q * m, b, u)
            while q > 48:
                acc, nb, word, full = bw_add(acc, nb, (1 << 48) - 1, 48)
                bbuf[w] = word
                w += full
                q -= 48
            acc, nb, word, full = bw_add(acc, nb, (1 << q) - 1, q + 1)
            bbuf[w] = word
            w += full
            acc, nb, word, full = bw_add(acc, nb, rem, rl)
            bbuf[w] = word
            w += full
        s, ne, ex = bucket(np.int64(z[k]))
        ds[k] = s
        acc, nb, word, full = bw_add(acc, nb, ex, ne)
        bbuf[w] = word
        w += full
    w, total_bits = bw_finish(bbuf, w, acc, nb)
    rg = _encode_lane(gs, 0, 1, genc, rbuf[0]) if gap_mode == GAP_TABLE else rbuf.shape[1]
    rd = _encode_lane(ds, 0, 1, denc, rbuf[1])
    return rg, rd, w, total_bits


@njit(**NJIT)
def encode_dense_chunk(
    p: np.ndarray, c: np.ndarray, syms: np.ndarray, sign: int, mask: int, denc: np.ndarray, rbuf: np.ndarray,
    bbuf: np.ndarray, starts: np.ndarray,
) -> tuple[int, int]:  # fmt: skip
    """One symbol per element (``syms`` from ``dense_symbols``); element ``i`` goes to rANS stream
    ``i % LANES`` (row of ``rbuf``, each row ``len(p) // LANES + 4`` slots), whose first used slot is
    written to ``starts``. Returns (used words of ``bbuf``, total bits)."""
    w, acc, nb = 0, np.uint64(0), 0
    for i in range(p.shape[0]):
        if syms[i] >= DIRECT:  # only large changes carry raw bits
            zz = zigzag(to_key(np.int64(c[i]), sign, mask) - to_key(np.int64(p[i]), sign, mask))
            _, ne, ex = bucket(zz)
            acc, nb, word, full = bw_add(acc, nb, ex, ne)
            bbuf[w] = word
            w += full
    w, total_bits = bw_finish(bbuf, w, acc, nb)
    encode_lanes(syms, denc, rbuf, starts)
    return w, total_bits


@njit(**NJIT)
def encode_lanes(syms: np.ndarray, enc: np.ndarray, rbuf: np.ndarray, starts: np.ndarray) -> None:
    """``_encode_lane`` for the four lanes at once (element ``i`` in lane ``i % 4``): their four
    independent state chains interleave, so the CPU overlaps them."""
    n = syms.shape[0]
    tail = n - n % 4
    x_max, rcp, shift, bias, cmpl = enc[0], enc[1], enc[2], enc[3], enc[4]
    b0, b1, b2, b3 = rbuf[0], rbuf[1], rbuf[2], rbuf[3]
    wb, one, lo = np.uint64(16), np.uint64(1), np.uint64(RANS_L)
    r0 = r1 = r2 = r3 = np.uint64(rbuf.shape[1])
    x0 = x1 = x2 = x3 = lo
    for i in range(n - 1, tail - 1, -1):  # the partial last group first: encoding runs backwards
        s = np.uint64(syms[i])
        lane = i & 3
        x = x0 if lane == 0 else (x1 if lane == 1 else x2)
        r = r0 if lane == 0 else (r1 if lane == 1 else r2)
        emit = x >= x_max[s]
        rbuf[lane, r - one] = x & U16
        x = (x >> wb) if emit else x
        r -= np.uint64(emit)
        x = x + bias[s] + (((x * rcp[s]) >> np.uint64(32)) >> shift[s]) * cmpl[s]
        if lane == 0:
            x0, r0 = x, r
        elif lane == 1:
            x1, r1 = x, r
        else:
            x2, r2 = x, r
    for g in range(tail - 4, -1, -4):
        s0, s1 = np.uint64(syms[g]), np.uint64(syms[g + 1])
        s2, s3 = np.uint64(syms[g + 2]), np.uint64(syms[g + 3])
        e0, e1, e2, e3 = x0 >= x_max[s0], x1 >= x_max[s1], x2 >= x_max[s2], x3 >= x_max[s3]
        b0[r0 - one], b1[r1 - one], b2[r2 - one], b3[r3 - one] = x0 & U16, x1 & U16, x2 & U16, x3 & U16
        x0, x1 = (x0 >> wb) if e0 else x0, (x1 >> wb) if e1 else x1
        x2, x3 = (x2 >> wb) if e2 else x2, (x3 >> wb) if e3 else x3
        r0, r1, r2, r3 = r0 - np.uint64(e0), r1 - np.uint64(e1), r2 - np.uint64(e2), r3 - np.uint64(e3)
        x0 = x0 + bias[s0] + (((x0 * rcp[s0]) >> np.uint64(32)) >> shift[s0]) * cmpl[s0]
        x1 = x1 + bias[s1] + (((x1 * rcp[s1]) >> np.uint64(32)) >> shift[s1]) * cmpl[s1]
        x2 = x2 + bias[s2] + (((x2 * rcp[s2]) >> np.uint64(32)) >> shift[s2]) * cmpl[s2]
        x3 = x3 + bias[s3] + (((x3 * rcp[s3]) >> np.uint64(32)) >> shift[s3]) * cmpl[s3]
    xs, rs = (x0, x1, x2, x3), (r0, r1, r2, r3)
    for lane in range(LANES):
        x, r = xs[lane], rs[lane]
        rbuf[lane, r - one] = x >> wb
        rbuf[lane, r - np.uint64(2)] = x & U16
        starts[lane] = np.int64(r) - 2


@njit(**NJIT)
def quad_scan(
    p: np.ndarray, c: np.ndarray, sign: int, mask: int, quads: np.ndarray, qhist: np.ndarray,
    ehist: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int, int]:  # fmt: skip
    """Quad symbols of one chunk into ``quads`` (``ceil(len(p) / 4)``), their histogram into ``qhist``
    (``QUAD_ALPHABET``) and the histogram of the escapes' diff symbols (``bucket``) into ``ehist``. Returns
    the escapes' codes (``escape_code``) in element order, their raw bits (``bw_add`` words), the used
    words and the bit count.
    Separate loops, each simple enough for LLVM to vectorise or to run without branches: ``min(z, 255)``
    per element (one byte each), quads from each four such bytes (a byte of 3 or more is class 3, four
    bytes at a time), the histogram, the quads that hold an escape, the escapes' positions within them,
    then the escapes' symbols and bits, which read ``z`` from its byte and recompute it from the elements
    only when the byte saturated (``z >= 255``, rare: most escapes are a few ulps). Keeping ``z`` instead
    of the class took quad_scan from 6.2-7.1 ms to 5.6-6.1 ms on a trained model's dense delta (43
    tensors, 5.8M elements, about 8% escapes; identical output)."""
    n = p.shape[0]
    nq = quads.shape[0]
    packed = np.zeros(nq, np.uint32)
    zb = packed.view(np.uint8)  # element i's min(z, 255) in byte i; the last quad's missing elements stay 0
    for i in range(n):
        z = zigzag(to_key(np.int64(c[i]), sign, mask) - to_key(np.int64(p[i]), sign, mask))
        zb[i] = min(z, 255)
    low7, top = np.uint32(0x7F7F7F7F), np.uint32(0x80808080)
    high6, low2 = np.uint32(0xFCFCFCFC), np.uint32(0x03030303)
    for j in range(nq):
        x = packed[j]
        y = x & high6  # per byte: nonzero iff z >= 4
        big = (((y & low7) + low7) | y) & top  # bit 7 of each byte whose y is nonzero (no carries)
        x = (x & low2) | ((big >> np.uint32(7)) * np.uint32(3))  # per byte: its class (z = 3 is already 3)
        quads[j] = (x & 3) | ((x >> 6) & 0xC) | ((x >> 12) & 0x30) | ((x >> 18) & 0xC0)
    sub = np.zeros((4, qhist.shape[0]), np.int64)  # four sub-histograms: repeated symbols do not serialise
    for j in range(nq):
        sub[j & 3, quads[j]] += 1
    for j in range(4):
        for s in range(qhist.shape[0]):
            qhist[s] += sub[j, s]
    where, m = escape_positions(quads)
    esyms = np.empty(m, np.uint8)
    bbuf = np.empty(m * (64 - MAX_EXTRA_FREE) // 64 + 3, np.uint64)
    w, acc, nb = 0, np.uint64(0), 0
    for e in range(m):
        i = where[e]
        z = np.int64(zb[i])
        if z == 255:  # saturated: the element's own z
            z = zigzag(to_key(np.int64(c[i]), sign, mask) - to_key(np.int64(p[i]), sign, mask))
        ehist[bucket(z)[0]] += 1  # the dense mode's symbols, for the mode choice
        code, ne, ex = escape_code(z)
        esyms[e] = code
        acc, nb, word, full = bw_add(acc, nb, ex, ne)
        bbuf[w] = word
        w += full
    w, nbits = bw_finish(bbuf, w, acc, nb)
    return esyms, bbuf, w, nbits


@njit(**NJIT)
def quad_scan_chunk(
    p: np.ndarray, c: np.ndarray, sign: int, mask: int, hist: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray, int]:
    """``quad_scan`` of a whole chunk in one compiled call, with its own outputs: (quads, their histogram,
    the escapes' diff-symbol histogram, the chunk's number of changes, the escapes' diff symbols, their raw
    bits trimmed to the used words, the bit count). Also adds the chunk's dense histogram to row 1 of
    ``hist`` (``dense_hist_of_quads``). One call where the encoder made three and four allocations, so a
    two-thread encode's scan tasks wait less on the GIL between kernels."""
    n = p.shape[0]
    quads = np.empty((n + 3) // 4, np.uint8)
    qhist, ehist = np.zeros(QUAD_ALPHABET, np.int64), np.zeros(ALPHABET, np.int64)
    esyms, ebits, words, enbits = quad_scan(p, c, sign, mask, quads, qhist, ehist)
    changed = dense_hist_of_quads(qhist, ehist, n, hist)
    return quads, qhist, ehist, changed, esyms, ebits[:words].copy(), enbits


@njit(**NJIT)
def escape_positions(quads: np.ndarray) -> tuple[np.ndarray, int]:
    """The element positions of the escapes (class 3) of a chunk's quads (fewer than 2**31 elements), in
    order, and their number (the array has spare slots). A branch-free pass turns each word of eight quads
    into a 32-bit mask of its escapes (``_escape_masks``); then each 64-element block writes the positions
    of its first eight set bits unconditionally (one trailing-zero count each; the slots past its count
    are overwritten by the next block) and loops only for a ninth and beyond. Looping over each block's set
    bits until none was left took 0.86 ms per version of the shipped model against 0.25 ms: the loop's
    exit, once per block, mispredicted. int32 positions: half the memory traffic of int64."""
    nq = quads.shape[0]
    masks, count = _escape_masks(quads)
    nw = masks.shape[0]
    where = np.empty(count + 4 * (nq - 8 * nw) + 72, np.int32)
    m = 0
    one, half = np.uint64(1), np.uint64(32)
    for b in range(nw // 2):
        t = np.uint64(masks[2 * b]) | (np.uint64(masks[2 * b + 1]) << half)
        cnt = _popcount(t)
        base = np.int32(64 * b)
        for k in range(8):  # trailing_zeros(0) is some number: those slots are overwritten
            where[m + k] = base + np.int32(trailing_zeros(t))
            t &= t - one
        k = 8
        while t:
            where[m + k] = base + np.int32(trailing_zeros(t))
            t &= t - one
            k += 1
        m += cnt
    if nw % 2:
        t = np.uint64(masks[nw - 1])
        base = np.int32(32 * (nw - 1))
        while t:
            where[m] = base + np.int32(trailing_zeros(t))
            m += 1
            t &= t - one
    for j in range(8 * nw, nq):  # quads after the last whole word, branch-free (one spare slot)
        q = np.int32(quads[j])
        for k in range(4):
            where[m] = 4 * j + k
            m += ((q >> (2 * k)) & 3) == 3
    return where, m


@njit(**NJIT)
def _popcount(x: int) -> int:
    """The number of set bits of a 64-bit word (SWAR)."""
    one = np.uint64(1)
    c = x - ((x >> one) & np.uint64(0x5555555555555555))
    c = (c & np.uint64(0x3333333333333333)) + ((c >> np.uint64(2)) & np.uint64(0x3333333333333333))
    c = (c + (c >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((c * np.uint64(0x0101010101010101)) >> np.uint64(56))


@njit(**NJIT)
def _escape_masks(quads: np.ndarray) -> tuple[np.ndarray, int]:
    """Bit ``k`` of mask ``j``: element ``32 * j + k`` is an escape, for the whole words of eight quads; and
    the number of escapes there. Per word: the even bits of ``x & x >> 1`` mark the escapes, then five
    shift-or-mask steps gather the even bits into the low half."""
    nw = quads.shape[0] // 8
    words = quads[: 8 * nw].view(np.uint64)
    masks = np.empty(nw, np.uint32)
    count = 0
    one = np.uint64(1)
    for j in range(nw):
        x = words[j]
        t = x & (x >> one) & np.uint64(0x5555555555555555)
        c = t - ((t >> one) & np.uint64(0x5555555555555555))  # popcount of t (its bits are the escapes)
        c = (c & np.uint64(0x3333333333333333)) + ((c >> np.uint64(2)) & np.uint64(0x3333333333333333))
        c = (c + (c >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        count += np.int64((c * np.uint64(0x0101010101010101)) >> np.uint64(56))
        t = (t | (t >> one)) & np.uint64(0x3333333333333333)
        t = (t | (t >> np.uint64(2))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        t = (t | (t >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
        t = (t | (t >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
        t = (t | (t >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
        masks[j] = np.uint32(t)
    return masks, count


@njit(**NJIT)
def dense_hist_of_quads(qhist: np.ndarray, ehist: np.ndarray, n: int, hist: np.ndarray) -> int:
    """Add the dense histogram of a chunk of ``n`` elements (row 1 of ``hist``) from its quad symbols'
    histogram and its escapes' diff symbols' histogram; returns the chunk's number of changes. Classes 0-2
    are the diff symbols 0-2, escapes the symbols >= 3; the last quad's padding is class 0."""
    for q in range(qhist.shape[0]):
        for k in range(4):
            cls = (q >> (2 * k)) & 3
            if cls < 3:
                hist[1, cls] += qhist[q]
    hist[1, 0] -= 4 * ((n + 3) // 4) - n
    for s in range(ehist.shape[0]):
        hist[1, s] += ehist[s]
    unchanged = hist[1, 0]
    return n - unchanged


def new_hist() -> np.ndarray:
    return np.zeros((HIST_ROWS, ALPHABET), np.int64)


LIST_MAX = 256  # the list mode is tried for tensors with at most this many changes


@njit(**NJIT)
def encode_list(idx: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The list mode's payload of the changes at sorted flat positions ``idx`` (int64) with changes ``z``
    (each below 2**35, as ``tables.get_varint`` reads): per change, varint gap then varint ``z``."""
    out = np.empty(10 * idx.shape[0], np.uint8)
    k, last = 0, -1
    for j in range(idx.shape[0]):
        k = put_varint(out, k, idx[j] - last - 1)
        k = put_varint(out, k, z[j])
        last = idx[j]
    return out[:k]


@njit(**NJIT)
def aligned_words(p: np.ndarray, c: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """uint64 views of the whole words of two chunk slices of ``lanes`` elements per word, or empty arrays
    if either is not 8-byte aligned (compiled: the same in Python took 5.9 us a call under line_profiler,
    mostly reading ``ctypes.data``)."""
    nw = p.shape[0] // lanes
    if nw == 0 or p.ctypes.data % 8 != 0 or c.ctypes.data % 8 != 0:
        empty = np.zeros(0, np.uint64)
        return empty, empty
    return p[: nw * lanes].view(np.uint64), c[: nw * lanes].view(np.uint64)
