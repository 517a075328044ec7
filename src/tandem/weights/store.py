"""The versioned weight store: content-addressed blobs plus one JSON manifest per version.

Layout (over any ``BlobBackend``): ``store.json`` (marks the store, records the snapshot interval K),
``manifests/v{version:08d}.json``, ``blobs/{sha256}``, ``writer.lock``.

Invariants:
- Blobs are opaque bytes, addressed by their sha256; ``blob()`` returns bytes only after checking that hash
  (``CorruptBlobError`` otherwise, which also catches truncation).
- ``publish(..., pack=True)`` (what ``WeightPublisher`` does) packs the small entries of a version (each
  under ``PACK_BELOW`` bytes, in name order) into blobs of up to ``PACK_TARGET`` bytes; the manifest
  records each entry's slice (``manifest.slice_blobs``). A version of a 145-tensor model is then a handful
  of requests instead of 145 (about 1.5 ms each here).
- ``publish`` writes every blob first and the manifest last, with one atomic create-if-absent: a crash or a
  full disk mid-publish leaves the version invisible (orphan blobs are removed by ``gc``), and a published
  version is never overwritten. Versions are strictly increasing; a delta's parent must be published.
- One writer per store: ``publish`` and ``gc`` take the backend's writer lock (held until ``close``); a
  second writer gets ``StoreLockedError`` naming the holder.
- ``gc`` never deletes a blob that a kept manifest references, and deletes manifests before blobs, so a
  crash mid-gc never leaves a visible manifest pointing at deleted blobs. It deletes only keys the store
  names (``manifests/v{8 digits}.json``, ``blobs/{sha256}``): anything else under the store's location (a
  directory or prefix shared with other data, a store nested under ``blobs/``) is left alone. It first
  checks that the writer lock is still its own (``StoreLockedError`` otherwise, nothing deleted): a
  publisher whose lock was removed and taken by another must not delete that one's blobs in flight.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.weights.backend import BlobBackend, FileBackend, WriterLock
from tandem.weights.errors import (
    CorruptBlobError,
    ManifestError,
    MissingBlobError,
    MissingKeyError,
    NotAStoreError,
    VersionNotFoundError,
)
from tandem.weights.manifest import (
    DEFAULT_SNAPSHOT_EVERY,
    DELTA,
    FULL,
    KINDS,
    BlobRef,
    Manifest,
    PlanStep,
    blob_sizes,
    is_sha256,
    plan,
    should_snapshot,
    slice_blobs,
    snapshot_path,
)

MARKER_KEY = "store.json"
LOCK_KEY = "writer.lock"
MANIFEST_PREFIX = "manifests/"
BLOB_PREFIX = "blobs/"
_STORE_FORMAT = "tandem-weights-store"
MAX_VERSION = 10**8  # manifest names hold 8 digits
PACK_BELOW = 1 << 20
"""Entries smaller than this are packed with others into one blob."""
PACK_TARGET = 4 << 20
"""A pack is closed once it holds this many bytes (larger blobs still fetch in parallel ranges)."""


def manifest_key(version: int) -> str:
    return f"{MANIFEST_PREFIX}v{version:08d}.json"


def blob_key(sha256: str) -> str:
    return f"{BLOB_PREFIX}{sha256}"


def _version_of(key: str) -> int | None:
    name = key[len(MANIFEST_PREFIX) :]
    digits = name[1:9]  # ASCII only: str.isdigit() alone accepts e.g. "²", which int() refuses
    if (
        len(name) == 14
        and name.startswith("v")
        and name.endswith(".json")
        and digits.isascii()
        and digits.isdigit()
    ):
        return int(digits)
    return None


@dataclass
class GcReport:
    kept_from: int | None
    deleted_versions: list[int] = field(default_factory=list)
    deleted_blobs: int = 0
    freed_bytes: int = 0


class WeightStore:
    """Publish and read versions; see the module docstring for the guarantees."""

    def __init__(
        self, backend: BlobBackend, *, create: bool = False, snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    ) -> None:
        self.backend = backend
        self.snapshot_every = self._open_marker(create, snapshot_every)
        self._lock: WriterLock | None = None
        self._write_mutex = threading.Lock()
        self._manifests: dict[int, Manifest] = {}
        self._verified: dict[str, int] = {}

    @classmethod
    def open(
        cls,
        location: str | Path,
        *,
        create: bool = False,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        endpoint_url: str | None = None,
    ) -> WeightStore:
        """Open a directory, or ``s3://bucket/prefix`` (with ``endpoint_url`` for non-AWS servers)."""
        text = str(location)
        if text.startswith("s3://"):
            from tandem.weights.s3 import S3Backend

            bucket, _, prefix = text[5:].partition("/")
            backend: BlobBackend = S3Backend(bucket, prefix, endpoint_url=endpoint_url, create_bucket=create)
        else:
            path = Path(location)
            if not create and not path.is_dir():
                raise NotAStoreError(f"weight store {str(path)!r} does not exist; publish to it first")
            backend = FileBackend(path)
        return cls(backend, create=create, snapshot_every=snapshot_every)

    def _open_marker(self, create: bool, snapshot_every: int) -> int:
        try:
            marker = json.loads(self.backend.get(MARKER_KEY))
        except MissingKeyError:
            if not create:
                raise NotAStoreError(
                    f"{self.describe()} is not a weight store (no {MARKER_KEY}); check the path, or publish "
                    "to it first"
                ) from None
            should_snapshot(0, snapshot_every)  # validates the interval
            marker = {"format": _STORE_FORMAT, "layout": 1, "snapshot_every": snapshot_every}
            self.backend.put_if_absent(MARKER_KEY, json.dumps(marker).encode())
            marker = json.loads(self.backend.get(MARKER_KEY))
        except ValueError as e:
            raise NotAStoreError(f"{self.describe()}: {MARKER_KEY} is not valid JSON ({e})") from e
        if not isinstance(marker, dict) or marker.get("format") != _STORE_FORMAT:
            raise NotAStoreError(f"{self.describe()}: {MARKER_KEY} does not describe a tandem weight store")
        return int(marker.get("snapshot_every", DEFAULT_SNAPSHOT_EVERY))

    def describe(self) -> str:
        return self.backend.describe()

    # ---- reading ----

    def versions(self) -> list[int]:
        found = (_version_of(k) for k in self.backend.list(MANIFEST_PREFIX))
        return sorted(v for v in found if v is not None)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def _available(self) -> str:
        versions = self.versions()
        if not versions:
            return "the store is empty"
        plural = "s" if len(versions) != 1 else ""
        return f"available: {versions[0]}..{versions[-1]}, {len(versions)} version{plural}"

    def manifest_bytes(self, version: int) -> bytes:
        try:
            return self.backend.get(manifest_key(version))
        except MissingKeyError:
            raise VersionNotFoundError(
                f"version {version} is not in weight store {self.describe()} ({self._available()})"
            ) from None

    def manifest(self, version: int) -> Manifest:
        cached = self._manifests.get(version)
        if cached is None:
            where = f"v{version} in {self.describe()}"
            cached = Manifest.from_bytes(self.manifest_bytes(version), where, version)
            self._manifests[version] = cached
        return cached

    def blob_size(self, key: str) -> int:
        try:
            return self.backend.size(blob_key(_check_sha(key)))
        except MissingKeyError:
            raise MissingBlobError(f"blob {key} is not in weight store {self.describe()}") from None

    def blob_range(self, key: str, start: int, end: int) -> bytes:
        """Unverified bytes ``[start, end)``; serve them only after ``verify_blob``."""
        try:
            return self.backend.get_range(blob_key(_check_sha(key)), start, end)
        except MissingKeyError:
            raise MissingBlobError(f"blob {key} is not in weight store {self.describe()}") from None

    def blob(self, key: str) -> bytes:
        """The blob's bytes, checked against its content address."""
        try:
            data = self.backend.get(blob_key(_check_sha(key)))
        except MissingKeyError:
            raise MissingBlobError(f"blob {key} is not in weight store {self.describe()}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != key:
            raise CorruptBlobError(key, actual, len(data), self.describe())
        self._verified[key] = len(data)
        return data

    def verify_blob(self, key: str) -> int:
        """Check the stored blob's hash once per process (re-checked if its size changes); return its size."""
        size = self.blob_size(key)
        if self._verified.get(key) != size:
            self._verified.pop(key, None)
            size = len(self.blob(key))
        return size

    def blobs(self, refs: Mapping[str, BlobRef]) -> dict[str, bytes]:
        """Each entry's verified bytes (each stored blob read once, pack entries cut out)."""
        return slice_blobs(refs, {key: self.blob(key) for key in blob_sizes(refs.values())})

    def plan(self, from_version: int | None, to_version: int | None = None) -> list[PlanStep]:
        """Cheapest steps from ``from_version`` (None: no weights) to ``to_version`` (default: latest)."""
        target = self.latest() if to_version is None else to_version
        if target is None:
            raise VersionNotFoundError(f"weight store {self.describe()} is empty; nothing to fetch")
        return plan(self.manifest, from_version, target)

    def should_snapshot(self, version: int) -> bool:
        return should_snapshot(version, self.snapshot_every)

    # ---- writing ----

    def acquire_writer(self) -> None:
        """Take the single-writer lock now (``publish`` and ``gc`` take it on first use)."""
        if self._lock is None:
            self._lock = self.backend.acquire_lock(LOCK_KEY)

    def close(self) -> None:
        """Release the writer lock, if held."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(
        self,
        version: int,
        parent: int | None,
        kind: str,
        weights_hash: str,
        blobs: Mapping[str, bytes],
        meta: dict[str, Any] | None = None,
        delta_blobs: Mapping[str, bytes] | None = None,
        pack: bool = False,
    ) -> Manifest:
        """Publish one version (blobs first, manifest last); ``delta_blobs`` only with ``kind="full"``;
        ``pack``: small entries share stored blobs (module docstring)."""
        _check_publish_args(version, kind, weights_hash, blobs, meta)
        with self._write_mutex:
            self.acquire_writer()
            self._check_order(version, parent, kind, delta_blobs)
            refs = self._put_blobs(blobs, pack)
            delta_refs = None if delta_blobs is None else self._put_blobs(delta_blobs, pack)
            manifest = Manifest(
                version, parent, kind, weights_hash, refs, time.time(), meta or {}, delta_refs
            )
            assert self._lock is not None
            self._lock.verify()
            if not self.backend.put_if_absent(manifest_key(version), manifest.to_bytes()):
                raise ManifestError(f"version {version} was already published to {self.describe()}")
            self._manifests[version] = manifest
            return manifest

    def _check_order(
        self, version: int, parent: int | None, kind: str, delta_blobs: Mapping[str, bytes] | None
    ) -> None:
        latest = self.latest()
        if latest is not None and version <= latest:
            raise ManifestError(
                f"cannot publish version {version} to {self.describe()}: latest is {latest}; versions must "
                "increase"
            )
        if parent is not None and not 0 <= parent < version:
            raise ManifestError(f"version {version}: parent {parent} must be in [0, {version})")
        needs_parent = kind == DELTA or delta_blobs is not None
        if delta_blobs is not None and kind != FULL:
            raise ManifestError(f"version {version}: delta_blobs only go with kind='full'")
        if needs_parent:
            if parent is None:
                raise ManifestError(f"version {version}: a delta needs a parent version")
            try:
                self.manifest(parent)
            except VersionNotFoundError as e:
                raise ManifestError(f"version {version} is a delta on parent {parent}, but: {e}") from None

    def _put_blobs(self, blobs: Mapping[str, bytes], pack: bool) -> dict[str, BlobRef]:
        """Store every entry (small ones packed if ``pack``: module docstring); return their references."""
        groups = _pack_groups(blobs) if pack else [[name] for name in blobs]
        if len(groups) > 1:
            with ThreadPoolExecutor(max_workers=min(4, len(groups))) as pool:
                stored = list(pool.map(lambda g: self._put_blob(b"".join(blobs[n] for n in g)), groups))
        else:
            stored = [self._put_blob(b"".join(blobs[n] for n in g)) for g in groups]
        refs: dict[str, BlobRef] = {}
        for names, blob in zip(groups, stored, strict=True):
            if len(names) == 1 and (not pack or len(blobs[names[0]]) >= PACK_BELOW):
                refs[names[0]] = blob
                continue
            offset = 0
            for name in names:
                n = len(blobs[name])
                refs[name] = BlobRef(blob.key, blob.size, blob.sha256, offset, n)
                offset += n
        return refs

    def _put_blob(self, data: bytes) -> BlobRef:
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        key = blob_key(sha)
        try:
            present = self.backend.size(key) == len(data)
        except MissingKeyError:
            present = False
        if not present:
            self.backend.put(key, data)
        return BlobRef(sha, len(data), sha)

    def gc(self, keep_readers_from: int | None = None, keep_last: int = 1) -> GcReport:
        """Delete versions no reader at ``>= keep_readers_from`` (or of the last ``keep_last``) needs."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the latest version is always kept), got {keep_last}")
        with self._write_mutex:
            self.acquire_writer()
            assert self._lock is not None
            self._lock.verify()  # another publisher may have taken the store: delete nothing of its
            versions = self.versions()
            if not versions:
                return GcReport(None)
            floor = versions[-min(keep_last, len(versions))]
            if keep_readers_from is not None:
                floor = min(floor, keep_readers_from)
            kept_from = self._kept_from(versions, floor)
            report = GcReport(kept_from)
            # Newest first: if gc stops half-way, every manifest left still has its snapshot ancestor.
            for version in reversed(versions):
                if version < kept_from:
                    self.backend.delete(manifest_key(version))
                    self._manifests.pop(version, None)
                    report.deleted_versions.append(version)
            report.deleted_versions.sort()
            self._delete_unreferenced(report)
            return report

    def _kept_from(self, versions: list[int], floor: int) -> int:
        """Oldest version to keep: the snapshot ancestors of every version >= floor stay."""
        anchors = [v for v in versions if v <= floor]
        kept_from = anchors[-1] if anchors else versions[0]
        start_of: dict[int, int] = {}
        changed = True
        while changed:
            changed = False
            for version in (v for v in versions if v >= kept_from):
                if version not in start_of:
                    try:
                        start_of[version] = snapshot_path(self.manifest, version)[0].version
                    except VersionNotFoundError:
                        start_of[version] = versions[0]  # broken chain: be conservative, keep everything
                if start_of[version] < kept_from:
                    kept_from, changed = start_of[version], True
        return kept_from

    def _delete_unreferenced(self, report: GcReport) -> None:
        referenced: set[str] = set()
        for version in self.versions():
            referenced |= self.manifest(version).keys()
        for key in self.backend.list(BLOB_PREFIX):
            sha = key[len(BLOB_PREFIX) :]
            if sha in referenced or not is_sha256(sha):
                continue  # referenced, or not a blob of this store (module invariants)
            try:
                report.freed_bytes += self.backend.size(key)
            except MissingKeyError:
                continue
            self.backend.delete(key)
            self._verified.pop(sha, None)
            report.deleted_blobs += 1


def _check_sha(key: str) -> str:
    if not is_sha256(key):
        raise MissingBlobError(f"{key!r} is not a blob address (64 lowercase hex digits of a sha256)")
    return key


def _check_publish_args(
    version: int, kind: str, weights_hash: str, blobs: Mapping[str, bytes], meta: dict[str, Any] | None
) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < MAX_VERSION:
        raise ManifestError(f"version must be an integer in [0, {MAX_VERSION}), got {version!r}")
    if kind not in KINDS:
        raise ManifestError(f"version {version}: kind {kind!r} is not one of {KINDS}")
    if not isinstance(weights_hash, str) or not weights_hash:
        raise ManifestError(f"version {version}: weights_hash must be a non-empty string")
    for name, data in blobs.items():
        if not isinstance(name, str) or not name:
            raise ManifestError(f"version {version}: blob names must be non-empty strings, got {name!r}")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ManifestError(f"version {version}: blob {name!r} must be bytes, got {type(data).__name__}")
    try:
        json.dumps(meta or {})
    except (TypeError, ValueError) as e:
        raise ManifestError(f"version {version}: meta must be JSON-serializable ({e})") from e


def _pack_groups(blobs: Mapping[str, bytes]) -> list[list[str]]:
    """Entry names grouped into stored blobs: each large entry alone; small ones, in name order, into packs
    of up to ``PACK_TARGET`` bytes."""
    groups: list[list[str]] = []
    pack: list[str] = []
    filled = 0
    for name in sorted(blobs):
        n = len(blobs[name])
        if n >= PACK_BELOW:
            groups.append([name])
            continue
        pack.append(name)
        filled += n
        if filled >= PACK_TARGET:
            groups.append(pack)
            pack, filled = [], 0
    if pack:
        groups.append(pack)
    return groups
