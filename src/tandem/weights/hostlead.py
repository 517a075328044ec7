"""Lead a host's weight steps: advance the host's one shadow from the store and write the step's patch.

``lead_step`` is what the leader of a step does, whoever it is: an engine whose next patch is missing
(``tandem.engine.follow``), or a ``HostLeader``, a process of its own on the host that does nothing else, so
the engines that serve only ever read patches and never decode beside their decode loop (decoding is
compiled code, but its setup and the verification loop run Python, which takes the GIL from the loop).

Invariants:
- ``lead_step`` runs only under the share's exclusive lock (``HostShare.lock``), which it does not take.
- The host shadow never moves back: a step asked for a version below the shadow's leaves it where it is.
- The shadow is marked dirty while it is advanced in place and committed only once the follower verified
  the new version against the store's hash; on any failure it is dropped (the next leader recovers from a
  snapshot), so no patch is ever written from unverified weights.
- A patch ``base -> version`` is written for every delta step that moved a verified shadow; a full step (a
  first load, a recovery) writes none. A patch that cannot be written (a full ``/dev/shm``: ``OSError``)
  is logged and leaves no file; the step then has no patch (``written`` None) but the verified shadow, from
  which engines patch or reload, so a full share never fails a sync that the shadow can serve.
- ``HostLeader.advance`` is a no-op when the shadow is already at or past the target; its download, decode
  and verification run ``nice`` levels below its process, like an engine's store work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.core.errors import TandemError
from tandem.core.procs import lower_thread_priority
from tandem.weights.client import WeightClient
from tandem.weights.follow import Advance, WeightFollower
from tandem.weights.hostshadow import HostShadow
from tandem.weights.hostshare import HostShare, Patches

log = logging.getLogger(__name__)


@dataclass
class LeadResult:
    """What one ``lead_step`` did."""

    base: int | None  # the shadow's version before (None: there was no verified shadow)
    version: int  # the shadow's version after
    adv: Advance  # the follower's work (downloads, decode, whether it was a full step)
    tensors: dict[str, np.ndarray]  # the shadow's arrays: read them only under the share's lock
    written: Patches | None  # the patch ``base -> version`` written to the share, if any


def patch_of(
    changes: dict[str, np.ndarray | None],
    tensors: dict[str, np.ndarray],
    known: dict[str, np.ndarray] | None = None,
) -> Patches:
    """The patch of ``changes`` (per tensor its changed flat indices, None for all of them) with the values
    ``tensors`` hold there: ``known[name]`` when given (those values, in the same order, e.g. the decoded
    ones of ``Advance.values``; a gather of 2.3M changes across a 100M model took 20-22 ms), else gathered."""
    known = known or {}
    out: Patches = {}
    for name, idx in changes.items():
        flat = tensors[name].reshape(-1)
        index = np.arange(flat.size, dtype=np.int64) if idx is None else idx
        values = known.get(name)
        if values is None or values.shape != index.shape or values.dtype != flat.dtype:
            values = flat[index]
        out[name] = (index, values)
    return out


def lead_step(
    share: HostShare,
    shadow: HostShadow,
    follower: WeightFollower,
    target: int,
    advance: Callable[[int], Advance] | None = None,
) -> LeadResult:
    """Under the share's exclusive lock: bring the host shadow to ``target`` (or leave it past it) and write
    the step's patch (see module invariants). ``advance`` runs ``follower.advance`` (e.g. on a lower-priority
    thread); by default it is called directly."""
    base, tensors = shadow.load()
    if base is not None and base > target:
        target = base  # never move the host's shadow back
    follower.shadow, follower.version = tensors, base
    shadow.begin()
    try:
        adv = (advance or follower.advance)(target)
        if follower.shadow is None or follower.version != target:
            raise TandemError(f"the follower stopped at version {follower.version}, not {target}")
        tensors = shadow.commit(target, follower.shadow)
    except BaseException:
        shadow.drop()
        raise
    finally:
        follower.shadow, follower.version = None, None  # the shadow is only used under the lock
    written = None
    if not adv.full and base is not None and base < target:
        patch = patch_of(adv.changes, tensors, adv.values)
        try:
            share.write(base, target, patch)
            written = patch
        except OSError as e:  # module invariants: the shadow still serves this step
            log.warning("host share %s: patch %d -> %d not written (%s)", share.path, base, target, e)
    return LeadResult(base, target, adv, tensors, written)


class HostLeader:
    """Leads every step of a host share from a process of its own (see module docstring): ``advance(v)``
    brings the host shadow to ``v`` and writes the patch the host's engines then read."""

    def __init__(
        self,
        urls: str | Sequence[str],
        share: HostShare | str,
        connections: int = 4,
        threads: int = 1,
        nice: int = 10,
    ) -> None:
        from tandem.weights.delta import warm_kernels

        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice} must be in [0, 19] (0: the leader's work runs at its priority)")
        self.share = HostShare(share) if isinstance(share, str) else share
        self.shadow = HostShadow(self.share.path)
        self.follower = WeightFollower(WeightClient(urls, parallel=connections), threads=threads)
        self._lock = threading.Lock()
        # Download, decode and verify run ``nice`` levels below the process (``SCHED_IDLE`` in a Ray actor
        # at nice 15), like an engine's store work: serving keeps the CPU, the leader takes what is left.
        self._store = ThreadPoolExecutor(1, "leader", initializer=lower_thread_priority, initargs=(nice,))
        self.stats: dict[str, float] = {"steps": 0, "patches": 0, "downloaded_bytes": 0, "recoveries": 0}
        self._store.submit(warm_kernels).result()  # the first delta then decodes at full speed

    def advance(self, target: int | None = None) -> dict[str, Any]:
        """Lead the host to ``target`` (the store's latest when None); returns what was done."""
        with self._lock:
            if target is None:
                target = self.follower.latest()
                if target is None:
                    raise TandemError("the weight store has no published version yet")
            with self.share.lock():
                at, _ = self.shadow.load()
                if at is not None and at >= target:
                    return {"version": at, "skipped": True}
                res = lead_step(self.share, self.shadow, self.follower, target, self._on_store)
            s = self.stats
            s["steps"] += 1
            s["patches"] += res.written is not None
            s["downloaded_bytes"] += res.adv.downloaded_bytes
            s["recoveries"] = self.follower.stats["recoveries"]
            return {
                "version": res.version,
                "skipped": False,
                "base": res.base,
                "full": res.adv.full,
                "recovered": res.adv.recovered,
                "patch": res.written is not None,
                "downloaded_bytes": res.adv.downloaded_bytes,
                "fetch_s": res.adv.fetch_s,
                "decode_s": res.adv.decode_s,
            }

    def _on_store(self, target: int) -> Advance:
        return self._store.submit(self.follower.advance, target).result()

    def close(self) -> None:
        self._store.shutdown(wait=True)
