"""Regional relays: one upstream fetch per blob for many clients, verified cache, fallback when killed."""

import os
import shutil
import socket
import threading
import time

import pytest

from tandem.weights.client import WeightClient
from tandem.weights.errors import CorruptBlobError, TransportError, WeightStoreError
from tandem.weights.relay import Relay
from tandem.weights.store import PACK_BELOW, WeightStore
from tandem.weights.transport import serve_store


def make_store(path, sizes, pack=False):
    store = WeightStore.open(path, create=True)
    blobs = {name: os.urandom(size) for name, size in sizes.items()}
    store.publish(0, None, "full", "h0", blobs, pack=pack)
    store.publish(1, 0, "delta", "h1", {"d": os.urandom(1000)})
    store.close()
    return store, blobs


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_relay_fetches_each_blob_once_for_many_clients(tmp_path):
    # three small entries share one pack, the large one is a blob of its own: two stored blobs
    sizes = {**{f"t{i}": 60_000 + i for i in range(3)}, "big": PACK_BELOW + 10}
    store, blobs = make_store(tmp_path / "s", sizes, pack=True)
    upstream = serve_store(store)
    # a slow upstream link (2 MB/s) keeps fetches in flight while all clients ask for the same blobs
    relay = Relay([upstream.url], tmp_path / "cache", upstream_bandwidth_bytes_per_s=2e6)
    results, errors = [], []

    def engine():
        try:
            with WeightClient([relay.url], parallel=2) as client:
                results.append(client.download(client.manifest(0).blobs))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=engine) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and results == [blobs] * 4
    up = upstream.stats.snapshot()
    keys = {store.manifest(0).blobs[name].key for name in blobs}
    assert up["blob_gets_by_key"] == dict.fromkeys(keys, 1)  # once each, whatever the number of clients
    stats = relay.stats()
    assert len(keys) == 2 and stats["upstream_blob_fetches"] == 2
    assert stats["served"]["blob_gets"] == 8 and stats["coalesced"] + stats["cache_hits"] == 6
    assert relay.upstream_limiter.bytes == sum(len(b) for b in blobs.values())
    with WeightClient(relay.url) as client:  # manifests and latest are proxied unchanged
        assert client.latest() == 1 and client.manifest_bytes(1) == store.manifest_bytes(1)
    relay.close()
    upstream.close()


def test_relay_killed_mid_transfer_client_resumes_from_upstream(tmp_path):
    store, blobs = make_store(tmp_path / "s", {"w": 2_000_000})
    size = len(blobs["w"])
    upstream = serve_store(store)
    relay = Relay([upstream.url], tmp_path / "cache", bandwidth_bytes_per_s=1e6)  # slow local egress
    client = WeightClient([relay.url, upstream.url], parallel=1, backoff_s=0.01)
    manifest = client.manifest(0)
    result = {}
    worker = threading.Thread(target=lambda: result.update(client.download(manifest.blobs)))
    worker.start()
    wait_for(lambda: relay.server.stats.snapshot().get("bytes_sent", 0) >= 300_000)
    relay.close()
    worker.join(timeout=30)
    assert result["w"] == blobs["w"]
    stats = client.stats
    assert stats["resumes"] == 1 and stats["resumed_bytes"] >= 200_000
    # upstream sent the relay one full copy, then the client only the tail the relay did not deliver
    assert upstream.stats.snapshot()["bytes_sent"] == size + size - stats["resumed_bytes"]
    client.close()
    upstream.close()


def test_relay_restarts_from_its_verified_cache_without_upstream(tmp_path):
    store, blobs = make_store(tmp_path / "s", {"w": 30_000})
    upstream = serve_store(store)
    with Relay([upstream.url], tmp_path / "cache") as relay, WeightClient(relay.url) as client:
        assert client.download(client.manifest(0).blobs) == blobs
    upstream.close()
    key = store.manifest(0).blobs["w"].key
    with Relay([upstream.url], tmp_path / "cache", retries=0) as relay:
        with WeightClient(relay.url, retries=0) as client:
            assert client.download(client.manifest(0).blobs) == blobs
            assert relay.stats()["upstream_blob_fetches"] == 0
            with pytest.raises(TransportError, match="latest"):
                client.latest()  # never seen and upstream down: an error response, not a crash
    # a cache file that went bad is re-hashed at start and never served
    (tmp_path / "cache" / "blobs" / key).write_bytes(b"rot")
    with Relay([upstream.url], tmp_path / "cache", retries=0) as relay:
        with WeightClient(relay.url, retries=0) as client:
            with pytest.raises(TransportError, match="502"):
                client.download(client.manifest(0).blobs)
    assert not (tmp_path / "cache" / "blobs" / key).exists()


def test_relay_never_caches_a_corrupt_upstream_blob(tmp_path):
    store, blobs = make_store(tmp_path / "s", {"w": 30_000})
    key = store.manifest(0).blobs["w"].key
    path = tmp_path / "s" / "blobs" / key
    path.write_bytes(path.read_bytes()[:-5])
    with serve_store(store) as upstream, Relay([upstream.url], tmp_path / "cache", retries=0) as relay:
        with WeightClient(relay.url, retries=0) as client:
            with pytest.raises(CorruptBlobError, match=key[:16]):
                client.download(client.manifest(0).blobs)
    assert not (tmp_path / "cache" / "blobs" / key).exists()


def test_an_unusable_cache_dir_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for cache in (tmp_path / "file" / "sub", tmp_path / "file"):
        with pytest.raises(
            WeightStoreError, match="relay cache directory .*file.* cannot be created or written"
        ):
            Relay(["http://127.0.0.1:1"], cache)
    Relay(["http://127.0.0.1:1"], tmp_path / "new" / "cache").close()  # created on demand
    assert sorted(p.name for p in (tmp_path / "new" / "cache").iterdir()) == [".tmp", "blobs", "manifests"]


def test_a_relay_whose_cache_is_deleted_or_truncated_while_serving_fetches_again(tmp_path):
    store, blobs = make_store(tmp_path / "s", {"w": 30_000})
    key = store.manifest(0).blobs["w"].key
    cache = tmp_path / "cache"
    with serve_store(store) as upstream, Relay([upstream.url], cache, retries=0) as relay:
        with WeightClient(relay.url, retries=0) as client:
            assert client.download(client.manifest(0).blobs) == blobs
            shutil.rmtree(cache)  # e.g. a cleanup job under a running relay
            assert client.download(client.manifest(0).blobs) == blobs
            assert relay.stats()["upstream_blob_fetches"] == 2
            (cache / "blobs" / key).write_bytes(blobs["w"][:100])  # a verified file that changed size
            assert client.download(client.manifest(0).blobs) == blobs
            assert relay.stats()["upstream_blob_fetches"] == 3


def test_relay_clients_that_stop_reading_are_dropped_and_never_lock_the_region_out(tmp_path):
    """The relay's local server has the store server's send bounds: clients that ask for a big blob and read
    nothing are dropped (the relay's cap full of them closes the stalled ones for new clients)."""
    store, blobs = make_store(tmp_path / "s", {"big": 32 << 20})
    key = store.manifest(0).blobs["big"].key
    with (
        serve_store(store) as upstream,
        Relay(
            [upstream.url], tmp_path / "cache", max_connections=3, send_stall_s=1.0, min_send_rate=0
        ) as relay,
    ):
        with WeightClient(relay.url, retries=0, parallel=1) as client:  # the relay caches the blob first
            assert client.blob(key) == blobs["big"]
        served = relay.server.stats.snapshot
        gets = served()["blob_gets"]
        stalled = []
        for _ in range(3):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", relay.server.port))
            s.sendall(f"GET /v1/weights/blobs/{key} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            stalled.append(s)
        wait_for(lambda: served()["blob_gets"] == gets + 3)  # all three are being sent their blob
        deadline = time.monotonic() + 60  # a hang guard, far beyond the seconds this takes
        while True:
            try:
                with WeightClient(relay.url, retries=0, parallel=2) as client:
                    assert client.latest() == 1
                    assert client.blob(key) == blobs["big"]
                break
            except TransportError:
                assert time.monotonic() < deadline, f"locked out: {relay.server.stats.snapshot()}"
                time.sleep(0.1)
        wait_for(
            lambda: (
                served().get("dropped_stalled_responses", 0) + served().get("evicted_stalled_connections", 0)
                == 3
            ),
            timeout=60,
        )
        wait_for(lambda: served()["streams_in_flight"] == 0)
        assert relay.stats()["upstream_blob_fetches"] == 1
        for s in stalled:
            s.close()
