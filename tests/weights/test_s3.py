"""The weight store over S3-compatible storage: a real moto server on 127.0.0.1 speaking the S3 protocol."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tandem.weights.client import WeightClient
from tandem.weights.errors import (
    CorruptBlobError,
    NotAStoreError,
    StoreLockedError,
    VersionNotFoundError,
    WeightStoreError,
)
from tandem.weights.s3 import S3Backend
from tandem.weights.store import WeightStore
from tandem.weights.transport import serve_store

_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def backend(endpoint, bucket, create=False):
    return S3Backend(bucket, prefix="runs/one", endpoint_url=endpoint, create_bucket=create)


def new_bucket():
    return f"weights-{uuid.uuid4().hex[:12]}"


def test_s3_store_publish_read_plan_gc(s3_endpoint):
    bucket = new_bucket()
    store = WeightStore(backend(s3_endpoint, bucket, create=True), create=True, snapshot_every=2)
    store.publish(0, None, "full", "h0", {"a": b"A" * 5000, "b": b"B" * 100})
    store.publish(1, 0, "delta", "h1", {"a": b"a1", "b": b"b1"})
    store.publish(2, 1, "full", "h2", {"a": b"C" * 5000, "b": b"b2"}, delta_blobs={"a": b"a2", "b": b"b2"})
    store.publish(3, 2, "delta", "h3", {"a": b"a3"})
    store.close()

    reader = WeightStore(backend(s3_endpoint, bucket))
    assert reader.versions() == [0, 1, 2, 3] and reader.snapshot_every == 2
    m = reader.manifest(2)
    assert reader.blobs(m.blobs) == {"a": b"C" * 5000, "b": b"b2"}
    assert reader.blob_range(m.blobs["a"].key, 4990, 6000) == b"C" * 10
    assert [(s.version, s.kind) for s in reader.plan(1)] == [(2, "delta"), (3, "delta")]
    assert [(s.version, s.kind) for s in reader.plan(None)] == [(2, "full"), (3, "delta")]
    with pytest.raises(VersionNotFoundError, match=r"version 9 .*available: 0\.\.3"):
        reader.manifest(9)
    # keys live under the prefix, in the documented layout
    listed = reader.backend.client.list_objects_v2(Bucket=bucket)["Contents"]
    assert "runs/one/manifests/v00000002.json" in {o["Key"] for o in listed}

    writer = WeightStore(backend(s3_endpoint, bucket))
    report = writer.gc(keep_readers_from=3)
    assert report.kept_from == 2 and report.deleted_versions == [0, 1] and writer.versions() == [2, 3]
    assert reader.blobs(writer.manifest(3).blobs) == {"a": b"a3"}
    writer.close()


def test_s3_corrupt_blob_is_detected_and_missing_store_named(s3_endpoint):
    bucket = new_bucket()
    store = WeightStore(backend(s3_endpoint, bucket, create=True), create=True)
    key = store.publish(0, None, "full", "h0", {"a": b"good bytes"}).blobs["a"].key
    store.backend.put(f"blobs/{key}", b"evil bytes")
    with pytest.raises(CorruptBlobError, match=key[:16]):
        store.blob(key)
    with pytest.raises(NotAStoreError, match=f"s3://{bucket}/elsewhere"):
        WeightStore(S3Backend(bucket, "elsewhere", endpoint_url=s3_endpoint))


def test_s3_second_publisher_is_refused(s3_endpoint):
    bucket = new_bucket()
    first = WeightStore(backend(s3_endpoint, bucket, create=True), create=True)
    first.publish(0, None, "full", "h0", {"a": b"0"})
    second = WeightStore(backend(s3_endpoint, bucket))
    with pytest.raises(StoreLockedError, match="already has a publisher .*writer.lock"):
        second.publish(1, 0, "delta", "h1", {"a": b"1"})
    assert second.backend._conditional, "moto should have honoured If-None-Match"
    first.close()
    second.publish(1, 0, "delta", "h1", {"a": b"1"})
    second.close()
    assert not second.backend.exists("writer.lock")


def test_s3_lock_of_a_dead_process_is_broken(s3_endpoint):
    bucket = new_bucket()
    store = WeightStore(backend(s3_endpoint, bucket, create=True), create=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    holder = {
        "pid": int(dead.stdout),
        "host": socket.gethostname(),
        "token": "old",
        "since": time.time() - 60,
    }
    store.backend.put("writer.lock", json.dumps(holder).encode())
    store.publish(0, None, "full", "h0", {"a": b"0"})
    assert json.loads(store.backend.get("writer.lock"))["pid"] == os.getpid()
    store.close()


def test_an_s3_store_is_served_over_http(s3_endpoint):
    bucket = new_bucket()
    store = WeightStore(backend(s3_endpoint, bucket, create=True), create=True)
    blobs = {"a": os.urandom(300_000), "b": os.urandom(1000)}
    store.publish(0, None, "full", "h0", blobs)
    with serve_store(store) as server, WeightClient([server.url], part_size=100_000) as client:
        assert client.latest() == 0
        assert client.download(client.manifest(0).blobs) == blobs
    store.close()


def _dead_holder():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return {"pid": int(dead.stdout), "host": socket.gethostname(), "token": "old", "since": time.time() - 60}


def test_two_publishers_breaking_the_same_stale_lock_get_one_writer(s3_endpoint):
    bucket = new_bucket()
    first = WeightStore(backend(s3_endpoint, bucket, create=True), create=True)
    first.backend.put("writer.lock", json.dumps(_dead_holder()).encode())
    second = WeightStore(backend(s3_endpoint, bucket))  # its own S3 client
    taken = []

    def rival_takes_over(**kwargs):
        # Fires as `first` is about to delete the stale lock it read: `second` breaks the same stale lock and
        # takes it in between (a real interleaving of two publishers, forced through boto3's event hooks).
        if not taken:
            second.acquire_writer()
            taken.append(json.loads(second.backend.get("writer.lock"))["token"])

    first.backend.client.meta.events.register_first("before-call.s3.DeleteObject", rival_takes_over)
    with pytest.raises(StoreLockedError, match="already has a publisher"):
        first.acquire_writer()
    assert taken and json.loads(first.backend.get("writer.lock"))["token"] == taken[0]
    second.publish(0, None, "full", "h0", {"a": b"0"})  # `second` still holds it
    first.close()
    second.close()
    assert not second.backend.exists("writer.lock")


def test_missing_bucket_is_named_and_one_is_created_in_the_clients_region(s3_endpoint):
    bucket = new_bucket()
    with pytest.raises(WeightStoreError, match=f"S3 bucket '{bucket}' .* does not exist; check the bucket"):
        WeightStore.open(f"s3://{bucket}/runs/one", endpoint_url=s3_endpoint)
    regional = S3Backend(bucket, "p", endpoint_url=s3_endpoint, region_name="eu-west-1", create_bucket=True)
    store = WeightStore(regional, create=True)
    store.publish(0, None, "full", "h0", {"a": b"0"})
    store.close()
    location = regional.client.get_bucket_location(Bucket=bucket)["LocationConstraint"]
    assert location == "eu-west-1"
    S3Backend(
        bucket, "p", endpoint_url=s3_endpoint, region_name="eu-west-1", create_bucket=True
    )  # exists: ok
    with pytest.raises(WeightStoreError, match="cannot create S3 bucket 'ab' .*create the bucket yourself"):
        S3Backend("ab", "p", endpoint_url=s3_endpoint, create_bucket=True)  # too short: S3 refuses it


def test_gc_of_a_store_at_the_bucket_root_leaves_other_data_alone(s3_endpoint):
    bucket = new_bucket()
    nested = WeightStore(
        S3Backend(bucket, "blobs/team-b", endpoint_url=s3_endpoint, create_bucket=True), create=True
    )
    nested.publish(0, None, "full", "n0", {"a": b"team b's weights"})
    nested.close()
    root = WeightStore(S3Backend(bucket, "", endpoint_url=s3_endpoint), create=True)
    root.backend.put("blobs/notes.txt", b"someone else's")
    root.publish(0, None, "full", "h0", {"a": b"0"})
    root.publish(1, None, "full", "h1", {"a": b"1"})
    report = root.gc(keep_last=1)
    assert report.deleted_versions == [0] and report.deleted_blobs == 1
    assert root.backend.get("blobs/notes.txt") == b"someone else's"
    again = WeightStore(S3Backend(bucket, "blobs/team-b", endpoint_url=s3_endpoint))
    assert again.blobs(again.manifest(0).blobs) == {"a": b"team b's weights"}
    root.close()


def test_missing_credentials_are_named_with_what_to_set(s3_endpoint, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(WeightStoreError, match="lack of valid credentials.*set AWS_ACCESS_KEY_ID") as info:
        WeightStore.open("s3://some-bucket/runs/one", endpoint_url=s3_endpoint)
    assert "s3://some-bucket/runs/one" in str(info.value)


def test_a_malformed_prefix_is_refused_naming_it(s3_endpoint):
    for prefix in ("runs//one", "runs/../other", "./runs", "runs/\none"):
        with pytest.raises(WeightStoreError, match="S3 prefix .* is malformed"):
            WeightStore.open(f"s3://some-bucket/{prefix}", endpoint_url=s3_endpoint)
    assert S3Backend("some-bucket", "/runs/one/", endpoint_url=s3_endpoint).prefix == "runs/one"


def test_a_blob_above_the_multipart_size_is_uploaded_in_parts_and_read_back_whole(s3_endpoint):
    """S3 refuses a single PutObject over 5 GiB, which one tensor of a large model can exceed: blobs above
    ``multipart_from`` go up in parts (the object's ETag then ends in ``-<parts>``). Here the threshold is
    lowered to 8 MiB so the path runs on a 12 MiB blob; a version published through it reads back whole."""
    bucket = new_bucket()
    b = S3Backend(bucket, prefix="runs/big", endpoint_url=s3_endpoint, create_bucket=True,
                  multipart_from=8 * 2**20, min_part_bytes=5 * 2**20)  # fmt: skip
    store = WeightStore(b, create=True)
    big = os.urandom(12 * 2**20)
    store.publish(0, None, "full", "h0", {"a": big, "b": b"small"})
    m = store.manifest(0)
    store.close()

    def etag(ref):
        return b.client.head_object(Bucket=bucket, Key=f"runs/big/blobs/{ref.key}")["ETag"].strip('"')

    assert etag(m.blobs["a"]).endswith("-3"), etag(m.blobs["a"])  # 12 MiB in parts of 5 MiB: 3 parts
    assert "-" not in etag(m.blobs["b"])  # below the threshold: one PutObject
    reader = WeightStore(S3Backend(bucket, prefix="runs/big", endpoint_url=s3_endpoint))
    assert reader.blobs(reader.manifest(0).blobs) == {"a": big, "b": b"small"}
