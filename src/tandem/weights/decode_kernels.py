"""Per-chunk numba kernels of the delta codec, decoder side (the stream layout is in ``kernels``).

Invariants: decoders never read or write out of bounds, whatever the input: stream reads are clamped to
the zero-padded rows, positions are checked against the chunk, and they return ``-1`` when a stream is
inconsistent (position past the chunk, bit stream overrun, final rANS state or word count not the ones the
encoder left). Only ``patch_chunk``, ``scatter``, ``decode_dense_chunk`` and ``patch_quads`` write tensor
memory, and only after the streams decoded (sparse) or into a fresh output (dense, quad).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tandem.weights.entropy import (
    BASE,
    DIRECT,
    GOLOMB_FAST_Q,
    NEXTRA,
    NJIT,
    PROB_BITS,
    RANS_L,
    SLOT_MASK,
    golomb_decode,
    low_bits,
    peek,
    rans_dec,
)
from tandem.weights.kernels import (
    ESC_DIRECT,
    ESC_EXP0,
    GAP_TABLE,
    LANES,
    aligned_words,
    escape_positions,
    from_key,
    to_key,
    unzigzag,
)
from tandem.weights.tables import get_varint


@njit(**NJIT)
def patched(pu: int, zz: int, sign: int, mask: int) -> int:
    """The new bit pattern of an element whose old pattern is ``pu`` and whose change is ``zz``."""
    return from_key((to_key(pu, sign, mask) + unzigzag(zz)) & mask, sign, mask)


@njit(**NJIT)
def decode_sparse_chunk(
    size: int,
    n: int,
    gap_mode: int,
    glut: np.ndarray,
    gfreq: np.ndarray,
    gcum: np.ndarray,
    dlut: np.ndarray,
    dfreq: np.ndarray,
    dcum: np.ndarray,
    m: int,
    b: int,
    u: int,
    rwords: np.ndarray,
    rlens: np.ndarray,
    bwords: np.ndarray,
    nbits: int,
    idx_out: np.ndarray,
    z_out: np.ndarray,
    p: np.ndarray,
    sign: int,
    mask: int,
    base: int,
    vals_out: np.ndarray,
) -> int:
    """Decode the ``n`` changes of a chunk of ``size`` elements; 0 on success, -1 if the streams are
    inconsistent. ``rwords`` rows are the gap and diff streams (``rlens`` words each, rows padded by at least
    one zero word), ``bwords`` carries two words of padding. Two outputs (arrays of length ``n``):

    - ``vals_out`` empty: positions within the chunk into ``idx_out`` and changes into ``z_out``
      (``p``, ``sign``, ``mask`` and ``base`` unused);
    - else the patch itself: flat positions ``base + i`` into ``idx_out`` and new bit patterns
      ``patched(p[i], z)`` into ``vals_out`` (``p`` the chunk's base elements, ``z_out`` unused). One pass,
      no array of changes in between and no copies to offset and join the chunks' results: preparing a
      100M-parameter model's delta (1.7M changes) took 57-77 ms against 65-86 ms for decoding, gathering
      and joining apart. Loading the base in blocks of 64 changes after decoding them was no faster.

    Reads ``p`` only at positions already checked against the chunk; touches no tensor memory (see
    ``patch_chunk``)."""
    cols, nw = rwords.shape[1], bwords.shape[0]
    table = gap_mode == GAP_TABLE
    values = vals_out.shape[0] > 0
    if cols <= max(rlens[0], rlens[1]) or rlens[1] < 2 or (table and rlens[0] < 2) or nw < 2:
        return -1
    outs_short = vals_out.shape[0] < n or p.shape[0] < size if values else z_out.shape[0] < n
    if idx_out.shape[0] < n or outs_short:
        return -1
    xg = np.uint64(rwords[0, 0]) | (np.uint64(rwords[0, 1]) << np.uint64(16))
    xd = np.uint64(rwords[1, 0]) | (np.uint64(rwords[1, 1]) << np.uint64(16))
    rg, rd, pos, last = 2, 2, 0, -1
    for k in range(n):
        if table:
            s = np.int64(glut[xg & SLOT_MASK])
            xg, low = rans_dec(xg, gfreq[s], gcum[s], rwords[0, min(rg, cols - 1)])
            rg += low
            j = min(pos >> 6, nw - 2)
            gap = BASE[s] + low_bits(peek(bwords[j], bwords[j + 1], pos & 63), NEXTRA[s])
            pos += NEXTRA[s]
        else:
            q_long = 0
            while True:
                j = min(pos >> 6, nw - 2)
                gap, used = golomb_decode(peek(bwords[j], bwords[j + 1], pos & 63), m, b, u)
                if gap >= 0:
                    if q_long > size // m:  # a gap past the chunk (and no int64 overflow computing it)
                        return -1
                    pos += used
                    gap += q_long * m
                    break
                q_long += GOLOMB_FAST_Q
                pos += GOLOMB_FAST_Q
                if pos > nbits:
                    return -1
        if gap >= size - last:  # checked before adding: a crafted gap had wrapped ``last`` negative
            return -1
        last = last + 1 + gap
        if last >= size or pos > nbits:
            return -1
        s = np.int64(dlut[xd & SLOT_MASK])
        xd, low = rans_dec(xd, dfreq[s], dcum[s], rwords[1, min(rd, cols - 1)])
        rd += low
        j = min(pos >> 6, nw - 2)
        zz = BASE[s] + low_bits(peek(bwords[j], bwords[j + 1], pos & 63), NEXTRA[s])
        pos += NEXTRA[s]
        if values:
            idx_out[k] = base + last
            vals_out[k] = patched(np.int64(p[last]), zz, sign, mask)
        else:
            idx_out[k] = last
            z_out[k] = zz
    ok_g = not table or (xg == np.uint64(RANS_L) and rg == rlens[0])
    return 0 if ok_g and xd == np.uint64(RANS_L) and rd == rlens[1] and pos == nbits else -1


@njit(**NJIT)
def decode_list(
    buf: np.ndarray, n: int, size: int, p: np.ndarray, idx_out: np.ndarray, vals_out: np.ndarray, sign: int,
    mask: int,
) -> int:  # fmt: skip
    """Decode a list-mode payload (``kernels.encode_list``) of ``n`` changes to a tensor of ``size``
    elements: flat positions into ``idx_out`` and, unless ``vals_out`` is empty, the new bit patterns
    ``patched(p[i], z)`` into ``vals_out``. 0 on success, -1 if a varint is truncated, a position falls
    outside the tensor, or the payload does not end after the ``n``-th change. Reads ``p`` only at checked
    positions; writes no tensor memory."""
    values = vals_out.shape[0] > 0
    if idx_out.shape[0] < n or (values and (vals_out.shape[0] < n or p.shape[0] < size)):
        return -1
    pos, last = 0, -1
    for k in range(n):
        gap, pos = get_varint(buf, pos)
        if gap < 0 or gap >= size - last - 1:  # checked before adding (as in the sparse decoder)
            return -1
        zz, pos = get_varint(buf, pos)
        if zz < 0:
            return -1
        last += 1 + gap
        idx_out[k] = last
        if values:
            vals_out[k] = patched(np.int64(p[last]), zz, sign, mask)
    return 0 if pos == buf.shape[0] else -1


@njit(**NJIT)
def patch_chunk(p: np.ndarray, out: np.ndarray, idx: np.ndarray, z: np.ndarray, sign: int, mask: int) -> None:
    """``out[idx] = new(p[idx], z)``. A tight loop of independent iterations, so the CPU overlaps the cache
    misses of scattered positions (``out`` may be ``p``; positions were validated by the decoder)."""
    for k in range(idx.shape[0]):
        i = idx[k]
        out[i] = patched(np.int64(p[i]), z[k], sign, mask)


@njit(**NJIT)
def scatter(flat: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    """``flat[idx] = values`` (positions are trusted: callers validated them)."""
    for k in range(idx.shape[0]):
        flat[idx[k]] = values[k]


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def scatter_bits(flat: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    """``flat[idx] = values`` for a 1-D contiguous ``flat`` and ``values`` of its dtype, bit-exact for any
    dtype (copied as unsigned integers of the same width through ``scatter``; NumPy's fancy assignment
    otherwise). Positions are trusted."""
    view = _UINT.get(flat.dtype.itemsize)
    if view is None or values.dtype != flat.dtype or not flat.flags.c_contiguous or flat.ndim != 1:
        flat[idx] = values
        return
    scatter(flat.view(view), np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(values).view(view))


@njit(**NJIT)
def _row_of(x: int, o: int, base: int, in_dim: int) -> tuple[int, int]:
    """The row ``o`` of flat index ``x`` in rows of ``in_dim`` and that row's first index, given the previous
    ``(o, base)``: counted forward a few rows at a time when ``x`` is close ahead (the usual case for
    ascending indices of a few-percent delta), divided otherwise (any order stays correct)."""
    if x < base or x - base >= 8 * in_dim:
        o = x // in_dim
        return o, o * in_dim
    while x - base >= in_dim:
        o += 1
        base += in_dim
    return o, base


@njit(**NJIT)
def transposed_order(
    idx: np.ndarray, values: np.ndarray, in_dim: int, stride: int, offset: int, out_pos: np.ndarray,
    out_values: np.ndarray,
) -> None:  # fmt: skip
    """The writes of W's flat indices ``idx`` (``W[o, i]`` at ``i * stride + offset + o`` of a transposed
    buffer) listed in buffer order: ``out_pos`` ascending when ``idx`` is ascending, ``out_values[k]`` the
    value to write at ``out_pos[k]`` (a stable counting sort by column, O(n + in_dim), that moves the values
    in the same pass). Scattering in this order writes the transposed buffer front to back. Rows are found
    by ``_row_of`` rather than two 64-bit divisions per index: 5.3-5.8 instead of 6.4-6.7 ns per index at
    1.67% density here (the rest is the cache misses of the counts and the output)."""
    count = np.zeros(in_dim + 1, np.int64)
    o, base = 0, 0
    for k in range(idx.shape[0]):
        o, base = _row_of(idx[k], o, base, in_dim)
        count[idx[k] - base + 1] += 1
    for i in range(in_dim):
        count[i + 1] += count[i]
    o, base = 0, 0
    for k in range(idx.shape[0]):
        o, base = _row_of(idx[k], o, base, in_dim)
        i = idx[k] - base
        at = count[i]
        count[i] = at + 1
        out_pos[at] = i * stride + offset + o
        out_values[at] = values[k]


@njit(**NJIT)
def decode_dense_chunk(
    p: np.ndarray,
    out: np.ndarray,
    dlut: np.ndarray,
    dfc: np.ndarray,
    rwords: np.ndarray,
    rlens: np.ndarray,
    bwords: np.ndarray,
    nbits: int,
    sign: int,
    mask: int,
    dkey: np.ndarray,
) -> int:
    """Rewrite ``out`` from ``p`` and the dense streams; 0 on success, -1 if the streams are inconsistent.
    ``dkey`` is ``DKEY`` (passed in: numba reads argument arrays faster than global constant arrays).
    Three passes: rANS symbols, a vectorisable patch of every element by its symbol's small change, then
    the few elements whose change carries raw bits."""
    n = p.shape[0]
    syms = np.empty(n, np.uint8)
    if dense_symbols_from_streams(dlut, dfc, rwords, rlens, syms) != 0:
        return -1
    top, low = (15 if mask == 0xFFFF else 31), mask >> 1
    for i in range(n):  # patched() written out branch-free, with the key delta looked up per symbol
        u = np.int64(p[i])
        k = (u ^ sign ^ (((u >> top) & 1) * low)) + dkey[syms[i]]
        k &= mask
        out[i] = k ^ sign ^ ((1 - ((k >> top) & 1)) * low)
    pos, nw = 0, bwords.shape[0]
    for i in range(n):
        s = syms[i]
        if s >= DIRECT:
            j = min(pos >> 6, nw - 2)
            zz = BASE[s] + low_bits(peek(bwords[j], bwords[j + 1], pos & 63), NEXTRA[s])
            pos += NEXTRA[s]
            out[i] = patched(np.int64(p[i]), zz, sign, mask)
    return 0 if pos == nbits else -1


@njit(**NJIT)
def patch_quads(
    p: np.ndarray, out: np.ndarray, quads: np.ndarray, esyms: np.ndarray, bwords: np.ndarray, nbits: int,
    sign: int, mask: int,
) -> int:  # fmt: skip
    """Rewrite ``out`` from ``p``, a quad chunk's quads (``ceil(len(p) / 4)`` of them) and its escapes'
    codes (``kernels.escape_code``) and raw bits (layout in ``tandem.weights.kernels``); 0 on success, -1
    if they are inconsistent (classes past the end, escape count, bit count). Where ``p`` or ``out`` is
    not 8-byte aligned every element takes the one-element path. Passes: a vectorisable patch of the whole
    words (``patch_words16``/``patch_words32``; an escape gets change 0 there), the elements left, the
    escapes' positions (``kernels.escape_positions``), then the escapes. Every read stays in bounds
    whatever the arrays hold; escapes are written only at positions inside the chunk."""
    n = p.shape[0]
    nq = (n + 3) // 4
    if quads.shape[0] != nq or bwords.shape[0] < 2:
        return -1
    if n % 4 and quads[nq - 1] >> (2 * (n % 4)) != 0:
        return -1  # classes for elements past the end
    wide = mask != 0xFFFF
    p64, o64 = aligned_words(p, out, 2 if wide else 4)
    done = 0
    if p64.shape[0] > 0:
        done = patch_words32(p64, quads, o64) if wide else patch_words16(p64, quads, o64)
    top, low = (31 if wide else 15), mask >> 1
    for i in range(done, n):  # elements outside whole words: the same change, one element at a time
        c = (np.int64(quads[i >> 2]) >> (2 * (i & 3))) & 3
        u = np.int64(p[i])
        k = (u ^ sign ^ (((u >> top) & 1) * low)) + (c >> 1) - (c & 1)  # class 1: -1, 2: +1, 0 and 3: 0
        k &= mask
        out[i] = k ^ sign ^ ((1 - ((k >> top) & 1)) * low)
    # Listing the escapes first, then patching them, was faster than patching each as it was found (this
    # kernel took 2.70 against 2.98 ms per version of the shipped model, with the escapes' bits then read
    # for every escape) and than both block by block (2.84-3.25 ms for blocks of 128K-4K elements).
    where, m = escape_positions(quads)
    if m != esyms.shape[0]:
        return -1
    pos, nw = 0, bwords.shape[0]
    for e in range(m):
        i = where[e]
        zz = np.int64(esyms[e])
        if zz >= ESC_DIRECT:  # rare (a change of over a hundred steps): the code's raw bits
            k = zz - ESC_DIRECT + ESC_EXP0
            w = min(pos >> 6, nw - 2)
            zz = (np.int64(1) << k) | low_bits(peek(bwords[w], bwords[w + 1], pos & 63), k)
            pos += k
        out[i] = patched(np.int64(p[i]), zz, sign, mask)
    return 0 if pos == nbits else -1


@njit(**NJIT)
def patch_words16(p64: np.ndarray, quads: np.ndarray, o64: np.ndarray) -> int:
    """Patch whole words of four 16-bit elements, word ``j`` by quad ``j``'s classes (1: key - 1, 2: key + 1,
    0 and 3: unchanged): to key, add, from key, with SWAR arithmetic confined to the 16-bit lanes (no
    branches, no multiplies, so LLVM vectorises it). Returns the number of elements written."""
    hi, lo = np.uint64(0x8000800080008000), np.uint64(0x7FFF7FFF7FFF7FFF)
    ones, top, one = np.uint64(0x0001000100010001), np.uint64(15), np.uint64(1)
    for j in range(p64.shape[0]):
        q = np.uint64(quads[j])  # classes at bits 2k -> lane k's low two bits (bits 16k, 16k + 1)
        spread = (q & np.uint64(3)) | ((q & np.uint64(0xC)) << np.uint64(14))
        spread |= ((q & np.uint64(0x30)) << np.uint64(28)) | ((q & np.uint64(0xC0)) << np.uint64(42))
        o64[j] = _swar_step(p64[j], spread & ones, (spread >> one) & ones, hi, lo, ones, top)
    return 4 * p64.shape[0]


@njit(**NJIT)
def patch_words32(p64: np.ndarray, quads: np.ndarray, o64: np.ndarray) -> int:
    """``patch_words16`` for 32-bit elements: two words per quad, whole quads only. Returns the number of
    elements written."""
    hi, lo = np.uint64(0x8000000080000000), np.uint64(0x7FFFFFFF7FFFFFFF)
    ones, top, one = np.uint64(0x0000000100000001), np.uint64(31), np.uint64(1)
    m2, m4, s30, s4 = np.uint64(3), np.uint64(0xC), np.uint64(30), np.uint64(4)
    nq = p64.shape[0] // 2
    for j in range(nq):
        q = np.uint64(quads[j])
        a = (q & m2) | ((q & m4) << s30)
        b = ((q >> s4) & m2) | (((q >> s4) & m4) << s30)
        o64[2 * j] = _swar_step(p64[2 * j], a & ones, (a >> one) & ones, hi, lo, ones, top)
        o64[2 * j + 1] = _swar_step(p64[2 * j + 1], b & ones, (b >> one) & ones, hi, lo, ones, top)
    return 4 * nq


@njit(**NJIT)
def _swar_step(x: int, down: int, up: int, hi: int, lo: int, ones: int, top: int) -> int:
    """Every lane of the word ``x`` (bit patterns; ``hi`` marks the lanes' top bits, ``lo`` the others,
    ``ones`` their lowest bits, ``top`` = lane width - 1) moved by ``up - down`` (0 or 1 each) in
    ordered-key space, each lane wrapping on its own like ``patched``."""
    neg = (x >> top) & ones
    key = x ^ hi ^ ((neg << top) - neg)  # to key: a negative lane flips every bit, a positive one its top
    a = ((key & lo) + up) ^ (key & hi)  # + up per lane: a carry out of the low bits flips the top bit
    k = ((a | hi) - down) ^ (hi & ~a)  # - down per lane: the top bit lends, and is restored by the xor
    pos = (~k >> top) & ones
    return k ^ hi ^ ((pos << top) - pos)  # from key


@njit(**NJIT)
def dense_symbols_from_streams(
    dlut: np.ndarray, dfc: np.ndarray, rwords: np.ndarray, rlens: np.ndarray, syms: np.ndarray
) -> int:
    """Decode one symbol per element, element ``i`` from row ``i % 4`` of ``rwords`` (``dfc`` packs
    freq | cum << 16); 0 if every stream ends exactly where the encoder left it, else -1. Written out by
    hand for speed: unsigned indices (no negative-index fix-ups), one table load per symbol, branch-free
    renormalisation, reads clamped to the padded rows."""
    n, cols = syms.shape[0], rwords.shape[1]
    if cols < 3 or cols <= rlens.max():
        return -1
    w0, w1, w2, w3 = rwords[0], rwords[1], rwords[2], rwords[3]
    msk, sh, wb, lo = SLOT_MASK, np.uint64(PROB_BITS), np.uint64(16), np.uint64(RANS_L)
    f16, last = np.uint64(0xFFFF), np.uint64(cols - 1)
    x0 = np.uint64(w0[0]) | (np.uint64(w0[1]) << wb)
    x1 = np.uint64(w1[0]) | (np.uint64(w1[1]) << wb)
    x2 = np.uint64(w2[0]) | (np.uint64(w2[1]) << wb)
    x3 = np.uint64(w3[0]) | (np.uint64(w3[1]) << wb)
    r0 = r1 = r2 = r3 = np.uint64(2)
    for i in range(0, n - n % 4, 4):
        s0, s1, s2, s3 = dlut[x0 & msk], dlut[x1 & msk], dlut[x2 & msk], dlut[x3 & msk]
        syms[np.uint64(i)], syms[np.uint64(i + 1)] = s0, s1
        syms[np.uint64(i + 2)], syms[np.uint64(i + 3)] = s2, s3
        e0, e1, e2, e3 = np.uint64(dfc[s0]), np.uint64(dfc[s1]), np.uint64(dfc[s2]), np.uint64(dfc[s3])
        x0 = (e0 & f16) * (x0 >> sh) + (x0 & msk) - (e0 >> wb)
        x1 = (e1 & f16) * (x1 >> sh) + (x1 & msk) - (e1 >> wb)
        x2 = (e2 & f16) * (x2 >> sh) + (x2 & msk) - (e2 >> wb)
        x3 = (e3 & f16) * (x3 >> sh) + (x3 & msk) - (e3 >> wb)
        l0, l1, l2, l3 = x0 < lo, x1 < lo, x2 < lo, x3 < lo
        y0 = (x0 << wb) | np.uint64(w0[min(r0, last)])
        y1 = (x1 << wb) | np.uint64(w1[min(r1, last)])
        y2 = (x2 << wb) | np.uint64(w2[min(r2, last)])
        y3 = (x3 << wb) | np.uint64(w3[min(r3, last)])
        x0, x1, x2, x3 = (y0 if l0 else x0), (y1 if l1 else x1), (y2 if l2 else x2), (y3 if l3 else x3)
        r0, r1, r2, r3 = r0 + np.uint64(l0), r1 + np.uint64(l1), r2 + np.uint64(l2), r3 + np.uint64(l3)
    xs = [x0, x1, x2, x3]
    rs = [r0, r1, r2, r3]
    for i in range(n - n % 4, n):  # the tail: lanes 0..2 once more
        lane = i & 3
        x = xs[lane]
        s = dlut[x & msk]
        syms[i] = s
        e = np.uint64(dfc[s])
        x = (e & f16) * (x >> sh) + (x & msk) - (e >> wb)
        if x < lo:
            x = (x << wb) | np.uint64(rwords[lane, min(rs[lane], last)])
            rs[lane] += np.uint64(1)
        xs[lane] = x
    ok = True
    for lane in range(LANES):
        ok = ok and xs[lane] == lo and rs[lane] == np.uint64(rlens[lane])
    return 0 if ok else -1
