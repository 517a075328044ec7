"""The buffer's credits per producer: a dead producer's credits come back, and nothing it still had on its
way makes or loses a credit (a real Ray actor; the whole crew is exercised by a run in test_faults.py)."""

import time

import pytest
import ray

from tandem.core.records import Group
from tandem.orchestrator.actors import BufferActor


@pytest.fixture(scope="module")
def buffer(ray_cluster):
    ray.init(address=ray_cluster)
    try:
        yield BufferActor.remote(64)
    finally:
        ray.shutdown()


def _credits(buffer) -> int:
    return ray.get(buffer.stats.remote())["credits"]


def test_a_reclaimed_producer_returns_its_credits_and_its_late_calls_are_accounted(buffer):
    ray.get(buffer.grant.remote(3))
    assert ray.get([buffer.acquire_credit.remote("0.0") for _ in range(2)]) == [True, True]
    assert ray.get(buffer.acquire_credit.remote("1.0")) is True
    assert _credits(buffer) == 0
    waiting = buffer.acquire_credit.remote("0.0")  # the dead producer's loop was waiting for a credit
    time.sleep(0.2)
    assert ray.get(buffer.reclaim.remote("0.0")) == 2
    assert ray.get(waiting, timeout=30) is False  # it gets none: nobody would run the group
    assert _credits(buffer) == 2

    # calls the dead producer sent before it died, arriving late
    ray.get(buffer.put.remote(Group(task_id="late", trajectories=[]), "0.0"))  # kept: it uses a credit
    assert _credits(buffer) == 1
    ray.get(buffer.failed.remote("late failure", "0.0"))  # its credit was reclaimed already
    assert _credits(buffer) == 1

    # the live producer's calls are unchanged
    ray.get(buffer.failed.remote("a failure", "1.0"))
    assert _credits(buffer) == 2
    ray.get(buffer.acquire_credit.remote("1.0"))
    ray.get(buffer.put.remote(Group(task_id="ok", trajectories=[]), "1.0"))
    stats = ray.get(buffer.stats.remote())
    assert stats["credits"] == 1 and stats["buffered"] == 2 and stats["reclaimed"] == 2
    # the restarted worker produces under a new token; the old token stays refused
    assert ray.get(buffer.acquire_credit.remote("0.1")) is True
    assert ray.get(buffer.acquire_credit.remote("0.0")) is False
