import tracemalloc

import blake3
import numpy as np
import pytest

from tandem.weights import WeightUpdate, make_update, tensors_hash, verify_update
from tandem.weights.seam import HASH_PREFIX, hash_scheme, tensors_hash_as, tensors_hash_v1


def test_hash_is_order_independent_and_content_sensitive():
    a = {"x": np.arange(4, dtype=np.float32), "y": np.ones((2, 2), np.float32)}
    b = {"y": a["y"].copy(), "x": a["x"].copy()}
    assert tensors_hash(a) == tensors_hash(b)
    b["x"][0] = np.nextafter(np.float32(0), np.float32(1))
    assert tensors_hash(a) != tensors_hash(b)


def test_verify_rejects_a_corrupted_update():
    upd = make_update(3, {"w": np.zeros(8, np.float32)})
    verify_update(upd)
    upd.tensors["w"] = upd.tensors["w"].copy()
    upd.tensors["w"][5] = 1.0
    with pytest.raises(ValueError, match="version 3 is corrupt"):
        verify_update(upd)
    with pytest.raises(ValueError):
        make_update(-1, {})


def test_tensors_with_a_zero_in_their_shape_hash_by_shape():
    """Empty tensors hash (memoryview.cast refuses a 0 in a shape) and the shape still counts."""
    h = tensors_hash({"e": np.zeros((0, 4), np.float32)})
    assert h == tensors_hash({"e": np.empty((0, 4), np.float32)})
    assert (
        h
        != tensors_hash({"e": np.zeros((4, 0), np.float32)})
        != tensors_hash({"e": np.zeros((0,), np.float32)})
    )
    assert verify_update(make_update(0, {"e": np.zeros((2, 0, 3), np.uint16)})) is None
    # the legacy scheme (v1, kept to verify old data) is unchanged for every tensor without a 0 in its shape
    # (0-d and strided ones included)
    for arr in (np.arange(3, dtype=np.int64), np.array(2.5, np.float32), np.ones((2, 3), np.uint16)[:, ::2]):
        old = blake3.blake3()
        c = np.ascontiguousarray(arr)
        for part in (b"x", str(c.dtype).encode(), str(c.shape).encode(), memoryview(c).cast("B")):
            old.update(part)
        assert tensors_hash_v1({"x": arr}) == old.hexdigest()


def test_distinct_tensor_sets_never_share_a_hash_where_v1_collided():
    """v1 concatenated name, dtype, shape and bytes without lengths: a name could absorb the start of the
    dtype ("p" + "uint8" == "pu" + "int8") or a whole tensor ("a", "uint8", "(0,)" then "b" reads like one
    tensor named "auint8(0,)b"). The current scheme length-prefixes every field."""
    data = np.arange(6, dtype=np.uint8).reshape(2, 3)
    collisions = [
        ({"p": data}, {"pu": data.view(np.int8)}),
        ({"a": np.zeros(0, np.uint8), "b": data[0]}, {"auint8(0,)b": data[0]}),
    ]
    for one, other in collisions:
        assert tensors_hash_v1(one) == tensors_hash_v1(other)  # the defect, kept only to verify old data
        assert tensors_hash(one) != tensors_hash(other)
        assert tensors_hash_as(tensors_hash(one), other) != tensors_hash(one)
    # bytes moving between tensors, a dimension moving into the name, and the tensor count all count too
    flat = data.reshape(-1)
    sets = [
        {"a": flat[:2], "b": flat[2:]},
        {"a": flat[:3], "b": flat[3:]},
        {"a": flat},
        {"a": data.reshape(6, 1)},
        {"a": data.reshape(1, 6)},
        {"a1": flat},
        {},
    ]
    assert len({tensors_hash(t) for t in sets}) == len(sets)


def test_new_hashes_carry_the_scheme_and_old_ones_are_recognised():
    t = {"w": np.arange(5, dtype=np.float32)}
    new, old = tensors_hash(t), tensors_hash_v1(t)
    assert new.startswith(HASH_PREFIX) and len(new) == len(HASH_PREFIX) + 64
    assert make_update(0, t).weights_hash == new
    assert (hash_scheme(new), hash_scheme(old)) == (2, 1)
    for other in ("hash0", old.upper(), HASH_PREFIX, HASH_PREFIX + old.upper(), "b3v3:" + old, ""):
        assert hash_scheme(other) is None
    # a recorded hash is recomputed in its own scheme, never compared with the other scheme's value
    assert tensors_hash_as(new, t) == new and tensors_hash_as(old, t) == old
    assert tensors_hash_as("hash0", t) != "hash0"


def test_an_update_recorded_with_a_v1_hash_still_verifies_and_corruption_is_still_caught():
    """Data written before the current scheme carries bare-hex v1 hashes; verifiers accept them."""
    t = {"w": np.zeros(8, np.float32), "b": np.ones(3, np.uint16)}
    upd = WeightUpdate(4, tensors_hash_v1(t), t)
    verify_update(upd)
    upd.tensors["w"] = upd.tensors["w"].copy()
    upd.tensors["w"][2] = 1.0
    with pytest.raises(ValueError, match="version 4 is corrupt"):
        verify_update(upd)


def test_hashing_reads_contiguous_tensors_in_place():
    """The per-tensor header is hashed on its own: no copy of a tensor's data is made (numpy reports its
    allocations to tracemalloc)."""
    tensors = {"a": np.ones((1024, 1024), np.uint16), "b": np.zeros(1 << 20, np.float32)}
    tracemalloc.start()
    try:
        tensors_hash(tensors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # the data is 6 MiB
