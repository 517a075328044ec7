"""The versioned weight store on a filesystem: publish/read, atomicity, corruption, plan, gc, one writer."""

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tandem.weights.backend import FileBackend
from tandem.weights.errors import (
    CorruptBlobError,
    ManifestError,
    MissingBlobError,
    NotAStoreError,
    StoreLockedError,
    VersionNotFoundError,
)
from tandem.weights.manifest import should_snapshot
from tandem.weights.store import WeightStore


def rand_blobs(seed: int, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {name: b"\x00" + rng.bytes(size - 1) for name, size in sizes.items()}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_publish_then_read_back_from_another_instance(tmp_path):
    root = tmp_path / "store"
    store = WeightStore.open(root, create=True)
    b0 = rand_blobs(0, {"a": 1000, "b": 3000})
    b1 = rand_blobs(1, {"a": 100, "b": 50})
    store.publish(0, None, "full", "hash0", b0, meta={"step": 0})
    store.publish(1, 0, "delta", "hash1", {**b1, "same": b0["a"]})
    store.close()

    reader = WeightStore.open(root)
    assert reader.versions() == [0, 1] and reader.latest() == 1
    m1 = reader.manifest(1)
    assert (m1.version, m1.parent, m1.kind, m1.weights_hash) == (1, 0, "delta", "hash1")
    assert m1.blobs["a"].key == m1.blobs["a"].sha256 == sha(b1["a"]) and m1.blobs["a"].size == 100
    assert reader.blobs(m1.blobs) == {**b1, "same": b0["a"]}
    assert reader.manifest(0).meta == {"step": 0}
    # Layout: one JSON manifest per version, content-addressed blobs (identical bytes stored once).
    raw = json.loads((root / "manifests" / "v00000001.json").read_text())
    assert raw["kind"] == "delta" and raw["parent"] == 0 and raw["created"] > 0
    assert raw["blobs"]["b"] == {"key": sha(b1["b"]), "size": 50, "sha256": sha(b1["b"])}
    stored = sorted(p.name for p in (root / "blobs").iterdir())
    assert stored == sorted({sha(x) for x in [*b0.values(), *b1.values()]})
    assert reader.blob_range(m1.blobs["a"].key, 10, 20) == b1["a"][10:20]


def test_publish_refuses_bad_requests_and_names_the_value(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True)
    store.publish(3, None, "full", "h", {"w": b"x"})
    with pytest.raises(ManifestError, match="version 3 .* latest is 3"):
        store.publish(3, None, "full", "h", {"w": b"x"})
    with pytest.raises(ManifestError, match="parent 2, but: version 2 is not in"):
        store.publish(4, 2, "delta", "h", {"w": b"x"})
    with pytest.raises(ManifestError, match="needs a parent"):
        store.publish(4, None, "delta", "h", {"w": b"x"})
    with pytest.raises(ManifestError, match="kind 'sparse'"):
        store.publish(4, 3, "sparse", "h", {"w": b"x"})
    with pytest.raises(ManifestError, match="blob 'w' must be bytes"):
        store.publish(4, 3, "delta", "h", {"w": [1, 2]})
    with pytest.raises(ManifestError, match="JSON"):
        store.publish(4, 3, "delta", "h", {"w": b"x"}, meta={"bad": object()})
    with pytest.raises(ManifestError, match="delta_blobs only go with kind='full'"):
        store.publish(4, 3, "delta", "h", {"w": b"x"}, delta_blobs={"w": b"y"})
    assert store.latest() == 3


def test_opening_a_missing_or_foreign_directory_names_it(tmp_path):
    with pytest.raises(NotAStoreError, match="nope"):
        WeightStore.open(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    with pytest.raises(NotAStoreError, match="plain.*not a weight store"):
        WeightStore.open(tmp_path / "plain")


class FullDisk(FileBackend):
    """A filesystem backend whose disk fills up while writing the chosen value (half of it lands)."""

    fail_when = None

    def _write(self, f, data):
        if self.fail_when is not None and self.fail_when(data):
            f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(data)


@pytest.mark.parametrize("where", ["blob", "manifest"])
def test_disk_full_mid_publish_leaves_no_half_written_version(tmp_path, where):
    backend = FullDisk(tmp_path / "s")
    store = WeightStore(backend, create=True)
    store.publish(0, None, "full", "h0", rand_blobs(0, {"a": 5000, "b": 5000}))
    b1 = rand_blobs(1, {"a": 4000, "b": 4000})
    if where == "blob":
        backend.fail_when = lambda data: data == b1["b"]
    else:
        backend.fail_when = lambda data: b'"weights_hash"' in data
    with pytest.raises(OSError, match="No space left"):
        store.publish(1, 0, "delta", "h1", b1)
    reader = WeightStore.open(tmp_path / "s")
    assert reader.versions() == [0] and reader.latest() == 0
    with pytest.raises(VersionNotFoundError, match="version 1"):
        reader.manifest(1)
    assert not list((tmp_path / "s" / ".tmp").iterdir()), "temporary files left behind"
    # The store still works once there is space again, and gc drops the orphan blobs of the failed try.
    backend.fail_when = None
    store.publish(1, 0, "delta", "h1", b1)
    assert WeightStore.open(tmp_path / "s").blobs(reader.manifest(1).blobs) == b1
    assert store.gc(keep_last=2).deleted_blobs == 0


def test_corrupted_truncated_and_missing_blobs_are_detected(tmp_path):
    root = tmp_path / "s"
    store = WeightStore.open(root, create=True)
    blobs = rand_blobs(0, {"a": 2000, "b": 2000, "c": 2000})
    m = store.publish(0, None, "full", "h", blobs)
    ka, kb, kc = (m.blobs[n].key for n in "abc")
    path_a = root / "blobs" / ka
    data = bytearray(path_a.read_bytes())
    data[1234] ^= 0x01
    path_a.write_bytes(bytes(data))
    (root / "blobs" / kb).write_bytes(blobs["b"][:1500])
    (root / "blobs" / kc).unlink()
    reader = WeightStore.open(root)
    with pytest.raises(CorruptBlobError, match=ka[:16]):
        reader.blob(ka)
    with pytest.raises(CorruptBlobError, match="1500 bytes"):
        reader.verify_blob(kb)
    with pytest.raises(MissingBlobError, match=kc):
        reader.blob(kc)
    with pytest.raises(MissingBlobError, match="not a blob address"):
        reader.blob("../store.json")


def test_missing_version_error_names_it_and_the_available_range(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True)
    with pytest.raises(VersionNotFoundError, match="is empty"):
        store.plan(None)
    with pytest.raises(VersionNotFoundError, match="version 0 .*the store is empty"):
        store.manifest(0)
    for v in range(3):
        store.publish(v, v - 1 if v else None, "delta" if v else "full", f"h{v}", {"w": bytes([v]) * 10})
    with pytest.raises(VersionNotFoundError, match=r"version 7 .*available: 0\.\.2"):
        store.manifest(7)


def publish_series(store, n, full_size, delta_size, snapshot_every, seed=0):
    """Versions 0..n-1: a full snapshot every K (also carrying a delta from its parent), deltas between."""
    for v in range(n):
        delta = rand_blobs(seed * 1000 + v, {"w": delta_size})
        if should_snapshot(v, snapshot_every):
            full = rand_blobs(seed * 1000 + 500 + v, {"w": full_size})
            store.publish(v, v - 1 if v else None, "full", f"h{v}", full, delta_blobs=delta if v else None)
        else:
            store.publish(v, v - 1, "delta", f"h{v}", delta)


def test_plan_takes_the_cheaper_of_delta_chain_and_snapshot(tmp_path):
    small_deltas = WeightStore.open(tmp_path / "a", create=True, snapshot_every=4)
    publish_series(small_deltas, 7, full_size=10_000, delta_size=100, snapshot_every=4)
    # chain 4,5,6 = 300 bytes beats snapshot 4 + deltas 5,6 = 10_200 bytes
    chain = small_deltas.plan(3, 6)
    assert [(s.version, s.kind) for s in chain] == [(4, "delta"), (5, "delta"), (6, "delta")]
    assert chain[0].parent == 3 and chain[0].nbytes == 100
    assert [(s.version, s.kind) for s in small_deltas.plan(None)] == [(4, "full"), (5, "delta"), (6, "delta")]
    assert small_deltas.plan(6, 6) == []

    big_deltas = WeightStore.open(tmp_path / "b", create=True, snapshot_every=4)
    publish_series(big_deltas, 7, full_size=3_000, delta_size=5_000, snapshot_every=4)
    # chain 2..6 = 25_000 bytes loses to snapshot 4 (3_000) + deltas 5,6 (10_000)
    assert [(s.version, s.kind) for s in big_deltas.plan(1, 6)] == [(4, "full"), (5, "delta"), (6, "delta")]
    # a chain inside one snapshot interval is a suffix of the snapshot path: it always wins
    assert [s.version for s in big_deltas.plan(5, 6)] == [6]
    # a reader "ahead" of the target (rollback) or at an unknown version gets the snapshot path
    assert big_deltas.plan(6, 5)[0].kind == "full" and big_deltas.plan(99, 6)[0].version == 4


def test_plan_across_a_snapshot_without_a_delta_uses_the_snapshot(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True)
    store.publish(0, None, "full", "h0", {"w": b"0" * 1000})
    store.publish(1, 0, "delta", "h1", {"w": b"1"})
    store.publish(2, 1, "full", "h2", {"w": b"2" * 1000})  # no delta_blobs: the chain cannot cross it
    store.publish(3, 2, "delta", "h3", {"w": b"3"})
    assert [(s.version, s.kind) for s in store.plan(1, 3)] == [(2, "full"), (3, "delta")]


def test_gc_keeps_everything_readers_may_still_need(tmp_path):
    root = tmp_path / "s"
    store = WeightStore.open(root, create=True, snapshot_every=3)
    publish_series(store, 8, full_size=300, delta_size=50, snapshot_every=3)  # fulls at 0, 3, 6
    shared = store.blob(store.manifest(5).blobs["w"].key)
    store.publish(8, 7, "delta", "h8", {"w": shared, "x": b"only in 8"})  # v5's bytes referenced again
    orphan = b"left behind by a failed publish"
    store.backend.put(f"blobs/{sha(orphan)}", orphan)

    report = store.gc(keep_readers_from=4, keep_last=1)
    # a reader at 4 needs snapshot 3 (its ancestor) and everything after it
    assert report.kept_from == 3 and report.deleted_versions == [0, 1, 2]
    assert store.versions() == [3, 4, 5, 6, 7, 8]
    referenced = set().union(*(store.manifest(v).keys() for v in store.versions()))
    assert set(os.listdir(root / "blobs")) == referenced
    for v in store.versions():
        for ref in [*store.manifest(v).blobs.values(), *(store.manifest(v).delta_blobs or {}).values()]:
            store.blob(ref.key)  # still present and intact
    reader = WeightStore.open(root)
    assert [s.version for s in reader.plan(4, 8)] == [5, 6, 7, 8]
    assert [s.version for s in reader.plan(None, 5)] == [3, 4, 5]
    with pytest.raises(VersionNotFoundError, match="version 2"):
        reader.manifest(2)

    report = store.gc(keep_last=1)  # nobody older than the latest: keep its snapshot 6 onward
    assert report.kept_from == 6 and store.versions() == [6, 7, 8] and report.freed_bytes > 0
    assert store.blob(store.manifest(8).blobs["w"].key) == shared
    with pytest.raises(ValueError, match="keep_last"):
        store.gc(keep_last=0)


def test_gc_deletes_only_the_stores_own_keys(tmp_path):
    # A store created in a directory that holds other data under ``blobs/`` (or a store nested there):
    # gc removes orphan blobs of its own and nothing else.
    root = tmp_path / "s"
    (root / "blobs" / "photos").mkdir(parents=True)
    (root / "blobs" / "photos" / "cat.jpg").write_bytes(b"meow")
    (root / "blobs" / "README").write_bytes(b"someone else's")
    nested = WeightStore.open(root / "blobs" / "nested", create=True)
    nested.publish(0, None, "full", "n0", {"w": b"nested store"})
    nested.close()
    store = WeightStore.open(root, create=True)
    store.publish(0, None, "full", "h0", {"w": b"0"})
    store.publish(1, None, "full", "h1", {"w": b"1"})
    orphan = b"left behind by a failed publish"
    store.backend.put(f"blobs/{sha(orphan)}", orphan)
    report = store.gc(keep_last=1)
    assert report.deleted_versions == [0] and report.deleted_blobs == 2  # v0's blob and the orphan
    assert (root / "blobs" / "photos" / "cat.jpg").read_bytes() == b"meow"
    assert (root / "blobs" / "README").read_bytes() == b"someone else's"
    again = WeightStore.open(root / "blobs" / "nested")
    assert again.blobs(again.manifest(0).blobs) == {"w": b"nested store"}
    store.close()


def test_gc_by_a_publisher_whose_lock_was_taken_deletes_nothing(tmp_path):
    first = WeightStore.open(tmp_path / "s", create=True)
    first.publish(0, None, "full", "h0", {"w": b"0"})
    (tmp_path / "s" / "writer.lock").unlink()  # an operator removed the lock, believing `first` gone
    second = WeightStore.open(tmp_path / "s")
    second.acquire_writer()
    in_flight = b"the new publisher's blob; its manifest is not written yet"
    second.backend.put(f"blobs/{sha(in_flight)}", in_flight)
    with pytest.raises(StoreLockedError, match="writer.lock .* was removed or replaced"):
        first.gc()
    assert second.backend.get(f"blobs/{sha(in_flight)}") == in_flight
    second.publish(1, 0, "delta", "h1", {"w": in_flight})
    assert second.blobs(second.manifest(1).blobs) == {"w": in_flight}
    second.close()


def test_second_publisher_is_refused_until_the_first_closes(tmp_path):
    first = WeightStore.open(tmp_path / "s", create=True)
    first.publish(0, None, "full", "h0", {"w": b"0"})
    second = WeightStore.open(tmp_path / "s")
    assert second.latest() == 0  # reading is always allowed
    with pytest.raises(StoreLockedError, match=f"already has a publisher \\(pid {os.getpid()}"):
        second.publish(1, 0, "delta", "h1", {"w": b"1"})
    with pytest.raises(StoreLockedError):
        second.gc()
    first.close()
    second.publish(1, 0, "delta", "h1", {"w": b"1"})
    with pytest.raises(StoreLockedError):
        first.publish(2, 1, "delta", "h2", {"w": b"2"})
    second.close()


def race_for_the_lock(stores):
    outcomes = []
    barrier = threading.Barrier(len(stores))

    def grab(store):
        barrier.wait()
        try:
            store.acquire_writer()
            outcomes.append("ok")
        except StoreLockedError:
            outcomes.append("refused")
        except Exception as e:  # anything else is a bug; show it
            outcomes.append(repr(e))

    threads = [threading.Thread(target=grab, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(outcomes)


def test_threads_racing_for_the_lock_get_exactly_one_writer(tmp_path):
    WeightStore.open(tmp_path / "s", create=True)
    for _ in range(10):
        stores = [WeightStore.open(tmp_path / "s") for _ in range(4)]
        assert race_for_the_lock(stores) == ["ok", "refused", "refused", "refused"]
        for store in stores:
            store.close()


def test_a_lock_left_by_a_dead_process_is_broken(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    holder = {"pid": int(dead.stdout), "host": socket.gethostname(), "token": "x", "since": time.time() - 60}
    lock = tmp_path / "s" / "writer.lock"
    lock.write_text(json.dumps(holder))
    os.utime(lock, (time.time() - 60, time.time() - 60))
    store.publish(0, None, "full", "h0", {"w": b"0"})
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    store.close()
    assert not lock.exists()


def test_should_snapshot():
    assert [v for v in range(45) if should_snapshot(v)] == [0, 20, 40]
    with pytest.raises(ValueError, match="interval"):
        should_snapshot(3, 0)


def test_a_damaged_manifest_is_reported_not_trusted(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True)
    store.publish(0, None, "full", "h0", {"w": b"0"})
    path = tmp_path / "s" / "manifests" / "v00000000.json"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ManifestError, match="manifest v0 .*not valid JSON"):
        WeightStore.open(tmp_path / "s").manifest(0)
    with pytest.raises(ManifestError, match=r"version must be an integer in \[0, 100000000\)"):
        store.publish(10**8, None, "full", "h", {"w": b"x"})


def test_packed_publish_shares_blobs_and_reads_back_each_entry(tmp_path):
    from tandem.weights.store import PACK_BELOW, PACK_TARGET

    root = tmp_path / "s"
    store = WeightStore.open(root, create=True)
    small = rand_blobs(0, {f"n{i:03d}": 300_000 + i for i in range(20)})  # 6 MB of small entries
    big = rand_blobs(1, {"emb": PACK_BELOW + 7})
    m = store.publish(0, None, "full", "h", {**small, **big}, pack=True)
    keys = m.keys()
    assert len(keys) == 3  # the large entry alone, the small ones in two packs of <= PACK_TARGET + one entry
    assert m.blobs["emb"].length is None and m.blobs["emb"].key == sha(big["emb"])
    packs = {m.blobs[n].key for n in small}
    assert len(packs) == 2 and all(len(store.blob(k)) <= PACK_TARGET + 300_020 for k in packs)
    assert m.nbytes == sum(len(b) for b in {**small, **big}.values())  # each stored blob counted once
    assert WeightStore.open(root).blobs(m.blobs) == {**small, **big}
    raw = json.loads((root / "manifests" / "v00000000.json").read_text())
    assert raw["format"] == 2 and raw["blobs"]["n001"]["offset"] == 300_000 and raw["blobs"]["n001"]["length"]
    # A corrupt pack is refused for every entry in it.
    key = m.blobs["n000"].key
    data = bytearray((root / "blobs" / key).read_bytes())
    data[5] ^= 0x01
    (root / "blobs" / key).write_bytes(bytes(data))
    with pytest.raises(CorruptBlobError, match=key[:16]):
        WeightStore.open(root).blobs({"n003": m.blobs["n003"]})


def test_a_slice_outside_its_blob_or_an_unknown_format_is_refused(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True)
    store.publish(0, None, "full", "h0", {"a": b"abc", "b": b"defg"}, pack=True)
    path = tmp_path / "s" / "manifests" / "v00000000.json"
    raw = json.loads(path.read_text())
    raw["blobs"]["b"]["length"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=r"blob 'b' .*offset \+ length within size"):
        WeightStore.open(tmp_path / "s").manifest(0)
    raw["blobs"]["b"]["length"], raw["format"] = 4, 3
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=r"format 3; this tandem reads formats \[1, 2\]"):
        WeightStore.open(tmp_path / "s").manifest(0)
    raw["format"] = 1  # an older manifest without slices still reads
    del raw["blobs"]["a"]["offset"], raw["blobs"]["a"]["length"], raw["blobs"]["b"]
    path.write_text(json.dumps(raw))
    assert WeightStore.open(tmp_path / "s").manifest(0).blobs["a"].length is None
