"""`samples.jsonl` rows: which sessions of a step are written, and that each is JSON of the whole session."""

import json

from tandem.core.records import Group, Message, Reward, SegmentBuilder, Trajectory
from tandem.orchestrator.samples import sample_rows


def _traj(task: str, reward: float, version: int) -> Trajectory:
    b = SegmentBuilder()
    b.add_context([1, 2, 3])
    b.add_sampled([4, 5], [-0.5, -0.25], [version, version + 1])
    messages = [
        Message("user", f"solve {task}"),
        Message("assistant", "", [{"name": "submit", "arguments": {}}]),
    ]
    return Trajectory(task, [b.build()], Reward(reward, {"pass_fraction": reward}), {"truncated": False},
                      {}, {"turns": 1}, messages, "--- a/x\n+++ b/x\n")  # fmt: skip


def test_samples_go_round_robin_over_groups_whatever_their_rewards():
    groups = [
        Group("a", [_traj("a", 0.0, 3), _traj("a", 1.0, 3)]),
        Group("b", [_traj("b", 1.0, 2), _traj("b", 0.0, 2), _traj("b", 0.5, 2)]),
    ]
    rows = sample_rows(7, groups, 4)
    assert [(r["group"], r["index"]) for r in rows] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["task_id"] for r in rows] == ["a", "b", "a", "b"]
    assert [(r["group"], r["index"]) for r in sample_rows(7, groups, 10)][-1] == (1, 2)  # all five, no more
    assert len(sample_rows(7, groups, 10)) == 5 and sample_rows(7, groups, 0) == [] == sample_rows(7, [], 3)
    row = json.loads(json.dumps(rows[1]))  # plain JSON, whole
    assert row["step"] == 7 and row["reward"] == 1.0 and row["components"] == {"pass_fraction": 1.0}
    assert row["sampled_by"] == 2 and row["sampled_tokens"] == 2 and row["tool_stats"] == {"turns": 1}
    assert row["messages"][1]["tool_calls"] == [{"name": "submit", "arguments": {}}]
    assert row["diff"].startswith("--- a/x")


def test_samples_per_step_out_of_range_is_refused_naming_the_field():
    import pytest

    from tandem.core.config import ConfigError, load_config

    assert load_config(overrides=["orchestrator.samples_per_step=0"]).orchestrator.samples_per_step == 0
    for bad in ("-1", "1025", "'2'"):
        with pytest.raises(ConfigError, match="orchestrator.samples_per_step"):
            load_config(overrides=[f"orchestrator.samples_per_step={bad}"])
