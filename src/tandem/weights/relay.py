"""A regional relay: one upstream fetch per blob, a verified disk cache, many local clients.

The relay answers the same routes as ``serve_store`` (see ``tandem.weights.transport``).

Invariants:
- Each blob is fetched from upstream at most once while it stays cached: concurrent requests for a blob that
  is not cached yet wait on the single in-flight fetch (``stats()["coalesced"]``), and a failed fetch is
  reported to every waiter and retried by the next request.
- Only verified blobs enter the cache (the upstream client checks every hash; cache files from an earlier
  run are re-hashed once before they are served). Cache writes are atomic. A verified cache file that is
  gone or has another size when a request comes (the cache directory was cleaned or deleted under the
  running relay) is fetched and verified again, so the relay keeps serving instead of failing that blob.
- Manifests are immutable and cached in memory after one upstream fetch; ``latest`` is forwarded and cached
  for ``latest_ttl_s`` (0: always forwarded), and a cached value is served if upstream is unreachable.
- The cache directory is created and test-written on construction: an unusable one is a
  ``WeightStoreError`` naming it before anything starts, not a 500 on every request later.
- ``upstream_bandwidth_bytes_per_s`` paces everything the relay receives from upstream (one link);
  ``bandwidth_bytes_per_s`` paces what it sends to local clients. A blob is served only after it is fully
  cached (store and forward).
- Its local server is a ``WeightServer`` with the same connection cap and send bounds as ``serve_store``
  (``max_connections``, ``send_stall_s``, ``min_send_rate``): local clients that stop reading a blob, or
  read it below the floor rate, are dropped, and never keep the other engines of the region out.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tandem.weights.backend import FileBackend
from tandem.weights.client import WeightClient
from tandem.weights.errors import ManifestError, MissingKeyError, TransportError
from tandem.weights.manifest import Manifest
from tandem.weights.ratelimit import TokenBucket
from tandem.weights.transport import DEFAULT_MIN_SEND_RATE, DEFAULT_SEND_STALL_S, BlobReader, WeightServer


class Relay:
    """Started on construction; ``url`` is where local clients connect; ``close()`` stops it."""

    def __init__(
        self,
        upstream_urls: str | Sequence[str],
        cache_dir: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bandwidth_bytes_per_s: float | None = None,
        upstream_bandwidth_bytes_per_s: float | None = None,
        latest_ttl_s: float = 0.5,
        parallel: int = 4,
        retries: int = 3,
        timeout_s: float = 30.0,
        max_connections: int | None = None,
        send_stall_s: float = DEFAULT_SEND_STALL_S,
        min_send_rate: float = DEFAULT_MIN_SEND_RATE,
    ) -> None:
        self.cache = FileBackend(cache_dir, durable=False)
        # before anything starts: an unusable cache would otherwise fail every request with a 500
        self.cache.check_writable(("blobs", "manifests"), what="relay cache directory")
        self.upstream_limiter = (
            TokenBucket(upstream_bandwidth_bytes_per_s) if upstream_bandwidth_bytes_per_s else None
        )
        self.upstream = WeightClient(
            upstream_urls,
            parallel=parallel,
            retries=retries,
            timeout_s=timeout_s,
            limiter=self.upstream_limiter,
        )
        self.latest_ttl_s = latest_ttl_s
        self._mutex = threading.Lock()
        self._inflight: dict[str, Future[None]] = {}
        self._verified: dict[str, int] = {}  # key -> size of its verified cache file
        self._sizes: dict[str, int] = {}
        self._manifests: dict[int, bytes] = {}
        self._latest: tuple[float, int | None] | None = None
        self._counts = {"upstream_blob_fetches": 0, "cache_hits": 0, "coalesced": 0, "upstream_latest": 0}
        self.server = WeightServer(
            self,
            host,
            port,
            bandwidth_bytes_per_s,
            max_connections=max_connections,
            send_stall_s=send_stall_s,
            min_send_rate=min_send_rate,
        )

    @property
    def url(self) -> str:
        return self.server.url

    def stats(self) -> dict[str, Any]:
        """Relay counters plus the upstream client's (``upstream_*``) and the local server's (``served``)."""
        with self._mutex:
            out: dict[str, Any] = dict(self._counts)
        out.update({f"upstream_{k}": v for k, v in self.upstream.stats.items()})
        out["served"] = self.server.stats.snapshot()
        return out

    def _count(self, name: str) -> None:
        with self._mutex:
            self._counts[name] += 1

    def close(self) -> None:
        self.server.close()
        self.upstream.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- BlobSource ----

    def latest(self) -> int | None:
        now = time.monotonic()
        cached = self._latest
        if cached is not None and now - cached[0] < self.latest_ttl_s:
            return cached[1]
        try:
            version = self.upstream.latest()
        except TransportError:
            if cached is None:
                raise
            return cached[1]  # upstream unreachable: the last answer is better than none
        self._count("upstream_latest")
        self._latest = (now, version)
        return version

    def manifest_bytes(self, version: int) -> bytes:
        body = self._manifests.get(version)
        if body is not None:
            return body
        body = self._cached_manifest(version)
        if body is not None:
            self._remember(version, body)
            return body
        body = self.upstream.manifest_bytes(version)
        self._remember(version, body)  # parses first: a malformed manifest is never cached
        self.cache.put(f"manifests/v{version:08d}.json", body)
        return body

    def _remember(self, version: int, body: bytes) -> None:
        where = f"v{version} from upstream {', '.join(self.upstream.urls)}"
        manifest = Manifest.from_bytes(body, where, version)
        with self._mutex:
            for ref in [*manifest.blobs.values(), *(manifest.delta_blobs or {}).values()]:
                self._sizes[ref.key] = ref.size
            self._manifests[version] = body

    def _cached_manifest(self, version: int) -> bytes | None:
        """A manifest cached by an earlier run (only if it parses; a bad copy is dropped)."""
        key = f"manifests/v{version:08d}.json"
        try:
            body = self.cache.get(key)
            Manifest.from_bytes(body, key, version)
        except MissingKeyError:
            return None
        except ManifestError:
            self.cache.delete(key)
            return None
        return body

    def open_blob(self, key: str) -> BlobReader:
        cache_key = f"blobs/{key}"
        for attempt in range(2):
            self._ensure(key)
            try:
                size = self.cache.size(cache_key)
            except MissingKeyError:
                size = -1
            with self._mutex:
                if size == self._verified.get(key) or attempt == 1:
                    break
                self._verified.pop(key, None)  # removed or changed since it was verified: fetch it again
        if size < 0:
            raise MissingKeyError(f"key {cache_key!r} does not exist in relay cache {self.cache.describe()}")
        return BlobReader(size, lambda s, e: self.cache.get_range(cache_key, s, e))

    # ---- single-flight cache fill ----

    def _ensure(self, key: str) -> None:
        with self._mutex:
            if key in self._verified:
                self._counts["cache_hits"] += 1
                return
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = Future()
            else:
                self._counts["coalesced"] += 1
        assert future is not None
        if not owner:
            future.result()
            return
        try:
            self._fill(key)
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._mutex:
                self._inflight.pop(key, None)

    def _fill(self, key: str) -> None:
        size = self._cached_ok(key)
        if size is not None:
            self._count("cache_hits")
        else:
            data = self.upstream.blob(key, self._sizes.get(key))
            self.cache.put(f"blobs/{key}", data)
            size = len(data)
            self._count("upstream_blob_fetches")
        with self._mutex:
            self._verified[key] = size

    def _cached_ok(self, key: str) -> int | None:
        """The size of a cache file from an earlier run if it still hashes to its address, else None."""
        try:
            data = self.cache.get(f"blobs/{key}")
        except MissingKeyError:
            return None
        if hashlib.sha256(data).hexdigest() == key:
            return len(data)
        self.cache.delete(f"blobs/{key}")
        return None
