"""Ray actors: engine, trajectory buffer, rollout worker and trainer.

Invariants:
- The buffer hands out *credits*: a rollout worker starts a group only after taking one. The driver grants
  ``(max_staleness + 1) * groups_per_step`` credits up front and ``groups_per_step`` more each time it takes a
  batch (async), or exactly one batch worth after each weight update (sync). With FIFO consumption this bounds
  how far behind the trainer a group can fall; groups that are still too old at ``take`` are dropped and
  counted.
- A group that fails or times out returns its credit and its task is requeued; no call waits forever:
  ``take`` raises after ``request_timeout_s`` without progress.
- Credits are held per *producer*: the token the driver passes to one ``produce`` call of one rollout worker
  process. When that process dies the driver calls ``reclaim(token)``: the credits of the groups it had in
  flight return to the pool, and whatever the dead producer still had on its way to the buffer is accounted
  so that no credit is lost or made: a waiting ``acquire_credit`` of it gets none, a late ``put`` of it
  keeps its group and uses one credit of the pool, a late ``failed`` of it returns nothing.
- Engines apply a weight update only after verifying its content hash: the full ``WeightUpdate`` of the
  object-store path, or, on the delta path (``weights.transport = "delta"``), every version they fetch from
  the trainer's weight store (``tandem.engine.follow``), through relays when configured.
- Every long-lived actor freezes its start-up heap once it is built (``tandem.core.procs.freeze_heap``), so
  the cyclic collector's full passes skip it instead of stopping the actor's threads for 0.3-0.6 s.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any

import ray

from tandem.core.config import RunConfig
from tandem.core.procs import freeze_heap
from tandem.core.records import Group, Task
from tandem.weights import WeightUpdate, verify_update


def _set_threads(n: int) -> None:
    import warnings

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # Ray hands out read-only numpy views of weight updates; engines only read them (copy_ into params).
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    torch.set_num_threads(max(1, n))
    os.environ["OMP_NUM_THREADS"] = str(max(1, n))


def _restarted_actor() -> bool:
    """Whether this actor's process is one Ray started again after the actor's previous process died."""
    import warnings

    with warnings.catch_warnings():  # Ray's implementation of it warns about an API of its own
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


@ray.remote(num_cpus=0)
class EngineActor:
    """Serves ``generate`` for rollout workers from one engine (``engine.kind``); applies verified updates."""

    def __init__(self, cfg: RunConfig, seed: int = 0) -> None:
        _set_threads(cfg.engine.threads)
        from tandem.engine import create_engine

        self.cfg = cfg
        self.engine = create_engine(
            cfg.model.path,
            cfg.engine,
            dtype=cfg.model.dtype,
            seed=seed,
            deterministic=cfg.train.deterministic,  # one flag for the trainer and the engines
        )
        # An automatic loop boost stays off until the driver says the trainer is on another node
        # (``place_loop``): on the trainer's host it would favour decoding over training.
        self.engine.set_beside_trainer(True)
        self.engine.start()
        self.weight_sync = None
        self.serving = asyncio.Event()
        """Set while ``generate`` may run: at once in a first start; in a process Ray restarted after a
        crash only once the driver brought it to the run's version (``resume_serving``), so a restarted
        engine never samples from the starting weights it loaded."""
        if not _restarted_actor():
            self.serving.set()
        freeze_heap()

    async def resume_serving(self) -> None:
        """The driver brought this (restarted) engine to the run's version: serve again."""
        self.serving.set()

    async def connect_weights(self, weight_urls: list[str], weight_share: str | None = None) -> None:
        """Follow the weight store at ``weight_urls`` (the delta path; the URLs are known only once the
        trainer actor serves its store, so engines start beside the trainer and are connected after)."""
        from tandem.engine.follow import EngineWeightSync

        w = self.cfg.weights
        self.weight_sync = EngineWeightSync(
            self.engine,
            weight_urls,
            w.connections,
            w.codec_threads,
            w.follow_nice,
            share=weight_share,
            lead_yield_ms=w.lead_yield_ms,
            host_leader=weight_share is not None and w.host_leader,
        )

    async def follow(self, version: int) -> dict[str, Any]:
        """Fetch, verify and apply ``version`` from the weight store while serving (delta path)."""
        assert self.weight_sync is not None, "this engine was never connected to a weight store"
        return await asyncio.to_thread(self.weight_sync.sync, version)

    async def generate(self, request):
        if not self.serving.is_set():
            await self.serving.wait()
        return await asyncio.wrap_future(self.engine.submit(request))

    async def update_weights(self, update: WeightUpdate) -> float:
        """Verify and apply; returns the seconds the engine was paused to patch tensors."""
        await asyncio.to_thread(verify_update, update)
        t0 = time.monotonic()
        await asyncio.to_thread(self.engine.update_weights, update.version, update.tensors)
        return time.monotonic() - t0

    async def place_loop(self, trainer_node: str) -> int | None:
        """The trainer runs on Ray node ``trainer_node``: an engine on another node gets the automatic loop
        boost (``EngineConfig.loop_priority_boost`` None), one beside it none. Returns the loop's niceness."""
        beside = ray.get_runtime_context().get_node_id() == trainer_node
        return self.engine.set_beside_trainer(beside)

    async def ping(self) -> dict[str, Any]:
        """Answers at once while the actor's process runs, whatever its other calls are waiting on (the
        fleet tells a hung engine from one blocked behind it by this, a restarted one by ``pid`` and
        ``serving``, and one whose engine cannot serve any more by ``ok`` and ``error``)."""
        health = self.engine.health()
        return {
            "pid": os.getpid(), "serving": self.serving.is_set(), "ok": bool(health.get("ok", True)),
            "error": health.get("error", ""),
        }  # fmt: skip

    async def stats(self) -> dict[str, Any]:
        out = {**self.engine.stats(), **self.engine.health(), "pid": os.getpid()}
        if self.weight_sync is not None:
            out["weights"] = {**self.weight_sync.stats, "recoveries": self.weight_sync.recoveries}
        return out

    async def shutdown(self) -> None:
        """Stop serving and release the engine (vLLM's engine core and its rendezvous file in the temp dir,
        which ``ray.kill`` alone leaves behind), before the caller kills this actor."""
        self.engine.stop()
        close = getattr(self.engine, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


UNAVAILABLE_RETRY_S = 0.5
"""How long a rollout worker waits before it sends a request again to an engine Ray is restarting."""
FAIL_FAST_GROUPS = 16  # groups failing in a row (none finishing) after which the trainer stops waiting


@ray.remote(num_cpus=0)
class BufferActor:
    """FIFO of finished groups with credit-based admission and staleness filtering."""

    def __init__(self, max_groups: int) -> None:
        self.groups: deque[Group] = deque()
        self.credits = 0
        self.held: dict[str, int] = {}
        """Credits each live producer holds (groups it runs or is putting)."""
        self.reclaimed: set[str] = set()
        """Producers whose process died and whose credits went back to the pool."""
        self.closed = False
        self.cond = asyncio.Condition()
        self.max_groups = max_groups
        self.counters = {"produced": 0, "dropped_stale": 0, "failed": 0, "taken": 0, "reclaimed": 0}
        self.last_progress = time.monotonic()
        self.failed_in_a_row = 0  # groups failed since the last one that finished
        self.last_failure = ""

    async def grant(self, n: int) -> None:
        async with self.cond:
            self.credits += n
            self.cond.notify_all()

    async def acquire_credit(self, producer: str = "") -> bool:
        """Wait for a credit and hold it for ``producer``; False once the buffer is closed or the producer
        was reclaimed (its process died while it waited: nobody would use the credit)."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.closed or producer in self.reclaimed or self.credits > 0)
            if self.closed or producer in self.reclaimed:
                return False
            self.credits -= 1
            self.held[producer] = self.held.get(producer, 0) + 1
            return True

    def _release(self, producer: str) -> bool:
        """Drop one credit ``producer`` holds; False when it holds none (it was reclaimed)."""
        if self.held.get(producer, 0) <= 0:
            return False
        self.held[producer] -= 1
        return True

    async def put(self, group: Group, producer: str = "") -> None:
        async with self.cond:
            if not self._release(producer):
                self.credits -= 1  # its credit already went back with the reclaim: this group uses one
            self.groups.append(group)
            self.counters["produced"] += 1
            self.failed_in_a_row = 0
            self.last_progress = time.monotonic()
            self.cond.notify_all()

    async def failed(self, reason: str = "", producer: str = "") -> None:
        """A group failed: give its credit back so another one starts (``take`` gives up after
        ``FAIL_FAST_GROUPS`` failures in a row)."""
        async with self.cond:
            self.counters["failed"] += 1
            self.failed_in_a_row += 1
            self.last_failure = reason or self.last_failure
            if self._release(producer):
                self.credits += 1
            self.cond.notify_all()

    async def restart_idle_clock(self) -> None:
        """Count now as progress for ``take``'s ``timeout_s`` (the driver removed a hung engine: the groups
        that waited on it are requeued now and get a full period to finish)."""
        async with self.cond:
            self.last_progress = time.monotonic()

    async def reclaim(self, producer: str) -> int:
        """``producer``'s process died: its held credits go back to the pool (returns how many), and its
        calls still on their way are accounted as the module docstring says."""
        async with self.cond:
            self.reclaimed.add(producer)
            n = self.held.pop(producer, 0)
            self.credits += n
            self.counters["reclaimed"] += n
            self.cond.notify_all()
            return n

    async def take(
        self, n: int, trainer_version: int, max_staleness: int, timeout_s: float
    ) -> tuple[list[Group], dict[str, Any]]:
        """Wait for ``n`` groups no older than ``max_staleness`` versions; drop (and count) older ones."""
        taken: list[Group] = []
        staleness: list[int] = []
        dropped = 0
        deadline_base = time.monotonic()
        async with self.cond:
            while len(taken) < n:
                while self.groups and len(taken) < n:
                    g = self.groups.popleft()
                    oldest = g.oldest_version()
                    lag = 0 if oldest is None else trainer_version - oldest
                    if lag > max_staleness:
                        dropped += 1
                        self.counters["dropped_stale"] += 1
                        self.credits += 1  # replace the dropped group
                        self.cond.notify_all()
                        continue
                    taken.append(g)
                    staleness.append(lag)
                if len(taken) >= n:
                    break
                if self.closed:
                    raise RuntimeError("buffer closed while the trainer waited for groups")
                if self.failed_in_a_row >= FAIL_FAST_GROUPS:
                    raise RuntimeError(
                        f"the last {self.failed_in_a_row} rollout groups all failed and none finished "
                        f"since; the last failure: {self.last_failure}"
                    )
                idle = time.monotonic() - max(self.last_progress, deadline_base)
                if idle > timeout_s:
                    raise TimeoutError(
                        f"no rollout group finished for {timeout_s:.0f}s (have {len(taken)}/{n}); engines or "
                        f"rollout workers are stuck or dead. Raise orchestrator.request_timeout_s if "
                        f"sessions "
                        f"are legitimately slow."
                    )
                try:
                    await asyncio.wait_for(self.cond.wait(), timeout=min(5.0, timeout_s))
                except TimeoutError:
                    pass
            self.counters["taken"] += len(taken)
        return taken, {"staleness": staleness, "dropped_stale": dropped, "buffered": len(self.groups)}

    async def close(self) -> None:
        async with self.cond:
            self.closed = True
            self.cond.notify_all()

    async def stats(self) -> dict[str, Any]:
        return {**self.counters, "buffered": len(self.groups), "credits": self.credits}


@ray.remote(num_cpus=0)
class RolloutActor:
    """Produces groups for the buffer (training) and runs evaluations, against the engine actors."""

    def __init__(
        self, cfg: RunConfig, engine_names: list[str], buffer_name: str, index: int = 0, num_workers: int = 1,
        task_cursor: int = 0,
    ) -> None:  # fmt: skip
        """The engines and the buffer come as actor names, looked up here (also on a restart): actor handles
        among the arguments of an actor Ray may restart made Ray print an alarming error line in every run
        ("has constructor arguments in the object store and max_restarts > 0", ray-project/ray#53727)."""
        # No torch here: the worker only tokenizes and runs sandboxes, and importing torch and transformers'
        # models was most of its start (5.3 s, now 1.4 s). One thread for anything that imports it later.
        os.environ["OMP_NUM_THREADS"] = "1"
        from tandem.model import load_chat_format
        from tandem.rollout import RolloutWorker, TaskStream

        self.cfg = cfg
        self.engines = engines = [ray.get_actor(name) for name in engine_names]
        buffer = ray.get_actor(buffer_name)
        self.outstanding = [0] * len(engines)
        self.dead = [False] * len(engines)
        self.unavailable_until = [0.0] * len(engines)  # monotonic time before which an engine is restarting
        self.buffer = buffer
        self.stream = TaskStream(cfg, index, num_workers, task_cursor)  # a resumed run goes on from there
        self.worker = RolloutWorker(
            self._generate, load_chat_format(cfg.model.path), cfg, seed=cfg.train.seed + index
        )
        self.running = False
        self.inflight: set[asyncio.Task] = set()
        self.errors: list[str] = []
        freeze_heap()

    async def _generate(self, request):
        """Generate on the live engine with the fewest requests outstanding. A request whose engine died
        (Ray restarts it, or it is gone for good) is sent again, whole, to another engine, or to the same one
        once it is back, until ``orchestrator.request_timeout_s``: a session loses no turn to an engine
        crash (what the engine had sampled of the turn is discarded with it; nothing of it was recorded)."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        from tandem.core.generation import Completion

        deadline = time.monotonic() + self.cfg.orchestrator.request_timeout_s
        while True:
            alive = [i for i in range(len(self.engines)) if not self.dead[i]]
            if not alive:
                dead = ", ".join(f"engine {i}" for i in range(len(self.engines)))
                return Completion([], [], [], "error", f"no live engine ({dead} died)")
            now = time.monotonic()
            ready = [i for i in alive if self.unavailable_until[i] <= now]
            if not ready:
                if now >= deadline:
                    return Completion([], [], [], "error", "every live engine is restarting")
                await asyncio.sleep(UNAVAILABLE_RETRY_S)
                continue
            i = min(ready, key=lambda j: self.outstanding[j])
            self.outstanding[i] += 1
            ref = self.engines[i].generate.remote(request)
            try:
                return await ref
            except asyncio.CancelledError:  # e.g. the rollout of an external harness ended (gateway revoke)
                ray.cancel(ref)  # the engine actor's task ends; the engine drops the request if not started
                raise
            except ActorUnavailableError:  # its process died and Ray restarts it: try again shortly
                self.unavailable_until[i] = time.monotonic() + UNAVAILABLE_RETRY_S
            except (ActorDiedError, RayActorError) as e:
                self.dead[i] = True
                self.errors.append(f"engine {i} died: {e}")
            finally:
                self.outstanding[i] -= 1

    async def produce(self, producer: str = "", task_cursor: int = 0) -> str | None:
        """Loop until stopped: take a credit, run a group, put it in the buffer. Returns why it stopped on
        its own (None when stopped, or when the buffer closed); the driver stops the run then. ``producer``
        names this call in the buffer's credit accounting (the driver reclaims its credits if this process
        dies); ``task_cursor`` is where the task stream goes on (a restarted worker: the cursor it last
        reported, see ``TaskStream``)."""
        self.stream.skip_to(task_cursor)
        self.running = True
        limit = asyncio.Semaphore(self.cfg.rollout.groups_in_flight)
        while self.running:
            await limit.acquire()
            if all(self.dead):
                self.errors.append("every engine is dead; this worker stops producing")
                return "every engine is dead"
            if not self.running or not await self.buffer.acquire_credit.remote(producer):
                limit.release()
                break
            task = next(self.stream)
            t = asyncio.create_task(self._one_group(task, limit, producer))
            self.inflight.add(t)
            t.add_done_callback(self.inflight.discard)
        return None

    async def _one_group(self, task: Task, limit: asyncio.Semaphore, producer: str) -> None:
        from tandem.env.harness import session_error
        from tandem.rollout.worker import MAX_TASK_ATTEMPTS

        try:
            group = await asyncio.wait_for(
                self.worker.run_group(task), timeout=self.cfg.orchestrator.request_timeout_s
            )
            failed = [t for t in group.trajectories if t.flags.get("engine_error")]
            if failed:
                raise RuntimeError(f"a session of the group failed: {session_error(failed[0])}")
            reasons = [session_error(t) for t in group.trajectories]
            if all(reasons):
                raise RuntimeError(f"no session of the group left anything to train on: {reasons[0]}")
            await self.buffer.put.remote(group, producer)
        except Exception as e:  # noqa: BLE001 - requeue and keep producing
            reason = f"group {task.id}: {type(e).__name__}: {e}"
            if not self.stream.requeue(task):
                reason += f" (task dropped after {MAX_TASK_ATTEMPTS} failed attempts)"
            self.errors.append(reason)
            await asyncio.sleep(1.0)  # back off so a broken engine does not turn into a busy loop
            await self.buffer.failed.remote(reason, producer)
        finally:
            limit.release()

    async def stop(self) -> None:
        self.running = False
        for t in list(self.inflight):
            t.cancel()

    async def shutdown(self) -> None:
        """Stop producing, remove every sandbox, layer cache and ``/etc`` copy this process made, then exit
        it. The removal happens before this call returns: the caller kills the actor right after, which
        could cut its exit hooks short (``ray.kill`` alone left them all to the next run's sweep)."""
        from tandem.sandbox.cleanup import release_now

        await self.stop()
        if self.inflight:  # let the cancelled sessions close their own sandboxes first
            await asyncio.wait(list(self.inflight), timeout=10)
        await asyncio.to_thread(release_now)
        ray.actor.exit_actor()

    async def evaluate(
        self, tasks: list[Task], samples_per_task: int, temperature: float, ks: tuple[int, ...]
    ):
        from tandem.rollout import evaluate

        return await evaluate(self.worker, tasks, samples_per_task, ks, temperature, concurrency=16)

    async def get_errors(self) -> list[str]:
        return list(self.errors)

    async def ping(self) -> int:
        """Answers at once while the process runs (its sessions' blocking work runs on threads): the
        driver kills and restarts a worker that does not (``RolloutCrew.check``). The answer is the task
        stream's cursor (``TaskStream.cursor``), which the driver keeps for a restart and a checkpoint."""
        return self.stream.cursor


@ray.remote(num_cpus=0)
class RelayActor:
    """One region's relay: fetches each blob once from upstream and serves the region's engines."""

    def __init__(self, upstream: list[str], cache_dir: str, bandwidth_mbps: float = 0.0) -> None:
        from tandem.weights import Relay
        from tandem.weights.ratelimit import mbps_to_bytes_per_s

        limit = mbps_to_bytes_per_s(bandwidth_mbps) if bandwidth_mbps > 0 else None
        self.relay = Relay(
            upstream, cache_dir, host="127.0.0.1", port=0, upstream_bandwidth_bytes_per_s=limit
        )
        freeze_heap()

    def url(self) -> str:
        return self.relay.url

    def stats(self) -> dict[str, Any]:
        return dict(self.relay.stats())

    async def until_dead(self) -> None:
        """Never returns: the driver keeps one call pending and watches it with ``ray.wait`` (no waiting);
        it fails with ``ActorDiedError`` once this relay is gone (``WeightPath`` reports it in ``lost``).
        The one ``async`` method makes this an async actor: ``url`` and ``stats`` run on its event loop,
        beside this call."""
        await asyncio.Event().wait()


@ray.remote(num_cpus=0)
class HostLeaderActor:
    """A host's weight leader (``tandem.weights.hostlead.HostLeader``): advances the host share's shadow and
    writes each step's patch for the host's engines."""

    def __init__(self, urls: list[str], share: str, nice: int = 10) -> None:
        from tandem.weights.hostlead import HostLeader

        self.leader = HostLeader(urls, share, nice=nice)
        freeze_heap()

    async def advance(self, version: int) -> dict[str, Any]:
        return await asyncio.to_thread(self.leader.advance, version)

    def stats(self) -> dict[str, float]:
        return dict(self.leader.stats)


@ray.remote(num_cpus=0)
class TrainerActor:
    """Owns the policy's fp32 master weights and optimizer; steps on groups and publishes updates."""

    def __init__(
        self, cfg: RunConfig, model_path: str, resume_dir: str | None = None, store: str | None = None
    ) -> None:
        _set_threads(cfg.train.threads)
        from tandem.train import Trainer

        # The delta path publishes bf16 (few elements change per step); the object store the engine dtype.
        dtype = "bfloat16" if store else cfg.model.dtype
        self.trainer = Trainer(model_path, cfg.train, publish_dtype=dtype)
        if resume_dir:
            self.trainer.load_checkpoint(resume_dir)
        self.publisher = self.server = None
        if store:
            from tandem.weights import WeightStore, serve_store
            from tandem.weights.publish import WeightPublisher

            w = cfg.weights
            st = WeightStore.open(store, create=True, snapshot_every=w.snapshot_every)
            latest = st.latest()
            if latest is not None and latest >= self.trainer.version:
                st.close()
                raise RuntimeError(
                    f"weight store {store} already holds version {latest} (this run starts at "
                    f"{self.trainer.version}); give weights.store an empty location"
                )
            self.publisher = WeightPublisher(st, threads=w.codec_threads, keep_versions=w.keep_versions)
            self.server = serve_store(st, host="127.0.0.1", port=0)
        freeze_heap()

    def weights_url(self) -> str:
        assert self.server is not None
        return self.server.url

    def publish_to_store(self) -> dict[str, Any]:
        """Encode the current version as a delta (or snapshot) into the store; returns the publish report."""
        assert self.publisher is not None
        t0 = time.perf_counter()
        report = self.publisher.publish(self.trainer.version, self.trainer.publish_state())
        return {
            "version": report.version, "kind": report.kind, "nbytes": report.nbytes,
            "raw_bytes": report.raw_bytes, "encode_s": report.encode_s,
            "publish_s": time.perf_counter() - t0,
        }  # fmt: skip

    def close_store(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.publisher is not None:
            self.publisher.store.close()

    def version(self) -> int:
        return self.trainer.version

    def node_id(self) -> str:
        """The Ray node this trainer runs on (engines on it keep their loop unboosted: ``place_loop``)."""
        return ray.get_runtime_context().get_node_id()

    def step(self, groups: list[Group]) -> dict[str, Any]:
        return self.trainer.step(groups)

    def publish(self) -> WeightUpdate:
        from tandem.weights import make_update

        return make_update(self.trainer.version, self.trainer.publish_state())

    def save_checkpoint(self, path: str, run_state: dict[str, Any] | None = None) -> None:
        self.trainer.save_checkpoint(path, run_state)

    def export_model(self, path: str) -> None:
        self.trainer.export_model(path)
