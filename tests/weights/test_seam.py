import blake3
import numpy as np
import pytest

from tandem.weights import make_update, tensors_hash, verify_update


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
    # unchanged for every tensor without a 0 in its shape (0-d and strided ones included)
    for arr in (np.arange(3, dtype=np.int64), np.array(2.5, np.float32), np.ones((2, 3), np.uint16)[:, ::2]):
        old = blake3.blake3()
        c = np.ascontiguousarray(arr)
        for part in (b"x", str(c.dtype).encode(), str(c.shape).encode(), memoryview(c).cast("B")):
            old.update(part)
        assert tensors_hash({"x": arr}) == old.hexdigest()
