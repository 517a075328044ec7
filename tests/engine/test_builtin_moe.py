"""The built-in engine on a real tiny Qwen3-MoE: it serves through the HF runner and reports, per completion,
the experts every prompt and sampled token was routed to, equal to a plain HF forward's routing, also when
a parked prefix is reused and after a weight update."""

import numpy as np
import pytest
import torch

from tandem.core.config import EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine.builtin import BuiltinEngine
from tandem.env.harness import segment_routes
from tandem.model.build import build_model, qwen3_config
from tandem.model.moe import RouterHooks, moe_shape, routers


def _model(seed: int = 0):
    return build_model(qwen3_config("moe", vocab_size=4096), seed=seed).eval()


def _reference_routes(model, ids: list[int]) -> np.ndarray:
    with RouterHooks(model) as hooks, torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
        return hooks.own().numpy()


@pytest.fixture(scope="module")
def engine():
    eng = BuiltinEngine(_model(), EngineConfig(max_batch=4, max_seq_len=128, max_parked=4))
    yield eng
    eng.stop()


def test_moe_preset_shape():
    m = _model()
    assert type(m).__name__ == "Qwen3MoeForCausalLM"
    assert moe_shape(m) is not None and (moe_shape(m).layers, moe_shape(m).top_k) == (2, 2)


def test_routes_cover_prompt_and_sampled_tokens_and_match_hf(engine):
    ref = _model()
    assert engine.fallback_reason is not None  # served by the HF runner
    prompts = [list(range(5, 30)), list(range(100, 140)), [7, 8, 9]]
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=10, seed=i)) for i, p in enumerate(prompts)]
    for p, c in zip(prompts, engine.generate(reqs), strict=True):
        assert c.finish_reason in ("stop", "length")
        r = np.asarray(c.routed_experts)
        full = p + c.token_ids
        assert r.shape == (len(full), 2, 2) and r.dtype == np.uint8
        assert np.array_equal(r, _reference_routes(ref, full))


def test_prefix_reuse_keeps_the_routes_of_the_parked_slot(engine):
    ref = _model()
    prompt = list(range(200, 230))
    first = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=6, seed=1))])[0]
    hits = engine.stats()["prefix_hit_tokens"]
    turn2 = prompt + first.token_ids + [11, 12, 13]
    second = engine.generate([GenerationRequest(turn2, SamplingParams(max_new_tokens=6, seed=2))])[0]
    assert engine.stats()["prefix_hit_tokens"] - hits == len(prompt) + len(first.token_ids)
    full = turn2 + second.token_ids
    assert np.array_equal(np.asarray(second.routed_experts), _reference_routes(ref, full))


def test_routes_follow_a_weight_update(engine):
    other = _model(seed=7)
    state = {f"{n}": p.detach().clone() for n, p in other.named_parameters()}
    engine.update_weights(1, state)
    try:
        prompt = list(range(50, 70))
        c = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=5, seed=3))])[0]
        assert c.versions == [1] * len(c.token_ids)
        assert np.array_equal(np.asarray(c.routed_experts), _reference_routes(other, prompt + c.token_ids))
    finally:
        engine.update_weights(2, {n: p.detach().clone() for n, p in _model().named_parameters()})


def test_dense_model_reports_no_routes():
    eng = BuiltinEngine(build_model(qwen3_config("smoke", vocab_size=512)), EngineConfig(max_seq_len=64))
    try:
        c = eng.generate([GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=3, seed=0))])[0]
        assert c.routed_experts is None and routers(eng.model) == []
    finally:
        eng.stop()


def test_segment_routes_fill_tokens_after_the_last_turn():
    r = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8
    out = segment_routes(r, 5, 8)
    assert out.shape == (8, 2, 2) and out.dtype == np.uint8
    assert np.array_equal(out[:5], r) and np.array_equal(out[5:], np.broadcast_to([0, 1], (3, 2, 2)))
    assert segment_routes(r, 4, 8) is None  # do not cover the last turn exactly: no routes
    assert segment_routes(None, 5, 8) is None
    assert segment_routes(r.tolist(), 5, 5).dtype == np.uint8
