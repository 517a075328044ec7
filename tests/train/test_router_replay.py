"""Router replay (R3) and routing agreement on a real tiny Qwen3-MoE: replayed routes drive the forward, the
router still gets gradient, agreement is 1 on the sampler's own weights and drops after perturbing the router,
bad routes and r3 on a dense model are refused with the reason."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.core.config import TrainConfig, load_config
from tandem.core.errors import ConfigError
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.core.records import Group, Reward, Segment, SegmentBuilder, Trajectory
from tandem.engine.builtin import BuiltinEngine
from tandem.model.moe import routers, write_model_dir
from tandem.train.batching import SequenceInput, pack, token_logprobs
from tandem.train.trainer import Trainer, load_causal_lm

BASE = Path(__file__).resolve().parents[2] / "models" / "tandem-base"
PROMPTS = [list(range(40, 52)), list(range(300, 309)), list(range(1000, 1015))]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("moe"), "moe", tokenizer_dir=BASE, seed=0))


@pytest.fixture(scope="module")
def sampled(moe_dir):
    """Groups sampled by the built-in engine from the MoE model (G=2 per prompt), with their routes."""
    from tandem.core.config import EngineConfig

    engine = BuiltinEngine(load_causal_lm(moe_dir), EngineConfig(max_batch=8, max_seq_len=64, max_parked=0))
    try:
        groups = []
        for pi, prompt in enumerate(PROMPTS):
            reqs = [
                GenerationRequest(prompt, SamplingParams(max_new_tokens=6, seed=10 * pi + g)) for g in (0, 1)
            ]
            trajs = []
            for g, c in enumerate(engine.generate(reqs)):
                b = SegmentBuilder()
                b.add_context(prompt)
                b.add_sampled(c.token_ids, c.logprobs, c.versions)
                seg = b.build()
                seg.routed_experts = np.asarray(c.routed_experts)
                trajs.append(Trajectory(f"p{pi}", [seg], Reward(float(g))))
            groups.append(Group(f"p{pi}", trajs))
    finally:
        engine.stop()
    return groups


def _config(**kw):
    base = dict(lr=1e-2, micro_batch_tokens=64, seed=0, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def _seg(seg: Segment, routes) -> Segment:
    return Segment(seg.token_ids, seg.loss_mask, seg.sampler_logprobs, seg.versions, routes)


def _rows(groups, **kw):
    seqs = [SequenceInput(t.segments[0], 1.0) for g in groups for t in g.trajectories]
    return pack(seqs, 64)


def test_pack_carries_routes_aligned_with_tokens(sampled):
    segs = [t.segments[0] for g in sampled for t in g.trajectories]
    bare = _seg(segs[1], None)
    mbs = pack([SequenceInput(segs[0], 1.0), SequenceInput(bare, 1.0)], 1000)
    assert len(mbs) == 1
    mb = mbs[0]
    n0 = len(segs[0])
    assert mb.routed_experts.shape == (mb.num_tokens, 2, 2)
    assert torch.equal(mb.routed_experts[:n0], torch.from_numpy(segs[0].routed_experts.astype(np.int64)))
    assert mb.routes_known.tolist() == [True] * n0 + [False] * len(bare)
    # scored: known routes before the last sampled token of the sequence
    assert mb.routes_scored.tolist() == [True] * (n0 - 1) + [False] * (1 + len(bare))
    assert pack([SequenceInput(bare, 1.0)], 1000)[0].routed_experts is None


def test_replaying_own_routes_is_exact_and_other_routes_change_logprobs(moe_dir, sampled):
    trainer = Trainer(moe_dir, _config(router_replay="r3"))
    mb = _rows(sampled)[0]
    with torch.no_grad():
        plain = token_logprobs(trainer.model, mb).logprobs  # hooks installed but nothing replayed
        # the model's own routes of this row, in top-k order
        trainer.routing.hooks.clear()
        token_logprobs(trainer.model, mb)
        own = trainer.routing.hooks.own().view(mb.routed_experts.shape).clone()
        mb.routed_experts = own
        replayed = trainer._logprobs(mb, False, None).logprobs
        assert torch.equal(replayed, plain)
        other = (own + 3) % 8  # distinct experts, none of the chosen ones (top-2 of 8, shift by 3)
        mb.routed_experts = other
        changed = trainer._logprobs(mb, False, None).logprobs
    assert not torch.allclose(changed, plain)


def test_r3_gradient_reaches_the_router(moe_dir, sampled):
    trainer = Trainer(moe_dir, _config(router_replay="r3"))
    mb = _rows(sampled)[0]
    out = trainer._logprobs(mb, False, None).logprobs
    (out * mb.loss_mask).sum().backward()
    gates = routers(trainer.model)
    assert all(g.weight.grad is not None and float(g.weight.grad.abs().sum()) > 0 for g in gates)
    before = [g.weight.detach().clone() for g in gates]
    trainer.model.zero_grad(set_to_none=True)
    metrics = trainer.step(sampled)
    assert metrics["updated"] == 1
    assert all(not torch.equal(b, g.weight) for b, g in zip(before, gates, strict=True))
    assert metrics["routes_recorded_frac"] == 1.0


def test_routing_agreement_is_one_on_sampler_weights_and_drops_after_perturbing(moe_dir, sampled):
    trainer = Trainer(moe_dir, _config(router_replay="off", lr=0.0))
    m = trainer.step(sampled)
    assert m["routing_agreement"] == 1.0
    assert m["mismatch_abs_dlogp_max"] < 1e-4
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for g in routers(trainer.model):
            g.weight.add_(torch.randn(g.weight.shape, generator=gen) * g.weight.std() * 2)
    m2 = trainer.step(sampled)
    assert 0.0 <= m2["routing_agreement"] < 0.9
    # under r3 the same perturbed trainer still reports how far its own router is from the sampler's
    r3 = Trainer(moe_dir, _config(router_replay="r3", lr=0.0))
    assert r3.step(sampled)["routing_agreement"] == 1.0


def test_bad_routes_are_refused_before_training(moe_dir, sampled):
    trainer = Trainer(moe_dir, _config(router_replay="r3"))
    seg = sampled[0].trajectories[0].segments[0]
    n = len(seg)
    cases = {
        rf"expected \({n}, 2, 2\)": np.zeros((n - 1, 2, 2), np.uint8),
        rf"shape \({n}, 3, 2\)": np.zeros((n, 3, 2), np.uint8),
        "outside \\[0, 8\\)": np.full((n, 2, 2), 9, np.uint8),
    }
    before = [p.detach().clone() for p in trainer.model.parameters()]
    for pattern, routes in cases.items():
        bad = Group("bad", [Trajectory("bad", [_seg(seg, routes)], Reward(1.0)), sampled[0].trajectories[1]])
        with pytest.raises(ValueError, match=pattern):
            trainer.step([bad])
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))
    assert trainer.version == 0


def test_r3_on_a_dense_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        Trainer(str(BASE), _config(router_replay="r3"))
    with pytest.raises(ConfigError, match="router_replay='r3' needs a mixture-of-experts model"):
        load_config(overrides=[f"model.path={BASE}", "train.router_replay=r3"])
    with pytest.raises(ConfigError, match="engine.kind='vllm'"):
        load_config(overrides=["engine.kind=vllm", "train.router_replay=r3"])
    # routes on a dense model are refused by the check, also without replay
    trainer = Trainer(str(BASE), _config())
    seg = SegmentBuilder()
    seg.add_context([5, 6, 7])
    seg.add_sampled([8, 9], [-1.0, -1.0], [0, 0])
    s = seg.build()
    s.routed_experts = np.zeros((5, 2, 2), np.uint8)
    group = Group("d", [Trajectory("d", [s], Reward(1.0)), Trajectory("d", [seg.build()], Reward(0.0))])
    with pytest.raises(ValueError, match="no MoE layers"):
        trainer.step([group])


def test_routes_survive_serialization_and_ppo_updates_replay_them(moe_dir, sampled):
    groups = [Group.from_dict(g.to_dict()) for g in sampled]
    for a, b in zip(sampled, groups, strict=True):
        ra, rb = a.trajectories[0].segments[0].routed_experts, b.trajectories[0].segments[0].routed_experts
        assert np.array_equal(ra, rb) and rb.dtype == np.uint8
    trainer = Trainer(moe_dir, _config(router_replay="r3", epochs=2, mini_batches=2, groups_per_step=3))
    m = trainer.step(groups)
    assert m["updates"] == 4 and m["routing_agreement"] == 1.0


def test_segments_without_routes_keep_the_trainers_routing_under_r3(moe_dir, sampled):
    trainer = Trainer(moe_dir, _config(router_replay="r3"))
    segs = [t.segments[0] for g in sampled for t in g.trajectories][:2]
    shifted = _seg(segs[0], (segs[0].routed_experts + 3) % 8)
    mb_bare = pack([SequenceInput(_seg(segs[0], None), 1.0), SequenceInput(_seg(segs[1], None), 1.0)], 1000)[
        0
    ]
    mb_mixed = pack([SequenceInput(shifted, 1.0), SequenceInput(_seg(segs[1], None), 1.0)], 1000)[0]
    acc: dict = {}
    with torch.no_grad():
        plain = trainer._logprobs(mb_bare, False, None).logprobs
        mixed = trainer._logprobs(mb_mixed, False, acc).logprobs
    n0 = len(segs[0])
    # the segment without routes keeps the trainer's own routing (equal up to the rounding of expert
    # matmuls, which group the row's tokens by expert)
    assert torch.allclose(mixed[n0:], plain[n0:], atol=1e-5)
    assert not torch.allclose(mixed[:n0], plain[:n0])  # the other one: its (shifted) recorded routes
    assert acc["route_known"] == n0 and acc["route_tokens"] == mb_mixed.num_tokens
    assert acc["route_agree"] == 0  # shifted routes never share the trainer's expert set
