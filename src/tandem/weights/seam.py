"""The publish/apply seam between trainer and engines, and the one place weight content hashes are made.

Invariants: ``WeightUpdate.weights_hash`` is ``tensors_hash`` of its tensors; ``verify_update`` recomputes it
(in the recorded hash's scheme) and raises ``ValueError`` naming the version on mismatch, so an engine never
applies weights whose content differs from what the trainer published. Versions are monotone.

Hash schemes. A weights hash is persisted (store manifests' ``weights_hash``, delta files' ``base_hash`` and
``target_hash``, ``WeightUpdate`` and ``Version`` records), so its scheme is part of the string:

- v2, ``"b3v2:" + 64 lowercase hex`` (``HASH_PREFIX``): every hash made now. BLAKE3 (256 bits) over the
  domain tag ``b"tandem/tensors_hash/v2\\0"`` and the tensor count, then for each tensor in name order a
  header and its bytes (C order). The header is fixed-width little-endian uint64 lengths and values: the
  UTF-8 name's length and the name, ``str(dtype)``'s length and it, the number of dimensions and each one,
  and the byte count of the data that follows. Every field is length-prefixed or of fixed width, so the
  hashed stream decodes to exactly one tensor set: distinct sets differ in the stream and collide only if
  BLAKE3 does. The header is hashed separately from the data, which is hashed in place (no copy of a
  C-contiguous tensor).
- v1, a bare 64 lowercase hex string (no prefix): hashes made before v2, found in stores and delta files
  written then. BLAKE3 over name, ``str(dtype)``, ``str(shape)`` and bytes concatenated with no separators
  or lengths, which is ambiguous (``{"p": uint8}`` and ``{"pu": int8}`` with the same bytes collide). It is
  kept only to verify such data (``tensors_hash_v1``); nothing new is hashed with it.

A recorded hash is verified in its own scheme and only there: ``tensors_hash_as(recorded, tensors)`` hashes
in the scheme ``recorded`` is written in, so a v1 record is compared with a v1 hash and a v2 record with a
v2 hash, never across. A recorded string in neither form (``hash_scheme`` is None) matches no tensors.
Every producer (``make_update``, the publisher, ``encode_delta``, the CLI) calls ``tensors_hash`` and every
verifier (``verify_update``, delta apply, the follower, the CLI) calls ``tensors_hash_as``, so they cannot
drift apart.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import blake3
import numpy as np

HASH_PREFIX = "b3v2:"
_V2_TAG = b"tandem/tensors_hash/v2\0"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class WeightUpdate:
    """Full weights of one policy version, as plain numpy arrays (they cross the Ray object store as is)."""

    version: int
    weights_hash: str
    tensors: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


def tensors_hash(tensors: dict[str, np.ndarray]) -> str:
    """Content hash of a name -> array mapping in the current scheme (v2, see the module docstring),
    independent of insertion order.

    BLAKE3 rather than SHA-256: every engine re-hashes the whole model after each sync before it may serve
    it, and on these CPUs (no SHA extensions) BLAKE3 runs about 12x faster (3.6 vs 0.3 GB/s on one thread),
    so verifying a 100M-parameter bf16 model costs about 55 ms instead of 0.6 s. The per-tensor headers add
    a few dozen bytes per tensor and no copy of the data."""
    h = blake3.blake3(_V2_TAG + _u64(len(tensors)))
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(_header_v2(name, arr))
        h.update(byte_view(arr))
    return HASH_PREFIX + h.hexdigest()


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _header_v2(name: str, arr: np.ndarray) -> bytes:
    name_b, dtype_b = name.encode(), str(arr.dtype).encode()
    return struct.pack(
        f"<Q{len(name_b)}sQ{len(dtype_b)}sQ{arr.ndim}QQ",
        len(name_b), name_b, len(dtype_b), dtype_b, arr.ndim, *arr.shape, arr.nbytes,
    )  # fmt: skip


def tensors_hash_v1(tensors: dict[str, np.ndarray]) -> str:
    """The legacy v1 hash (bare hex; ambiguous, see the module docstring). Only for verifying hashes recorded
    before v2: never record a new one."""
    h = blake3.blake3()
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(name.encode())
        h.update(str(arr.dtype).encode())
        h.update(str(arr.shape).encode())
        h.update(byte_view(arr))
    return h.hexdigest()


def hash_scheme(recorded: str) -> int | None:
    """The scheme a recorded hash is written in: 2, 1 (bare 64 lowercase hex), or None for neither."""
    if recorded.startswith(HASH_PREFIX) and _HEX64.fullmatch(recorded, len(HASH_PREFIX)):
        return 2
    return 1 if _HEX64.fullmatch(recorded) else None


def tensors_hash_as(recorded: str, tensors: dict[str, np.ndarray]) -> str:
    """``tensors``' hash in the scheme ``recorded`` is written in, to compare with it: the tensors match the
    record iff the result equals ``recorded``. A record in no known scheme gets the current scheme's hash,
    which then never equals it."""
    return tensors_hash_v1(tensors) if hash_scheme(recorded) == 1 else tensors_hash(tensors)


def short_hash(h: str) -> str:
    """A hash shortened for messages: its scheme prefix (if any) and 12 hex digits."""
    return h[: len(HASH_PREFIX) + 12] if hash_scheme(h) == 2 else h[:12]


def byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of ``arr`` (C order) as a flat memoryview, without a copy when it is contiguous. Works for
    every shape, also 0-d and empty ones (``memoryview.cast`` refuses a shape with a zero)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def make_update(version: int, tensors: dict[str, np.ndarray]) -> WeightUpdate:
    """Wrap the trainer's published tensors as an update with their content hash."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return WeightUpdate(version, tensors_hash(tensors), tensors)


def verify_update(update: WeightUpdate) -> None:
    """Raise ValueError if the tensors do not hash to the recorded hash (in its scheme)."""
    actual = tensors_hash_as(update.weights_hash, update.tensors)
    if actual != update.weights_hash:
        raise ValueError(
            f"weight update for version {update.version} is corrupt: hash {short_hash(actual)} != "
            f"recorded {short_hash(update.weights_hash)}; refetch the version"
        )
