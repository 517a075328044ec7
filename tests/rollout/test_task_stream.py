"""The training task stream: failed tasks come back first, a task that keeps failing is dropped."""

from tandem.core.config import RunConfig
from tandem.rollout.worker import MAX_TASK_ATTEMPTS, TaskStream


def test_a_failed_task_is_served_again_until_it_has_failed_max_attempts_times():
    stream = TaskStream(RunConfig())
    poison, fresh = next(stream), TaskStream(RunConfig())
    next(fresh)
    for _ in range(MAX_TASK_ATTEMPTS - 1):
        assert stream.requeue(poison)
        assert next(stream).id == poison.id  # requeued tasks first
    assert not stream.requeue(poison)  # dropped: the stream moves on to new tasks
    assert next(stream).id == next(fresh).id != poison.id
