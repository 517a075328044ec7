"""The HTTP transport: real servers on 127.0.0.1, faults made by closing servers mid-transfer."""

import hashlib
import http.client
import json
import os
import shutil
import socket
import threading
import time

import pytest

from tandem.weights.client import WeightClient
from tandem.weights.errors import CorruptBlobError, MissingBlobError, TransportError, VersionNotFoundError
from tandem.weights.ratelimit import TokenBucket
from tandem.weights.store import WeightStore
from tandem.weights.transport import parse_range, serve_store


def make_store(path, sizes, version=0):
    store = WeightStore.open(path, create=True)
    blobs = {name: os.urandom(size) for name, size in sizes.items()}
    manifest = store.publish(version, None, "full", f"h{version}", blobs)
    store.close()
    return store, manifest, blobs


def get(url, path, method="GET", headers=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp, body


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_routes_ranges_and_errors(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 10_000})
    key = manifest.blobs["w"].key
    with serve_store(store) as server:
        resp, body = get(server.url, "/v1/weights/latest")
        assert resp.status == 200 and json.loads(body) == {"version": 0}
        resp, body = get(server.url, "/v1/weights/manifests/0")
        assert resp.status == 200 and body == store.manifest_bytes(0)
        resp, body = get(server.url, "/v1/weights/manifests/5")
        assert resp.status == 404 and "version 5" in json.loads(body)["error"]
        resp, body = get(server.url, "/v1/weights/manifests/abc")
        assert resp.status == 400 and "'abc'" in json.loads(body)["error"]
        resp, body = get(server.url, f"/v1/weights/blobs/{key}", "HEAD")
        assert (resp.status, body, resp.getheader("Content-Length")) == (200, b"", "10000")
        assert resp.getheader("Accept-Ranges") == "bytes"
        resp, body = get(server.url, f"/v1/weights/blobs/{key}", headers={"Range": "bytes=100-199"})
        assert resp.status == 206 and body == blobs["w"][100:200]
        assert resp.getheader("Content-Range") == "bytes 100-199/10000"
        resp, body = get(server.url, f"/v1/weights/blobs/{key}", headers={"Range": "bytes=-10"})
        assert resp.status == 206 and body == blobs["w"][-10:]
        resp, body = get(server.url, f"/v1/weights/blobs/{key}", headers={"Range": "bytes=20000-"})
        assert resp.status == 416 and resp.getheader("Content-Range") == "bytes */10000"
        resp, body = get(server.url, f"/v1/weights/blobs/{key}", headers={"Range": "bytes=0-1,5-6"})
        assert resp.status == 200 and body == blobs["w"]
        resp, body = get(server.url, "/v1/weights/blobs/" + "0" * 64)
        assert resp.status == 404
        resp, body = get(server.url, "/v1/weights/blobs/nothex")
        assert resp.status == 400
        resp, body = get(server.url, "/v2/other")
        assert resp.status == 404 and "no route" in json.loads(body)["error"]
        resp, body = get(server.url, "/v1/weights/stats")
        assert json.loads(body)["blob_gets_by_key"] == {key: 3}  # 416 and HEAD send no body


def test_parse_range():
    assert parse_range(None, 10) is None and parse_range("bytes=2-", 10) == (2, 10)
    assert parse_range("bytes=2-100", 10) == (2, 10) and parse_range("bytes=-3", 10) == (7, 10)
    assert parse_range("items=1-2", 10) is None and parse_range("bytes=x-2", 10) is None


def test_client_downloads_in_parallel_and_verifies(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {f"t{i}": 100_000 + i for i in range(6)})
    total = sum(len(b) for b in blobs.values())
    # a slow link keeps every stream open long enough for them to overlap
    with serve_store(store, bandwidth_bytes_per_s=2e6) as server:
        with WeightClient([server.url], parallel=4, part_size=64 * 1024) as client:
            assert client.latest() == 0
            assert client.download(client.manifest(0).blobs) == blobs
            stats = client.stats
        served = server.stats.snapshot()
    parts = sum(-(-len(b) // (64 * 1024)) for b in blobs.values())
    assert stats["blob_requests"] == parts == served["blob_gets"]
    assert stats["bytes_downloaded"] == total == served["bytes_sent"]
    assert served["max_concurrent_streams"] >= 2
    assert stats.get("source_failures", 0) == 0


def test_client_fetches_a_plan(tmp_path):
    store = WeightStore.open(tmp_path / "s", create=True, snapshot_every=3)
    for v in range(5):
        blobs = {"w": os.urandom(2000 if v % 3 == 0 else 100)}
        store.publish(v, v - 1 if v else None, "full" if v % 3 == 0 else "delta", f"h{v}", blobs)
    with serve_store(store) as server, WeightClient(server.url) as client:
        assert client.plan(1) == store.plan(1) and client.plan(None, 4) == store.plan(None, 4)
        fetched = client.fetch(None)
        assert [f.step.version for f in fetched] == [3, 4]
        assert fetched[1].blobs == store.blobs(store.manifest(4).blobs)
        with pytest.raises(VersionNotFoundError, match="version 9"):
            client.manifest(9)
        with pytest.raises(MissingBlobError, match="0" * 64):
            client.blob("0" * 64)


def test_transfer_cut_mid_blob_resumes_from_the_next_source(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 3_000_000})
    size = len(blobs["w"])
    slow = serve_store(store, bandwidth_bytes_per_s=1e6)
    fast = serve_store(store)
    client = WeightClient([slow.url, fast.url], parallel=1, backoff_s=0.01)
    result = {}
    worker = threading.Thread(target=lambda: result.update(client.download(manifest.blobs)))
    worker.start()
    wait_for(lambda: slow.stats.snapshot().get("bytes_sent", 0) >= 300_000)
    slow.close()  # killed mid-transfer
    worker.join(timeout=30)
    assert result["w"] == blobs["w"]
    stats, from_fast = client.stats, fast.stats.snapshot()
    assert stats["resumes"] == 1 and stats["resumed_bytes"] >= 200_000
    # the second source sent only the missing tail: the partial data was kept
    assert from_fast["bytes_sent"] == size - stats["resumed_bytes"]
    client.close()
    fast.close()


def test_dead_sources_are_skipped_then_reported(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 5000})
    gone = dead_url()
    with serve_store(store) as server, WeightClient([gone, server.url], backoff_s=0.01) as client:
        assert client.download(manifest.blobs) == blobs
        assert client.stats["source_failures"] >= 1
    with WeightClient([gone], retries=2, backoff_s=0.01) as client:
        with pytest.raises(TransportError, match=f"every source failed after 3 rounds.*{gone}"):
            client.latest()
        assert client.stats["retries"] == 2
    with pytest.raises(TransportError, match="bad weight server URL 'ftp://x'"):
        WeightClient(["ftp://x"])


def test_corrupt_blobs_are_never_handed_out(tmp_path):
    store_a, manifest, blobs = make_store(tmp_path / "a", {"w": 50_000})
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    store_b = WeightStore.open(tmp_path / "b")
    key = manifest.blobs["w"].key
    path = tmp_path / "a" / "blobs" / key
    with serve_store(store_a) as a, serve_store(store_b) as b:
        # a server refuses to send a blob that fails its hash check (502) and the client moves on
        path.write_bytes(path.read_bytes()[:-1])
        with WeightClient([a.url, b.url], backoff_s=0.01) as client:
            assert client.download(manifest.blobs) == blobs
        assert a.stats.snapshot()["corrupt_blobs"] == 1
        with WeightClient([a.url], retries=1, backoff_s=0.01) as client:
            with pytest.raises(CorruptBlobError, match=key[:16]):
                client.download(manifest.blobs)
        # bytes that change after the server checked them are caught by the client's own hash check
        path.write_bytes(blobs["w"])
        store_a.verify_blob(key)
        path.write_bytes(bytes([blobs["w"][0] ^ 1]) + blobs["w"][1:])
        with WeightClient([a.url, b.url], backoff_s=0.01) as client:
            assert client.download(manifest.blobs) == blobs
            assert client.stats["corrupt_blobs"] == 1
        with WeightClient([a.url], retries=0) as client:
            with pytest.raises(CorruptBlobError, match=key[:16]):
                client.download(manifest.blobs)


def test_bandwidth_limit_is_honoured(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"a": 300_000, "b": 300_000})
    rate = 1e6
    with serve_store(store, bandwidth_bytes_per_s=rate) as server:
        with WeightClient(server.url, parallel=2) as client:
            start = time.monotonic()
            assert client.download(manifest.blobs) == blobs
            elapsed = time.monotonic() - start
        limiter = server.limiter
    assert limiter.bytes == 600_000
    # both streams shared one 1 MB/s link; sleeps never end early, so this lower bound always holds
    assert elapsed >= limiter.min_duration_s(600_000) > 0.5


def test_token_bucket_is_one_link_for_all_threads():
    bucket = TokenBucket(2e6, burst_bytes=10_000)
    start = time.monotonic()
    threads = [threading.Thread(target=lambda: [bucket.consume(10_000) for _ in range(20)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bucket.bytes == 800_000
    assert time.monotonic() - start >= bucket.min_duration_s(800_000)
    with pytest.raises(ValueError, match="bandwidth"):
        TokenBucket(0)


def test_client_cache_dir_serves_repeat_downloads(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 20_000, "empty": 0})
    with serve_store(store) as server:
        with WeightClient(server.url, cache_dir=tmp_path / "cache") as client:
            assert client.download(manifest.blobs) == blobs
    with WeightClient(dead_url(), cache_dir=tmp_path / "cache", retries=0) as client:
        assert client.download(manifest.blobs) == blobs  # no server needed
        assert client.stats["cache_hits"] == 1  # the empty blob needs neither cache nor server
    key = manifest.blobs["w"].key
    assert hashlib.sha256((tmp_path / "cache" / "blobs" / key).read_bytes()).hexdigest() == key


def test_downloaded_blobs_are_read_only_views_of_one_receive_buffer(tmp_path):
    # Entries packed into one stored blob are cut out of its receive buffer, not copied: no bulk copy holds
    # the GIL on the follower's low-priority threads (see tandem.weights.client).
    import numpy as np

    store = WeightStore.open(tmp_path / "s", create=True)
    blobs = {f"t{i}": os.urandom(3000 + i) for i in range(8)}
    manifest = store.publish(0, None, "full", "h0", blobs, pack=True)
    store.close()
    packed = [name for name, ref in manifest.blobs.items() if ref.length is not None]
    assert len(packed) >= 2, "the store is expected to pack small entries"
    with serve_store(store) as server, WeightClient(server.url, part_size=4096) as client:
        got = client.download(manifest.blobs)
    assert got == blobs
    views = [got[name] for name in packed]
    assert all(isinstance(v, memoryview) and v.readonly for v in views)
    assert len({manifest.blobs[name].key for name in packed}) == 1
    assert all(v.obj is views[0].obj for v in views)  # one buffer behind them all
    ref0, ref1 = manifest.blobs[packed[0]], manifest.blobs[packed[1]]
    a, b = (np.frombuffer(v, np.uint8).ctypes.data for v in views[:2])
    assert b - a == ref1.offset - ref0.offset  # cut out in place
    with pytest.raises(TypeError):
        views[0][0] = 1


def _raw_status(url, request: bytes) -> int:
    """Send raw request bytes (http.client would refuse non-ASCII in a path) and return the status."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_bad_numbers_are_400_or_ignored_ranges_never_500(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 1000})
    key = manifest.blobs["w"].key
    with serve_store(store) as server:
        for version in (b"\xb2", b"9" * 5000, b"0" * 30 + b"1"):  # b"\xb2" is latin-1 "²": isdigit(), no int
            request = b"GET /v1/weights/manifests/" + version + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            assert _raw_status(server.url, request) == 400, version[:10]
        resp, _ = get(server.url, "/v1/weights/manifests/000")
        assert resp.status == 200
        path = f"/v1/weights/blobs/{key}"
        for rng in ("bytes=\xb2-", "bytes=-\xb2", "bytes=1-\xb2", "bytes=5-3", "bytes=-", "bytes=a-b"):
            resp, body = get(server.url, path, headers={"Range": rng})  # invalid: ignored (RFC 9110)
            assert (resp.status, body) == (200, blobs["w"]), rng
        resp, _ = get(server.url, path, headers={"Range": "bytes=" + "9" * 5000 + "-"})
        assert resp.status == 416 and resp.getheader("Content-Range") == "bytes */1000"
        resp, body = get(server.url, path, headers={"Range": "bytes=10-" + "9" * 5000})
        assert resp.status == 206 and body == blobs["w"][10:]
        resp, body = get(server.url, path, headers={"Range": "bytes=-" + "9" * 5000})
        assert resp.status == 206 and body == blobs["w"]
        assert "status_500" not in json.loads(get(server.url, "/v1/weights/stats")[1])
    with pytest.raises(ValueError, match="finite"):
        TokenBucket(float("inf"))


class _Liar:
    """An upstream on 127.0.0.1 that answers each path with what ``routes`` says: (status, headers, body),
    where a body of None is endless (chunked, until the client hangs up)."""

    def __init__(self, routes):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                status, headers, body = routes.get(self.path, (404, {}, b'{"error": "no"}'))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if body is None:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
                    try:
                        while True:
                            self.wfile.write(chunk)
                    except OSError:
                        return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_what_a_lying_upstream_sends_is_bounded_and_checked(tmp_path):
    """A red-team probe's upstream made a relay read an endless manifest (2.9 GB in 4 s), crash at start on
    ``{"version": [1]}``, and cache a manifest of version 2 as version 1 for good."""
    from tandem.weights.client import MAX_SMALL_BYTES
    from tandem.weights.relay import Relay

    store, manifest, _ = make_store(tmp_path / "s", {"a": 5000})
    good = store.manifest_bytes(0)
    other = json.loads(good)
    other["version"] = 2
    liar = _Liar(
        {
            "/v1/weights/latest": (200, {}, b'{"version": [1]}'),
            "/v1/weights/manifests/0": (200, {}, json.dumps(other).encode()),
            "/v1/weights/manifests/1": (200, {}, None),
        }
    )
    try:
        with WeightClient([liar.url], retries=0) as client:
            with pytest.raises(TransportError, match="non-negative integer"):
                client.latest()
            with pytest.raises(TransportError, match=f"more than {MAX_SMALL_BYTES} bytes"):
                client.manifest_bytes(1)
            with pytest.raises(TransportError, match="manifest v2 for v0"):
                client.manifest(0)
            with pytest.raises(TransportError, match="at most"):
                client.fetch_keys({"0" * 64: 10**15})
        relay = Relay([liar.url], tmp_path / "cache")
        try:
            with WeightClient([relay.url], retries=0) as client:
                with pytest.raises(TransportError):
                    client.manifest(0)
        finally:
            relay.close()
    finally:
        liar.close()
    honest = serve_store(WeightStore.open(tmp_path / "s"))
    relay = Relay([honest.url], tmp_path / "cache")  # the same cache: nothing of the liar's was kept
    try:
        with WeightClient([relay.url], retries=0) as client:
            assert client.manifest(0).version == 0 and client.manifest_bytes(0) == good
    finally:
        relay.close()
        honest.close()


def test_a_store_manifest_naming_another_version_is_refused_not_followed(tmp_path):
    """Manifest files whose bodies name other versions (v4 says 9 with parent 5, v5 says 8 with parent 4)
    made ``plan`` and ``gc`` loop forever, growing."""
    from tandem.weights.errors import ManifestError

    store = WeightStore.open(tmp_path / "s", create=True)
    for v in range(6):
        parent, kind = (None, "full") if v == 0 else (v - 1, "delta")
        store.publish(v, parent, kind, f"h{v}", {"x": os.urandom(99)})
    store.close()
    for v, (claimed, parent) in {4: (9, 5), 5: (8, 4)}.items():
        path = next((tmp_path / "s").rglob(f"*{v:08d}.json"))
        body = json.loads(path.read_text())
        body.update(version=claimed, parent=parent)
        path.write_text(json.dumps(body))
    store = WeightStore.open(tmp_path / "s")
    with pytest.raises(ManifestError, match="names version 8, not 5"):
        store.plan(None, 5)
    with pytest.raises(ManifestError, match="names version 8, not 5"):
        store.plan(3, 5)


def test_a_full_server_closes_its_longest_idle_connection_for_a_new_one(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 400_000})
    # The idle connections fill the server, so the client's first connection already needs a slot. (With
    # one slot left, the test depended on the client opening a second connection; on a loaded machine its
    # second thread can reuse the first's connection, and nothing was evicted: CI failed that way.)
    with serve_store(store, max_connections=4) as server:
        host, port = server.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        idle[1].sendall(b"GET /v1/weights/latest HTTP/1.1\r\n")  # a slowloris: headers never finished
        wait_for(lambda: len(server._connections) == 4)
        with WeightClient([server.url], retries=0, parallel=2, part_size=100_000) as client:
            assert client.download(manifest.blobs) == blobs
        assert server.stats.snapshot()["evicted_idle_connections"] >= 1
        assert idle[0].recv(1) == b""  # the longest idle was closed first
        for s in idle:
            s.close()


def test_a_server_whose_connections_are_all_busy_refuses_a_new_one_and_keeps_serving(tmp_path):
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 300_000})
    key = manifest.blobs["w"].key
    # 200 kB/s for the whole server: two streams of 300 kB stay busy for about 3 s
    with serve_store(store, max_connections=2, bandwidth_bytes_per_s=200_000) as server:
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(get(server.url, f"/v1/weights/blobs/{key}")[1]))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        wait_for(lambda: server.stats.snapshot().get("streams_in_flight", 0) == 2)
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            assert s.recv(1) == b""  # refused: closed at once, not left waiting behind the busy ones
        assert server.stats.snapshot()["refused_connections"] == 1
        for t in threads:
            t.join(timeout=60)
        assert results == [blobs["w"]] * 2
        with WeightClient([server.url], retries=0) as client:
            assert client.latest() == 0


def test_a_request_body_is_never_taken_for_the_next_request(tmp_path):
    store, _, _ = make_store(tmp_path / "s", {"w": 100})
    smuggled = b"GET /v1/weights/stats HTTP/1.1\r\n\r\n"
    with serve_store(store) as server:
        for framing in (b"Content-Length: %d\r\n" % len(smuggled), b"Transfer-Encoding: chunked\r\n"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                s.sendall(b"GET /v1/weights/latest HTTP/1.1\r\n" + framing + b"\r\n" + smuggled)
                data = b""
                while chunk := s.recv(65536):  # the server closes the connection after its answer
                    data += chunk
            assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b'{"version": 0}'), data
            assert data.count(b"HTTP/1.1") == 1
        assert server.stats.snapshot()["requests"] == 2  # one per connection: nothing smuggled in


def request_and_stop_reading(port, key, drip_bytes=0, every_s=0.05):
    """A client that asks for blob ``key`` and then reads nothing (a small receive buffer, so the kernel takes
    little on its behalf), or reads ``drip_bytes`` every ``every_s`` until its connection ends."""
    s = socket.socket()
    if not drip_bytes:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET /v1/weights/blobs/{key} HTTP/1.1\r\nHost: t\r\n\r\n".encode())

    def drip():
        try:
            while s.recv(drip_bytes):
                time.sleep(every_s)
        except OSError:
            pass

    if drip_bytes:
        threading.Thread(target=drip, daemon=True).start()
    return s


def ended_short(s, size):
    """Read what a dropped connection still delivers: True if it ends (reset or EOF) before ``size`` bytes."""
    got = 0
    s.settimeout(30)
    try:
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    return got < size


def test_clients_that_stop_reading_a_big_blob_never_lock_a_good_client_out(tmp_path):
    """Before, four clients that asked for a big blob and read nothing held every slot of a 4-connection
    server: a good client was refused for 120 s (until each stalled send's socket timeout)."""
    store, manifest, blobs = make_store(tmp_path / "s", {"big": 32 << 20})
    key = manifest.blobs["big"].key
    with serve_store(store, max_connections=4) as server:  # the default send bounds
        stalled = [request_and_stop_reading(server.port, key) for _ in range(4)]
        wait_for(lambda: server.stats.snapshot().get("streams_in_flight", 0) == 4)
        deadline = time.monotonic() + 60  # a hang guard, far beyond the seconds this takes
        while True:
            try:
                with WeightClient([server.url], retries=0, parallel=2) as client:
                    assert client.latest() == 0
                    assert client.blob(key) == blobs["big"]
                break
            except TransportError:  # refused while the stalled ones have not waited long enough yet
                assert time.monotonic() < deadline, f"good client locked out: {server.stats.snapshot()}"
                time.sleep(0.1)
        assert server.stats.snapshot()["evicted_stalled_connections"] >= 1
        with WeightClient([server.url], retries=0) as client:  # and the server keeps serving
            assert client.latest() == 0
        for s in stalled:
            s.close()


def test_a_response_whose_client_accepts_nothing_for_send_stall_s_is_dropped(tmp_path):
    """Below the connection cap too: the sending thread is freed and the connection reset, not held."""
    store, manifest, blobs = make_store(tmp_path / "s", {"big": 32 << 20})
    key = manifest.blobs["big"].key
    with serve_store(store, send_stall_s=1.0, min_send_rate=0) as server:
        stalled = [request_and_stop_reading(server.port, key) for _ in range(3)]
        wait_for(lambda: server.stats.snapshot().get("dropped_stalled_responses", 0) == 3, timeout=60)
        wait_for(lambda: server.stats.snapshot()["streams_in_flight"] == 0)
        assert all(ended_short(s, len(blobs["big"])) for s in stalled)
        with WeightClient([server.url], retries=0) as client:
            assert client.blob(key) == blobs["big"]
        assert "dropped_slow_responses" not in server.stats.snapshot()
        for s in stalled:
            s.close()
    for bad in ({"send_stall_s": 0}, {"send_stall_s": float("inf")}, {"min_send_rate": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            serve_store(store, **bad)


def test_a_response_whose_client_reads_below_the_floor_rate_is_dropped(tmp_path):
    """Clients that keep reading, but slowly (about 1.3 MB/s against a floor of 8 MiB/s), are dropped too:
    before, clients dripping 40 kB/s held their connections for as long as the blob lasted."""
    store, manifest, blobs = make_store(tmp_path / "s", {"big": 32 << 20})
    key = manifest.blobs["big"].key
    with serve_store(store, send_stall_s=2.0, min_send_rate=8 << 20) as server:
        slow = [request_and_stop_reading(server.port, key, drip_bytes=64 << 10) for _ in range(2)]
        wait_for(lambda: server.stats.snapshot().get("dropped_slow_responses", 0) == 2, timeout=60)
        wait_for(lambda: server.stats.snapshot()["streams_in_flight"] == 0)
        assert "dropped_stalled_responses" not in server.stats.snapshot()  # they never stopped reading
        with WeightClient([server.url], retries=0) as client:
            assert client.blob(key) == blobs["big"]
        for s in slow:
            s.close()


def test_a_client_at_or_above_the_floor_rate_is_never_dropped(tmp_path):
    """A client paced at 1 MB/s by its own link, against a floor of 256 KiB/s and a 1 s stall bound: its
    socket's send buffer drains slowly (no writable wake-up for long stretches), but it keeps acknowledging
    bytes, so nothing is dropped."""
    store, manifest, blobs = make_store(tmp_path / "s", {"w": 3_000_000})
    with serve_store(store, send_stall_s=1.0, min_send_rate=256 << 10) as server:
        limiter = TokenBucket(1e6)
        with WeightClient([server.url], retries=0, parallel=1, limiter=limiter) as client:
            assert client.download(manifest.blobs) == blobs
        assert limiter.waited_s > 1.0  # it was paced, so the server waited on it
        stats = server.stats.snapshot()
        assert "dropped_stalled_responses" not in stats and "dropped_slow_responses" not in stats


def test_a_connection_is_untracked_before_its_socket_is_closed(tmp_path):
    """Eviction and ``close`` shut down tracked sockets only: a socket its handler closes is untracked first,
    so neither acts on a descriptor the next accept may already reuse for another client."""
    with (
        serve_store(WeightStore.open(tmp_path / "s", create=True)) as server,
        socket.create_connection((server.host, server.port)),
    ):
        deadline = time.monotonic() + 10
        while not server._connections and time.monotonic() < deadline:
            time.sleep(0.01)
        sock = next(iter(server._connections))
        server._httpd.shutdown_request(sock)  # what socketserver calls when a handler is done
        assert sock not in server._connections
        assert sock._closed  # (the descriptor itself closes once the handler drops its file objects)
