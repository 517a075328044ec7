"""Layer 1: how weights travel from the trainer to engines.

For now one seam: ``WeightUpdate`` (a version, its content hash and the full tensors in the engine's dtype),
made by ``make_update`` on the trainer side and checked by ``verify_update`` on the engine side. The
delta-weights work replaces what travels inside the update, not the seam.

Store and transport: ``WeightStore`` (manifests + content-addressed blobs over ``FileBackend`` or
``S3Backend``), ``serve_store`` / ``WeightClient`` (HTTP, parallel, resumable, verified) and ``Relay``
(one upstream fetch per blob, many local clients).
"""

from tandem.weights.backend import BlobBackend, FileBackend
from tandem.weights.client import WeightClient
from tandem.weights.errors import (
    CorruptBlobError,
    ManifestError,
    MissingBlobError,
    NotAStoreError,
    StoreLockedError,
    TransportError,
    VersionNotFoundError,
    WeightStoreError,
)
from tandem.weights.manifest import DEFAULT_SNAPSHOT_EVERY, BlobRef, Manifest, PlanStep, should_snapshot
from tandem.weights.ratelimit import TokenBucket
from tandem.weights.relay import Relay
from tandem.weights.seam import WeightUpdate, make_update, tensors_hash, verify_update
from tandem.weights.store import GcReport, WeightStore
from tandem.weights.transport import WeightServer, serve_store

__all__ = [
    "DEFAULT_SNAPSHOT_EVERY",
    "BlobBackend",
    "BlobRef",
    "CorruptBlobError",
    "FileBackend",
    "GcReport",
    "Manifest",
    "ManifestError",
    "MissingBlobError",
    "NotAStoreError",
    "PlanStep",
    "Relay",
    "StoreLockedError",
    "TokenBucket",
    "TransportError",
    "VersionNotFoundError",
    "WeightClient",
    "WeightServer",
    "WeightStore",
    "WeightStoreError",
    "WeightUpdate",
    "make_update",
    "serve_store",
    "should_snapshot",
    "tensors_hash",
    "verify_update",
]
