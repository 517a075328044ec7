"""Deterministic mode on a real tiny Qwen3-MoE: the built-in engine's routes and logprobs do not depend on
the batch (also through a parked prefix), the deterministic forward agrees with transformers' own MoE
forward to float rounding, and the trainer's logprobs and routes of the engine's tokens, packed with other
sequences, equal the engine's bits: mismatch KL exactly 0 and routing agreement exactly 1, also after
bf16-published updates that patch router and expert elements."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.core.config import EngineConfig, RunConfig, TrainConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.core.records import Group, Reward, SegmentBuilder, Trajectory
from tandem.engine.builtin import BuiltinEngine
from tandem.env.harness import segment_routes
from tandem.model import deterministic as det
from tandem.model.moe import RouterHooks, write_model_dir
from tandem.train.trainer import Trainer, load_causal_lm

BASE = str(Path(__file__).resolve().parents[2] / "models" / "tandem-base")
TARGET = [5, 17, 99, 300, 42, 7, 8, 1000, 23, 61, 2000, 12]
OTHERS = [([3 + i, 50, 60 + i, 700] * (i + 1), 7 + i, 10 + 5 * i) for i in range(5)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("moe") / "m", "moe", tokenizer_dir=BASE, seed=0))


def _engine(path, **kw):
    cfg = dict(max_batch=8, max_seq_len=256, max_parked=0)
    cfg.update(kw)
    return BuiltinEngine.from_path(path, EngineConfig(**cfg), deterministic=True)


def _req(prompt, seed, n, temperature=1.0):
    return GenerationRequest(
        list(prompt), SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed)
    )


def test_forward_matches_transformers_moe_and_is_batch_invariant(moe_dir):
    model = load_causal_lm(moe_dir)
    cos, sin = det.rope_table(model, 64)
    ids = torch.randint(0, 4000, (5, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RouterHooks(model) as hooks:
        ref = model(input_ids=ids[:1, :23]).logits[0]
        ref_routes = hooks.own()
        alone = det.forward_tokens(model, ids[:1, :23], cos, sin, route_fn=hooks.process)[0]
        own_routes = hooks.own()
        batch = det.forward_tokens(model, ids, cos, sin)
    assert torch.equal(alone, batch[0, :23])
    assert (alone - ref).abs().max().item() < 1e-4
    assert torch.equal(own_routes, ref_routes)


def test_engine_bits_and_routes_do_not_depend_on_the_batch(moe_dir):
    eng = _engine(moe_dir, max_parked=4)
    try:
        assert eng._runner.records_routes
        alone = eng.generate([_req(TARGET, 123, 30, 0.9)])[0]
        r = np.asarray(alone.routed_experts)
        assert r.shape == (len(TARGET) + 30, 2, 2) and r.dtype == np.uint8
        others = [_req(p, s, n) for p, s, n in OTHERS]
        for at in (0, 2, 5):
            mixed = eng.generate([*others[:at], _req(TARGET, 123, 30, 0.9), *others[at:]])[at]
            assert mixed.token_ids == alone.token_ids and mixed.logprobs == alone.logprobs
            assert np.array_equal(np.asarray(mixed.routed_experts), r)
        # A second turn reuses the parked first turn: same bits and routes as a fresh engine's full prefill.
        turn2 = [*TARGET, *alone.token_ids, 77, 78]
        hits = eng.stats()["prefix_hit_tokens"]
        again = eng.generate([_req(turn2, 5, 12)])[0]
        assert eng.stats()["prefix_hit_tokens"] > hits
    finally:
        eng.stop()
    fresh = _engine(moe_dir)
    try:
        ref = fresh.generate([_req(turn2, 5, 12)])[0]
    finally:
        fresh.stop()
    assert again.token_ids == ref.token_ids and again.logprobs == ref.logprobs
    assert np.array_equal(np.asarray(again.routed_experts), np.asarray(ref.routed_experts))


def _groups(eng):
    reqs = [_req(TARGET, 123, 30, 0.9), *[_req(p, s, n) for p, s, n in OTHERS[:3]]]
    trajs = []
    for i, (r, c) in enumerate(zip(reqs, eng.generate(reqs), strict=True)):
        b = SegmentBuilder()
        b.add_context(list(r.prompt_ids))
        b.add_sampled(c.token_ids, c.logprobs, c.versions, c.logmass, r.params.temperature)
        seg = b.build()
        seg.routed_experts = segment_routes(c.routed_experts, len(seg), len(seg))
        assert seg.routed_experts is not None
        trajs.append(Trajectory("t", [seg], Reward(float(i % 2))))
    return [Group("a", trajs[:2]), Group("b", trajs[2:])]


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_trainer_matches_engine_bits_and_routes_through_bf16_patches(moe_dir, replay, element_patches):
    cfg = TrainConfig(deterministic=True, threads=1, lr=1e-3, router_replay=replay, micro_batch_tokens=512)
    trainer = Trainer(moe_dir, cfg, publish_dtype="bfloat16")
    eng = _engine(moe_dir)
    try:
        state = trainer.publish_state()
        eng.update_weights(0, state)
        patched = set()
        for step in range(2):
            metrics = trainer.step(_groups(eng))
            assert metrics["mismatch_tokens"] > 0 and metrics["updated"] == 1, step
            assert metrics["mismatch_kl_k3"] == 0.0 and metrics["mismatch_abs_dlogp_max"] == 0.0, step
            assert metrics["routing_agreement"] == 1.0 and metrics["routing_used_agreement"] == 1.0, step
            new = trainer.publish_state()
            patches = element_patches(state, new)
            patched |= set(patches)
            eng.patch_weights(trainer.version, patches)
            state = new
        assert any("experts" in n for n in patched) and any("gate.weight" in n for n in patched)
    finally:
        eng.stop()


def test_config_accepts_moe_in_deterministic_mode(moe_dir):
    RunConfig(model={"path": moe_dir}, train={"deterministic": True})
    RunConfig(model={"path": moe_dir}, train={"deterministic": True, "router_replay": "r3"})
