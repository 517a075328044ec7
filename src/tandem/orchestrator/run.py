"""The training run: the picture of design section 1 as code.

    tasks -> rollout workers -> engines;  workers -> buffer -> trainer -> weight update -> engines

Invariants:
- ``mode="async"``: workers keep generating while the trainer steps; a batch is taken as soon as
  ``groups_per_step`` fresh groups exist; staleness is bounded by credits and enforced at ``take``.
- ``mode="sync"``: one batch of groups is generated on version v, then trained, then every engine is
  updated to v+1 before the next batch starts (the comparison baseline).
- Every step appends one line to ``metrics.jsonl``; checkpoints are atomic; ``resume`` continues from the
  latest checkpoint's version with the same config.
- Faults: an engine whose process dies is restarted up to ``orchestrator.engine_restarts`` times and
  brought to the run's version before it serves again; the run goes on without an engine dead for good (or
  hung) while another lives, and without a dead host leader (``EngineFleet``, ``WeightPath``; each loss or
  restart is noted on the progress line, losses are counted in the metrics row's ``engines_alive``, and
  both are listed in the report). A rollout worker whose process dies has its groups' credits
  reclaimed and is restarted up to ``orchestrator.worker_restarts`` times, then left out; the run stops,
  naming it, only when no worker is left (``RolloutCrew``; restarts and losses are noted and reported like
  the engines'). A dead buffer or trainer stops the run at once with an error naming it.
"""

from __future__ import annotations

import json
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from tandem.core.config import RunConfig, dump_config
from tandem.core.errors import TandemError
from tandem.core.procs import busy_cores, cpu_ticks
from tandem.core.stopping import StoppedError, StopRequested, raise_if_stopping, stop_on_signals
from tandem.env.harness import TRUNCATION_CAUSES
from tandem.orchestrator.actors import BufferActor, EngineActor, RolloutActor, TrainerActor
from tandem.orchestrator.crew import RolloutCrew
from tandem.orchestrator.fleet import CHECK_EVERY_S, EngineFleet
from tandem.orchestrator.metrics import MetricsLogger, ProgressLine
from tandem.orchestrator.rundir import check_run_dir, previous_run
from tandem.orchestrator.samples import sample_rows
from tandem.orchestrator.weightpath import WeightPath

STOP_WAIT_S = 30.0
"""How long stopping waits for each of: the workers to stop, the stop's checkpoint, the workers to exit."""
MISMATCH_STEPS = 3
"""Steps whose (p_sampler, p_trainer) pairs the run keeps for the report (at most 2000 pairs each)."""
BUFFER_NAME = "tandem-buffer"
"""The buffer actor's name; rollout workers look it (and the engines, ``tandem-engine-N``) up by name."""


@dataclass
class RunResult:
    """What a finished run measured (also written to the run directory)."""

    steps: int
    version: int
    wall_s: float
    samples: int
    trainer_busy: float
    engine_busy: float
    staleness_hist: dict[str, int]
    eval_before: dict[str, Any] | None = None
    eval_after: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    mismatch_pairs: list[list[float]] = field(default_factory=list)
    """[p_sampler, p_trainer] token pairs of the last ``MISMATCH_STEPS`` steps (subsampled by the trainer),
    for the report's scatter plot; not in ``metrics.jsonl``."""
    machine_busy_cores: float | None = None
    """Mean number of the driver machine's cores busy (all its processes, tandem's or not) during the
    training loop; None where ``/proc/stat`` cannot be read."""
    lost: list[str] = field(default_factory=list)
    """The actors the run lost and went on without (an engine or rollout worker dead for good, a hung
    engine, the host leader, a relay), one line each."""
    restarted: list[str] = field(default_factory=list)
    """Each restart of an engine or rollout worker whose process died, one line each."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.wall_s, 1e-9)


def heldout_tasks(cfg: RunConfig):
    from tandem.env.sources import tasks_for
    from tandem.rollout.worker import apply_limits

    return [apply_limits(t, cfg) for t in tasks_for(cfg.tasks, "heldout", cfg.tasks.heldout_size)]


def cluster_address(cfg: RunConfig) -> str | None:
    """The Ray cluster a run joins: ``orchestrator.ray_address``, else the ``RAY_ADDRESS`` environment
    variable (Ray's own convention), else none (the run starts a local cluster of its own)."""
    import os

    return cfg.orchestrator.ray_address or os.environ.get("RAY_ADDRESS") or None


def _check_reachable(address: str, source: str, timeout_s: float = 10.0) -> None:
    """Refuse a ``host:port`` address whose port takes no connection within ``timeout_s``: ``ray.init``
    waits for such a cluster for over 10 minutes. Other forms (``auto``, ``ray://...``) are left to Ray."""
    import re
    import socket

    match = re.fullmatch(r"\[?([\w.\-:]+?)\]?:(\d+)", address)
    if match is None:
        return
    try:
        with socket.create_connection((match[1], int(match[2])), timeout=timeout_s):
            return
    except OSError as e:
        raise TandemError(
            f"no Ray cluster answers at {address!r} ({source}): {e}. Pass the address `ray status` prints on "
            "the cluster's head node, or unset it to start a local cluster"
        ) from e


def init_ray(cfg: RunConfig) -> None:
    """Start a local Ray cluster sized for the run's actors, or join the one ``cluster_address`` names.

    A joined cluster must have the CPUs the run's actors ask for (``train.threads`` plus ``engine.threads``
    per engine), or the actors would wait for ever to be placed: the run refuses it, naming the numbers."""
    import os

    if ray.is_initialized():
        return
    needed = cfg.train.threads + cfg.engine.threads * cfg.engine.num_engines
    address = cluster_address(cfg)
    if not address:
        # "local": a cluster of the run's own, even where `ray start` left /tmp/ray/ray_current_cluster,
        # which a bare ray.init() would join (and then refuse num_cpus)
        cpus = max(os.cpu_count() or 1, needed)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
        return
    source = "orchestrator.ray_address" if cfg.orchestrator.ray_address else "RAY_ADDRESS in the environment"
    _check_reachable(address, source)
    try:
        ray.init(address=address, log_to_driver=True)
    except (ConnectionError, ValueError) as e:
        raise TandemError(
            f"could not join the Ray cluster at {address!r} ({source}): {e}. Check the address (`ray status` "
            "on the cluster prints it); a cluster with Ray's token authentication on also needs "
            "RAY_AUTH_MODE=token here. Without an address the run starts a local cluster"
        ) from e
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < needed:
        ray.shutdown()
        raise TandemError(
            f"the Ray cluster at {address!r} ({source}) has {cpus:g} CPUs and this run's actors ask for "
            f"{needed} (train.threads={cfg.train.threads} + engine.threads={cfg.engine.threads} x "
            f"engine.num_engines={cfg.engine.num_engines}); lower those or add nodes to the cluster"
        )


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, quiet: bool = False) -> RunResult:
    """Run RL training as configured; returns what it measured and writes the run directory."""
    from tandem.engine.choice import resolve_run_engine
    from tandem.train.checkpoint import latest_checkpoint, read_state, verify_files

    cfg, changed = check_run_dir(cfg, run_dir, resume)  # a new run never mixes with an old one
    resume_dir, task_cursor = None, 0
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            if previous_run(run_dir) is None:
                raise FileNotFoundError(
                    f"--resume: no checkpoint under {run_dir / 'checkpoints'}; start without it"
                )
            # e.g. a run that failed before its first checkpoint: a new run refuses its metrics rows, so
            # "start without it" would only send the user back here
            raise TandemError(
                f"--resume: {run_dir} holds a run that stopped before its first checkpoint "
                f"(train.checkpoint_every={cfg.train.checkpoint_every}), so there is nothing to continue; "
                f"start it over with a new --run-dir, or remove {run_dir} first"
            )
        resume_dir = str(ckpt)
        state = read_state(ckpt)
        verify_files(ckpt, state)  # here, naming the file, not in an actor's traceback after Ray started
        done = int(state["version"])
        task_cursor = state.get("task_cursor", 0)
        if not isinstance(task_cursor, int) or isinstance(task_cursor, bool) or task_cursor < 0:
            raise TandemError(
                f"--resume: {ckpt}/trainer_state.json has task_cursor={task_cursor!r}, not an index >= 0; "
                "remove the field to draw tasks from tasks.train_start again"
            )
        if done >= cfg.orchestrator.steps:
            raise TandemError(
                f"--resume: the run's latest checkpoint is at step {done} and orchestrator.steps="
                f"{cfg.orchestrator.steps}, so there is nothing left to train; pass --set "
                f"orchestrator.steps=N with N > {done}"
            )
    cfg, engine_reason = resolve_run_engine(cfg)  # engine.kind 'auto' -> the engine every actor runs
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(cfg))
    init_ray(cfg)
    st = _RunState(run_dir)
    st.task_cursor = task_cursor
    with stop_on_signals() as stop:
        try:
            return _run(cfg, run_dir, resume, resume_dir, changed, engine_reason, quiet, st)
        except StopRequested as e:
            _stop(st, e.signum)
            raise AssertionError("unreachable: _stop raises") from e
        except Exception as e:  # after the loop (final evaluation, report): a stop signal's mangled exception
            if stop.signum is None:
                raise
            _stop(st, stop.signum)
            raise AssertionError("unreachable: _stop raises") from e


@dataclass
class _RunState:
    """What a run has started and reached so far, for the stop path (``_stop``) to save and release."""

    run_dir: Path
    trainer: Any = None
    buffer: Any = None
    weights: WeightPath | None = None
    engines: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    logger: MetricsLogger | None = None
    step: int = 0
    """The last step whose metrics row was logged (its version is the trainer's)."""
    saved_step: int | None = None
    """The step of the newest checkpoint on disk (the resumed one, a periodic one or the final one)."""
    finished: bool = False
    """The training loop is over and its final checkpoint and model are written."""
    crew: RolloutCrew | None = None
    task_cursor: int = 0
    """Where the workers' task streams start: 0, or a resumed checkpoint's ``task_cursor``."""

    def run_state(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """What a checkpoint keeps for the run that resumes from it (``Trainer.save_checkpoint``)."""
        cursor = self.crew.task_cursor(timeout_s) if self.crew is not None else self.task_cursor
        return {"task_cursor": max(cursor, self.task_cursor)}

    def actors(self) -> list:
        extra = self.weights.actors() if self.weights is not None else []
        return [a for a in (*self.workers, *self.engines, self.trainer, self.buffer, *extra) if a is not None]

    def release(self) -> None:
        """Close the metrics log, stop every actor (workers and engines release what they hold first) and
        remove the host share; never raises."""
        if self.logger is not None:
            self.logger.close()
        _teardown(self.actors(), [*self.workers, *self.engines])
        if self.weights is not None:
            self.weights.remove_share()


def _run(
    cfg: RunConfig, run_dir: Path, resume: bool, resume_dir: str | None, changed: list[str],
    engine_reason: str, quiet: bool, st: _RunState,
) -> RunResult:  # fmt: skip
    o, b = cfg.orchestrator, cfg.train.groups_per_step
    st.weights = weights = WeightPath(cfg, run_dir, resume)
    st.trainer = trainer = TrainerActor.options(num_cpus=cfg.train.threads).remote(
        cfg, cfg.model.path, resume_dir, weights.trainer_store()
    )
    st.buffer = buffer = BufferActor.options(name=BUFFER_NAME).remote(o.buffer_max_groups)
    try:
        # Every actor starts at once (each start is mostly imports and model loading); the engines are
        # connected to the trainer's weight store once it serves. Smoke preset here: 7.1 s from ray.init
        # to every actor started, 10.0 s when the engines started only once the trainer served.
        engine_names = [f"tandem-engine-{i}" for i in range(cfg.engine.num_engines)]
        st.engines = engines = [
            EngineActor.options(
                num_cpus=cfg.engine.threads, name=name, max_restarts=o.engine_restarts
            ).remote(cfg, seed=cfg.train.seed + i)
            for i, name in enumerate(engine_names)
        ]
        st.workers = workers = [
            RolloutActor.options(name=f"tandem-rollout-{i}", max_restarts=o.worker_restarts).remote(
                cfg, engine_names, BUFFER_NAME, i, cfg.rollout.num_workers, st.task_cursor
            )
            for i in range(cfg.rollout.num_workers)
        ]
        st.crew = crew = RolloutCrew(workers, buffer, o.worker_restarts, o.request_timeout_s, st.task_cursor)
        fleet = EngineFleet(engines, o.request_timeout_s, o.engine_restarts)
        weights.connect(trainer, fleet, run_dir)
        # Wait until every actor has finished starting, so the clock below measures steady-state work.
        ray.get([e.stats.remote() for e in engines] + [w.get_errors.remote() for w in workers])
        fleet.place(ray.get(trainer.node_id.remote()))  # engines away from the trainer boost their loops
        version = ray.get(trainer.version.remote())
        st.step = version
        st.saved_step = version if resume else None
        # Engines serve the starting version exactly as published (resumed runs: the checkpoint's weights).
        if weights.delta or version > 0:
            weights.start(trainer, version)
    except Exception as e:
        raise_if_stopping(e)  # a stop signal's exception, mangled by C code
        st.release()
        cause = getattr(e, "cause", None) or e
        raise TandemError(f"the run could not start: {type(cause).__name__}: {cause}") from e

    st.logger = logger = MetricsLogger(run_dir, append=resume)
    progress = ProgressLine(o.steps, quiet=quiet)
    progress.note(f"engine: {cfg.engine.kind} ({engine_reason})")
    if changed:
        progress.note("resuming with settings that differ from the run's config.toml: " + "; ".join(changed))
    eval_tasks = heldout_tasks(cfg)
    eval_before = None
    if cfg.eval.before_after and not resume:
        progress.note("evaluating the starting model on the held-out split")
        try:
            eval_before = _evaluate(cfg, crew.live()[0], eval_tasks)
        except Exception as e:
            raise_if_stopping(e)  # a stop signal's exception, mangled by C code
            st.release()
            cause = getattr(e, "cause", None) or e
            raise TandemError(f"evaluating the starting model failed: {cause}") from e
        (run_dir / "eval_before.json").write_text(json.dumps(eval_before, indent=2))

    ray.get(buffer.grant.remote((o.max_staleness + 1) * b if o.mode == "async" else b))
    crew.start()  # each worker's produce returns only when the worker stops or dies

    hist: dict[str, int] = {}
    history: list[dict[str, Any]] = []
    recent_pairs: deque[list[list[float]]] = deque(maxlen=MISMATCH_STEPS)
    samples_total, trainer_busy_s = 0, 0.0
    engine0 = fleet.totals()
    engine_last = engine0
    ticks0 = cpu_ticks()
    start = time.monotonic()
    step = version
    noted: set[str] = set()

    fleet.on_progress = lambda: buffer.restart_idle_clock.remote()  # an engine restarting is progress

    def check_engines() -> None:
        """While waiting for groups: remove hung engines (``EngineFleet.check``) and kill hung rollout workers
        for a restart (``RolloutCrew.check``); the groups stuck on either are requeued then, so ``take``'s
        idle clock restarts."""
        if fleet.check() | crew.check():
            ray.get(buffer.restart_idle_clock.remote())

    try:
        while step < o.steps:
            if o.time_budget_s and time.monotonic() - start > o.time_budget_s:
                break
            t_wait = time.monotonic()
            groups, info = crew.take(
                b, version, o.max_staleness, o.request_timeout_s, on_wait=check_engines, every_s=CHECK_EVERY_S
            )
            wait_s = time.monotonic() - t_wait
            if o.mode == "async":
                buffer.grant.remote(b)
            t_train = time.monotonic()
            metrics = ray.get(trainer.step.remote(groups))
            recent_pairs.append(metrics.pop("mismatch_pairs", []))  # not a metric: kept for the report only
            sync_metrics = weights.after_step(trainer, step + 1, wait=o.mode == "sync")
            train_s = time.monotonic() - t_train
            version = step = step + 1
            if o.mode == "sync":
                buffer.grant.remote(b)
            trainer_busy_s += metrics.get("step_time_s", train_s)
            samples = sum(len(g.trajectories) for g in groups)
            samples_total += samples
            for lag in info["staleness"]:
                hist[str(lag)] = hist.get(str(lag), 0) + 1
            elapsed = time.monotonic() - start
            engine_now = fleet.totals()
            engine_busy = (engine_now["busy_s"] - engine0["busy_s"]) / max(elapsed * len(engines), 1e-9)
            row = _step_row(
                step, version, groups, metrics, info, samples, samples_total, elapsed, trainer_busy_s
            )
            row.update(engine_busy=engine_busy, wait_s=wait_s, **_prefill_row(engine_last, engine_now))
            cores = busy_cores(ticks0, cpu_ticks())
            if cores is not None:
                row["machine_busy_cores"] = cores
            row.update(sync_metrics, engines_alive=len(fleet.live()))
            restarted = [*fleet.restarted, *crew.restarted]
            for line in [*fleet.lost, *weights.lost, *crew.lost, *restarted]:
                if line not in noted:
                    noted.add(line)
                    progress.note(f"{'' if line in restarted else 'lost '}{line}; the run goes on")
            engine_last = engine_now
            logger.log(row)
            logger.log_samples(sample_rows(step, groups, o.samples_per_step))
            st.step = step
            history.append(row)
            progress.update(row)
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                ray.get(trainer.save_checkpoint.remote(str(_checkpoint_dir(run_dir, step)), st.run_state()))
                st.saved_step = step
    except Exception as e:
        raise_if_stopping(e)  # a stop signal's exception, mangled by C code
        errors = _collect_errors(workers, wait_s=10.0)
        if errors:
            (run_dir / "rollout_errors.log").write_text("\n".join(errors))
        st.release()
        cause = getattr(e, "cause", None) or e
        saved = (
            f"the latest checkpoint is {_checkpoint_dir(run_dir, st.saved_step)}; continue with "
            f"`tandem train --run-dir {run_dir} --resume`"
            if st.saved_step
            else "no checkpoint was written, so the run starts over in a new --run-dir"
        )
        raise TandemError(
            f"training stopped at step {step}: {type(cause).__name__}: {cause}"
            + (f" (last rollout error: {errors[-1]})" if errors and errors[-1] not in str(cause) else "")
            + f". {saved}"
        ) from e
    wall = time.monotonic() - start
    machine_cores = busy_cores(ticks0, cpu_ticks())
    engine_busy = (fleet.totals()["busy_s"] - engine0["busy_s"]) / max(wall * len(engines), 1e-9)
    weights.finish(trainer)
    ray.get([w.stop.remote() for w in crew.live()])
    ray.get(buffer.close.remote())
    errors = _collect_errors(crew.live())
    if errors:
        (run_dir / "rollout_errors.log").write_text("\n".join(errors))
    ray.get(trainer.save_checkpoint.remote(str(_checkpoint_dir(run_dir, step)), st.run_state()))
    st.saved_step = step
    ray.get(trainer.export_model.remote(str(run_dir / "final_model")))
    st.finished = True

    eval_after = None
    if cfg.eval.before_after:
        progress.note("evaluating the final model on the held-out split")
        try:
            eval_after = _evaluate(cfg, crew.live()[0], eval_tasks)
        except Exception as e:  # e.g. the last engine died: what training wrote is complete, say so
            raise_if_stopping(e)  # a stop signal's exception, mangled by C code
            st.release()
            cause = getattr(e, "cause", None) or e
            raise TandemError(
                f"training finished ({_checkpoint_dir(run_dir, step)} and {run_dir / 'final_model'} are "
                f"written), but evaluating the final model failed: {type(cause).__name__}: {cause}; "
                f"`tandem eval --model {run_dir / 'final_model'}` evaluates it again"
            ) from e
        (run_dir / "eval_after.json").write_text(json.dumps(eval_after, indent=2))
    result = RunResult(
        steps=len(history),
        version=version,
        wall_s=wall,
        samples=samples_total,
        trainer_busy=trainer_busy_s / max(wall, 1e-9),
        engine_busy=engine_busy,
        staleness_hist=hist,
        eval_before=eval_before,
        eval_after=eval_after,
        history=history,
        mismatch_pairs=[p for pairs in recent_pairs for p in pairs],
        machine_busy_cores=machine_cores,
        lost=[*fleet.lost, *weights.lost, *crew.lost],
        restarted=[*fleet.restarted, *crew.restarted],
    )
    st.release()
    from tandem.orchestrator.report import write_report

    write_report(run_dir, result, cfg)
    return result


def _checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _stop(st: _RunState, signum: int) -> None:
    """The stop path (``tandem.core.stopping``): stop producing, checkpoint the trainer's version
    (after a step it was running finishes) unless a checkpoint of it exists, release everything, then raise
    ``StoppedError`` saying what was saved and how to continue. A second signal cuts it short (the handlers
    from before the run are back)."""
    name = signal.Signals(signum).name
    if st.workers:
        try:
            ray.get([w.stop.remote() for w in st.workers], timeout=STOP_WAIT_S)
        except Exception:  # noqa: BLE001 - a dead or stuck worker is released by the teardown below
            pass
    failed = ""
    version = st.step
    if st.trainer is not None and not st.finished:
        try:
            version = ray.get(st.trainer.version.remote(), timeout=STOP_WAIT_S)
            if version > 0 and version != st.saved_step:
                path = str(_checkpoint_dir(st.run_dir, version))
                run_state = st.run_state(timeout_s=min(STOP_WAIT_S, 5.0))
                ray.get(st.trainer.save_checkpoint.remote(path, run_state), timeout=STOP_WAIT_S)
                st.saved_step = version
        except Exception as e:  # noqa: BLE001 - said in the message; an older checkpoint stays usable
            failed = f"saving a checkpoint failed ({type(e).__name__}: {e}); "
    st.release()
    unlogged = (
        f" (step {version} finished after the signal: its metrics row was not written)"
        if version > st.step and st.saved_step == version
        else ""
    )
    if st.finished:
        what = (
            f"training had finished: the final checkpoint and {st.run_dir / 'final_model'} are written; the "
            "held-out evaluation and report.md were cut short"
        )
    elif st.saved_step:
        what = (
            f"{failed}the latest checkpoint is {_checkpoint_dir(st.run_dir, st.saved_step)}{unlogged}; "
            f"continue with `tandem train --run-dir {st.run_dir} --resume`"
        )
    else:
        what = (
            f"{failed}no step had finished, so there is no checkpoint; the same command (without --resume) "
            "starts the run over in this directory"
        )
    raise StoppedError(f"stopped by {name} after step {st.step}: {what}", signum)


def _collect_errors(workers, wait_s: float = 0.0) -> list[str]:
    """The errors the rollout workers recorded. ``wait_s > 0`` (the run is stopping on an error): poll until
    one is recorded or ``wait_s`` passed, because a worker learns that an engine died only when its own next
    request to it fails, which may come a moment after the orchestrator's own call to that engine failed."""
    end = time.monotonic() + wait_s
    while True:
        errors: list[str] = []
        for w in workers:
            try:
                errors += ray.get(w.get_errors.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - a dead worker is itself the error
                errors.append(f"rollout worker unreachable: {type(e).__name__}")
        if errors or time.monotonic() >= end:
            return errors
        time.sleep(0.2)


def _teardown(actors, graceful=()) -> None:
    """Stop every actor of the run; never raises (some may already be dead). The ``graceful`` ones (rollout
    workers and engines) first release what they hold outside their process (``shutdown``: sandboxes, layer
    caches and ``/etc`` copies; vLLM's engine core and rendezvous file), which ``ray.kill`` alone left to the
    next run's sweep or for good, for up to ``STOP_WAIT_S``; then every actor is killed."""
    if graceful:
        try:
            ray.wait([a.shutdown.remote() for a in graceful], num_returns=len(graceful), timeout=STOP_WAIT_S)
        except Exception:  # noqa: BLE001, S110 - killed below either way
            pass
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001, S110
            pass


def _evaluate(cfg: RunConfig, worker, tasks) -> dict[str, Any]:
    e = cfg.eval
    ks = tuple(k for k in (1, 2, 4, 8) if k <= e.samples_per_task)
    return ray.get(worker.evaluate.remote(tasks, e.samples_per_task, e.temperature, ks))


def _prefill_row(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """Since ``before``: prompt tokens the engines computed, the fraction of prompt tokens they reused, and
    sampled tokens per decode step (the mean decode batch: a step costs nearly as much for one session as for
    dozens on a small model, so this says how well the engines' time is used)."""
    prefill = now["prefill_tokens"] - before["prefill_tokens"]
    hit = now["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    steps = now["steps"] - before["steps"]
    sampled = now["tokens_generated"] - before["tokens_generated"]
    return {
        "engine_prefill_tokens": prefill,
        "engine_prefix_hit_frac": hit / max(prefill + hit, 1.0),
        "engine_batch_mean": sampled / steps if steps else 0.0,
    }


def _step_row(step, version, groups, metrics, info, samples, samples_total, elapsed, trainer_busy_s) -> dict:
    rewards = np.concatenate([g.rewards() for g in groups]) if groups else np.zeros(0)
    trajs = [t for g in groups for t in g.trajectories]
    staleness = info["staleness"] or [0]
    row = {
        "step": step,
        "version": version,
        "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        "pass_rate": float(np.mean([t.reward.components.get("pass_fraction", 0.0) >= 1.0 for t in trajs])),
        "samples": samples,
        "samples_total": samples_total,
        "samples_per_s": samples_total / max(elapsed, 1e-9),
        "staleness_max": int(max(staleness)),
        "staleness_mean": float(np.mean(staleness)),
        "dropped_stale": info["dropped_stale"],
        "trainer_busy": trainer_busy_s / max(elapsed, 1e-9),
        "elapsed_s": elapsed,
        "turns_mean": float(np.mean([t.tool_stats.get("turns", 0) for t in trajs])),
        "malformed_calls": int(sum(t.tool_stats.get("malformed_calls", 0) for t in trajs)),
        "truncated_frac": float(np.mean([t.flags.get("truncated", False) for t in trajs])),
        **{
            f"truncated_{c}_frac": float(np.mean([t.flags.get(f"truncated_{c}", False) for t in trajs]))
            for c in TRUNCATION_CAUSES
        },
        "submitted_frac": float(np.mean([t.flags.get("submitted", False) for t in trajs])),
        "tests_edited_frac": float(np.mean([t.flags.get("tests_edited", False) for t in trajs])),
        "limit_violation_frac": float(np.mean([t.flags.get("limit_violation", False) for t in trajs])),
        "symlinks_ignored_frac": float(np.mean([t.flags.get("symlinks_ignored", False) for t in trajs])),
        "snapshot_limited_frac": float(np.mean([t.flags.get("snapshot_limited", False) for t in trajs])),
        "harness_failed_frac": float(np.mean([t.flags.get("harness_failed", False) for t in trajs])),
        "no_requests_frac": float(np.mean([t.flags.get("no_requests", False) for t in trajs])),
        "harness_sampling_overridden_frac": float(
            np.mean([t.flags.get("harness_sampling_overridden", False) for t in trajs])
        ),
        "sampled_tokens": int(sum(t.num_sampled for t in trajs)),
    }
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and k not in row:
            row[f"train/{k}"] = float(v)
    return row
