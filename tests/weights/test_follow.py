"""WeightFollower over a real store served on 127.0.0.1: the decoded values it hands to patch writers."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.weights.client import WeightClient
from tandem.weights.delta import encode_delta
from tandem.weights.follow import ShadowMismatchError, WeightFollower
from tandem.weights.hostlead import patch_of
from tandem.weights.publish import WeightPublisher, encode_full
from tandem.weights.seam import tensors_hash, tensors_hash_v1
from tandem.weights.store import WeightStore
from tandem.weights.transport import serve_store


def _versions() -> list[dict[str, np.ndarray]]:
    """v0, then v1 moves 2% of a bf16 tensor ("a", bit patterns) and of an fp32 one ("b"), then v2 moves
    other elements of "a" only."""
    rng = np.random.default_rng(0)
    fp32 = rng.standard_normal((300, 500)).astype(np.float32) * 0.02
    bf16_bits = (fp32.view(np.uint32) >> 16).astype(np.uint16)
    out = [{"a": bf16_bits, "b": rng.standard_normal(40_000).astype(np.float32)}]
    for names in (("a", "b"), ("a",)):
        nxt = {k: v.copy() for k, v in out[-1].items()}
        for name in names:
            bits = nxt[name].reshape(-1).view(np.uint16 if name == "a" else np.uint32)
            moved = rng.random(bits.shape[0]) < 0.02
            bits[moved] += rng.integers(1, 9, int(moved.sum())).astype(bits.dtype)
        out.append(nxt)
    return out


def test_a_single_delta_step_hands_over_its_decoded_values_and_a_chain_only_the_unmerged_ones(tmp_path):
    versions = _versions()
    store = WeightStore.open(tmp_path / "store", create=True, snapshot_every=10)
    publisher = WeightPublisher(store)
    for v, tensors in enumerate(versions):
        publisher.publish(v, tensors)
    with serve_store(store) as server, WeightClient(server.url) as c1, WeightClient(server.url) as c2:
        one_step = WeightFollower(c1)
        assert one_step.advance(0).values == {}  # a snapshot: nothing decoded element-wise
        adv = one_step.advance(1)
        assert sorted(adv.values) == ["a", "b"]
        shadow = one_step.shadow
        for name, values in adv.values.items():
            assert values.dtype == shadow[name].dtype
            assert values.tobytes() == shadow[name].reshape(-1)[adv.changes[name]].tobytes()
            assert np.array_equal(adv.changes[name], np.flatnonzero(versions[0][name] != versions[1][name]))

        chained = WeightFollower(c2)
        chained.advance(0)
        adv = chained.advance(2)  # 0 -> 1 -> 2: "a" changed in both steps, its indices are a union
        assert sorted(adv.changes) == ["a", "b"] and sorted(adv.values) == ["b"]
        shadow = chained.shadow
        with_known, gathered = patch_of(adv.changes, shadow, adv.values), patch_of(adv.changes, shadow)
        for name in ("a", "b"):
            assert np.array_equal(with_known[name][0], gathered[name][0])
            assert with_known[name][1].tobytes() == gathered[name][1].tobytes()
            assert with_known[name][1].tobytes() == versions[2][name].reshape(-1)[gathered[name][0]].tobytes()
    store.close()


def test_patch_of_gathers_when_known_values_do_not_fit():
    tensors = {"w": np.arange(10, dtype=np.float32)}
    idx = np.array([1, 4, 7])
    assert patch_of({"w": idx}, tensors, {"w": np.zeros(2, np.float32)})["w"][1].tolist() == [1.0, 4.0, 7.0]
    assert patch_of({"w": idx}, tensors, {"w": np.zeros(3, np.int32)})["w"][1].tolist() == [1.0, 4.0, 7.0]
    assert patch_of({"w": idx}, tensors, {"w": np.full(3, 9, np.float32)})["w"][1].tolist() == [9.0] * 3
    whole = patch_of({"w": None}, tensors, {"w": np.zeros(3, np.float32)})["w"]
    assert np.array_equal(whole[0], np.arange(10)) and np.array_equal(whole[1], tensors["w"])


def test_tensors_with_a_zero_in_their_shape_publish_and_follow(tmp_path):
    v0 = {
        "e": np.zeros((0, 4), np.float32),
        "z": np.zeros((2, 0, 3), np.uint16),
        "w": np.arange(6, dtype=np.float32),
    }
    v1 = {**v0, "w": v0["w"] + 1}
    store = WeightStore.open(tmp_path / "store", create=True, snapshot_every=10)
    publisher = WeightPublisher(store)
    assert publisher.publish(0, v0).kind == "full" and publisher.publish(1, v1).kind == "delta"
    with serve_store(store) as server, WeightClient(server.url) as client:
        follower = WeightFollower(client)
        follower.advance(0)
        follower.advance(1)
        assert {k: (v.shape, v.dtype) for k, v in follower.shadow.items()} == {
            k: (v.shape, v.dtype) for k, v in v1.items()
        }
        assert np.array_equal(follower.shadow["w"], v1["w"])
    store.close()


def test_a_store_written_with_v1_hashes_is_still_followed_and_its_corruption_still_caught(tmp_path):
    """Versions published before the current hash scheme record bare-hex v1 hashes (published here as the
    publisher did then); a follower verifies each in its own scheme, also across a v1 -> current step, and
    still refuses a v1 version whose weights do not match."""
    versions = _versions()
    store = WeightStore.open(tmp_path / "store", create=True, snapshot_every=10)
    v1 = tensors_hash_v1
    store.publish(0, None, "full", v1(versions[0]), encode_full(versions[0]), pack=True)
    step = encode_delta(versions[0], versions[1], base_hash=v1(versions[0]), target_hash=v1(versions[1]))
    store.publish(1, 0, "delta", v1(versions[1]), step.blobs, pack=True)
    bad = encode_delta(versions[1], versions[2])
    store.publish(2, 1, "delta", v1(versions[1]), bad.blobs, pack=True)  # records another version's hash
    WeightPublisher(store).publish(3, versions[2])  # the current publisher continues the store
    assert store.manifest(3).weights_hash == tensors_hash(versions[2]) != v1(versions[2])
    with serve_store(store) as server, WeightClient(server.url) as client:
        follower = WeightFollower(client)
        follower.advance(0)
        assert follower.advance(1).full is False
        assert all(np.array_equal(follower.shadow[k], versions[1][k]) for k in versions[1])
        with pytest.raises(ShadowMismatchError, match="version 2"):
            follower.advance(2)
        assert follower.shadow is None
        follower.advance(3)
        assert all(np.array_equal(follower.shadow[k], versions[2][k]) for k in versions[2])
    store.close()
