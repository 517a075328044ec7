"""Process faults during a run: a dead engine's groups fail and are requeued; the run goes on while another
engine lives (and without its host leader), and stops with an error naming what died otherwise, never
hanging."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from tandem.cli.main import build_config
from tandem.core.errors import TandemError
from tandem.orchestrator import train
from tandem.weights.hostshare import default_share_root

from .conftest import actor_pid, at_first_step, tandem_debris, train_then_release


def _kill_after_first_step(
    run_dir: Path, names: list[str], killed: dict, when: str = "metrics.jsonl"
) -> threading.Thread:
    """A thread that ``ray.kill``s the named actors once the run has written ``when`` (by default, once its
    first metrics row is written)."""

    def killer():
        for name in names:
            ray.kill(ray.get_actor(name))
        killed["at"] = time.monotonic()

    return at_first_step(run_dir, killer, when)


@pytest.mark.slow
def test_killing_the_only_engine_ends_the_run_with_an_error(tmp_path, joined_ray):
    cfg = build_config(
        "smoke",
        None,
        ["orchestrator.steps=50", "orchestrator.request_timeout_s=20", "eval.before_after=false"],
    )
    killed = {}

    def killer():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (Path(tmp_path) / "metrics.jsonl").exists() and (tmp_path / "metrics.jsonl").read_text():
                ray.kill(ray.get_actor("tandem-engine-0"))
                killed["at"] = time.monotonic()
                return
            time.sleep(0.5)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        with pytest.raises(TandemError, match="training stopped at step"):
            train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
    assert "at" in killed
    assert time.monotonic() - killed["at"] < 120
    log = (tmp_path / "rollout_errors.log").read_text()
    assert "engine 0 died" in log


@pytest.mark.slow
def test_a_run_goes_on_without_a_dead_engine_and_its_host_leader(tmp_path, joined_ray):
    """Two engines and a host leader; one engine and the leader die after step 1. Before, the driver's next
    call to either (a weight sync, the engines' stats) ended the run, although the rollout workers route
    around a dead engine and the engines lead each step the leader does not take. The host share a
    SIGKILLed driver left in /dev/shm (a copy of the weights in memory) is removed, as nothing did before."""
    cfg = build_config(
        "smoke",
        None,
        [
            "orchestrator.steps=5",
            "engine.num_engines=2",
            "weights.host_leader=true",
            "eval.before_after=false",
        ],
    )
    gone = subprocess.run([sys.executable, "-c", "print(__import__('os').getpid())"], capture_output=True)
    stale = default_share_root() / f"tandem-share-{socket.gethostname()}-{int(gone.stdout)}-0123456789abcdef"
    stale.mkdir()
    (stale / "shadow.json").write_text("{}")
    before = tandem_debris()
    killed: dict = {}
    _kill_after_first_step(tmp_path, ["tandem-engine-1", "tandem-host-leader"], killed)
    try:
        result = train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
    assert "at" in killed
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and result.version == 5
    assert rows[0]["engines_alive"] == 2 and rows[-1]["engines_alive"] == 1
    assert [line.split(" (")[0] for line in result.lost] == ["engine 1 died", "the host leader died"]
    report = (tmp_path / "report.md").read_text()
    assert all(line in report for line in result.lost)
    assert tandem_debris() <= before  # the run's host share is removed as after any run
    assert not stale.exists()


def _hold_lock_and_stop(actor, lock_path: str) -> None:
    """In an engine actor's process: take the host share's exclusive lock, then stop the process."""
    import fcntl

    actor.held_lock_fd = os.open(lock_path, os.O_RDWR)
    fcntl.flock(actor.held_lock_fd, fcntl.LOCK_EX)
    os.kill(os.getpid(), signal.SIGSTOP)


@pytest.mark.slow
def test_a_hung_engine_is_killed_restarted_and_the_run_goes_on(tmp_path, joined_ray):
    """One of two engines is stopped (SIGSTOP: alive to Ray, answering nothing) after step 1, holding the
    host share's lock, which the other engine needs to lead the next step. Before, the driver's next weight
    sync or stats call to it waited for ever; then, with a deadline, the other engine, blocked on the lock,
    missed it too and was killed as hung, which ended the run ("every engine died"); and while the driver
    waited for groups, which all had a session stuck on the stopped engine, nothing looked at the engines
    until ``take`` timed out. Then the driver pinged the engines while it waited and at a missed deadline,
    and an engine that did not answer was killed and counted lost, restarts left or not. Now it is killed
    with its restart allowed (``orchestrator.engine_restarts``, 3 by default), as a hung rollout worker is:
    the other engine gets the lock and answers, the new process is brought to the run's version, and the
    run finishes on both engines. (Without restarts left it is lost: tests/orchestrator/test_fleet.py.)"""
    cfg = build_config(
        "smoke",
        None,
        [
            "orchestrator.steps=4",
            "orchestrator.mode=sync",
            "engine.num_engines=2",
            "orchestrator.request_timeout_s=20",
            "eval.before_after=false",
        ],
    )
    stopped: dict = {}

    def stopper():
        engine = ray.get_actor("tandem-engine-1")
        stopped["pid"] = actor_pid("tandem-engine-1")
        prefix = f"tandem-share-{socket.gethostname()}-{os.getpid()}-"
        (share,) = default_share_root().glob(prefix + "*")
        engine.__ray_call__.remote(_hold_lock_and_stop, str(share / "lock"))

    at_first_step(tmp_path, stopper)
    result = train_then_release(cfg, tmp_path, stopped)
    assert "pid" in stopped
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["engines_alive"] == 2 for r in rows)
    assert result.lost == []
    assert result.restarted == [
        "engine 1 died (hung: did not answer a ping within 10 s; killed); restarted and brought to the run's "
        "version (1 of orchestrator.engine_restarts=3)"
    ]


@pytest.mark.slow
def test_a_dead_rollout_worker_stops_the_run_at_once_naming_it(tmp_path, joined_ray):
    """Before, ``take`` waited out orchestrator.request_timeout_s for groups the dead worker held credits
    for, then blamed "engines or rollout workers"."""
    cfg = build_config(
        "smoke",
        None,
        ["orchestrator.steps=50", "orchestrator.request_timeout_s=600", "eval.before_after=false"],
    )
    killed: dict = {}
    _kill_after_first_step(tmp_path, ["tandem-rollout-0"], killed)
    try:
        with pytest.raises(
            TandemError, match="training stopped at step .*rollout worker 0 died: ActorDiedError"
        ):
            train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
    assert time.monotonic() - killed["at"] < 300  # only a hang check: before, it took the 600 s timeout


@pytest.mark.slow
def test_a_crashed_engine_and_then_a_hung_rollout_worker_are_restarted_and_the_run_goes_on(
    tmp_path, joined_ray
):
    """Two faults, one after the other, in one run (each run costs about 20 s of start-up here):

    1. The only engine's process is SIGKILLed after step 1 (a crash: Ray restarts it). Before, the run ended
       ("every engine died"; the actor was not restartable). Now the fleet waits for the new process, brings
       it to the run's newest version through the weight store and only then lets it serve (it loaded the
       starting weights, version 0); the requests the dead process was serving are sent again.
    2. Once the new engine serves, the only rollout worker is stopped (SIGSTOP), holding the credits of its
       groups. Before, the run waited out orchestrator.request_timeout_s and stopped ("no rollout group
       finished"). Now the driver pings the workers while it waits for groups; the silent one is killed with
       its restart allowed, its credits are reclaimed, and the run finishes on its new process.

    The run is synchronous, so the steps after the stop need groups the stopped worker has not made."""
    cfg = build_config(
        "smoke",
        None,
        [
            "orchestrator.steps=4",
            "orchestrator.mode=sync",
            "orchestrator.request_timeout_s=120",
            "eval.before_after=false",
            "train.checkpoint_every=0",
        ],
    )
    seen: dict = {}

    def crash_then_hang():
        engine = ray.get_actor("tandem-engine-0")
        seen["old_pid"] = actor_pid("tandem-engine-0")
        os.kill(seen["old_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until the restarted process serves
            with contextlib.suppress(Exception):
                answer = ray.get(engine.ping.remote(), timeout=10)
                if answer["pid"] != seen["old_pid"] and answer["serving"]:
                    seen["version"] = ray.get(engine.stats.remote(), timeout=10)["version"]
                    break
            time.sleep(0.05)
        else:
            return
        seen["steps_before_hang"] = len((tmp_path / "metrics.jsonl").read_text().splitlines())
        seen["pid"] = actor_pid("tandem-rollout-0")
        os.kill(seen["pid"], signal.SIGSTOP)

    watcher = at_first_step(tmp_path, crash_then_hang)
    result = train_then_release(cfg, tmp_path, seen)
    watcher.join(timeout=10)
    assert "old_pid" in seen and "pid" in seen, seen
    assert seen["version"] >= 1  # it served the run's weights from the start, not the starting ones
    assert seen["steps_before_hang"] < 4, seen  # the worker hung while the run still needed its groups
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["engines_alive"] == 1 for r in rows)
    assert result.lost == []
    engine, worker = result.restarted
    assert engine.startswith("engine 0 died (")
    assert engine.endswith("restarted and brought to the run's version (1 of orchestrator.engine_restarts=3)")
    assert worker.startswith(
        "rollout worker 0 died (hung: did not answer a ping within 10 s; killed; the credits of its"
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarted"] == result.restarted


@pytest.mark.slow
def test_an_engine_that_cannot_serve_is_restarted(tmp_path, joined_ray):
    """The only engine's serving loop is stopped after step 1: its process answers, but every request gets
    "engine stopped" (as a vLLM engine whose failed update could not be undone answers with its reason).
    Before, every group failed until the run stopped ("the last 16 rollout groups all failed"). Now the
    driver's ping sees ``ok: False``, kills the engine with its restart allowed and brings the new process to
    the run's version, and the run finishes.

    The run is synchronous, so steps 2 and 3 need groups started after the stop: in async mode groups made
    ahead could finish the run without a wait, so without a ping. (CI once saw ``restarted == []`` here; the
    cause was the engine's: a request that came while ``stop`` waited for the loop started the loop again.)"""
    cfg = build_config(
        "smoke",
        None,
        [
            "orchestrator.steps=3",
            "orchestrator.mode=sync",
            "eval.before_after=false",
            "train.checkpoint_every=0",
        ],
    )
    broke: dict = {}

    def breaker():
        engine = ray.get_actor("tandem-engine-0")
        broke["stopping"] = ray.get(engine.__ray_call__.remote(_stop_serving))

    at_first_step(tmp_path, breaker)
    try:
        result = train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
    assert broke["stopping"] is True
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and result.lost == []
    assert len(result.restarted) == 1
    assert result.restarted[0].startswith("engine 0 died (could not serve: its engine stopped; killed)")


def _stop_serving(actor) -> bool:
    """In an engine actor's process: stop its engine's serving loop, on a thread of its own. Run on the
    actor's event loop, a slow stop (once over 10 s on a loaded machine) kept the actor from answering the
    driver's ping, which then killed it as hung instead of finding it unable to serve."""
    import threading

    threading.Thread(target=actor.engine.stop, daemon=True).start()
    return True


@pytest.mark.slow
def test_a_crashed_rollout_worker_is_restarted_and_a_dead_one_left_out(tmp_path, joined_ray):
    """Two rollout workers after step 1: worker 1's process is SIGKILLed (a crash: Ray restarts it) and
    worker 0 is killed for good. Before, either death stopped the run ("rollout worker N died"): the credits
    of the dead worker's groups in flight never came back. Now the credits are reclaimed, worker 1 is
    restarted and produces again, the run finishes every step on it and evaluates on it, and the report
    says what happened. What the crashed process's sandboxes left is swept by its restarted process."""
    cfg = build_config(
        "smoke",
        None,
        ["orchestrator.steps=4", "rollout.num_workers=2", "train.checkpoint_every=0"],
    )
    before = tandem_debris()
    killed: dict = {}

    def killer():
        metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 60
        while len(metrics.read_text().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # after step 2: the driver has heard the workers' cursors at step 2's batch
        crashing = ray.get_actor("tandem-rollout-1")
        killed["cursor"] = ray.get(crashing.ping.remote())
        os.kill(actor_pid("tandem-rollout-1"), signal.SIGKILL)
        ray.kill(ray.get_actor("tandem-rollout-0"))
        killed["at"] = time.monotonic()
        seen = killed["after"] = []  # the restarted process's task-stream cursors, until it drew tasks
        while time.monotonic() < killed["at"] + 60 and not any(c > killed["cursor"] for c in seen):
            try:
                seen.append(ray.get(crashing.ping.remote(), timeout=5))
            except Exception:  # noqa: BLE001 - restarting, or the run is over
                time.sleep(0.05)
            time.sleep(0.01)

    watcher = at_first_step(tmp_path, killer)
    try:
        result = train(cfg, tmp_path, quiet=True)
        watcher.join(timeout=60)
    finally:
        ray.shutdown()
    assert "at" in killed
    # Its stream went on from the cursor the driver had heard, not from the run's first tasks again (worker
    # 1 draws train_start + 1, + 3, ...: from the start, its first task would show the cursor start + 2).
    start = cfg.tasks.train_start
    assert killed["cursor"] > start + 4 and any(c > killed["cursor"] for c in killed["after"]), killed
    assert start + 2 not in killed["after"], killed
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and result.version == 4
    assert result.lost == ["rollout worker 0 died (ActorDiedError); not restarted"]
    assert len(result.restarted) == 1
    assert result.restarted[0].startswith("rollout worker 1 died (")
    assert result.restarted[0].endswith("restarted (1 of orchestrator.worker_restarts=3)")
    assert result.eval_after is not None and result.eval_after["n"] == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lost"] == result.lost and summary["restarted"] == result.restarted
    report = (tmp_path / "report.md").read_text()
    assert all(line in report for line in result.lost + result.restarted)
    assert tandem_debris() <= before


@pytest.mark.slow
def test_an_engine_dying_in_the_final_evaluation_is_reported_with_what_was_saved(tmp_path, joined_ray):
    """Before, the run ended in a traceback (``RayTaskError(EvaluationError)``) that never said the final
    checkpoint and model were written, and the actors were left to Ray's shutdown. The engine dies as the
    final checkpoint appears (with checkpoint_every=0, the only one), before the evaluation can finish a
    session, so every session of it fails."""
    cfg = build_config("smoke", None, ["orchestrator.steps=1", "train.checkpoint_every=0"])
    killed: dict = {}
    _kill_after_first_step(tmp_path, ["tandem-engine-0"], killed, when="checkpoints/step_000001")
    said = (
        "training finished .*step_000001 and .*final_model are written.*, but evaluating the final model "
        "failed: EvaluationError.*engine 0 died"
    )
    try:
        with pytest.raises(TandemError, match=said):
            train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
    assert "at" in killed


@pytest.mark.slow
def test_a_context_too_short_for_every_prompt_stops_the_run_fast_naming_it(tmp_path, joined_ray):
    """Every session fails in the engine (its prompt does not fit engine.max_seq_len): the starting
    evaluation raises with the engine's reason instead of reporting pass@1 = 0, and without it the run
    stops after FAIL_FAST_GROUPS failed groups instead of waiting orchestrator.request_timeout_s."""
    reason = "leaves no room in max_seq_len=8"
    cfg = build_config("smoke", None, ["engine.max_seq_len=8", "orchestrator.request_timeout_s=600"])
    try:
        with pytest.raises(TandemError, match=f"evaluating the starting model failed: every one .*{reason}"):
            train(cfg, tmp_path / "with_eval", quiet=True)
    finally:
        ray.shutdown()
    cfg.eval.before_after = False
    t0 = time.monotonic()
    try:
        with pytest.raises(TandemError, match=f"rollout groups all failed .*{reason}"):
            train(cfg, tmp_path / "without_eval", quiet=True)
    finally:
        ray.shutdown()
    assert time.monotonic() - t0 < 300  # well before the 600 s request timeout
    assert reason in (tmp_path / "without_eval" / "rollout_errors.log").read_text()


@pytest.mark.slow
def test_a_harness_that_fails_every_rollout_stops_the_run_naming_its_output(tmp_path, joined_ray):
    """Before, every rollout failed (harness_failed_frac 1.0), the run trained on nothing and exited 0."""
    cfg = build_config(
        "smoke",
        None,
        [
            """rollout.harness_command=["python3", "-c", "import sys; sys.exit('no API key found')"]""",
            "eval.before_after=false",
        ],
    )
    try:
        reason = "harness error: exit 1: no API key found"
        with pytest.raises(TandemError, match=f"rollout groups all failed .*{reason}"):
            train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
