"""HTTP client of the weight transport: parallel, resumable, verified downloads from a list of sources.

Invariants:
- Every blob handed to the caller hashes to its address; a blob that does not is refetched whole from each
  source in turn and, if none has a good copy, raises ``CorruptBlobError`` (its bytes are never returned).
- Sources are tried in list order (e.g. the regional relay, then upstream); a source that fails is moved
  to the back for ``penalty_s``. A transfer that breaks mid-blob keeps the bytes it received and asks the
  next source for the rest with ``Range`` (``stats["resumes"]``, ``stats["resumed_bytes"]``).
- After a round in which every source failed, the client waits ``backoff_s * 2**round`` (+ jitter) and
  tries again, ``retries`` times; then it raises ``TransportError`` listing each source's last error. A 404
  from every source is definitive: ``VersionNotFoundError`` / ``MissingBlobError`` at once.
  A corrupt copy reported by every source (HTTP 502 ``X-Tandem-Error: corrupt-blob``) is definitive too.
- Blobs are split into ``part_size`` ranges fetched by ``parallel`` threads over pooled keep-alive
  connections; the thread that completes a blob verifies it. ``close()`` aborts downloads in flight.
  The optional ``limiter`` paces everything this client receives (one link).
- What a source sends is bounded: manifests and ``latest`` answers by ``MAX_SMALL_BYTES`` (an endless body
  had grown a relay to 2.9 GB in 4 s), error bodies by ``MAX_ERROR_BYTES``, blob sizes by
  ``MAX_BLOB_BYTES``; past a bound the source has failed (``TransportError``), nothing else is read.
- ``cache_dir`` (optional) keeps verified blobs as ``blobs/{sha256}``; a cached blob is re-hashed on use.
- A downloaded blob is handed out as a read-only ``memoryview`` of the buffer it was received into (a cached
  one as ``bytes``): no bulk copy or zero-fill runs with the GIL held. The download threads run at the
  follower's lowered priority (``tandem.engine.follow``), and a starved thread that holds the GIL through a
  200 MB copy stalls the engine's decode loop for as long as the kernel keeps it off the CPU (measured with
  ``py-spy --gil`` in ``tandem bench sync``: seconds per full snapshot). The receive buffer is allocated
  without zero-fill, its pages are first touched by ``recv_into`` (which releases the GIL), and
  ``slice_blobs`` and the decoders cut entries out of it without copying.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.weights.backend import FileBackend
from tandem.weights.errors import (
    CorruptBlobError,
    MissingBlobError,
    MissingKeyError,
    TransportError,
    VersionNotFoundError,
)
from tandem.weights.httpconn import ConnectionPool, Source, parse_source
from tandem.weights.manifest import BlobRef, Manifest, PlanStep, blob_sizes, plan, slice_blobs
from tandem.weights.ratelimit import TokenBucket

PREFIX = "/v1/weights"
CORRUPT_HEADER = "X-Tandem-Error"
DEFAULT_PART_SIZE = 8 << 20
_READ_CHUNK = 256 * 1024
_NET_ERRORS = (OSError, http.client.HTTPException)
_EMPTY_SHA = hashlib.sha256(b"").hexdigest()
MAX_SMALL_BYTES = 64 << 20  # a manifest or a latest answer larger than this is refused, never read on
MAX_ERROR_BYTES = 64 << 10  # of an error answer's body, what is read (for its message)
MAX_BLOB_BYTES = 1 << 40  # a blob size (from a manifest or a HEAD) larger than this is refused before any
# buffer is allocated: 10**15 had raised MemoryError out of ``fetch``
Blob = bytes | memoryview
"""A verified blob: ``bytes`` from the cache, a read-only view of its receive buffer when downloaded."""


class SourceError(Exception):
    """The source answered, but wrongly (unexpected status or headers)."""


class _NotFound(Exception):
    pass


class _Corrupt(Exception):
    """The source refused to serve the blob because its copy is corrupt."""


class _Cancelled(TransportError):
    """The download was aborted (a sibling part failed, or the client is closing)."""


@dataclass
class _Part:
    key: str
    start: int
    end: int
    pos: int
    served_by: set[str] = field(default_factory=set)


@dataclass
class FetchedStep:
    step: PlanStep
    blobs: dict[str, Blob]


class WeightClient:
    """Fetch latest/manifests/blobs from weight servers or relays (see the module docstring)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        parallel: int = 4,
        retries: int = 3,
        backoff_s: float = 0.1,
        timeout_s: float = 30.0,
        part_size: int = DEFAULT_PART_SIZE,
        cache_dir: str | Path | None = None,
        limiter: TokenBucket | None = None,
        penalty_s: float = 5.0,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise TransportError("no weight server URL given; pass at least one http://HOST:PORT")
        if parallel < 1 or retries < 0 or part_size < 1:
            raise ValueError(
                f"need parallel >= 1, retries >= 0, part_size >= 1; got {parallel}, {retries}, {part_size}"
            )
        self.sources = [parse_source(u) for u in url_list]
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.part_size, self.limiter, self.penalty_s = part_size, limiter, penalty_s
        self.cache = FileBackend(cache_dir, durable=False) if cache_dir is not None else None
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="weights-dl")
        self._conns = ConnectionPool(timeout_s, parallel + 4)
        self._closing = threading.Event()
        self._mutex = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._manifests: dict[int, Manifest] = {}

    # ---- bookkeeping ----

    @property
    def stats(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._stats)

    def _count(self, name: str, n: int = 1) -> None:
        with self._mutex:
            self._stats[name] += n

    def _ordered(self) -> list[Source]:
        now = time.monotonic()
        return sorted(self.sources, key=lambda s: s.penalized_until > now)

    def _fail(self, src: Source) -> None:
        self._count("source_failures")
        src.penalized_until = time.monotonic() + self.penalty_s
        self._conns.drain(src)

    def _backoff(self, attempt: int) -> None:
        self._count("retries")
        time.sleep(self.backoff_s * (2**attempt) * (1 + 0.25 * random.random()))

    def close(self) -> None:
        """Abort downloads in flight (they raise) and close every connection."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._conns.close()

    def __enter__(self) -> WeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- small requests: latest, manifests, sizes ----

    def _small(self, method: str, path: str, what: str) -> tuple[bytes, http.client.HTTPResponse]:
        errors: dict[str, str] = {}
        for attempt in range(self.retries + 1):
            missing: list[str] = []
            for src in self._ordered():
                try:
                    conn, resp = self._conns.open(src, method, PREFIX + path)
                    limit = MAX_SMALL_BYTES if resp.status == 200 else MAX_ERROR_BYTES
                    body = resp.read(limit + 1)
                except _NET_ERRORS as e:
                    self._fail(src)
                    errors[src.url] = f"{type(e).__name__}: {e}"
                    continue
                if resp.isclosed():
                    self._conns.checkin(src, conn)
                else:  # more than ``limit`` came: an endless manifest, or an error longer than its message
                    conn.close()
                    if resp.status == 200:
                        self._fail(src)
                        errors[src.url] = f"answered more than {MAX_SMALL_BYTES} bytes for {what}"
                        continue
                if resp.status == 200:
                    return body, resp
                if resp.status == 404:
                    missing.append(_error_text(body) or f"{what} not found at {src.url}")
                    continue
                self._fail(src)
                errors[src.url] = f"HTTP {resp.status}: {_error_text(body)}"
            if len(missing) == len(self.sources):
                raise _NotFound(missing[0])
            if attempt < self.retries:
                self._backoff(attempt)
        raise TransportError(f"{what}: every source failed after {self.retries + 1} rounds: {errors}")

    def latest(self) -> int | None:
        try:
            body, _ = self._small("GET", "/latest", "latest version")
        except _NotFound as e:
            raise TransportError(f"{self._urls()} do not serve /v1/weights/latest: {e}") from None
        try:
            version = json.loads(body).get("version")
        except (ValueError, AttributeError):
            version = ""
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise TransportError(
                f"{self._urls()} answered /v1/weights/latest with {body[:100]!r}; expected "
                '{"version": N} with N a non-negative integer, or null'
            )
        return version

    def manifest_bytes(self, version: int) -> bytes:
        try:
            return self._small("GET", f"/manifests/{int(version)}", f"manifest of version {version}")[0]
        except _NotFound as e:
            raise VersionNotFoundError(str(e)) from None

    def manifest(self, version: int) -> Manifest:
        cached = self._manifests.get(version)
        if cached is None:
            cached = Manifest.from_bytes(self.manifest_bytes(version), f"v{version} from {self._urls()}")
            if cached.version != version:
                raise TransportError(f"{self._urls()} answered manifest v{cached.version} for v{version}")
            self._manifests[version] = cached
        return cached

    def blob_size(self, key: str) -> int:
        try:
            _, resp = self._small("HEAD", f"/blobs/{key}", f"blob {key}")
        except _NotFound as e:
            raise MissingBlobError(str(e)) from None
        length = resp.getheader("Content-Length", "")
        if not length.isdigit():
            raise TransportError(f"{self._urls()} answered HEAD of blob {key} without a Content-Length")
        return int(length)

    def plan(self, from_version: int | None, to_version: int | None = None) -> list[PlanStep]:
        target = self.latest() if to_version is None else to_version
        if target is None:
            raise VersionNotFoundError(f"{self._urls()} serve an empty store; nothing to fetch")
        return plan(self.manifest, from_version, target)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sources]

    def _urls(self) -> str:
        return ", ".join(self.urls)

    # ---- blobs ----

    def blob(self, key: str, size: int | None = None) -> Blob:
        size = self.blob_size(key) if size is None else size
        return self.fetch_keys({key: size})[key]

    def download(self, refs: Mapping[str, BlobRef]) -> dict[str, Blob]:
        """Verified bytes of each named entry (every stored blob fetched once, in parallel; packs sliced)."""
        return slice_blobs(refs, self.fetch_keys(blob_sizes(refs.values())))

    def fetch(self, from_version: int | None, to_version: int | None = None) -> list[FetchedStep]:
        """Plan the cheapest way to ``to_version`` and download every step's blobs in one parallel batch."""
        steps = self.plan(from_version, to_version)
        data = self.fetch_keys(blob_sizes(ref for step in steps for ref in step.blobs.values()))
        return [FetchedStep(s, slice_blobs(s.blobs, data)) for s in steps]

    def fetch_keys(self, sizes: Mapping[str, int]) -> dict[str, Blob]:
        """Verified bytes per blob address, given each blob's size (cache first, then the sources)."""
        for key, size in sizes.items():
            if not 0 <= size <= MAX_BLOB_BYTES:
                raise TransportError(f"blob {key} is said to be {size} bytes (at most {MAX_BLOB_BYTES})")
        out: dict[str, Blob] = {}
        todo: dict[str, int] = {}
        for key, size in sizes.items():
            cached = self._from_cache(key, size)
            if cached is None:
                todo[key] = size
            else:
                out[key] = cached
        if todo:
            _Batch(self, todo, out).run()
        return out

    def _finish(self, key: str, buf: np.ndarray, parts: list[_Part]) -> Blob:
        """Verify a fully received blob (refetching it if it is bad) and cache it."""
        served_by = set().union(*(p.served_by for p in parts))
        data = self._verified(key, memoryview(buf).toreadonly(), served_by)
        self._to_cache(key, data)
        return data

    def _fetch_part(
        self, part: _Part, mv: memoryview, abort: threading.Event, only: Iterable[Source] | None = None
    ) -> None:
        errors: dict[str, str] = {}
        for attempt in range(self.retries + 1):
            sources = list(only) if only is not None else self._ordered()
            missing = corrupt = 0
            for src in sources:
                try:
                    self._stream(src, part, mv, abort)
                    return
                except _NotFound:
                    missing += 1
                except _Corrupt as e:
                    corrupt += 1
                    self._fail(src)
                    errors[src.url] = f"corrupt: {e}"
                except (*_NET_ERRORS, SourceError) as e:
                    self._fail(src)
                    errors[src.url] = f"{type(e).__name__}: {e}"
            if corrupt and missing + corrupt == len(sources):  # definitive: no source has a good copy
                raise CorruptBlobError(part.key, "unknown", part.end, f"every source ({errors})")
            if missing == len(sources):
                raise MissingBlobError(f"blob {part.key} is missing from every source ({self._urls()})")
            if attempt < self.retries:
                self._backoff(attempt)
        raise TransportError(
            f"blob {part.key} bytes {part.pos}-{part.end}: every source failed after {self.retries + 1} "
            f"rounds: {errors}"
        )

    def _stream(self, src: Source, part: _Part, mv: memoryview, abort: threading.Event) -> None:
        if abort.is_set():
            raise _Cancelled
        if part.pos > part.start:
            self._count("resumes")
            self._count("resumed_bytes", part.pos - part.start)
        headers = {"Range": f"bytes={part.pos}-{part.end - 1}"}
        conn, resp = self._conns.open(src, "GET", f"{PREFIX}/blobs/{part.key}", headers)
        try:
            self._check_status(resp, part)
            self._count("blob_requests")
            while part.pos < part.end:
                if abort.is_set() or self._closing.is_set():
                    raise _Cancelled
                n = resp.readinto(mv[part.pos : min(part.end, part.pos + _READ_CHUNK)])
                if not n:
                    raise http.client.IncompleteRead(b"", part.end - part.pos)
                part.pos += n
                part.served_by.add(src.url)
                self._count("bytes_downloaded", n)
                if self.limiter is not None:
                    self.limiter.consume(n, self._closing)
        except BaseException:
            conn.close()
            raise
        self._conns.checkin(src, conn)

    def _check_status(self, resp: http.client.HTTPResponse, part: _Part) -> None:
        if resp.status == 206:
            content_range = resp.getheader("Content-Range", "")
            if not content_range.startswith(f"bytes {part.pos}-{part.end - 1}/"):
                raise SourceError(
                    f"asked bytes {part.pos}-{part.end - 1}, got Content-Range {content_range!r}"
                )
            return
        if resp.status == 200 and part.pos == 0 and resp.length == part.end:
            return  # the server ignored Range and sent the whole (single-part) blob
        body = resp.read(MAX_ERROR_BYTES)  # the connection is closed by the caller: no more is read
        if resp.status == 404:
            raise _NotFound(_error_text(body))
        if resp.getheader(CORRUPT_HEADER) == "corrupt-blob":
            raise _Corrupt(_error_text(body))
        raise SourceError(f"HTTP {resp.status}: {_error_text(body)}")

    def _verified(self, key: str, data: Blob, served_by: Collection[str] = ()) -> Blob:
        actual = hashlib.sha256(data).hexdigest()
        if actual == key:
            return data
        self._count("corrupt_blobs")
        # refetch whole from one source at a time, the ones that sent the bad bytes last
        for src in sorted(self._ordered(), key=lambda s: s.url in served_by):
            part = _Part(key, 0, len(data), 0)
            buf = bytearray(len(data))
            try:
                self._fetch_part(part, memoryview(buf), threading.Event(), only=[src])
            except (TransportError, MissingBlobError, CorruptBlobError):
                continue
            if hashlib.sha256(buf).hexdigest() == key:
                return bytes(buf)
            self._count("corrupt_blobs")
        raise CorruptBlobError(key, actual, len(data), f"every source ({self._urls()})")

    def _from_cache(self, key: str, size: int) -> bytes | None:
        if size == 0:  # nothing to download, but the address must still match
            return b"" if key == _EMPTY_SHA else _raise_corrupt(key)
        if self.cache is None:
            return None
        try:
            data = self.cache.get(f"blobs/{key}")
        except MissingKeyError:
            return None
        if len(data) == size and hashlib.sha256(data).hexdigest() == key:
            self._count("cache_hits")
            return data
        self.cache.delete(f"blobs/{key}")
        return None

    def _to_cache(self, key: str, data: Blob) -> None:
        if self.cache is not None and data:
            self.cache.put(f"blobs/{key}", data)


class _Batch:
    """One ``fetch_keys`` call: every part of every blob on the client's pool; the thread that completes a
    blob's last part verifies it, so hashing runs in parallel with the remaining downloads."""

    def __init__(self, client: WeightClient, sizes: Mapping[str, int], out: dict[str, Blob]) -> None:
        self.client, self.out = client, out
        # not zero-filled (see module invariants): every byte is received, then verified by its hash
        try:
            self.bufs = {key: np.empty(size, np.uint8) for key, size in sizes.items()}
        except MemoryError:
            total = sum(sizes.values())
            raise TransportError(f"cannot hold {len(sizes)} blobs of {total} bytes in memory") from None
        self.parts = {
            key: [_Part(key, a, min(a + client.part_size, size), a) for a in range(0, size, client.part_size)]
            for key, size in sizes.items()
        }
        self.remaining = {key: len(parts) for key, parts in self.parts.items()}
        self.abort = threading.Event()
        self.mutex = threading.Lock()

    def run(self) -> None:
        pool = self.client._pool
        futures: list[Future[None]] = [pool.submit(self._one, p) for ps in self.parts.values() for p in ps]
        error: BaseException | None = None
        for fut in futures:
            try:
                fut.result()
            except BaseException as e:  # stop the rest, then report the first failure
                if error is None:
                    error = e
                    self.abort.set()
                    for other in futures:
                        other.cancel()
        if error is not None:
            raise error

    def _one(self, part: _Part) -> None:
        self.client._fetch_part(part, memoryview(self.bufs[part.key]), self.abort)
        with self.mutex:
            self.remaining[part.key] -= 1
            last = self.remaining[part.key] == 0
            buf = self.bufs.pop(part.key) if last else None
        if buf is not None:
            data = self.client._finish(part.key, buf, self.parts[part.key])
            with self.mutex:
                self.out[part.key] = data


def _error_text(body: bytes) -> str:
    try:
        obj: Any = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    return str(obj.get("error", obj)) if isinstance(obj, dict) else str(obj)


def _raise_corrupt(key: str) -> bytes:
    raise CorruptBlobError(key, _EMPTY_SHA, 0, "the manifest (size 0 does not match the address)")
