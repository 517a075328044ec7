"""The reader side of weight transport: keep a verified copy of the newest published weights.

A ``WeightFollower`` holds a *shadow*: the published arrays of its current version (bf16 as uint16 bit
patterns, exactly as the trainer published them). ``advance(target)`` downloads the cheapest plan from its
version to ``target`` (a delta chain, or the nearest full snapshot plus its chain), decodes it into the
shadow, and reports which elements changed, so an engine can patch just those elements of its own weights.
The shadow is the follower's own, or, for the engines of a host share, the host's one shadow
(``tandem.weights.hostshadow``), which ``EngineWeightSync`` hands it only while it holds the share's lock.

Invariants:
- The shadow is verified before it is reported: after every plan step the shadow's hash must equal the
  version's recorded ``weights_hash``, computed in that hash's scheme (``tandem.weights.seam``: versions
  published with v1 hashes still verify). A caller therefore only ever applies verified weights.
- Any failure on the way (a corrupt or missing blob, a delta that does not decode, a hash mismatch, a
  vanished version) drops the shadow and recovers from the nearest full snapshot of the target; the event
  is counted in ``stats["recoveries"]``. If that fails too the error propagates and the shadow is empty, so
  nothing half-applied can be served.
- ``Advance.changes`` maps each tensor that changed to its sorted flat indices, or None when the whole tensor
  was replaced (full snapshot or a dense delta); ``Advance.full`` is True when the shadow was rebuilt from a
  snapshot (the caller should then reload every tensor). ``Advance.values`` holds, for a tensor whose
  indices came from exactly one delta step, the new values at those indices as decoded (the shadow's dtype,
  in the same order; ``tandem.weights.hostlead.patch_of`` uses them instead of gathering them again).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from tandem.core.errors import TandemError
from tandem.weights.client import WeightClient
from tandem.weights.delta import Delta, prepare_delta
from tandem.weights.manifest import FULL, PlanStep
from tandem.weights.publish import decode_full
from tandem.weights.seam import short_hash, tensors_hash_as

log = logging.getLogger(__name__)


class ShadowMismatchError(TandemError, ValueError):
    """Decoded weights do not hash to the version's recorded hash."""


@dataclass
class Advance:
    """Outcome of one ``WeightFollower.advance``."""

    version: int
    full: bool
    changes: dict[str, np.ndarray | None] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)  # see module invariants
    downloaded_bytes: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    recovered: bool = False


class WeightFollower:
    """Follows a weight store through a ``WeightClient`` (see module invariants)."""

    def __init__(self, client: WeightClient, threads: int = 1) -> None:
        self.client = client
        self.threads = threads
        self.shadow: dict[str, np.ndarray] | None = None
        self.version: int | None = None
        self.stats = {"recoveries": 0, "advances": 0, "downloaded_bytes": 0, "snapshots": 0}

    def latest(self) -> int | None:
        return self.client.latest()

    def advance(self, target: int | None = None) -> Advance:
        """Bring the shadow to ``target`` (the store's latest when None); see module invariants."""
        if target is None:
            target = self.client.latest()
            if target is None:
                raise TandemError("the weight store has no published version yet")
        if self.version == target and self.shadow is not None:
            return Advance(target, False)
        try:
            return self._advance(self.version if self.shadow is not None else None, target)
        except (TandemError, ValueError, OSError) as e:
            self.stats["recoveries"] += 1
            log.warning(
                "weights: advancing %s -> %s failed (%s); recovering from a snapshot", self.version, target, e
            )
            self.shadow, self.version = None, None
            out = self._advance(None, target)
            out.recovered = True
            return out

    def _advance(self, start: int | None, target: int) -> Advance:
        t0 = time.perf_counter()
        fetched = self.client.fetch(start, target)
        t1 = time.perf_counter()
        out = Advance(target, False)
        out.downloaded_bytes = sum(len(b) for f in fetched for b in f.blobs.values())
        for f in fetched:
            self._apply_step(f.step, f.blobs, out)
        out.fetch_s, out.decode_s = t1 - t0, time.perf_counter() - t1
        self.stats["advances"] += 1
        self.stats["downloaded_bytes"] += out.downloaded_bytes
        return out

    def _apply_step(self, step: PlanStep, blobs: dict[str, bytes], out: Advance) -> None:
        if step.kind == FULL:
            self.shadow, self.version = None, None
            shadow = decode_full(blobs, self.threads)
            self._verify(shadow, step)
            self.shadow, self.version = shadow, step.version
            out.full = True
            out.changes, out.values = dict.fromkeys(shadow), {}
            self.stats["snapshots"] += 1
            return
        if self.shadow is None or self.version != step.parent:
            raise ShadowMismatchError(
                f"delta to version {step.version} applies to version {step.parent}, the shadow is at "
                f"{self.version}"
            )
        base_hash = "unchecked"  # the shadow was verified when it reached self.version
        delta = Delta(base_hash, step.weights_hash, blobs)
        shadow = self.shadow
        self.shadow, self.version = None, None  # until verified, the shadow is not a version
        prepared = prepare_delta(shadow, delta, self.threads, verify=False)
        written = prepared.apply(shadow, self.threads)
        self._verify(shadow, step)
        self.shadow, self.version = shadow, step.version
        for name, idx in written.items():
            if name in out.changes and out.changes[name] is None:
                continue
            if idx is None or name in out.changes:  # the values of a union are the final shadow's
                out.values.pop(name, None)
                out.changes[name] = None if idx is None else np.union1d(out.changes[name], idx)
            else:
                out.changes[name] = idx
                values = prepared.patches[name].values
                if values is not None:
                    out.values[name] = values.view(shadow[name].dtype)

    @staticmethod
    def _verify(shadow: dict[str, np.ndarray], step: PlanStep) -> None:
        actual = tensors_hash_as(step.weights_hash, shadow)
        if actual != step.weights_hash:
            raise ShadowMismatchError(
                f"version {step.version}: decoded weights hash to {short_hash(actual)}, the store recorded "
                f"{short_hash(step.weights_hash)}"
            )
