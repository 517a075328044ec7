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


def test_a_stream_goes_on_from_its_cursor_and_never_draws_an_index_twice():
    """Worker i of n draws train_start + i + k*n. Its cursor is the index past its last new task; a stream
    started at a cursor (a resumed run) or moved to one (a restarted worker) draws nothing below it, keeps
    its own indices, and is never moved back."""
    cfg = RunConfig()
    start = cfg.tasks.train_start
    stream = TaskStream(cfg, worker_index=1, num_workers=3)
    assert stream.cursor == start
    first = [next(stream) for _ in range(3)]
    assert stream.cursor == start + 1 + 2 * 3 + 1
    again = TaskStream(cfg, worker_index=1, num_workers=3, cursor=stream.cursor)
    assert next(again).id == next(stream).id  # goes on exactly where the first stream was
    assert next(again).id not in {t.id for t in first}
    moved = TaskStream(cfg, worker_index=2, num_workers=3)
    moved.skip_to(start + 10)  # its indices are start + 2 + 3k: the first at or past the cursor is start + 11
    reference = TaskStream(cfg, worker_index=0, num_workers=1, cursor=start + 11)
    assert next(moved).id == next(reference).id and moved.cursor == start + 12
    moved.skip_to(start)  # never back
    assert moved.cursor == start + 12
    nothing_drawn = TaskStream(cfg, worker_index=0, num_workers=2, cursor=start + 7)
    assert nothing_drawn.cursor == start + 7  # a resumed worker that drew nothing keeps the saved cursor
