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
