"""The tensor codec (``tandem.weights.codec`` + ``decoder``): bit-exact round trips for every dtype and mode,
edge values, corruption detection, mismatch errors, determinism across threads, size near the bound."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from tandem.weights import codec
from tandem.weights.blob import (
    DENSE,
    IDENT,
    LIST,
    MODE_NAMES,
    QUAD,
    RAW,
    SPARSE,
    XOR_ZSTD,
    CorruptDeltaError,
    parse_header,
)
from tandem.weights.bound import entropy_bound_bits
from tandem.weights.codec import CHUNK_LOG2, TensorEncoder, encode_tensor, key_spec
from tandem.weights.decoder import TensorDecoder, decode_tensor
from tandem.weights.entropy import ALPHABET, bucket, golomb_params
from tandem.weights.kernels import (
    ESC_DIRECT,
    GAP_GOLOMB,
    GAP_TABLE,
    QUAD_ALPHABET,
    escape_code,
    escape_positions,
    quad_scan,
)

SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 65504.0, -1.0]


def bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns as uint16, the way the trainer publishes them."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).bfloat16().view(torch.uint16).numpy()


def as_dtype(x: np.ndarray, kind: str) -> np.ndarray:
    return bf16(x) if kind == "bf16" else x.astype(kind)


def roundtrip(prev: np.ndarray, cur: np.ndarray, threads: int = 1) -> bytes:
    blob = encode_tensor(prev, cur, threads=threads)
    out = decode_tensor(prev, blob, threads=threads)
    assert out.dtype == cur.dtype and out.shape == cur.shape
    assert out.tobytes() == cur.tobytes()
    return blob


def mode_of(blob: bytes) -> int:
    return parse_header(blob).mode


def adam_like(n: int, lr: float, kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32) * 0.02
    step = lr * rng.standard_normal(n).astype(np.float32)
    return as_dtype(w, kind), as_dtype(w + step, kind)


@pytest.mark.parametrize("kind", ["bf16", "float16", "float32"])
@pytest.mark.parametrize("lr", [1e-7, 3e-6, 1e-4])
def test_float_roundtrip_is_bit_exact_sparse_and_dense(kind, lr):
    prev, cur = adam_like(200_003, lr, kind)
    blob = roundtrip(prev, cur.reshape(prev.shape))
    assert mode_of(blob) in (SPARSE, DENSE, QUAD)


@pytest.mark.parametrize("kind", ["bf16", "float16", "float32"])
@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 1, (1 << 16) + 2, (1 << 16) + 3, (1 << CHUNK_LOG2) + 2])
def test_dense_changes_take_the_quad_mode_bit_exactly_with_every_tail(kind, n):
    """Dense changes of +-1 step (the classes) mixed with larger ones and specials (the escapes), for
    element counts that leave 0-3 elements in the last quad and span two chunks."""
    rng = np.random.default_rng(n)
    prev = as_dtype(rng.standard_normal(n).astype(np.float32) * 0.02, kind)
    bits = prev.view(np.uint16 if kind != "float32" else np.uint32)
    cur_bits = bits.copy()
    pick = rng.random(n)
    cur_bits[pick < 0.5] += 1
    cur_bits[(pick >= 0.5) & (pick < 0.7)] -= 1
    big = pick >= 0.92
    cur_bits[big] += rng.integers(2, 5000, int(big.sum())).astype(cur_bits.dtype)
    cur = cur_bits.view(prev.dtype)
    cur[-3:] = as_dtype(np.array(SPECIALS[:3], np.float32), kind)
    blob = roundtrip(prev, cur)
    assert mode_of(blob) == QUAD
    live = prev.copy()  # the engine path: prepared against live tensors, then applied
    dec = TensorDecoder("w", live, blob, prepare=True)
    for t in dec.tasks():
        t()
    dec.patch().apply(live)
    assert live.tobytes() == cur.tobytes()


@pytest.mark.parametrize("escape_rate", [0.0, 0.08, 0.5, 1.0])
def test_escape_positions_list_every_class_3_element_in_order(escape_rate):
    """Every quad count from 0 to 80 (whole 8-quad words, an odd number of them, and 0-7 quads after the
    last one), on an unaligned slice as well."""
    rng = np.random.default_rng(int(escape_rate * 100))
    for nq in range(81):
        classes = rng.integers(0, 3, 4 * nq)
        classes[rng.random(4 * nq) < escape_rate] = 3
        quads = (classes.reshape(nq, 4) << np.array([0, 2, 4, 6])).sum(axis=1).astype(np.uint8)
        expected = np.flatnonzero(classes == 3)
        unaligned = np.empty(nq + 1, np.uint8)[1:]
        unaligned[:] = quads
        for q in (quads, unaligned):
            where, m = escape_positions(q)
            assert m == expected.shape[0]
            assert where[:m].tolist() == expected.tolist()


def _dense_change(n: int, seed: int, ones: float, big: float) -> tuple[np.ndarray, np.ndarray]:
    """bf16 weights and a dense change of them: a fraction ``ones`` of the elements one key step down or up
    (half each), a fraction ``big`` by up to 5000 steps (escapes, many with raw bits), the rest unchanged."""
    rng = np.random.default_rng(seed)
    prev = bf16(rng.standard_normal(n).astype(np.float32) * 0.02)
    pick = rng.random(n)
    step = np.where(pick < ones / 2, 1, np.where(pick < ones, -1, 0))
    step[pick >= 1 - big] = rng.integers(-5000, 5000, int((pick >= 1 - big).sum()))
    return prev, _key_step(prev, step, 16)


def _key_step(bits: np.ndarray, step: np.ndarray, width: int) -> np.ndarray:
    """Bit patterns moved by ``step`` in ordered-key space (wrapping at the key range's ends)."""
    sign, mask = 1 << (width - 1), (1 << width) - 1
    u = bits.astype(np.int64)
    key = np.where(u & sign, u ^ mask, u | sign)
    k = (key + step) & mask
    return np.where(k & sign, k ^ sign, k ^ mask).astype(bits.dtype)


@pytest.mark.parametrize("width", [16, 32])
def test_quad_steps_wrap_like_the_key_model_on_every_boundary_and_an_unaligned_base(width):
    """The quad decoder's word-at-a-time patch (several elements per 64-bit word) must move each element
    exactly like the one-element model: +-1 key steps across +-0, the infinities, NaN patterns and both
    ends of the key range. Also decoded against a base that is not 8-byte aligned (one element at a
    time there)."""
    rng = np.random.default_rng(width)
    dt = np.uint16 if width == 16 else np.uint32
    n = 1 << 16
    edges = [0, 1, 0x7F80, 0x7F81, 0x7FFF, 0x8000, 0x8001, 0xFF80, 0xFFFE, 0xFFFF]
    if width == 32:
        edges = [0, 1, 0x7F800000, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFF, 0xFFFFFFFE]
    prev = rng.integers(0, 1 << width, n, dtype=np.uint64).astype(dt)
    prev[: 4 * len(edges) * 3] = np.repeat(edges, 4 * 3)  # every edge in every lane, with each step
    step = rng.choice([0, 0, -1, 1], n)
    step[: 4 * len(edges) * 3] = np.tile(np.repeat([-1, 1, 0], 4), len(edges))
    step[rng.random(n) < 0.05] = 7  # some escapes
    cur = _key_step(prev, step, width)
    if width == 32:  # float32 has the key model; uint16 is read as bfloat16 bit patterns
        prev, cur = prev.view(np.float32), cur.view(np.float32)
    blob = roundtrip(prev, cur)
    assert mode_of(blob) == QUAD
    raw = np.zeros(prev.nbytes + 8, np.uint8)
    unaligned = raw[prev.itemsize : prev.itemsize + prev.nbytes].view(prev.dtype)
    unaligned[:] = prev
    assert unaligned.ctypes.data % 8 != 0
    assert decode_tensor(unaligned, blob).tobytes() == cur.tobytes()


@pytest.mark.parametrize("width", [16, 32])
def test_quad_escapes_round_the_saturated_byte_are_exact(width):
    """The quad scan keeps each element's ``min(z, 255)`` in one byte and recomputes ``z`` from the elements
    where the byte saturated: key steps whose zigzag code is just below, at and above 255 and the first
    code with raw bits (``ESC_DIRECT``), and far beyond, both directions, in every lane of a quad, must
    round-trip; the escapes' codes must be ``escape_code``'s and their histogram the dense mode's buckets
    of every escape."""
    rng = np.random.default_rng(7 + width)
    dt = np.uint16 if width == 16 else np.uint32
    n = 1 << 15
    prev = rng.integers(0, 1 << width, n, dtype=np.uint64).astype(dt)
    step = rng.choice([0, 0, -1, 1], n)
    far = [2, -2, 8, -8, 111, -112, 112, 126, 127, -127, -128, 128, -129, 129, 1000, -30000, 30001]
    at = rng.choice(n, 16 * len(far), replace=False)
    step[at] = np.resize(far, at.size)
    cur = _key_step(prev, step, width)
    if width == 32:
        prev, cur = prev.view(np.float32), cur.view(np.float32)
    blob = roundtrip(prev, cur)
    assert mode_of(blob) == QUAD

    spec = key_spec(prev.dtype)
    p, c = prev.view(spec.bits_dtype), cur.view(spec.bits_dtype)
    qhist, ehist = np.zeros(QUAD_ALPHABET, np.int64), np.zeros(ALPHABET, np.int64)
    esyms, _, _, _ = quad_scan(p, c, spec.sign, spec.mask, np.empty(n // 4, np.uint8), qhist, ehist)
    key = lambda u: np.where(u & spec.sign, u ^ spec.mask, u | spec.sign).astype(np.int64)  # noqa: E731
    d = key(c.astype(np.int64)) - key(p.astype(np.int64))
    zs = ((d << 1) ^ (d >> 63)).tolist()
    buckets = [bucket(z)[0] for z in zs if z >= 3]
    assert max(zs) > 255 and {254, 255, ESC_DIRECT - 1, ESC_DIRECT} <= set(zs)
    assert esyms.tolist() == [escape_code(z)[0] for z in zs if z >= 3]
    assert ehist.tolist() == np.bincount(buckets, minlength=ALPHABET).tolist()


@pytest.mark.parametrize("kind", ["bf16", "float16", "float32"])
def test_special_values_round_trip(kind):
    rng = np.random.default_rng(1)
    prev = as_dtype(rng.standard_normal(4000).astype(np.float32), kind)
    cur = prev.copy()
    specials = as_dtype(np.array(SPECIALS, np.float32), kind)
    cur[:10] = specials  # finite -> special
    prev[100:110] = specials  # special -> finite
    cur[200:210] = specials[::-1]
    prev[200:210] = specials
    roundtrip(prev, cur)
    if kind != "bf16":  # NaN payloads survive too
        bits = cur.view(np.uint16 if kind == "float16" else np.uint32)
        bits[300] = 0x7E01 if kind == "float16" else 0x7FC00123
        roundtrip(prev, cur)


def test_every_16_bit_pattern_maps_to_every_other():
    p = np.arange(65536, dtype=np.uint16)
    roundtrip(p, p[::-1].copy())
    roundtrip(p, np.roll(p, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16, np.int64, np.bool_])
def test_empty_and_zero_dim_tensors(dtype):
    roundtrip(np.zeros((0, 7), dtype), np.zeros((0, 7), dtype))
    a, b = np.array(1, dtype), np.array(0, dtype)
    assert mode_of(roundtrip(a, a.copy())) == IDENT
    roundtrip(a, b)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8, np.float64, np.bool_, np.complex64])
def test_other_dtypes_use_the_dense_fallback(dtype):
    rng = np.random.default_rng(2)
    prev = (rng.standard_normal((40, 25)) * 50).astype(dtype)
    cur = prev.copy()
    cur[3, 4] = ~cur[3, 4] if dtype is np.bool_ else cur[3, 4] + 1
    blob = roundtrip(prev, cur)
    assert mode_of(blob) == XOR_ZSTD and parse_header(blob).changed == 1
    assert mode_of(roundtrip(prev, prev.copy())) == IDENT


def test_identical_tensor_costs_only_a_header():
    prev, _ = adam_like(1 << 16, 0, "bf16")
    blob = roundtrip(prev, prev.copy())
    assert mode_of(blob) == IDENT and len(blob) < 24


def test_random_bits_fall_back_to_raw():
    rng = np.random.default_rng(3)
    prev = rng.integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32)
    cur = rng.integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32)
    blob = roundtrip(prev, cur)
    assert mode_of(blob) == RAW and len(blob) < cur.nbytes + 32


def test_both_gap_coders_are_used_and_exact():
    gap_modes = set()
    for n, p in [(3000, 0.01), (3 << 20, 0.004), (1 << 20, 0.05)]:
        rng = np.random.default_rng(n)
        prev = rng.integers(0, 1 << 14, n).astype(np.uint16)
        cur = prev.copy()
        idx = rng.choice(n, int(n * p), replace=False)
        cur[idx] += rng.choice(np.array([1, 2], np.uint16), idx.size)
        blob = roundtrip(prev, cur)
        h = parse_header(blob)
        assert h.mode == SPARSE
        gap_modes.add(blob[h.payload_start])
    assert gap_modes == {GAP_TABLE, GAP_GOLOMB}


def test_multi_chunk_output_does_not_depend_on_threads():
    prev, cur = adam_like((1 << CHUNK_LOG2) * 2 + 12345, 3e-6, "bf16", seed=4)
    one = encode_tensor(prev, cur, threads=1)
    assert encode_tensor(prev, cur, threads=2) == one
    assert decode_tensor(prev, one, threads=2).tobytes() == cur.tobytes()


def test_bits_per_param_within_115_percent_of_the_entropy_bound():
    n = 1 << 21
    rng = np.random.default_rng(5)
    prev = bf16(rng.standard_normal(n).astype(np.float32) * 0.02)
    cur = prev.copy()
    idx = rng.choice(n, n // 100, replace=False)
    step = np.where(rng.random(idx.size) < 0.5, 1, -1)
    step[rng.random(idx.size) < 0.03] *= 2  # a few 2-ulp steps
    bits = prev[idx].astype(np.int64)
    keys = np.where(bits & 0x8000, bits ^ 0xFFFF, bits | 0x8000) + step  # +-1 ulp in value order
    cur[idx] = np.where(keys & 0x8000, keys ^ 0x8000, keys ^ 0xFFFF).astype(np.uint16)
    blob = roundtrip(prev, cur)
    bound = entropy_bound_bits(prev, cur)
    bits = 8 * len(blob) / n
    assert 0.05 < bound < 0.2
    assert bits <= 1.15 * bound, (bits, bound)


def test_a_flipped_byte_is_detected_before_decoding():
    prev, cur = adam_like(50_000, 3e-6, "bf16")
    blob = bytearray(encode_tensor(prev, cur))
    for pos in (0, 5, len(blob) // 2, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptDeltaError, match="corrupt"):
            decode_tensor(prev, bytes(bad))
    with pytest.raises(CorruptDeltaError, match="truncated"):
        decode_tensor(prev, bytes(blob[:5]))


def test_corruption_behind_a_valid_checksum_never_crashes():
    """Flip bytes and re-seal the crc: the decoder must raise or return some tensor, never read or write
    out of bounds (the version hash of ``decode_delta`` catches what stream checks cannot)."""
    rng = np.random.default_rng(6)
    modes = set()
    for kind, lr in [("bf16", 3e-6), ("bf16", 1e-4), ("float32", 3e-6), ("bf16", 1e-2), ("float32", 1e-1)]:
        prev, cur = adam_like(20_000, lr, kind)
        blob = encode_tensor(prev, cur)
        modes.add(mode_of(blob))
        for _ in range(60):
            bad = bytearray(blob[:-4])
            bad[int(rng.integers(3, len(bad)))] ^= int(rng.integers(1, 256))
            bad += zlib.crc32(bad).to_bytes(4, "little")
            try:
                out = decode_tensor(prev, bytes(bad))
            except (CorruptDeltaError, ValueError):
                continue
            assert out.shape == prev.shape
    assert {SPARSE, QUAD} <= modes


def test_mismatched_tensors_are_refused_with_names():
    a = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"'w'.*shape \[3, 4\].*shape \[4, 3\]"):
        encode_tensor(a, np.zeros((4, 3), np.float32), name="w")
    with pytest.raises(ValueError, match="float16"):
        encode_tensor(a, a.astype(np.float16))
    blob = encode_tensor(a, a + 1)
    with pytest.raises(ValueError, match=r"expects dtype float32 shape \[3, 4\]"):
        decode_tensor(np.zeros((2, 6), np.float32), blob)


@pytest.mark.parametrize("kind", ["bf16", "float32"])
def test_prepared_patch_writes_only_changed_elements(kind):
    """A sparse patch over three chunks (each decodes into its own slice of the patch's arrays, here in
    reverse order): the flat positions of exactly the changed elements and their new bit patterns."""
    rng = np.random.default_rng(3)
    prev = as_dtype(rng.standard_normal(2_500_003).astype(np.float32) * 0.02, kind)
    cur_bits = prev.view(np.uint16 if kind == "bf16" else np.uint32).copy()
    moved = rng.random(cur_bits.shape[0]) < 0.02
    cur_bits[moved] += rng.integers(1, 40, int(moved.sum())).astype(cur_bits.dtype)
    cur = cur_bits.view(prev.dtype)
    blob = encode_tensor(prev, cur)
    live = prev.copy()
    dec = TensorDecoder("w", live, blob, prepare=True)
    tasks = dec.tasks()
    assert len(tasks) == 3
    for t in reversed(tasks):
        t()
    patch = dec.patch()
    assert np.array_equal(live, prev)  # preparing writes nothing
    changed = np.flatnonzero(prev != cur)
    assert np.array_equal(patch.indices, changed)
    assert patch.values.tobytes() == cur.view(patch.values.dtype)[changed].tobytes()
    written = patch.apply(live)
    assert live.tobytes() == cur.tobytes()
    assert np.array_equal(written, changed)
    assert MODE_NAMES[mode_of(blob)] == "sparse"


def test_changed_positions_are_decoded_without_the_base_in_every_mode():
    """``changed_positions`` lists exactly the elements a blob changes, for every mode, from the blob
    alone (an engine that has no base at hand uses it to patch from a verified copy); a blob whose
    streams do not decode is refused naming the tensor."""
    from tandem.weights.decoder import changed_positions

    rng = np.random.default_rng(7)
    cases = [
        adam_like(300_000, 2e-6, "bf16"),
        adam_like(200_003, 1e-4, "bf16"),
        adam_like(100_001, 3e-6, "float32"),
    ]
    # A sparse chunk beside a dense one (the quad mode needs every chunk dense): the per-element dense mode.
    size = 1 << CHUNK_LOG2
    a = rng.integers(0x3C00, 0x3F00, 2 * size, dtype=np.uint16)
    hit = rng.random(2 * size) < np.r_[np.full(size, 0.15), np.full(size, 0.95)]
    b = (a.astype(np.int64) + rng.integers(-3, 4, 2 * size) * hit).astype(np.uint16)
    few = a[:256].copy()
    few[[3, 77, 200]] += 1  # a handful of changes: the list mode
    cases += [(a, b), (a, a), (a[:256], few)]
    modes = set()
    for prev, cur in cases:
        blob = encode_tensor(prev, cur)
        modes.add(mode_of(blob))
        np.testing.assert_array_equal(changed_positions(blob, "w", prev.size), np.flatnonzero(prev != cur))
    assert {SPARSE, QUAD, DENSE, IDENT, LIST} <= modes, [MODE_NAMES[m] for m in modes]
    noise = encode_tensor(*[rng.integers(0, 2**16, 5000, dtype=np.uint16) for _ in "ab"])
    assert changed_positions(noise, "w", 5000) is None
    prev, cur = cases[0]
    bad = bytearray(encode_tensor(prev, cur))
    bad[40] ^= 0x10  # behind a valid checksum: the streams no longer end where the encoder left them
    bad[-4:] = zlib.crc32(bad[:-4]).to_bytes(4, "little")
    with pytest.raises(CorruptDeltaError, match="'w'"):
        changed_positions(bytes(bad), "w", prev.size)


@pytest.mark.parametrize("n", [4096 + 3, 10_000])
def test_the_dense_histogram_from_quads_equals_the_one_from_listing_every_change(n):
    """A dense chunk's histogram is built from its quad and escape histograms (``dense_hist_of_quads``),
    a sparser one's from its listed changes (``change_hist``); the mode choice compares both, so they must
    agree symbol for symbol, and the change count must be the true one (padding of the last quad
    included)."""
    from tandem.weights import kernels as K
    from tandem.weights.blob import key_spec
    from tandem.weights.entropy import ALPHABET

    prev, cur = _dense_change(n, seed=3, ones=0.2, big=0.1)
    spec = key_spec(prev.dtype)
    cap = n + 24
    idx, z = np.empty(cap, np.uint32), np.empty(cap, np.uint64)
    empty = np.zeros(0, np.uint64)
    count = K.scan_chunk(prev, cur, empty, empty, 4, spec.sign, spec.mask, idx, z)
    listed = K.new_hist()
    K.change_hist(idx[:count].copy(), z[:count].copy(), n, listed)
    quads = np.empty((n + 3) // 4, np.uint8)
    qhist, ehist = np.zeros(K.QUAD_ALPHABET, np.int64), np.zeros(ALPHABET, np.int64)
    K.quad_scan(prev, cur, spec.sign, spec.mask, quads, qhist, ehist)
    from_quads = K.new_hist()
    changed = K.dense_hist_of_quads(qhist, ehist, n, from_quads)
    assert changed == count == int(np.count_nonzero(prev != cur))
    assert (from_quads[1] == listed[1]).all()


@pytest.mark.parametrize("n", [4096, 4099, 50_001])
def test_the_fused_quad_scan_equals_the_step_by_step_path_and_its_part_decodes(n):
    """``quad_scan_chunk`` (one compiled call, what the encoder runs) gives the same quads, histograms and
    escapes as ``quad_scan`` and ``dense_hist_of_quads`` called one by one; many escapes carry raw bits.
    The part ``quad_part`` makes of them decodes (``patch_quads``) to the new chunk."""
    from tandem.weights import kernels as K
    from tandem.weights.codec import quad_part

    prev, cur = _dense_change(n, seed=n, ones=0.6, big=0.15)
    spec = key_spec(prev.dtype)

    quads = np.empty((n + 3) // 4, np.uint8)
    qhist, ehist = np.zeros(K.QUAD_ALPHABET, np.int64), np.zeros(ALPHABET, np.int64)
    esyms, ebits, words, enbits = K.quad_scan(prev, cur, spec.sign, spec.mask, quads, qhist, ehist)
    hist = K.new_hist()
    changed = K.dense_hist_of_quads(qhist, ehist, n, hist)

    fused_hist = K.new_hist()
    fused = K.quad_scan_chunk(prev, cur, spec.sign, spec.mask, fused_hist)
    fq, fqh, feh, fchanged, fesyms, febits, fenbits = fused
    assert (fq == quads).all() and (fqh == qhist).all() and (feh == ehist).all()
    assert fchanged == changed == int(np.count_nonzero(prev != cur))
    assert (fused_hist == hist).all() and (fesyms == esyms).all()
    assert fenbits == enbits > 0 and (febits == ebits[:words]).all()

    blob = _quad_blob(prev, quad_part(fq, fesyms, febits, fenbits))
    assert decode_tensor(prev, blob).tobytes() == cur.tobytes()


def _quad_blob(prev: np.ndarray, *parts: bytes) -> bytes:
    """A sealed quad-mode blob of ``prev``'s dtype and shape around the given chunk parts."""
    from tandem.weights.blob import seal, write_header

    out = bytearray()
    write_header(out, QUAD, prev.dtype, prev.shape, 1)
    out.append(CHUNK_LOG2)
    for part in parts:
        out += part
    return seal(out)


def test_a_quad_blob_with_forged_streams_is_refused_before_it_writes_out_of_bounds():
    """Behind a valid checksum: escape codes whose raw bits are missing (the largest code reads 38 bits),
    more or fewer escapes than the quads mark, quads for elements past the end, a frame that holds more
    quads than the chunk or fewer, and a frame whose bytes are not zstd's: each is refused naming the
    tensor, and no read leaves the bit stream's padding."""
    from tandem.weights import zframes
    from tandem.weights.codec import quad_part

    n = 1001  # 250 whole quads and one element in the last
    prev = bf16(np.linspace(-1, 1, n).astype(np.float32))
    quads = np.zeros((n + 3) // 4, np.uint8)
    quads[0] = 0xFF  # four escapes
    good = quad_part(quads, np.array([3, 4, 5, 6], np.uint8), np.zeros(1, np.uint64), 0)
    assert decode_tensor(prev, _quad_blob(prev, good)).shape == prev.shape
    past = quads.copy()
    past[-1] = 0b0100  # class 1 for the element after the last
    no_bits = np.zeros(1, np.uint64)
    forged = {
        "raw bits missing": quad_part(quads, np.array([3, 4, 5, 255], np.uint8), no_bits, 0),
        "raw bits short": quad_part(quads, np.array([3, 255, 255, 6], np.uint8), np.ones(1, np.uint64), 50),
        "too few escapes": quad_part(quads, np.array([3, 4, 5], np.uint8), no_bits, 0),
        "too many escapes": quad_part(quads, np.array([3, 4, 5, 6, 7], np.uint8), no_bits, 0),
        "past the end": quad_part(past, np.array([3, 4, 5, 6], np.uint8), no_bits, 0),
        "quads short": quad_part(quads[:-1], np.array([3, 4, 5, 6], np.uint8), no_bits, 0),
        "quads long": quad_part(np.r_[quads, quads], np.array([3, 4, 5, 6], np.uint8), no_bits, 0),
    }
    frame = zframes.pack(quads)
    garbled = bytearray(good)
    at = bytes(good).index(frame)
    garbled[at : at + len(frame)] = bytes(len(frame))  # zeros: not a zstd frame
    forged["not zstd"] = bytes(garbled)
    for what, part in forged.items():
        with pytest.raises(CorruptDeltaError, match="'w'"):
            decode_tensor(prev, _quad_blob(prev, part), name="w")
        print("refused:", what)


@pytest.mark.parametrize("kind", ["bf16", "float32"])
def test_a_handful_of_changes_take_the_list_mode_smaller_than_sparse(kind):
    """A few changes (a norm weight's step: one to a few elements, some by many steps, across two chunks
    of a large tensor) are a list of varints, smaller than the sparse mode's blob with its tables; it
    decodes, prepares a patch of exactly those elements, and lists their positions without the base."""
    from tandem.weights.decoder import changed_positions

    rng = np.random.default_rng(11)
    big = 1 << CHUNK_LOG2
    for n, where in ((256, [0, 9, 255]), (big + 5, [4, big, big + 4])):
        prev = as_dtype(rng.standard_normal(n).astype(np.float32), kind)
        bits = prev.view(np.uint16 if kind == "bf16" else np.uint32)
        cur_bits = bits.copy()
        cur_bits[where] += np.array([1, 3, 40000 if kind == "float32" else 200], cur_bits.dtype)
        cur = cur_bits.view(prev.dtype)
        blob = roundtrip(prev, cur)
        assert mode_of(blob) == LIST
        enc = TensorEncoder("w", prev, cur)
        codec.run_tasks(enc.scan_tasks(), 1)
        enc.plan()
        assert enc.mode == LIST and len(blob) < 8 * len(where) + 16
        live = prev.copy()
        dec = TensorDecoder("w", live, blob, prepare=True)
        for t in dec.tasks():
            t()
        patch = dec.patch()
        assert patch.indices.tolist() == where and np.array_equal(live, prev)
        patch.apply(live)
        assert live.tobytes() == cur.tobytes()
        assert changed_positions(blob, "w", n).tolist() == where


def test_a_forged_list_is_refused_before_it_reads_or_writes_out_of_bounds():
    """Behind a valid checksum: a gap past the end of the tensor, a truncated varint, bytes after the last
    change, and a header that claims more changes than the payload can hold: each is refused naming the
    tensor."""
    from tandem.weights.blob import seal, write_header
    from tandem.weights.kernels import encode_list

    prev = np.arange(100, dtype=np.uint16)

    def blob(payload: bytes, changed: int) -> bytes:
        out = bytearray()
        write_header(out, LIST, prev.dtype, prev.shape, changed)
        return seal(out + payload)

    good = encode_list(np.array([5, 99], np.int64), np.array([2, 1], np.int64)).tobytes()
    assert decode_tensor(prev, blob(good, 2))[[5, 99]].tolist() == [6, 98]
    forged = {
        "past the end": encode_list(np.array([5, 100], np.int64), np.array([2, 1], np.int64)).tobytes(),
        "truncated": good[:-1] + b"\x80",
        "trailing": good + b"\x00",
    }
    for payload in forged.values():
        with pytest.raises(CorruptDeltaError, match="'w'"):
            decode_tensor(prev, blob(payload, 2), name="w")
    with pytest.raises(CorruptDeltaError, match="'w'.*more changes"):
        decode_tensor(prev, blob(good, 50), name="w")


def test_the_retired_rans_quad_mode_is_refused_by_name():
    """Mode 5 (quads in rANS streams, before 2026-12-01) is refused with what to do, not decoded as
    something else (a store reader falls back to a full snapshot on this error)."""
    from tandem.weights.blob import RETIRED_RANS_QUAD, seal, write_header

    out = bytearray()
    write_header(out, RETIRED_RANS_QUAD, np.dtype(np.uint16), (8,), 1)
    with pytest.raises(CorruptDeltaError, match="rANS quad mode.*full snapshot"):
        decode_tensor(np.zeros(8, np.uint16), seal(out + bytes(8)), name="w")


def test_run_tasks_keeps_one_pool_per_thread_and_priority_and_waits_for_every_task():
    """``run_tasks`` reuses the calling thread's pool (same worker threads across calls), a new one after the
    thread's nice value changes (workers inherit their creator's priority), and on a task's error returns
    only once every other task has finished, then raises it."""
    import itertools
    import os
    import threading
    import time

    from tandem.weights.codec import run_tasks

    tags = itertools.count()  # thread ids are reused once a thread exits; a tag on the Thread is not

    def workers(n: int = 8) -> set[int]:
        seen: set[int] = set()
        gate = threading.Barrier(2, timeout=10)  # two tasks at once: both workers of the pool take part

        def task() -> None:
            me = threading.current_thread()
            if not hasattr(me, "test_tag"):
                me.test_tag = next(tags)
            seen.add(me.test_tag)
            gate.wait()

        run_tasks([task] * n, 2)
        return seen

    def in_thread(fn):
        box = {}
        t = threading.Thread(target=lambda: box.update(out=fn()))
        t.start()
        t.join(60)
        return box["out"]

    def scenario() -> tuple[set[int], set[int], set[int], list[int]]:
        first, again = workers(), workers()
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 1)  # this thread only
        lowered = workers()
        nice = []

        def report() -> None:
            nice.append(os.getpriority(os.PRIO_PROCESS, 0))
            time.sleep(0.01)

        run_tasks([report] * 4, 2)
        return first, again, lowered, nice

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    first, again, lowered, nice = in_thread(scenario)
    assert len(first) == 2 and first == again  # kept across calls
    assert lowered.isdisjoint(first) and nice == [mine + 1] * 4  # new workers at the new priority
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the test thread was not touched

    done: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.05)
        done.append(i)

    def fail() -> None:
        raise RuntimeError("task failed")

    with pytest.raises(RuntimeError, match="task failed"):
        run_tasks([fail] + [lambda i=i: slow(i) for i in range(3)], 2)
    assert sorted(done) == [0, 1, 2]  # none still running when the error reached the caller


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


def _forged_sparse(numel: int, m: int, quotient_ones: int, remainder: int) -> bytes:
    """A sparse fp32 blob of one change whose Golomb-coded gap is ``quotient_ones`` ones, a zero and the
    ``remainder`` in truncated binary, sealed with a valid checksum (a malicious or broken publisher)."""
    body = bytearray([0xD1, 1, 1]) + _varint(1) + _varint(numel) + _varint(1)  # sparse, fp32, shape [numel]
    body += bytes([GAP_GOLOMB]) + _varint(m)
    body += _varint(2) + _varint(0) + _varint(0) + _varint(16384) + bytes([20])  # diff table, chunk 2**20
    b = (m - 1).bit_length()
    bits = [1] * quotient_ones + [0] + [(remainder >> 1 >> j) & 1 for j in range(b - 1)] + [remainder & 1]
    body += _varint(1) + _varint(0) + _varint(2) + _varint(len(bits))  # one change, gap and diff words, bits
    body += (0x8000).to_bytes(2, "little") + bytes(2)  # the diff stream's final state: never renormalises
    body += bytes(sum(x << i for i, x in enumerate(bits[k : k + 8])) for k in range(0, len(bits), 8))
    return bytes(body) + zlib.crc32(bytes(body)).to_bytes(4, "little")


@pytest.mark.parametrize("g0", [0, 1_000_000, 1 << 40])
def test_a_forged_golomb_gap_is_refused_not_written_out_of_bounds(g0):
    """A red-team probe's blob (valid checksum) with Golomb parameter 2**59: the gap overflowed int64, the
    position came out negative and passed ``last >= size``, and the decoder wrote ``g0`` elements past the
    tensor (a segfault, or ``verified: True`` after writing past the buffer). It is refused instead."""
    from tandem.weights.decoder import changed_positions

    prev = np.zeros(1000, np.float32)
    blob = _forged_sparse(1000, 1 << 59, 24, g0)
    with pytest.raises(CorruptDeltaError, match="Golomb parameter"):
        decode_tensor(prev, blob, "w")
    with pytest.raises(CorruptDeltaError, match="Golomb parameter"):
        TensorDecoder("w", prev, blob, prepare=True)
    with pytest.raises(CorruptDeltaError):
        changed_positions(blob, "w", 1000)
    for m in (1000, 7):  # a valid parameter: a gap past the tensor is refused by the decoder's own check
        with pytest.raises(CorruptDeltaError):
            decode_tensor(prev, _forged_sparse(1000, m, 24 * 50, 0), "w")
    assert golomb_params(2**62 + 1)[0] == 62  # had looped forever (``1 << 63`` wraps negative)


def test_changed_positions_sizes_its_output_by_the_tensor_not_the_blob():
    """A 40-byte dense blob claiming 2**30 elements decoded them all (9 s, 1.2 GB), 2**40 raised
    MemoryError: the engine's catch-up path now names the tensor's own size and refuses a mismatch."""
    from tandem.weights.decoder import changed_positions

    prev, cur = adam_like(5000, 2e-6, "bf16")
    blob = encode_tensor(prev, cur)
    np.testing.assert_array_equal(changed_positions(blob, "w", 5000), np.flatnonzero(prev != cur))
    with pytest.raises(CorruptDeltaError, match="5000 elements, the tensor has 5001"):
        changed_positions(blob, "w", 5001)
