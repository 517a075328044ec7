"""How each new version travels from the trainer actor to the engine actors during a run.

Two transports (``weights.transport``):
- ``"delta"`` (default): the trainer actor owns a ``WeightStore`` (``<run_dir>/weights`` unless
  ``weights.store`` says otherwise) and serves it over HTTP on 127.0.0.1; after each step it publishes the
  new version as a lossless bf16 delta (full snapshot every ``snapshot_every``), and every engine fetches,
  verifies and patches it in place (``EngineActor.follow``), through ``weights.relays`` relay actors when
  configured (each engine lists its relay first and the store server second, so a dead relay is survived).
  With several engines and ``weights.host_share``, the engines of a host share one decode of each delta
  through a host-local share directory (``tandem.weights.hostshare``) that ``finish`` removes; with
  ``weights.host_leader`` a ``HostLeaderActor`` of the host leads every step (it is told each version when
  the engines are), so the engines only read patches.
- ``"object_store"``: the full tensors as one ``WeightUpdate`` through Ray's object store, verified by hash.

Invariants:
- Before the first rollout, every engine serves the run's starting version as published (on the delta
  path that is the bf16 rounding of the starting weights, exactly what later deltas build on).
- ``after_step(version, wait=True)`` returns only when every engine serves ``version`` (sync mode).
  With ``wait=False`` (async mode) the engines' fetch runs while the trainer trains the next step; the
  previous version's fetch is awaited before a new one is issued, so engines lag the trainer by at most one
  version beyond what the staleness bound already accounts for (every token records its version).
- An engine that dies is left out of every later sync (``EngineFleet``); the run stops only when none is
  left. The host leader is an optimisation (an engine leads any step it has not taken): when it dies it is
  told no further versions and the engines lead; the loss is kept in ``lost``.
- A relay (``tandem-relay-<i>``) that dies is kept in ``lost`` once ("relay i died (...); its engines
  fetch from the store server", which they then do: it is second in each engine's list). Each relay has one
  call pending that never returns while it lives (``RelayActor.until_dead``); every collection of a step's
  sync looks at those calls with ``ray.wait`` without waiting (no time taken from a step), and ``finish``
  pings the relays still watched (at most ``RELAY_PING_S``), so a relay dead before the end of the run is
  reported, by ``ray.kill`` or with its process killed.
- A host share is named after the driver's host and pid (``tandem-share-<host>-<pid>-<id>``); ``finish``
  and the run's teardown remove it, and a run that starts a share removes the shares on its host whose
  driver is gone (killed with SIGKILL or by the OOM killer, it could not): nothing else would, and a share
  keeps a copy of the weights in memory (``/dev/shm``) until the machine restarts.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from tandem.core.config import RunConfig
from tandem.core.procs import pid_alive
from tandem.orchestrator.actors import HostLeaderActor, RelayActor
from tandem.orchestrator.fleet import EngineFleet

RELAY_PING_S = 2.0
"""How long ``finish`` waits for the relays still watched to answer a ping (a hung one is not waited on)."""


class WeightPath:
    """The weight transport of one run (see module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool) -> None:
        self.cfg = cfg
        self.delta = cfg.weights.transport == "delta"
        self.store: str | None = None
        if self.delta:
            self.store = cfg.weights.store or str(run_dir / "weights")
            if not cfg.weights.store and Path(self.store).exists():
                # The run's own store restarts with the run (a resume republishes its version as a snapshot).
                shutil.rmtree(self.store)
        self.relays: list[Any] = []
        self._relay_watch: dict[int, Any] = {}  # relay index -> its pending ``until_dead`` call
        self.share_dir: str | None = None
        self.leader: Any = None  # the host's HostLeaderActor, if any
        self.leader_alive = False
        self.lost: list[str] = []
        """What this path lost on the way and went on without (the host leader, relays), one line each."""
        self.fleet: EngineFleet | None = None
        self.version: int | None = None
        """The newest version the engines were told to serve (None before ``start``)."""
        self._trainer: Any = None
        self._urls: list[list[str]] = []
        self._leading: list[Any] = []
        self._pending: list[tuple[int, Any]] = []
        self.last: dict[str, float] = {}
        self.totals = {"delta_bytes": 0, "raw_bytes": 0, "publishes": 0}

    def trainer_store(self) -> str | None:
        return self.store

    def connect(self, trainer, fleet: EngineFleet, run_dir: Path) -> None:
        """On the delta path, connect every engine to the trainer's store (through its relay) and start the
        host leader; returns once every engine is connected (so once each has started). Nothing to do on
        the object-store path."""
        self.fleet = fleet
        self._trainer = trainer
        fleet.rejoin = self.rejoin
        engines = fleet.engines
        if not self.delta:
            return
        urls = self._engine_urls(trainer, len(engines), run_dir)
        share = self._engine_share(len(engines))
        self._start_leader(urls[0])
        self._urls = urls
        ray.get([e.connect_weights.remote(u, share) for e, u in zip(engines, urls, strict=True)])

    def rejoin(self, i: int, engine: Any) -> None:
        """Bring engine ``i``, a process Ray restarted after a crash, to the run's version and let it serve
        (``EngineFleet``): on the delta path connect it to the store (its relay first, its host's share) and
        sync it to the newest published version (its first sync is a full reload, from the host shadow or
        the store); on the object-store path send it the trainer's full weights."""
        if self.delta:
            ray.get(engine.connect_weights.remote(self._urls[i], self.share_dir))
            if self.version is not None:
                ray.get(engine.follow.remote(self.version))
        elif self.version is not None:
            ray.get(engine.update_weights.remote(self._trainer.publish.remote()))
        ray.get(engine.resume_serving.remote())

    def _engine_urls(self, trainer, n_engines: int, run_dir: Path) -> list[list[str]]:
        """Per engine, the URLs it fetches weights from: its relay (if any), then the store server."""
        upstream = ray.get(trainer.weights_url.remote())
        w = self.cfg.weights
        self.relays = [
            RelayActor.options(name=f"tandem-relay-{i}").remote(
                [upstream], str(run_dir / "relay_cache" / f"relay{i}"), w.bandwidth_mbps
            )
            for i in range(w.relays)
        ]
        relay_urls = ray.get([r.url.remote() for r in self.relays])
        self._relay_watch = {i: r.until_dead.remote() for i, r in enumerate(self.relays)}
        return [
            ([relay_urls[i % len(relay_urls)]] if relay_urls else []) + [upstream] for i in range(n_engines)
        ]

    def _engine_share(self, n_engines: int) -> str | None:
        """The host share directory the engines use (None with one engine, on the object-store path, or
        with ``weights.host_share`` off). Engines on another host create the same path in their own
        ``/dev/shm``, so each host shares among its own engines."""
        if not (self.delta and self.cfg.weights.host_share and n_engines > 1):
            return None
        from tandem.weights.hostshare import default_share_root

        root = default_share_root()
        prefix = f"tandem-share-{socket.gethostname()}-"
        for old in root.glob(prefix + "*"):  # a share whose driver died without its teardown
            pid = old.name[len(prefix) :].split("-")[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        self.share_dir = str(root / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:16]}")
        return self.share_dir

    def _start_leader(self, urls: list[str] | None) -> None:
        """With a host share and ``weights.host_leader``: start the host's leader, fetching from ``urls``
        (an engine's: its relay, then the store server)."""
        if self.share_dir is not None and urls and self.cfg.weights.host_leader:
            self.leader = HostLeaderActor.options(name="tandem-host-leader").remote(
                urls, self.share_dir, self.cfg.weights.follow_nice
            )
            self.leader_alive = True

    def start(self, trainer, version: int) -> None:
        """Make every engine serve ``version`` as published before anything is generated."""
        assert self.fleet is not None, "connect first"
        self.version = version
        if self.delta:
            self._publish(trainer)
            self._leading = self._lead(version)
            self._pending = self.fleet.call("follow", version)
            self._collect()
        else:
            self.fleet.gather(self.fleet.call("update_weights", trainer.publish.remote()))

    def after_step(self, trainer, version: int, wait: bool) -> dict[str, float]:
        """Publish ``version`` and move the live engines to it; returns timing and size metrics."""
        assert self.fleet is not None, "connect first"
        t0 = time.monotonic()
        if not self.delta:
            self.version = version
            pauses = self.fleet.gather(self.fleet.call("update_weights", trainer.publish.remote()))
            pause = max(pauses.values(), default=0.0)  # none: the only engine was restarted and rejoined
            return {"weight_sync_s": time.monotonic() - t0, "engine_pause_s": pause}
        out = self._collect()
        report = self._publish(trainer)
        self.version = version
        self._leading = self._lead(version)
        self._pending = self.fleet.call("follow", version)
        if wait:
            out = self._collect()
        out.update(
            weight_sync_s=time.monotonic() - t0,
            weight_publish_s=report["publish_s"],
            weight_delta_bytes=float(report["nbytes"]),
            weight_ratio=report["raw_bytes"] / max(report["nbytes"], 1),
        )
        return out

    def _publish(self, trainer) -> dict[str, Any]:
        report = ray.get(trainer.publish_to_store.remote())
        self.totals["publishes"] += 1
        self.totals["delta_bytes"] += report["nbytes"]
        self.totals["raw_bytes"] += report["raw_bytes"]
        return report

    def _lead(self, version: int) -> list[Any]:
        """The host leader's step to ``version``, started (empty without a leader)."""
        return [self.leader.advance.remote(version)] if self.leader_alive else []

    def _collect(self) -> dict[str, float]:
        """Wait for the live engines' last fetch; metrics of the slowest engine (empty if nothing was
        pending). A dead engine or host leader is left out from then on, and a dead relay is reported (see
        the module docstring)."""
        self._check_relays()
        if not self._pending:
            return {}
        assert self.fleet is not None
        results = list(self.fleet.gather(self._pending).values())  # a restarted engine's is not there
        try:
            ray.get(self._leading)
        except ActorDiedError as e:
            self.leader_alive = False
            self.lost.append(f"the host leader died ({type(e).__name__}); the engines lead each step")
        self._pending, self._leading = [], []
        if not results:  # the only engine was restarted and brought to the version by its rejoin
            return {}
        return {
            "engine_pause_s": max(r["pause_s"] for r in results),
            "engine_fetch_s": max(r.get("fetch_s", 0.0) + r.get("decode_s", 0.0) for r in results),
            "weight_recoveries": float(sum(bool(r.get("recovered")) for r in results)),
            # engines that took this version from the host share instead of decoding it themselves
            "weight_shared_frac": sum(r.get("shared_steps", 0) > 0 for r in results) / len(results),
        }

    def _check_relays(self, ping_s: float = 0.0) -> None:
        """Report each relay whose ``until_dead`` call ended (it died) in ``lost``, once. With ``ping_s``,
        first give the relays still watched that long to answer a ping: a relay that died just now may not
        have failed its pending call yet, and a ping to it fails as soon as Ray knows it is gone."""
        if not self._relay_watch:
            return
        calls = dict(self._relay_watch)
        if ping_s > 0:
            pings = {i: self.relays[i].url.remote() for i in calls}
            done, _ = ray.wait(
                list(pings.values()), num_returns=len(pings), timeout=ping_s, fetch_local=False
            )
            calls.update({i: ref for i, ref in pings.items() if ref in done})
        done, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=0, fetch_local=False)
        for i, ref in calls.items():
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except ActorUnavailableError:  # unreachable for now, not dead: watch it again
                self._relay_watch[i] = self.relays[i].until_dead.remote()
            except RayActorError as e:
                del self._relay_watch[i]
                self.lost.append(
                    f"relay {i} died ({type(e).__name__}); its engines fetch from the store server"
                )
            except Exception:  # not a death (the call never returns otherwise); watching never ends a run
                del self._relay_watch[i]

    def finish(self, trainer) -> None:
        """Wait for in-flight fetches and close the store (releases its single-writer lock)."""
        if self.delta:
            try:
                self._collect()
                self._check_relays(ping_s=RELAY_PING_S)
            finally:
                self.remove_share()
                ray.get(trainer.close_store.remote())

    def remove_share(self) -> None:
        """Delete this host's share directory (no engine may sync afterwards)."""
        if self.share_dir is not None:
            shutil.rmtree(self.share_dir, ignore_errors=True)

    def actors(self) -> list[Any]:
        return list(self.relays) + ([self.leader] if self.leader is not None else [])
