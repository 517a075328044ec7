"""A relay that dies during a run: the run goes on (its engines fetch from the store server) and the loss is
reported once, in ``RunResult.lost``, ``summary.json`` and ``report.md``."""

import json
import os
import signal
import time

import pytest
import ray

from tandem.cli.main import build_config
from tandem.orchestrator import train

from .conftest import actor_pid, at_first_step


@pytest.mark.slow
def test_a_dead_relay_is_reported_lost_and_the_run_goes_on(tmp_path, joined_ray):
    """Two relays; after step 1 relay 0 is ``ray.kill``ed and relay 1's process SIGKILLed. Before, the run
    finished with ``lost == []``: only the host leader was watched, so a run that had lost its relays looked
    like one that had not."""
    cfg = build_config("smoke", None, ["orchestrator.steps=5", "weights.relays=2", "eval.before_after=false"])
    killed: dict = {}

    def killer():
        pid = actor_pid("tandem-relay-1")
        ray.kill(ray.get_actor("tandem-relay-0"))
        os.kill(pid, signal.SIGKILL)
        killed["at"] = time.monotonic()

    at_first_step(tmp_path, killer)
    try:
        result = train(cfg, tmp_path, quiet=True)
    finally:
        ray.shutdown()
    assert "at" in killed
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and result.version == 5
    assert sorted(result.lost) == [
        "relay 0 died (ActorDiedError); its engines fetch from the store server",
        "relay 1 died (ActorDiedError); its engines fetch from the store server",
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["lost"] == result.lost
    report = (tmp_path / "report.md").read_text()
    assert all(line in report for line in result.lost)
