"""The trainer side of weight transport: every version goes to a ``WeightStore`` as a lossless delta.

Invariants:
- Version ``v`` is published as a delta from the previously published version, except the first version a
  publisher sees and every version the store's snapshot policy picks (``should_snapshot``): those are full
  snapshots, which also carry the delta from their parent when there is one (so a reader one version behind
  never has to download a snapshot).
- A full snapshot's blob of a tensor is that tensor encoded against zeros of its dtype and shape: the same
  checksummed blob format as deltas (``tandem.weights.codec``), decoded by ``decode_full``.
- The manifest's ``weights_hash`` is ``tensors_hash`` of exactly the published arrays; a reader that
  reproduces it holds bit-identical weights.
- After each publish the store is garbage collected down to what readers may still need: the newest
  ``keep_versions`` versions and the snapshot they rest on.
- ``publish`` keeps a reference to the arrays it was given as the base of the next delta: callers hand over
  fresh arrays (the trainer's ``publish_state`` does) and never modify them afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tandem.weights.codec import encode_tensor
from tandem.weights.decoder import decode_tensor
from tandem.weights.delta import encode_delta
from tandem.weights.manifest import DELTA, FULL
from tandem.weights.seam import tensors_hash
from tandem.weights.store import WeightStore


def encode_full(tensors: dict[str, np.ndarray], threads: int = 1) -> dict[str, bytes]:
    """Blobs of a full snapshot: each tensor encoded against zeros (see the module invariants)."""
    del threads  # one blob per tensor; the codec parallelises inside large tensors on its own
    return {n: encode_tensor(np.zeros_like(t), np.ascontiguousarray(t), name=n) for n, t in tensors.items()}


def decode_full(blobs: dict[str, bytes], threads: int = 1) -> dict[str, np.ndarray]:
    """Tensors of a full snapshot (inverse of ``encode_full``); each blob's checksum is verified."""
    out: dict[str, np.ndarray] = {}
    for name, blob in blobs.items():
        out[name] = _decode_against_zeros(name, blob, threads)
    return out


def _decode_against_zeros(name: str, blob: bytes, threads: int) -> np.ndarray:
    from tandem.weights.blob import parse_header

    header = parse_header(blob, name)
    zeros = np.zeros(header.shape, dtype=np.dtype(header.dtype_tag))
    return decode_tensor(zeros, blob, name=name, threads=threads)


@dataclass
class PublishReport:
    """What one ``publish`` did: the version, its kind, compressed and raw bytes, and how long it took."""

    version: int
    kind: str
    nbytes: int
    raw_bytes: int
    encode_s: float
    publish_s: float
    weights_hash: str

    @property
    def ratio(self) -> float:
        return self.raw_bytes / max(self.nbytes, 1)


class WeightPublisher:
    """Publishes successive versions of one model's tensors to a store (see module invariants)."""

    def __init__(self, store: WeightStore, threads: int = 1, keep_versions: int = 8) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.store = store
        self.threads = threads
        self.keep_versions = keep_versions
        self._prev: dict[str, np.ndarray] | None = None
        self._prev_version: int | None = None
        self._prev_hash: str | None = None

    def publish(self, version: int, tensors: dict[str, np.ndarray]) -> PublishReport:
        """Encode and publish ``tensors`` as ``version`` (greater than every version published before)."""
        t0 = time.perf_counter()
        weights_hash = tensors_hash(tensors)
        delta_blobs = None
        if self._prev is not None:
            delta = encode_delta(
                self._prev, tensors, self.threads, base_hash=self._prev_hash, target_hash=weights_hash
            )
            delta_blobs = delta.blobs
        full = delta_blobs is None or self.store.should_snapshot(version)
        blobs = encode_full(tensors, self.threads) if full else delta_blobs
        assert blobs is not None
        t1 = time.perf_counter()
        meta = {"raw_bytes": int(sum(t.nbytes for t in tensors.values()))}
        self.store.publish(
            version,
            self._prev_version,
            FULL if full else DELTA,
            weights_hash,
            blobs,
            meta=meta,
            delta_blobs=delta_blobs if full else None,
            pack=True,
        )
        self._prev, self._prev_version, self._prev_hash = tensors, version, weights_hash
        oldest_reader = max(0, version - self.keep_versions + 1)
        self.store.gc(keep_readers_from=oldest_reader, keep_last=self.keep_versions)
        return PublishReport(
            version=version,
            kind=FULL if full else DELTA,
            nbytes=sum(len(b) for b in blobs.values()),
            raw_bytes=meta["raw_bytes"],
            encode_s=t1 - t0,
            publish_s=time.perf_counter() - t0,
            weights_hash=weights_hash,
        )
