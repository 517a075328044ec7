"""Model-level deltas (``tandem.weights.delta``): hashes, wrong base, in-place apply, the file format."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zstandard
from zlib_ng.zlib_ng import crc32

from tandem.weights.blob import CorruptDeltaError
from tandem.weights.delta import (
    MAGIC,
    Delta,
    WrongBaseError,
    apply_delta_inplace,
    decode_delta,
    delta_stats,
    dumps_delta,
    encode_delta,
    load_delta,
    loads_delta,
    prepare_delta,
    save_delta,
)
from tandem.weights.seam import tensors_hash, tensors_hash_v1


def bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).bfloat16().view(torch.uint16).numpy()


def versions(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A small model: sparse bf16 matrices, a dense-changing fp32 vector, an int buffer, an untouched norm."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((300, 700)).astype(np.float32) * 0.02
    emb = rng.standard_normal((64, 32)).astype(np.float32)
    prev = {
        "layer.weight": bf16(w),
        "embed.weight": bf16(emb),
        "head.bias": rng.standard_normal(50).astype(np.float32),
        "norm.weight": np.ones(32, np.float32),
        "position_ids": np.arange(16, dtype=np.int64),
    }
    cur = {
        "layer.weight": bf16(w + 3e-6 * rng.standard_normal(w.shape).astype(np.float32)),
        "embed.weight": bf16(emb + 0.05 * rng.standard_normal(emb.shape).astype(np.float32)),
        "head.bias": prev["head.bias"] + np.float32(1e-3),
        "norm.weight": prev["norm.weight"].copy(),
        "position_ids": np.arange(16, dtype=np.int64)[::-1].copy(),
    }
    return prev, cur


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def test_roundtrip_hashes_and_file_format(tmp_path):
    prev, cur = versions()
    delta = encode_delta(prev, cur, threads=2, meta={"version": 7})
    assert delta.base_hash == tensors_hash(prev) and delta.target_hash == tensors_hash(cur)
    path = save_delta(tmp_path / "d.tdelta", delta)
    loaded = load_delta(path)
    assert loaded.blobs == delta.blobs and loaded.meta == {"version": 7}
    out = decode_delta(prev, loaded, threads=2)
    assert same(out, cur)
    assert same(prev, versions()[0])  # the base is not modified
    stats = {s.name: s for s in delta_stats(delta)}
    assert stats["norm.weight"].mode == "ident" and stats["norm.weight"].changed == 0
    assert stats["position_ids"].mode == "xor_zstd"
    assert stats["layer.weight"].mode == "sparse" and 0 < stats["layer.weight"].density < 0.2
    assert len(dumps_delta(delta)) < sum(a.nbytes for a in cur.values()) / 4


def test_wrong_base_is_refused_and_nothing_is_written():
    prev, cur = versions()
    delta = encode_delta(prev, cur)
    other = {k: v.copy() for k, v in prev.items()}
    other["head.bias"][0] += 1
    with pytest.raises(WrongBaseError, match="applies to base"):
        decode_delta(other, delta)
    snapshot = {k: v.copy() for k, v in other.items()}
    with pytest.raises(WrongBaseError):
        apply_delta_inplace(other, delta)
    assert same(other, snapshot)


def test_tensor_sets_and_shapes_must_match():
    prev, cur = versions()
    extra = dict(cur, new=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="only in new: \\['new'\\]"):
        encode_delta(prev, extra)
    missing = {k: v for k, v in cur.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match="missing from new: \\['norm.weight'\\]"):
        encode_delta(prev, missing)
    reshaped = dict(cur, **{"head.bias": cur["head.bias"][:49]})
    with pytest.raises(ValueError, match="'head.bias'"):
        encode_delta(prev, reshaped)


def test_inplace_apply_equals_decode_and_reports_what_changed():
    prev, cur = versions()
    delta = encode_delta(prev, cur)
    live = {k: v.copy() for k, v in prev.items()}
    changed = apply_delta_inplace(live, delta, threads=2)
    assert same(live, cur)
    assert set(changed) == {"layer.weight", "embed.weight", "head.bias", "position_ids"}
    idx = changed["layer.weight"]
    assert idx is not None
    assert np.array_equal(idx, np.flatnonzero(prev["layer.weight"] != cur["layer.weight"]))
    assert changed["position_ids"] is None  # rewritten whole


def test_prepare_writes_nothing_until_apply():
    prev, cur = versions()
    delta = encode_delta(prev, cur)
    live = {k: v.copy() for k, v in prev.items()}
    prepared = prepare_delta(live, delta)
    assert same(live, prev)
    assert prepared.changed_elements > 0
    prepared.apply(live)
    assert same(live, cur)
    with pytest.raises(ValueError, match="writable"):
        ro = {k: v.copy() for k, v in prev.items()}
        ro["head.bias"].flags.writeable = False
        prepare_delta(ro, delta)


def test_corrupt_files_and_blobs_are_detected(tmp_path):
    prev, cur = versions()
    delta = encode_delta(prev, cur)
    raw = bytearray(dumps_delta(delta))
    with pytest.raises(CorruptDeltaError, match="truncated"):
        loads_delta(bytes(raw[:-3]))
    with pytest.raises(CorruptDeltaError, match="not a tandem delta"):
        loads_delta(b"garbage" * 4)
    bad = bytearray(raw)
    bad[-40] ^= 0x10  # inside the last blob
    with pytest.raises(CorruptDeltaError, match="corrupt"):
        decode_delta(prev, loads_delta(bytes(bad)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_delta(tmp_path / "missing.tdelta")


def test_target_hash_catches_a_lying_delta():
    prev, cur = versions()
    delta = encode_delta(prev, cur)
    delta.target_hash = "0" * 64
    with pytest.raises(CorruptDeltaError, match="not the delta's target"):
        decode_delta(prev, delta)
    assert same(decode_delta(prev, delta, verify=False), cur)


def test_a_delta_recorded_with_v1_hashes_still_applies_and_is_still_checked(tmp_path):
    """A delta file written before the current hash scheme names its versions by bare-hex v1 hashes: it
    loads, decodes and applies in place against them, and a wrong base or a lying target is still refused."""
    prev, cur = versions()
    old = encode_delta(prev, cur, base_hash=tensors_hash_v1(prev), target_hash=tensors_hash_v1(cur))
    delta = load_delta(save_delta(tmp_path / "v1.tdelta", old))
    assert (delta.base_hash, delta.target_hash) == (tensors_hash_v1(prev), tensors_hash_v1(cur))
    assert same(decode_delta(prev, delta), cur)
    work = {k: v.copy() for k, v in prev.items()}
    apply_delta_inplace(work, delta)
    assert same(work, cur)
    other = {**prev, "norm.weight": prev["norm.weight"] * 2}
    with pytest.raises(WrongBaseError, match="apply it to the version it was made from"):
        decode_delta(other, delta)
    lying = Delta(delta.base_hash, tensors_hash_v1(other), delta.blobs)
    with pytest.raises(CorruptDeltaError, match="not the delta's target"):
        decode_delta(prev, lying)


def _with_header(raw: bytes, **changes: object) -> bytes:
    """``raw`` (a delta file) with header fields replaced, blobs kept."""
    hlen = int.from_bytes(raw[8:12], "little")
    header = json.loads(zstandard.ZstdDecompressor().decompress(raw[12 : 12 + hlen]))
    packed = zstandard.ZstdCompressor().compress(json.dumps({**header, **changes}).encode())
    return MAGIC + len(packed).to_bytes(4, "little") + packed + raw[12 + hlen :]


def test_crafted_headers_and_dtype_tags_are_corrupt_delta_errors_naming_the_tensor(tmp_path):
    w = {"w": np.arange(4, dtype=np.int64)}
    delta = encode_delta(w, {"w": w["w"] + 1})
    raw = dumps_delta(delta)
    size = len(delta.blobs["w"])
    for sizes, needle in (([str(size)], f"'{size}'"), ([size + 0.5], str(size + 0.5)), ([True], "True")):
        with pytest.raises(CorruptDeltaError, match=f"blob size of tensor 'w' is {needle}"):
            loads_delta(_with_header(raw, sizes=sizes))
    for changes, needle in (({"names": ["w", "w"], "sizes": [size, 0]}, "repeats"), ({"names": [1]}, "names"),
                            ({"meta": []}, "'meta'"), ({"base_hash": 5}, "base_hash")):  # fmt: skip
        with pytest.raises(CorruptDeltaError, match=needle):
            loads_delta(_with_header(raw, **changes))
    # a blob whose (checksummed) dtype tag is no numpy dtype: code 0, then the length-prefixed tag
    body = bytearray(delta.blobs["w"][:-4])
    assert body[2] == 0 and body[3] == 3 and bytes(body[4:7]) == b"<i8"
    body[4:7] = b"zzz"
    blob = bytes(body) + crc32(bytes(body)).to_bytes(4, "little")
    crafted = loads_delta(dumps_delta(Delta(delta.base_hash, delta.target_hash, {"w": blob})))
    with pytest.raises(CorruptDeltaError, match="'w' has an unknown dtype tag 'zzz'"):
        delta_stats(crafted)
    with pytest.raises(CorruptDeltaError, match="'w' has an unknown dtype tag"):
        decode_delta(w, crafted)
