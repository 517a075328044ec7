"""The engine fleet tells a hung engine from one that is late only because the hung one holds what it waits
for: real trainer and engine actors on a real weight store and host share, one engine stopped (SIGSTOP)
while it holds the share's lock."""

import contextlib
import os
import signal

import pytest
import ray

from tandem.cli.main import build_config
from tandem.orchestrator.actors import EngineActor, TrainerActor
from tandem.orchestrator.fleet import EngineFleet


def _hold_lock_and_stop(actor, lock_path: str) -> None:
    """In an engine actor's process: take the host share's exclusive lock, then stop the process."""
    import fcntl

    actor.held_lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(actor.held_lock_fd, fcntl.LOCK_EX)
    os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.slow
def test_an_engine_blocked_by_a_stopped_one_is_not_killed_with_it(tmp_path, joined_ray):
    """Engine 1 stops holding the share's lock; engine 0's sync needs the lock to lead the version, so both
    miss the deadline. Before, both were killed as hung and the run ended ("every engine died"). Now the
    late engines are pinged: engine 1 does not answer and is killed, which frees the lock, and engine 0,
    which answered, gets another period and finishes its sync."""
    cfg = build_config("smoke", None, ["engine.num_engines=2"])
    ray.init(address=joined_ray)
    stopped: dict = {}
    try:
        trainer = TrainerActor.remote(cfg, cfg.model.path, None, str(tmp_path / "weights"))
        engines = [EngineActor.remote(cfg, seed=i) for i in range(2)]
        ray.get(trainer.publish_to_store.remote())
        url = ray.get(trainer.weights_url.remote())
        share = tmp_path / "share"
        ray.get([e.connect_weights.remote([url], str(share)) for e in engines])
        stopped["pid"] = ray.get(engines[1].__ray_call__.remote(lambda _: os.getpid()))
        share.mkdir(mode=0o700, exist_ok=True)
        engines[1].__ray_call__.remote(_hold_lock_and_stop, str(share / "lock"))
        fleet = EngineFleet(engines, answer_within_s=10)
        results = fleet.gather(fleet.call("follow", 0))
        assert list(results) == [0] and results[0]["version"] == 0
        assert fleet.lost == ["engine 1 hung (did not answer a ping within 10 s; killed)"]
        assert [i for i, _ in fleet.live()] == [0]
        assert ray.get(engines[0].stats.remote())["weights"]["recoveries"] == 0
    finally:
        if "pid" in stopped:  # never leave a stopped process behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped["pid"], signal.SIGKILL)
        ray.shutdown()


@pytest.mark.slow
def test_an_automatic_loop_boost_applies_only_away_from_the_trainer(joined_ray):
    """``engine.loop_priority_boost`` unset (automatic): a run's engine starts with its loop at its process's
    niceness (it may sit beside the trainer); told that the trainer is on its own node it stays there, told
    that the trainer is on another node its loop is raised by ``AUTO_LOOP_PRIORITY_BOOST`` (root here)."""
    from tandem.core.config import AUTO_LOOP_PRIORITY_BOOST

    cfg = build_config("smoke", None, [])
    assert cfg.engine.loop_priority_boost is None
    ray.init(address=joined_ray)
    try:
        engine = EngineActor.remote(cfg, seed=0)
        proc_nice = ray.get(engine.__ray_call__.remote(lambda _: os.getpriority(os.PRIO_PROCESS, 0)))
        assert ray.get(engine.stats.remote())["loop_nice"] == proc_nice
        fleet = EngineFleet([engine], answer_within_s=30)
        fleet.place(ray.get_runtime_context().get_node_id())  # one node: the trainer would be here
        assert ray.get(engine.stats.remote())["loop_nice"] == proc_nice
        fleet.place("f" * 56)  # a node id that is not this one
        boosted = max(-20, proc_nice - AUTO_LOOP_PRIORITY_BOOST)
        assert ray.get(engine.stats.remote())["loop_nice"] == (boosted if os.geteuid() == 0 else proc_nice)
        assert fleet.trainer_node == "f" * 56  # told again to an engine restarted later
    finally:
        ray.shutdown()
