"""A dead engine must not hang the run: its groups fail and are requeued; the run stops with an error."""

import threading
import time
from pathlib import Path

import pytest
import ray

from tandem.cli.main import build_config
from tandem.core.errors import TandemError
from tandem.orchestrator import train


@pytest.mark.slow
def test_killing_the_only_engine_ends_the_run_with_an_error(tmp_path):
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
def test_a_context_too_short_for_every_prompt_stops_the_run_fast_naming_it(tmp_path):
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
def test_a_harness_that_fails_every_rollout_stops_the_run_naming_its_output(tmp_path):
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
