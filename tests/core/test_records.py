import math
import pickle

import numpy as np
import pytest

from tandem.core.records import Group, Message, Reward, Segment, SegmentBuilder, Trajectory


def make_traj(versions, reward=1.0):
    b = SegmentBuilder()
    b.add_context([1, 2, 3])
    b.add_sampled([4, 5], [-0.5, -1.0], versions)
    return Trajectory(
        "t1",
        [b.build()],
        Reward(reward, {"pass_fraction": reward}),
        {"submitted": True},
        {"total_s": 1.0},
        {"turns": 1},
        [Message("user", "hi")],
    )


def test_segment_builder_keeps_invariants():
    seg = make_traj([3, 4]).segments[0]
    assert seg.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert seg.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert all(math.isnan(x) for x in seg.sampler_logprobs[:3])
    assert seg.versions.tolist() == [-1, -1, -1, 3, 4]
    assert seg.oldest_version() == 3


def test_segment_rejects_ragged_arrays():
    with pytest.raises(ValueError, match="loss_mask"):
        Segment(np.zeros(3, np.int32), np.zeros(2, np.uint8), np.zeros(3, np.float32), np.zeros(3, np.int32))
    with pytest.raises(ValueError):
        SegmentBuilder().add_sampled([1], [0.0, 0.0], [0])


def test_group_round_trips_through_dicts_and_pickle():
    g = Group("t1", [make_traj([2, 2], 1.0), make_traj([1, 2], 0.0)])
    back = Group.from_dict(pickle.loads(pickle.dumps(g.to_dict())))
    assert back.oldest_version() == 1
    assert back.rewards().tolist() == [1.0, 0.0]
    a, b = g.trajectories[1].segments[0], back.trajectories[1].segments[0]
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.sampler_logprobs, b.sampler_logprobs)
    assert back.trajectories[0].messages[0].content == "hi"


def test_trajectory_diff_round_trips_and_old_dicts_load():
    from tandem.core.records import Reward, Segment, Trajectory

    t = Trajectory(
        "t", [Segment.empty()], Reward(1.0), flags={"tests_edited": True}, diff="--- a/x\n+++ b/x\n"
    )
    back = Trajectory.from_dict(t.to_dict())
    assert back.diff == t.diff and back.flags == {"tests_edited": True}
    old = t.to_dict()
    del old["diff"]
    assert Trajectory.from_dict(old).diff == ""


def test_sampling_bookkeeping_is_recorded_only_when_used_and_round_trips():
    plain = SegmentBuilder()
    plain.add_context([1, 2])
    plain.add_sampled([3, 4], [-0.5, -0.25], [0, 0])
    seg = plain.build()
    assert seg.sampler_logmass is None and seg.sampler_temperature is None
    assert "sampler_logmass" not in seg.to_dict()

    b = SegmentBuilder()
    b.add_context([1, 2])
    b.add_sampled([3, 4], [-0.5, -0.25], [0, 0], logmass=[-0.1, 0.0], temperature=0.7)
    b.add_context([5])
    b.add_sampled([6], [-1.0], [1], temperature=0.0)  # greedy is recorded as temperature 1
    seg = b.build()
    np.testing.assert_allclose(seg.sampler_logmass, [0, 0, -0.1, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(seg.sampler_temperature, [1, 1, 0.7, 0.7, 1, 1], atol=1e-7)
    back = Segment.from_dict(seg.to_dict())
    np.testing.assert_array_equal(back.sampler_logmass, seg.sampler_logmass)
    np.testing.assert_array_equal(back.sampler_temperature, seg.sampler_temperature)
    with pytest.raises(ValueError, match="equal lengths"):
        b.add_sampled([7, 8], [-1.0, -1.0], [1, 1], logmass=[0.0])
