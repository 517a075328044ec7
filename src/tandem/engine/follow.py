"""Keep a built-in engine on the newest verified version of a weight store (the delta path).

Invariants:
- Downloading, decoding and verifying from the store happen on the follower's store thread while the
  engine keeps serving (the thread first loads the codec's compiled kernels, so the first delta does not pay
  that); the engine pauses only inside ``patch_weights`` (changed elements) or, after a snapshot recovery or
  at the first sync, ``update_weights`` (a full reload). The store thread, and the download and decode
  threads it starts, run ``nice`` levels below the process (Linux thread niceness) as far as the kernel
  allows (see ``lower_priority_plan``: in a process that already runs niced, such as a Ray actor at nice 15,
  they run ``SCHED_IDLE``), so on a busy machine serving keeps the CPU and a store sync takes what is left.
- The rest of a sync (applying a host-share patch: read, check, the engine's patch plan and idle-bank writes;
  the writes a built-in engine leaves for after its pause, its other weight bank, done once the engine serves
  the new version and before ``sync`` returns, after a full reload too) runs on a thread whose priority
  depends on the engine at the start of the sync. An engine with sessions running or queued
  (``health()["active"]`` or ``["queued"]``) runs it at the process's priority: that work is short (about 30
  ms of CPU per sync on a 100M model) and holds the GIL for much of it, and a GIL holder the kernel starves (a
  ``SCHED_IDLE`` thread behind busy neighbours) stalls the engine's own decode loop, which needs the GIL
  between its torch calls: a priority inversion. An idle engine has no loop to stall, so it runs that work
  ``nice`` levels down and leaves the CPU to the engines that serve. Measured (docs/results.md, Weight sync):
  a loaded engine applying patches beside two busy processes decoded at 0.84-0.85 of its quiet rate with its
  after-pause writes at ``SCHED_IDLE`` and 0.94-1.02 with them at the process's priority; running every
  engine's patch work at the process's priority instead took CPU from the serving engine (0.80-0.81 in
  ``tandem bench sync``). The pause itself runs on the engine's loop thread.
- The engine is only ever given weights the follower verified against the store's recorded hash
  (``tandem.weights.follow``); if verification and the snapshot recovery both fail, the engine keeps its
  current version and the error propagates.
- With a host share (``tandem.weights.hostshare``) the host keeps one shadow (``tandem.weights.hostshadow``),
  written only under the share's exclusive lock, and no engine keeps its own. An engine at version ``a`` first
  reads the verified patches ``a -> b`` other engines of its host wrote (without a lock, in parallel with the
  others) and composes them into one engine patch; only when the next one is missing does it take the share's
  lock, look again, and, when still missing, *lead*: advance the host shadow from the store itself (on the
  store thread), write that step's verified patch for the others, whom the lock holds back meanwhile, and
  patch itself from it (``tandem.weights.hostlead.lead_step``; a host's ``HostLeader``, a process of its own,
  leads steps the same way and, told of each version when the engines are, usually first). When the host
  shadow is past the engine's version and no patch leads from ``a`` (gone, or failing its digest), the
  engine's patch is the elements the store's deltas ``a -> ...`` change (their positions decode without a
  base: ``changed_positions``) with the verified shadow's values. Only when that cannot be done (the engine's
  first sync, a shadow that had to be recovered from a snapshot, a snapshot on the store's path from ``a``)
  does the engine reload in full from the verified shadow, under the share's shared lock (in parallel with
  other engines' reloads, never beside a leader's writes), downloading nothing for it. An engine with sessions
  running first waits up to ``lead_yield_ms`` for another engine of the host to write that patch (producing it
  runs Python beside the decode loop, which takes the GIL from the loop), so an idle engine leads when there
  is one; after the wait it takes the lock as above, so a host of busy engines still advances. With
  ``host_leader`` (the host runs a ``HostLeader``) every engine, idle or not, waits so first.
- A sync that fails after the follower advanced (the engine refused the patch or the reload and still
  serves its old version) leaves the engine behind the follower's own shadow: the next sync reloads it in
  full from that shadow instead of patching from the version the follower reached (an empty patch, which
  had relabelled the old weights as the new version). With a host share the next sync patches from the
  engine's version as usual.
- Published tensors omit tied duplicates (``lm_head`` tied to the embeddings): patching the published name
  patches the shared storage and every derived buffer built from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.core.errors import TandemError
from tandem.core.procs import lower_priority_plan as lower_priority_plan
from tandem.core.procs import lower_thread_priority as _lower_priority
from tandem.engine.builtin import BuiltinEngine
from tandem.weights.client import WeightClient
from tandem.weights.decoder import changed_positions
from tandem.weights.delta import warm_kernels
from tandem.weights.follow import Advance, WeightFollower
from tandem.weights.hostlead import lead_step, patch_of
from tandem.weights.hostshadow import HostShadow
from tandem.weights.hostshare import HostShare, Patches
from tandem.weights.manifest import FULL


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
        host_leader: bool = False,
    ) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice} must be in [0, 19] (0: the sync runs at the process's priority)")
        if not 0 <= lead_yield_ms <= 10_000:
            raise ValueError(f"lead_yield_ms={lead_yield_ms} must be in [0, 10000] (0: never wait)")
        self.lead_yield_s = lead_yield_ms / 1000
        self.host_leader = host_leader  # the host runs a HostLeader: even an idle engine lets it lead
        self.engine = engine
        self.share = HostShare(share) if isinstance(share, str) else share
        self.host_shadow = HostShadow(self.share.path) if self.share is not None else None
        self._version: int | None = None  # the verified version the engine serves (None before a sync)
        self._reload_next = False  # a sync failed after the follower advanced: the next one reloads in full
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

    def _advance_shared(self, target: int | None) -> _Step:
        """Bring the engine's next state to ``target`` through the host share (see module invariants): the
        patches other engines wrote, read without a lock and composed into one engine patch; where the next
        one is missing, under the share's lock, :meth:`_lead`."""
        assert self.share is not None and self.host_shadow is not None
        if target is None:
            target = self.follower.latest()
            if target is None:
                raise TandemError("the weight store has no published version yet")
        steps: list[Patches] = []
        at = self._version
        looked_again: set[int] = set()
        yielded = False
        read_s = 0.0
        while True:
            t0 = time.perf_counter()
            while at is not None and at < target:  # no lock: see hostshare
                got = self.share.read(at, target)
                if got is None:
                    break
                at, patch = got
                steps.append(patch)
            read_s += time.perf_counter() - t0
            if at == target:
                self.stats["shared_read_s_total"] += read_s
                self.stats["shared_patches"] += len(steps)
                return _Step(target, compose_patches(steps), shared=len(steps))
            if at is not None and not yielded and (self.host_leader or self._serving()):
                yielded = True  # once per sync: let the host leader or an idle engine lead (lead_yield_ms)
                if self._wait_for_share(at, target):
                    self.stats["lead_yields"] += 1
                    continue
            with self.share.lock():
                # The leader of this step may have written its patch while this engine waited for the lock:
                # read it outside the lock, so the waiting engines read in parallel (once per version: a
                # patch that then fails its digest is rebuilt below).
                if at is not None and at not in looked_again and self.share.find(at, target) is not None:
                    looked_again.add(at)
                    continue
                step = self._lead(at, target, steps)
            if step.patches is None:
                with self.share.lock(shared=True):  # a full reload, in parallel with other engines' reloads
                    version, tensors = self.host_shadow.load()
                    if version is not None and version >= step.version:
                        step.full_pause = self.engine.update_weights(version, tensors)
                        step.version, step.live_at = version, time.time()
                        step.elements = sum(int(t.size) for t in tensors.values())
            if step.patches is not None or step.full_pause is not None:
                self.stats["shared_read_s_total"] += read_s
                self.stats["shared_patches"] += len(steps)
                return step
            # A leader died halfway between this engine's lead and its reload (the shadow is dirty): lead
            # again, which recovers the shadow.
            steps, at, looked_again = [], self._version, set()

    def _lead(self, at: int | None, target: int, steps: list[Patches]) -> _Step:
        """Under the share's lock: advance the host shadow to ``target`` from the store (on the store
        thread), write its patch for the other engines, and return this engine's step from ``at`` (its
        share patches ``steps`` plus that patch, or the positions the store's deltas change when the shadow
        is past ``at``). A step without patches means a full reload from the verified shadow, which the
        caller does under the shared lock (nothing is downloaded for it)."""
        assert self.host_shadow is not None and self.share is not None
        res = lead_step(self.share, self.host_shadow, self.follower, target, self._from_store)
        base, target, adv, tensors, written = res.base, res.version, res.adv, res.tensors, res.written
        if written is not None and base == at:
            return _Step(target, compose_patches([*steps, written]), adv=adv, shared=len(steps))
        if not adv.full and at is not None and base is not None and at < base:
            # The shadow is past the engine and no patch leads from ``at``: which elements changed from
            # ``at`` to ``base`` is in the store's deltas (positions need no base), their values are the
            # verified shadow's, so the engine still pauses only for a patch.
            moved = self._store.submit(self._store_positions, at, base, adv, tensors).result()
            if moved is not None:
                for name, idx in adv.changes.items():  # base -> target, advanced above
                    moved[name] = _union(moved[name], idx) if name in moved else idx
                patch = patch_of(moved, tensors)
                return _Step(target, compose_patches([*steps, patch]), adv=adv, shared=len(steps))
        return _Step(target, None, adv=adv)  # a full reload from the host shadow: the caller's, see above

    def _store_positions(
        self, a: int, b: int, adv: Advance, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray | None] | None:
        """The elements the store's delta chain ``a -> b`` changes, per tensor of ``tensors`` (None: all of
        it), decoded from the deltas alone; None when there is no such chain (versions gone, a snapshot on
        the way, a blob that does not decode or names a tensor not in ``tensors``). What it downloads is
        counted in ``adv``."""
        try:
            fetched = self.follower.client.fetch(a, b)
            if any(f.step.kind == FULL for f in fetched):
                return None
            moved: dict[str, np.ndarray | None] = {}
            for f in fetched:
                adv.downloaded_bytes += sum(len(blob) for blob in f.blobs.values())
                for name, blob in f.blobs.items():
                    if name not in tensors:
                        return None
                    idx = changed_positions(blob, name, int(tensors[name].size))
                    if idx is None or idx.size:
                        moved[name] = _union(moved[name], idx) if name in moved else idx
            return moved
        except (TandemError, ValueError, OSError):
            return None

    def _from_store(self, target: int | None) -> Advance:
        """Advance the follower from the store, on the lower-priority store thread."""
        return self._store.submit(self.follower.advance, target).result()

    def _serving(self) -> bool:
        """Whether the engine has sessions running or queued (its decode loop is busy, or about to be: a
        step in which every running session finished shows none active with the next ones still queued)."""
        health = getattr(self.engine, "health", None)
        if health is None:
            return False
        state = health()
        return bool(state.get("active", 0) or state.get("queued", 0))

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
            if target is not None and self._version is not None and self.engine.version >= target:
                return {"version": self.engine.version, "pause_s": 0.0, "skipped": True}
            t0, started_at = time.perf_counter(), time.time()
            try:
                step = self._advance_shared(target) if self.share is not None else self._advance_own(target)
                if self._reload_next and step.patches is not None and self.share is None:
                    step = _Step(step.version, None, adv=step.adv)  # the engine missed a patch: reload
                advanced_at = time.time()
                adv = step.adv or Advance(step.version, False)
                if step.patches is None:  # a full reload (done under the share's lock with a share)
                    if step.full_pause is None:
                        assert self.follower.shadow is not None
                        step.full_pause = self.engine.update_weights(step.version, self.follower.shadow)
                        step.live_at = time.time()
                        step.elements = sum(int(t.size) for t in self.follower.shadow.values())
                    pause, live_at = step.full_pause, step.live_at
                    patched = step.elements
                    if self._defers:  # e.g. the second weight bank: built now, not on the next delta's way
                        self.engine.flush_deferred()
                    self.stats["full_reloads"] += 1
                    self.stats["full_reload_s_last"] = pause
                else:
                    patches = step.patches
                    live: list[float] = []
                    on_live = lambda: live.append(time.time())  # noqa: E731
                    if self._defers:
                        pause = self.engine.patch_weights(step.version, patches, on_live, flush=False)
                        self.engine.flush_deferred()  # after the pause, see above
                    else:
                        pause = self.engine.patch_weights(step.version, patches, on_live)
                    live_at = live[0]
                    patched = sum(len(ix) for ix, _ in patches.values())
            except BaseException:
                # Without a share the follower may be past what the engine serves now: the next sync must
                # not patch from the version the follower reached (an empty patch would relabel the old
                # weights as the new version), so it reloads in full. (With a share the next sync reads
                # the patches from the engine's version again.)
                self._reload_next = True
                raise
            self._version, self._reload_next = step.version, False
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
                "version": step.version,
                "full": step.patches is None,
                "recovered": adv.recovered,
                "pause_s": pause,
                "fetch_s": adv.fetch_s,
                "decode_s": adv.decode_s,
                "downloaded_bytes": adv.downloaded_bytes,
                "patched_elements": patched,
                "total_s": time.perf_counter() - t0,
                "started_at": started_at,  # wall clock when this sync began (it held the sync lock)
                "advanced_at": advanced_at,  # when the verified patch (or the full reload) was at hand
                "live_at": live_at,  # wall clock when the engine started serving this version
                "shared_steps": step.shared,  # patches read from the host share
                "serving": serving,  # the engine had sessions running: the sync ran at the process's priority
            }

    def _advance_own(self, target: int | None) -> _Step:
        """Without a host share: advance this engine's own shadow from the store."""
        adv = self._from_store(target)
        shadow = self.follower.shadow
        assert shadow is not None and self.follower.version == adv.version
        return _Step(adv.version, None if adv.full else patch_of(adv.changes, shadow, adv.values), adv=adv)


@dataclass
class _Step:
    """Where one sync takes the engine: ``version`` through the engine patch ``patches``, or a full reload
    when it is None (already done, under the share's lock, when ``full_pause`` is set)."""

    version: int
    patches: Patches | None
    adv: Advance | None = None  # the store work this engine did, if any
    shared: int = 0  # host-share patches this step composed
    full_pause: float | None = None
    live_at: float = 0.0
    elements: int = 0  # of a full reload


def compose_patches(steps: list[Patches]) -> Patches:
    """One patch with the effect of applying ``steps`` in order: per tensor the sorted union of their
    indices, each with the value of the last step that writes it."""
    if len(steps) == 1:
        return steps[0]
    out: Patches = {}
    for name in sorted(set().union(*steps)):
        parts = [s[name] for s in reversed(steps) if name in s]  # newest first
        if len(parts) == 1:
            out[name] = parts[0]
            continue
        index, first = np.unique(np.concatenate([p[0] for p in parts]), return_index=True)
        out[name] = (index, np.concatenate([p[1] for p in parts])[first])  # first occurrence = newest step
    return out


def _union(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Sorted union of two flat index sets; None (the whole tensor) absorbs anything."""
    if a is None or b is None:
        return None
    return np.union1d(a, b)
