"""S3-compatible object storage backend (boto3, imported lazily).

Invariants:
- Every key lives under ``prefix`` in ``bucket``; a single ``PutObject`` is atomic, so a manifest written
  with one put is either fully visible or absent.
- ``put_if_absent`` uses a conditional put (``If-None-Match: *``). Where the server does not implement it,
  it falls back to check, put, then read back and compare the bytes (a weaker, racy guarantee).
- Missing keys raise ``MissingKeyError``; other S3 failures raise ``WeightStoreError`` naming bucket and key.
"""

from __future__ import annotations

from typing import Any

from tandem.weights.backend import ObjectLock, check_key
from tandem.weights.errors import MissingKeyError, WeightStoreError

_MISSING = {"NoSuchKey", "404", "NotFound"}
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


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
        **client_kwargs: Any,
    ) -> None:
        if not bucket:
            raise WeightStoreError("S3 bucket name is empty; pass the bucket that holds the weight store")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        if client is None:
            import boto3  # lazy: only S3 users pay for boto3's import time

            session = boto3.session.Session()
            client = session.client("s3", endpoint_url=endpoint_url, region_name=region_name, **client_kwargs)
        self.client = client
        self._conditional = True
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
            self.client.create_bucket(Bucket=self.bucket)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, op: str, key: str, e: Exception) -> Exception:
        if _code(e) in _MISSING:
            return MissingKeyError(f"key {key!r} does not exist in store {self.describe()}")
        return WeightStoreError(f"S3 {op} of {key!r} in {self.describe()} failed: {e}")

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:
            raise self._error("put", key, e) from e

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

    def acquire_lock(self, key: str) -> ObjectLock:
        return ObjectLock.acquire(self, key)


def _code(e: Exception) -> str:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return ""
    err = response.get("Error", {})
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    return str(err.get("Code") or status)
