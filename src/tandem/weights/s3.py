"""S3-compatible object storage backend (boto3, imported lazily).

Invariants:
- Every key lives under ``prefix`` in ``bucket``; a single ``PutObject`` is atomic, so a manifest written
  with one put is either fully visible or absent.
- ``put_if_absent`` uses a conditional put (``If-None-Match: *``). Where the server does not implement it,
  it falls back to check, put, then read back and compare the bytes (a weaker, racy guarantee).
- Missing keys raise ``MissingKeyError``; other S3 failures raise ``WeightStoreError`` naming bucket and key
  (a missing bucket, a bucket that cannot be created and missing or refused credentials name the bucket
  and say what to do).
- The prefix is ``/``-separated names, none empty, ``.`` or ``..`` (servers disagree on what such keys
  mean: AWS keeps them literally, others normalise or refuse them), else ``WeightStoreError`` naming it.
- ``create_bucket`` creates the bucket in the client's region (with the ``LocationConstraint`` every region
  but ``us-east-1`` requires); a bucket created meanwhile by this account is not an error.
- ``delete_if_unchanged`` deletes a key only while it still has the ETag the caller read (``If-Match``), so
  breaking a stale writer lock never deletes a lock another publisher has just taken instead.
- ``put`` of more than ``multipart_from`` bytes is a multipart upload (S3 refuses a single ``PutObject``
  over 5 GiB, and one tensor of a large model can be bigger), in parts of at least ``MIN_PART_BYTES`` and
  at most ``MAX_PARTS`` of them; the object appears only when the upload completes, so it stays atomic.
  Blobs are content-addressed and checked by their SHA-256, never by the ETag (a multipart ETag is not an
  MD5 of the bytes).
"""

from __future__ import annotations

import io
from typing import Any

from tandem.weights.backend import ObjectLock, check_key
from tandem.weights.errors import MissingKeyError, WeightStoreError

_MISSING = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_CREDENTIALS = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken", "403"
}  # fmt: skip
MULTIPART_FROM = 256 * 2**20
"""Default size above which ``put`` uploads in parts (S3's single-PUT limit is 5 GiB)."""
MIN_PART_BYTES = 64 * 2**20
"""Smallest part of a multipart upload (S3's own minimum is 5 MiB for every part but the last)."""
MAX_PARTS = 10_000
"""S3's limit on the parts of one upload."""


class S3Backend:
    """Blobs as objects in an S3-compatible bucket."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region_name: str | None = "us-east-1",
        client: Any = None,
        create_bucket: bool = False,
        multipart_from: int = MULTIPART_FROM,
        min_part_bytes: int = MIN_PART_BYTES,
        **client_kwargs: Any,
    ) -> None:
        if not bucket:
            raise WeightStoreError("S3 bucket name is empty; pass the bucket that holds the weight store")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        parts = self.prefix.split("/") if self.prefix else []
        if any(p in ("", ".", "..") or not p.isprintable() for p in parts):
            raise WeightStoreError(
                f"S3 prefix {prefix!r} of bucket {bucket!r} is malformed: use '/'-separated names without "
                "empty, '.' or '..' parts or control characters (e.g. runs/one)"
            )
        self.endpoint_url = endpoint_url
        self.multipart_from = multipart_from
        self.min_part_bytes = max(min_part_bytes, 5 * 2**20)
        if client is None:
            import boto3  # lazy: only S3 users pay for boto3's import time

            session = boto3.session.Session()
            client = session.client("s3", endpoint_url=endpoint_url, region_name=region_name, **client_kwargs)
        self.client = client
        self._conditional = True
        self._conditional_delete = True
        if create_bucket:
            self._ensure_bucket()

    def describe(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def _ensure_bucket(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            if _code(e) not in _MISSING:
                raise self._error("head bucket", "", e) from e
        else:
            return
        region = getattr(getattr(self.client, "meta", None), "region_name", None)
        config = {} if region in (None, "us-east-1") else {"LocationConstraint": region}
        try:
            if config:
                self.client.create_bucket(Bucket=self.bucket, CreateBucketConfiguration=config)
            else:
                self.client.create_bucket(Bucket=self.bucket)
        except Exception as e:
            if _code(e) in {"BucketAlreadyOwnedByYou"}:
                return  # another process of ours created it meanwhile
            raise WeightStoreError(
                f"cannot create S3 bucket {self.bucket!r} for store {self.describe()} (region {region}): "
                f"{e}; create the bucket yourself, or pass a valid bucket name you may create"
            ) from e

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, op: str, key: str, e: Exception) -> Exception:
        code = _code(e)
        if code == "NoSuchBucket":
            return WeightStoreError(
                f"S3 bucket {self.bucket!r} of store {self.describe()} does not exist; check the bucket name "
                "(and endpoint), or create the bucket (WeightStore.open(..., create=True) creates it)"
            )
        if code in _MISSING:
            return MissingKeyError(f"key {key!r} does not exist in store {self.describe()}")
        if code in _CREDENTIALS or type(e).__name__ in {"NoCredentialsError", "PartialCredentialsError"}:
            return WeightStoreError(
                f"S3 {op} of {key!r} in {self.describe()} was refused for lack of valid credentials: {e}; "
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to an identity that may "
                f"read and write s3://{self.bucket}/{self.prefix}"
            )
        return WeightStoreError(f"S3 {op} of {key!r} in {self.describe()} failed: {e}")

    def put(self, key: str, data: bytes) -> None:
        try:
            if len(data) > self.multipart_from:
                self._put_parts(key, data)
            else:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:
            raise self._error("put", key, e) from e

    def _put_parts(self, key: str, data: bytes) -> None:
        """A multipart upload of ``data`` (module invariants), through boto3's transfer manager, which
        aborts the upload on failure so no parts are left billed."""
        from boto3.s3.transfer import TransferConfig

        part = max(self.min_part_bytes, -(-len(data) // MAX_PARTS))
        config = TransferConfig(multipart_threshold=self.multipart_from, multipart_chunksize=part)
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._key(key), Config=config)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self._conditional:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return True
            except Exception as e:
                code = _code(e)
                if code in _PRECONDITION:
                    return False
                if code not in {"NotImplemented", "501"}:
                    raise self._error("conditional put", key, e) from e
                self._conditional = False
        if self.exists(key):
            return False
        self.put(key, data)
        return self.get(key) == data

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except Exception as e:
            raise self._error("get", key, e) from e

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        try:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}"
            )
            return resp["Body"].read()
        except Exception as e:
            if _code(e) in {"InvalidRange", "416"}:
                return b""
            raise self._error("ranged get", key, e) from e

    def size(self, key: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except Exception as e:
            raise self._error("head", key, e) from e

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except MissingKeyError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        full, strip = base + prefix, len(base)
        keys = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            for page in pages:
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        except Exception as e:
            raise self._error("list", prefix, e) from e
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            if _code(e) not in _MISSING:
                raise self._error("delete", key, e) from e

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """The value and its ETag (for ``delete_if_unchanged``)."""
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return resp["Body"].read(), str(resp.get("ETag", ""))
        except Exception as e:
            raise self._error("get", key, e) from e

    def delete_if_unchanged(self, key: str, etag: str) -> bool:
        """Delete ``key`` only if its ETag is still ``etag``; False if it changed or is gone. A server
        without conditional deletes gets a plain delete after comparing the ETag (a narrower race)."""
        if self._conditional_delete:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(key), IfMatch=etag)
                return True
            except Exception as e:
                code = _code(e)
                if code in _PRECONDITION or code in _MISSING:
                    return False
                if code not in {"NotImplemented", "501"}:
                    raise self._error("conditional delete", key, e) from e
                self._conditional_delete = False
        try:
            current = self.client.head_object(Bucket=self.bucket, Key=self._key(key)).get("ETag")
        except Exception as e:
            if _code(e) in _MISSING:
                return False
            raise self._error("head", key, e) from e
        if current != etag:
            return False
        self.delete(key)
        return True

    def acquire_lock(self, key: str) -> ObjectLock:
        return ObjectLock.acquire(self, key)


def _code(e: Exception) -> str:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return ""
    err = response.get("Error", {})
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    return str(err.get("Code") or status)
