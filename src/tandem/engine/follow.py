"""Keep a built-in engine on the newest verified version of a weight store (the delta path).

Invariants:
- Downloading, decoding and verifying from the store happen on the follower's store thread while the
  engine keeps serving (the thread first loads the codec's compiled kernels, so the first delta does not pay
  that); the engine pauses only inside ``patch_weights`` (changed elements) or, after a snapshot recovery or
  at the first sync, ``update_weights`` (a full reload). The store thread, and the download and decode
  threads it starts, run ``nice`` levels below the process (Linux thread niceness) as far as the kernel
  allows (see ``lower_priority_plan``: in a process that already runs niced, such as a Ray actor at nice 15,
  they run ``SCHED_IDLE``), so on a busy machine serving keeps the CPU and a store sync takes what is left.
- The rest of a sync (applying a host-share patch: read, check, the engine's patch plan and idle-bank
  writes; the shadow write of a shared step; the writes a built-in engine leaves for after its pause, its
  other weight bank and its parameters, done once the engine serves the new version and before ``sync``
  returns, after a full reload too) runs on a thread whose priority depends on the engine at the start of
  the sync. An engine with sessions running (``health()["active"]``) runs it at the process's priority:
  that work is short (about 30 ms of CPU per sync on a 100M model) and holds the GIL for much of it, and a
  GIL holder the kernel starves (a ``SCHED_IDLE`` thread behind busy neighbours) stalls the engine's own
  decode loop, which needs the GIL between its torch calls: a priority inversion. An idle engine has no
  loop to stall, so it runs that work ``nice`` levels down and leaves the CPU to the engines that serve.
  Measured (README, Weight sync): a loaded engine applying patches beside two busy processes decoded at
  0.84-0.85 of its quiet rate with its after-pause writes at ``SCHED_IDLE`` and 0.94-1.02 with them at the
  process's priority; running every engine's patch work at the process's priority instead took CPU from
  the serving engine (0.80-0.81 in ``tandem bench sync``). The pause itself runs on the engine's loop
  thread.
- The engine is only ever given weights the follower verified against the store's recorded hash
  (``tandem.weights.follow``); if verification and the snapshot recovery both fail, the engine keeps its
  current version and the error propagates.
- With a host share (``tandem.weights.hostshare``), an engine at version ``a`` first applies the verified
  patches ``a -> b`` other engines of its host wrote (read without a lock, in parallel with the others;
  when a single patch reaches the target, the engine is patched first and the shadow follows after the
  pause, before ``sync`` returns, so the shadow never lags once ``sync`` is done);
  only when the next one is missing does it take the share's lock, look again, and, when still missing,
  advance from the store itself and write its verified patch for the others, whom the lock holds back
  meanwhile. An engine with sessions running first waits up to ``lead_yield_ms`` for another engine of the
  host to write that patch (producing it runs Python beside the decode loop, which takes the GIL from the
  loop), so an idle engine leads when there is one; after the wait it takes the lock as above, so a host of
  busy engines still advances. Full reloads are never shared.
- Published tensors omit tied duplicates (``lm_head`` tied to the embeddings): patching the published name
  patches the shared storage and every derived buffer built from it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tandem.core.errors import TandemError
from tandem.engine.builtin import BuiltinEngine
from tandem.weights.client import WeightClient
from tandem.weights.delta import warm_kernels
from tandem.weights.follow import Advance, WeightFollower
from tandem.weights.hostshare import HostShare, Patches


class EngineWeightSync:
    """Follows a weight store (through servers or relays at ``urls``) for one engine."""

    def __init__(
        self,
        engine: BuiltinEngine,
        urls: str | Sequence[str],
        connections: int = 4,
        threads: int = 1,
        nice: int = 10,
        share: HostShare | str | None = None,
        lead_yield_ms: float = 50.0,
    ) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice} must be in [0, 19] (0: the sync runs at the process's priority)")
        if not 0 <= lead_yield_ms <= 10_000:
            raise ValueError(f"lead_yield_ms={lead_yield_ms} must be in [0, 10000] (0: never wait)")
        self.lead_yield_s = lead_yield_ms / 1000
        self.engine = engine
        self.share = HostShare(share) if isinstance(share, str) else share
        self.follower = WeightFollower(WeightClient(urls, parallel=connections), threads=threads)
        self._lock = threading.Lock()  # one sync at a time; a later call catches up to its own target
        # Where a sync runs (see module invariants): a serving engine's on a thread at the process's
        # priority, an idle engine's on a lowered one; store work (download, decode) always lowered.
        self._worker = ThreadPoolExecutor(1, "weight-sync")
        self._idle_worker = ThreadPoolExecutor(
            1, "weight-sync-idle", initializer=_lower_priority, initargs=(nice,)
        )
        self._store = ThreadPoolExecutor(1, "weight-store", initializer=_lower_priority, initargs=(nice,))
        self._store.submit(warm_kernels)  # in the background: the first delta then decodes at full speed
        self._defers = isinstance(engine, BuiltinEngine)  # its late writes follow the pause (flush_deferred)
        self.stats: dict[str, float] = {
            "syncs": 0, "full_reloads": 0, "pause_s_total": 0.0, "pause_s_last": 0.0,
            "full_reload_s_last": 0.0, "fetch_s_total": 0.0, "decode_s_total": 0.0,
            "downloaded_bytes": 0, "patched_elements": 0, "shared_patches": 0, "shared_read_s_total": 0.0,
            "lead_yields": 0, "serving_syncs": 0,
        }  # fmt: skip

    @property
    def recoveries(self) -> int:
        return int(self.follower.stats["recoveries"])

    def sync(self, target: int | None = None) -> dict[str, Any]:
        """Bring the engine to ``target`` (latest if None); returns what this sync did. Blocks the caller
        until done; the work runs on the follower's threads (see module invariants)."""
        serving = self._serving()
        return (self._worker if serving else self._idle_worker).submit(self._sync, target, serving).result()

    def _advance(self, target: int | None) -> tuple[Advance, Patches | None, tuple[int, int] | None]:
        """Advance the follower to ``target``: through the host share's patches as far as they reach, then
        from the store (see module invariants). Also returns the engine patch when it is already at hand
        (one shared step, or the patch this engine wrote for the others), so it is not gathered twice, and,
        when that one shared step ``(a, b)`` reaches ``target`` directly, leaves it for the caller to apply
        to the shadow after the engine's pause (the shadow is then still at ``a``)."""
        start = self.follower.version
        if self.share is None or start is None or self.follower.shadow is None:
            return self._from_store(target), None, None
        if target is None:
            target = self.follower.latest()
            if target is None:
                raise TandemError("the weight store has no published version yet")
        steps: list[Patches] = []
        read_s = 0.0
        adv: Advance | None = None
        written: Patches | None = None
        looked_again: set[int] = set()
        yielded = False
        while adv is None:
            t0 = time.perf_counter()
            while (a := self.follower.version) is not None and a < target:  # no lock: see hostshare
                got = self.share.read(a, target)
                if got is None:
                    break
                b, step = got
                if b == target and not steps and self.follower.check_patch(a, b, step):
                    self.stats["shared_read_s_total"] += time.perf_counter() - t0
                    return Advance(target, False, {}), step, (a, b)
                self.follower.apply_patch(a, b, step)
                self.stats["shared_patches"] += 1
                steps.append(step)
            read_s += time.perf_counter() - t0
            mid = self.follower.version
            if mid == target:
                break
            if mid is not None and not yielded and self._serving():
                yielded = True  # once per sync: let an idle engine of the host lead (see lead_yield_ms)
                if self._wait_for_share(mid, target):
                    self.stats["lead_yields"] += 1
                    continue
            with self.share.lock():
                # The leader of this step may have written its patch while this engine waited for the lock:
                # read it outside the lock, so the waiting engines read in parallel (once per version: a
                # patch that then fails its digest is rebuilt from the store below).
                if mid is not None and mid not in looked_again and self.share.find(mid, target) is not None:
                    looked_again.add(mid)
                    continue
                adv = self._from_store(target)
                if not adv.full and mid is not None and self.follower.shadow is not None:
                    written = _patches(adv.changes, self.follower.shadow)
                    self.share.write(mid, target, written)
        self.stats["shared_read_s_total"] += read_s
        shared: dict[str, np.ndarray | None] = {}
        for step in steps:
            for name, (index, _) in step.items():
                shared[name] = _union(shared[name], index) if name in shared else index
        if adv is None:
            return Advance(target, False, shared), steps[0] if len(steps) == 1 else None, None
        if adv.full:
            return adv, None, None
        if not shared:
            return adv, written, None
        for name, idx in shared.items():  # what the share moved before the store took over
            adv.changes[name] = _union(adv.changes[name], idx) if name in adv.changes else idx
        return adv, None, None

    def _from_store(self, target: int | None) -> Advance:
        """Advance the follower from the store, on the lower-priority store thread."""
        return self._store.submit(self.follower.advance, target).result()

    def _serving(self) -> bool:
        """Whether the engine has sessions running (its decode loop is busy)."""
        health = getattr(self.engine, "health", None)
        return bool(health is not None and health().get("active", 0))

    def _wait_for_share(self, a: int, target: int) -> bool:
        """Poll the host share for a patch from ``a`` (towards ``target``) for up to ``lead_yield_s``;
        True when one appeared."""
        assert self.share is not None
        deadline = time.monotonic() + self.lead_yield_s
        while time.monotonic() < deadline:
            if self.share.find(a, target) is not None:
                return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._idle_worker.shutdown(wait=True)
        self._store.shutdown(wait=True)

    def _sync(self, target: int | None, serving: bool = False) -> dict[str, Any]:
        with self._lock:
            if target is not None and self.engine.version >= target and self.follower.version is not None:
                return {"version": self.engine.version, "pause_s": 0.0, "skipped": True}
            t0, started_at = time.perf_counter(), time.time()
            shared_before = self.stats["shared_patches"]
            adv, ready, later = self._advance(target)
            advanced_at = time.time()
            shadow = self.follower.shadow
            at = adv.version if later is None else later[0]  # a deferred shared step: the shadow is at a
            assert shadow is not None and self.follower.version == at
            if adv.full:
                pause = self.engine.update_weights(adv.version, shadow)
                live_at = time.time()
                if self._defers:  # e.g. the second weight bank: built now, not on the next delta's way
                    self.engine.flush_deferred()
                self.stats["full_reloads"] += 1
                self.stats["full_reload_s_last"] = pause
                patched = sum(int(t.size) for t in shadow.values())
            else:
                patches = ready if ready is not None else _patches(adv.changes, shadow)
                live: list[float] = []
                on_live = lambda: live.append(time.time())  # noqa: E731
                if self._defers:
                    pause = self.engine.patch_weights(adv.version, patches, on_live, flush=False)
                else:
                    pause = self.engine.patch_weights(adv.version, patches, on_live)
                if later is not None:  # the shared step's shadow write, off the way to the pause
                    self._apply_shared(*later, patches)
                if self._defers:
                    self.engine.flush_deferred()  # after the pause, see above
                live_at = live[0]
                patched = sum(len(ix) for ix, _ in patches.values())
            s = self.stats
            s["syncs"] += 1
            s["serving_syncs"] += serving
            s["pause_s_total"] += pause
            s["pause_s_last"] = pause
            s["fetch_s_total"] += adv.fetch_s
            s["decode_s_total"] += adv.decode_s
            s["downloaded_bytes"] += adv.downloaded_bytes
            s["patched_elements"] += patched
            return {
                "version": adv.version,
                "full": adv.full,
                "recovered": adv.recovered,
                "pause_s": pause,
                "fetch_s": adv.fetch_s,
                "decode_s": adv.decode_s,
                "downloaded_bytes": adv.downloaded_bytes,
                "patched_elements": patched,
                "total_s": time.perf_counter() - t0,
                "started_at": started_at,  # wall clock when this sync began (it held the sync lock)
                # when the verified patch was at hand (a single shared step's shadow write follows the pause)
                "advanced_at": advanced_at,
                "live_at": live_at,  # wall clock when the engine started serving this version
                "shared_steps": int(self.stats["shared_patches"] - shared_before),  # patches from the share
                "serving": serving,  # the engine had sessions running: the sync ran at the process's priority
            }

    def _apply_shared(self, a: int, b: int, patches: Patches) -> None:
        """Move the shadow along the shared step ``a -> b`` the engine already serves."""
        self.follower.apply_patch(a, b, patches)
        self.stats["shared_patches"] += 1


IDLE_WEIGHT = 3
"""CFS weight of a ``SCHED_IDLE`` thread (a nice-0 thread weighs 1024, and each nice level is 1.25x less)."""


def _cfs_weight(nice: int) -> float:
    return 1024 / 1.25**nice


def lower_priority_plan(base: int, nice: int) -> tuple[str, int]:
    """How to make a thread ``nice`` levels less favoured than a process at niceness ``base``:
    ``("nice", n)`` (set the thread's niceness to ``n``) or ``("idle", 19)`` (``SCHED_IDLE``).

    The niceness range ends at 19, so a process that already runs niced (Ray starts its worker processes,
    and so every engine actor, at 15) has fewer levels left than asked for: at base 15, nice 19 is only
    2.4x below the engine instead of the 9.3x of 10 levels. Then the plan takes whichever of nice 19 and
    ``SCHED_IDLE`` (weight 3: 12x below a nice-15 thread) comes closer, in CPU share, to the ratio asked
    for."""
    if nice <= 0 or base + nice <= 19:
        return "nice", min(19, base + max(nice, 0))
    want = _cfs_weight(base) / _cfs_weight(base + nice)
    at_19 = _cfs_weight(base) / _cfs_weight(19)
    idle = _cfs_weight(base) / IDLE_WEIGHT
    return ("idle", 19) if abs(math.log(idle / want)) < abs(math.log(at_19 / want)) else ("nice", 19)


def _lower_priority(nice: int) -> None:
    """Make the calling thread ``nice`` levels less favoured than the process (threads it starts inherit),
    as far as the kernel allows (see ``lower_priority_plan``). Linux applies ``setpriority`` and
    ``sched_setscheduler`` to a single thread when given its thread id; elsewhere this does nothing."""
    if nice <= 0 or not hasattr(threading, "get_native_id"):
        return
    try:
        tid = threading.get_native_id()
        how, level = lower_priority_plan(os.getpriority(os.PRIO_PROCESS, os.getpid()), nice)
        os.setpriority(os.PRIO_PROCESS, tid, level)
        if how == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # not permitted here: keep what could be set
        pass


def _union(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Sorted union of two flat index sets; None (the whole tensor) absorbs anything."""
    if a is None or b is None:
        return None
    return np.union1d(a, b)


def _patches(changes: dict[str, np.ndarray | None], shadow: dict[str, np.ndarray]) -> Patches:
    """The engine patch of ``changes``: per tensor its changed flat indices (all of them for None) and the
    shadow's values there."""
    out: Patches = {}
    for name, idx in changes.items():
        flat = shadow[name].reshape(-1)
        index = np.arange(flat.size, dtype=np.int64) if idx is None else idx
        out[name] = (index, flat[index])
    return out
