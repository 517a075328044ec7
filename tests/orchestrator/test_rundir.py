"""Run directories: a new run never mixes with an old one; a resume keeps what the run trained with."""

import pytest

from tandem.core.config import dump_config, load_config
from tandem.core.errors import TandemError
from tandem.orchestrator.rundir import check_run_dir


def test_a_new_run_refuses_a_directory_holding_a_run(tmp_path):
    cfg = load_config()
    assert check_run_dir(cfg, tmp_path / "new", resume=False) == (cfg, [])
    (tmp_path / "config.toml").write_text(dump_config(cfg))  # a run that never started: fine to reuse
    assert check_run_dir(cfg, tmp_path, resume=False) == (cfg, [])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(TandemError, match="already holds a run .metrics.jsonl with rows.*--resume"):
        check_run_dir(cfg, tmp_path, resume=False)


def test_a_resume_reports_every_change_to_the_recorded_config(tmp_path):
    recorded = load_config(overrides=["engine.kind='builtin'"])
    (tmp_path / "config.toml").write_text(dump_config(recorded))
    same, changes = check_run_dir(load_config(), tmp_path, resume=True)
    assert changes == [] and same.engine.kind == "builtin"  # 'auto' resumes the engine the run recorded
    changed = load_config(overrides=["train.lr=0.1", "rollout.group_size=4", "orchestrator.steps=500"])
    kept, changes = check_run_dir(changed, tmp_path, resume=True)
    assert kept.train.lr == 0.1 and kept.orchestrator.steps == 500
    assert f"train.lr ({recorded.train.lr!r} -> 0.1)" in changes and "rollout.group_size (8 -> 4)" in changes
    assert "orchestrator.steps (40 -> 500)" in changes and len(changes) == 3
    (tmp_path / "config.toml").write_text("[train]\nno_such_field = 1\n")  # e.g. from another version
    _, changes = check_run_dir(changed, tmp_path, resume=True)
    assert len(changes) == 1 and "could not be read" in changes[0]


def test_a_resume_with_nothing_left_to_train_is_refused_before_starting(tmp_path):
    """Before, it ran 0 steps, exited 0, and rewrote final_model."""
    from tandem.orchestrator import train
    from tandem.train.checkpoint import checkpoint_path, write_state

    cfg = load_config(overrides=["engine.kind='builtin'", "orchestrator.steps=6"])
    (tmp_path / "config.toml").write_text(dump_config(cfg))
    ck = checkpoint_path(tmp_path, 6)
    ck.mkdir(parents=True)
    write_state(ck, {"version": 6})
    with pytest.raises(TandemError, match="latest checkpoint is at step 6 and orchestrator.steps=6"):
        train(cfg, tmp_path, resume=True)
    assert not (tmp_path / "final_model").exists()


def test_a_resume_of_a_run_that_failed_before_its_first_checkpoint_says_what_works(tmp_path):
    """Before, ``--resume`` answered "start without it", and starting without it was refused because the
    run dir holds metrics rows ("Pass --resume to continue it"): each sent the user to the other."""
    from tandem.orchestrator import train

    cfg = load_config(overrides=["engine.kind='builtin'", "orchestrator.steps=6"])
    (tmp_path / "config.toml").write_text(dump_config(cfg))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # it failed at step 1 (checkpoint_every=10)
    with pytest.raises(TandemError, match="stopped before its first checkpoint .* new --run-dir, or remove"):
        train(cfg, tmp_path, resume=True)
    (tmp_path / "metrics.jsonl").unlink()  # a run that never logged a step: starting without --resume works
    with pytest.raises(FileNotFoundError, match="no checkpoint under .*; start without it"):
        train(cfg, tmp_path, resume=True)
    assert check_run_dir(cfg, tmp_path, resume=False) == (cfg, [])


def test_a_damaged_latest_checkpoint_is_refused_before_ray_starts(tmp_path):
    """A truncated ``trainer_state.json`` of the latest checkpoint had been skipped silently: the run resumed
    from the one before and wrote its steps into metrics.jsonl twice. ``[]`` or ``"version": null`` there
    had been tracebacks; a damaged file had been found only by the trainer actor, after Ray started."""
    import ray

    from tandem.orchestrator import train
    from tandem.train.checkpoint import CheckpointError, checkpoint_path, write_state

    cfg = load_config(overrides=["engine.kind='builtin'", "orchestrator.steps=6"])
    (tmp_path / "config.toml").write_text(dump_config(cfg))
    for version in (2, 3):
        ck = checkpoint_path(tmp_path, version)
        ck.mkdir(parents=True)
        (ck / "optimizer.pt").write_bytes(b"state %d" % version)
        write_state(ck, {"version": version})
    state = checkpoint_path(tmp_path, 3) / "trainer_state.json"
    intact = state.read_text()
    for damage in (intact[:40], "[]", intact.replace('"version": 3', '"version": null')):
        state.write_text(damage)
        with pytest.raises(CheckpointError, match="step_000003.*move step_000003 out.*step_000002"):
            train(cfg, tmp_path, resume=True)
    state.write_text(intact)
    (checkpoint_path(tmp_path, 3) / "optimizer.pt").write_bytes(b"state 9")
    with pytest.raises(CheckpointError, match="optimizer.pt does not match the hash"):
        train(cfg, tmp_path, resume=True)
    assert not ray.is_initialized()
