"""Version manifests and the catch-up planner.

A manifest describes one published version: its ``parent``, its ``kind`` (``full``: the blobs alone rebuild
the weights; ``delta``: the blobs turn the parent's weights into this version's), the version's
``weights_hash``, and its blobs ``{name: {key, size, sha256[, offset, length]}}`` where ``key`` is the content
address (= sha256 hex of the bytes) of a stored blob of ``size`` bytes. With ``offset``/``length`` the entry
is a slice of a *pack*: small per-tensor blobs are concatenated into packs of a few MB at publish time, so a
reader fetches a version in a few requests instead of one per tensor (``slice_blobs`` cuts them out again).
A ``full`` manifest may also carry ``delta_blobs`` (a delta from ``parent``) so the delta chain continues
across snapshot versions.

Invariants: ``parent < version``; a ``delta`` manifest always has a parent; every blob key is 64 lowercase
hex digits equal to its sha256; a slice lies inside its blob; byte counts (``nbytes``) count each stored
blob once; manifests are immutable once published. ``plan`` returns the cheaper (by
total blob bytes) of the delta chain from the reader's version or the nearest full snapshot at or below the
target plus the chain after it; a reader with no weights always gets the snapshot path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.weights.errors import ManifestError, VersionNotFoundError

FULL, DELTA = "full", "delta"
KINDS = (FULL, DELTA)
DEFAULT_SNAPSHOT_EVERY = 20
"""Default K: a full snapshot every K versions bounds the delta chain a new reader must apply."""
FORMAT = 2
READABLE_FORMATS = (1, 2)
"""Format 2 added packed entries (``offset``/``length``); format-1 manifests read unchanged."""
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def should_snapshot(version: int, every_k: int = DEFAULT_SNAPSHOT_EVERY) -> bool:
    """True if ``version`` should be published as a full snapshot (version 0 always is)."""
    if every_k < 1:
        raise ValueError(f"snapshot interval must be >= 1 version, got {every_k}")
    return version % every_k == 0


def is_sha256(text: str) -> bool:
    return bool(_SHA_RE.match(text))


@dataclass(frozen=True)
class BlobRef:
    """A stored blob (``key``, ``size``, ``sha256``), or with ``length`` set the slice
    ``[offset, offset + length)`` of one (an entry of a pack)."""

    key: str
    size: int
    sha256: str
    offset: int = 0
    length: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "size": self.size, "sha256": self.sha256}
        if self.length is not None:
            out["offset"], out["length"] = self.offset, self.length
        return out

    @classmethod
    def from_json(cls, name: str, raw: Any, where: str) -> BlobRef:
        ok = isinstance(raw, dict) and _count(raw.get("size"))
        ok = ok and is_sha256(str(raw.get("key", ""))) and raw.get("sha256") == raw.get("key")
        length = raw.get("length") if isinstance(raw, dict) else None
        offset = raw.get("offset", 0) if isinstance(raw, dict) else 0
        if ok and length is not None:
            ok = _count(length) and _count(offset) and offset + length <= raw["size"]
        if not ok:
            raise ManifestError(
                f"manifest {where}: blob {name!r} entry {raw!r} is invalid (need key == sha256, and a slice "
                "offset + length within size)"
            )
        return cls(raw["key"], raw["size"], raw["sha256"], offset if length is not None else 0, length)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def blob_sizes(refs: Iterable[BlobRef]) -> dict[str, int]:
    """Each distinct stored blob the refs point into, with its size (what to download)."""
    return {ref.key: ref.size for ref in refs}


def slice_blobs(refs: Mapping[str, BlobRef], data: Mapping[str, bytes]) -> dict[str, bytes]:
    """Each named entry's bytes, given the bytes of every stored blob by key (a pack entry is cut out)."""
    out: dict[str, bytes] = {}
    for name, ref in refs.items():
        blob = data[ref.key]
        out[name] = blob if ref.length is None else blob[ref.offset : ref.offset + ref.length]
    return out


def _blobs_json(blobs: dict[str, BlobRef]) -> dict[str, Any]:
    return {name: ref.to_json() for name, ref in sorted(blobs.items())}


def _blobs_from(raw: Any, where: str) -> dict[str, BlobRef]:
    if not isinstance(raw, dict):
        raise ManifestError(f"manifest {where}: 'blobs' must be an object, got {type(raw).__name__}")
    return {str(name): BlobRef.from_json(str(name), ref, where) for name, ref in raw.items()}


@dataclass(frozen=True)
class Manifest:
    version: int
    parent: int | None
    kind: str
    weights_hash: str
    blobs: dict[str, BlobRef]
    created: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    delta_blobs: dict[str, BlobRef] | None = None

    def __post_init__(self) -> None:
        where = f"v{self.version}"
        if self.kind not in KINDS:
            raise ManifestError(f"manifest {where}: kind {self.kind!r} is not one of {KINDS}")
        if self.parent is not None and not 0 <= self.parent < self.version:
            raise ManifestError(f"manifest {where}: parent {self.parent} must be in [0, {self.version})")
        if self.kind == DELTA and self.parent is None:
            raise ManifestError(f"manifest {where}: a delta needs a parent version")
        if self.delta_blobs is not None and (self.kind != FULL or self.parent is None):
            raise ManifestError(f"manifest {where}: delta_blobs only belong on a full manifest with a parent")

    @property
    def delta(self) -> dict[str, BlobRef] | None:
        """The blobs that turn ``parent`` into this version, if the manifest has them."""
        return self.blobs if self.kind == DELTA else self.delta_blobs

    @property
    def nbytes(self) -> int:
        return sum(blob_sizes(self.blobs.values()).values())

    def keys(self) -> set[str]:
        refs = list(self.blobs.values()) + list((self.delta_blobs or {}).values())
        return {ref.key for ref in refs}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "parent": self.parent,
            "kind": self.kind,
            "weights_hash": self.weights_hash,
            "created": self.created,
            "blobs": _blobs_json(self.blobs),
            "meta": self.meta,
        }
        if self.delta_blobs is not None:
            out["delta_blobs"] = _blobs_json(self.delta_blobs)
        return out

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str, version: int | None = None) -> Manifest:
        """Parse a manifest; with ``version``, refuse one that names another version (a store or upstream
        that answers version 4 with a manifest of version 9 had made catch-up plans and GC loop forever,
        and a relay cache it for good)."""
        manifest = cls._parse(data, where)
        if version is not None and manifest.version != version:
            raise ManifestError(f"manifest {where} names version {manifest.version}, not {version}")
        return manifest

    @classmethod
    def _parse(cls, data: bytes, where: str) -> Manifest:
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise ManifestError(f"manifest {where} is not valid JSON ({e}); it may be truncated") from e
        if not isinstance(raw, dict):
            raise ManifestError(f"manifest {where} must be a JSON object")
        if raw.get("format", FORMAT) not in READABLE_FORMATS:
            raise ManifestError(
                f"manifest {where} has format {raw.get('format')!r}; this tandem reads formats "
                f"{list(READABLE_FORMATS)}: upgrade tandem to read it"
            )
        try:
            return cls(
                version=_int(raw["version"], where),
                parent=None if raw.get("parent") is None else _int(raw["parent"], where),
                kind=str(raw["kind"]),
                weights_hash=str(raw["weights_hash"]),
                blobs=_blobs_from(raw["blobs"], where),
                created=float(raw.get("created", 0.0)),
                meta=dict(raw.get("meta") or {}),
                delta_blobs=None
                if raw.get("delta_blobs") is None
                else _blobs_from(raw["delta_blobs"], where),
            )
        except KeyError as e:
            raise ManifestError(f"manifest {where} lacks field {e}") from e


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"manifest {where}: expected an integer version, got {value!r}")
    return value


@dataclass(frozen=True)
class PlanStep:
    """Apply ``blobs`` as ``kind``: a full rebuild, or a delta on top of ``parent``; yields ``version``."""

    version: int
    kind: str
    parent: int | None
    weights_hash: str
    blobs: dict[str, BlobRef]

    @property
    def nbytes(self) -> int:
        return sum(blob_sizes(self.blobs.values()).values())


def plan_nbytes(steps: list[PlanStep]) -> int:
    return sum(step.nbytes for step in steps)


ManifestGetter = Callable[[int], Manifest]


def plan(get: ManifestGetter, from_version: int | None, to_version: int) -> list[PlanStep]:
    """Steps that take a reader at ``from_version`` (None: no weights) to ``to_version``, cheapest first."""
    if from_version == to_version:
        return []
    snap = snapshot_path(get, to_version)
    chain = delta_chain(get, from_version, to_version) if from_version is not None else None
    if chain is not None and plan_nbytes(chain) <= plan_nbytes(snap):
        return chain
    return snap


def snapshot_path(get: ManifestGetter, to_version: int) -> list[PlanStep]:
    """The nearest full snapshot at or below ``to_version`` (following parents) plus the deltas after it."""
    steps: list[PlanStep] = []
    version: int | None = to_version
    while version is not None:
        m = get(version)
        if m.kind == FULL:
            steps.append(PlanStep(m.version, FULL, None, m.weights_hash, m.blobs))
            return steps[::-1]
        steps.append(PlanStep(m.version, DELTA, m.parent, m.weights_hash, m.blobs))
        version = m.parent
    raise VersionNotFoundError(f"version {to_version} has no full snapshot among its ancestors")


def delta_chain(get: ManifestGetter, from_version: int, to_version: int) -> list[PlanStep] | None:
    """Deltas from ``from_version`` to ``to_version``, or None if the chain is broken or does not exist."""
    steps: list[PlanStep] = []
    version = to_version
    while version > from_version:
        try:
            m = get(version)
        except VersionNotFoundError:
            return None
        if m.delta is None or m.parent is None:
            return None
        steps.append(PlanStep(m.version, DELTA, m.parent, m.weights_hash, m.delta))
        version = m.parent
    return steps[::-1] if version == from_version else None
