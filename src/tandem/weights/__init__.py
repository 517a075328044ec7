"""Layer 1: how weights travel from the trainer to engines.

Codec: ``encode_delta`` / ``decode_delta`` / ``prepare_delta`` (lossless per-tensor deltas of bf16, fp16 and
fp32 in ordered-integer space, entropy coded; any other dtype through XOR + zstd), checksummed blobs and a
hash per version (``tensors_hash``). ``WeightPublisher`` (trainer side) writes each version to a store as a
delta, with a full snapshot every K versions; ``WeightFollower`` (reader side) keeps a verified copy and
reports what changed. The object-store path (``WeightUpdate``: full tensors + hash) remains for comparison.

Store and transport: ``WeightStore`` (manifests + content-addressed blobs over ``FileBackend`` or
``S3Backend``), ``serve_store`` / ``WeightClient`` (HTTP, parallel, resumable, verified) and ``Relay``
(one upstream fetch per blob, many local clients).
"""

from tandem.weights.backend import BlobBackend, FileBackend
from tandem.weights.blob import CorruptDeltaError
from tandem.weights.bound import entropy_bound_bits
from tandem.weights.client import WeightClient
from tandem.weights.codec import encode_tensor
from tandem.weights.decoder import decode_tensor
from tandem.weights.delta import (
    Delta,
    WrongBaseError,
    apply_delta_inplace,
    decode_delta,
    encode_delta,
    load_delta,
    prepare_delta,
    save_delta,
)
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
from tandem.weights.follow import Advance, WeightFollower
from tandem.weights.manifest import DEFAULT_SNAPSHOT_EVERY, BlobRef, Manifest, PlanStep, should_snapshot
from tandem.weights.publish import PublishReport, WeightPublisher, decode_full, encode_full
from tandem.weights.ratelimit import TokenBucket
from tandem.weights.relay import Relay
from tandem.weights.seam import WeightUpdate, make_update, tensors_hash, verify_update
from tandem.weights.store import GcReport, WeightStore
from tandem.weights.transport import WeightServer, serve_store

__all__ = [
    "Advance",
    "CorruptDeltaError",
    "Delta",
    "PublishReport",
    "WeightFollower",
    "WeightPublisher",
    "WrongBaseError",
    "apply_delta_inplace",
    "decode_delta",
    "decode_full",
    "decode_tensor",
    "encode_delta",
    "encode_full",
    "encode_tensor",
    "entropy_bound_bits",
    "load_delta",
    "prepare_delta",
    "save_delta",
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
