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
