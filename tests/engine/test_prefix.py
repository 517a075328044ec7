"""Prefix reuse of the built-in engine: parked sessions' KV serves the next turn exactly (tiny models)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

from tandem.core.config import AUTO_LOOP_PRIORITY_BOOST, EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine import BuiltinEngine
from tandem.engine.prefix import MIN_REUSE
from tandem.engine.runner import FastRunner, HFRunner

V = 512

# an engine's loop with the automatic boost (no trainer on this host): raised where permitted (root
# here and in CI)
AUTO_LOOP_NICE = max(-20, os.nice(0) - AUTO_LOOP_PRIORITY_BOOST) if os.geteuid() == 0 else os.nice(0)
IDLE_HEALTH = {"ok": True, "version": 0, "active": 0, "queued": 0, "loop_nice": AUTO_LOOP_NICE}


def make(kind: str = "qwen3"):
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = Qwen3Config(
            vocab_size=V,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            head_dim=16,
            tie_word_embeddings=True,
        )
        return Qwen3ForCausalLM(cfg).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=256)).eval()


def req(ids, n=8, t=0.0, p=1.0, seed=None):
    return GenerationRequest(ids, SamplingParams(max_new_tokens=n, temperature=t, top_p=p, seed=seed))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sessions(eng: BuiltinEngine, n: int, turns: int, t: float = 0.0, obs: int = 7) -> list[list]:
    """n concurrent multi-turn sessions: each turn resends the whole context (+ sampled + observation)."""
    ctx = [tokens(30 + 3 * i, seed=i) for i in range(n)]
    outs: list[list] = [[] for _ in range(n)]
    for turn in range(turns):
        futs = [eng.submit(req(c, n=6 + i % 3, t=t, seed=97 * i + turn)) for i, c in enumerate(ctx)]
        for i, f in enumerate(futs):
            c = f.result()
            assert c.finish_reason == "length", c.error
            outs[i].append(c)
            ctx[i] = ctx[i] + c.token_ids + tokens(obs, seed=1000 * i + turn)
    return outs


def engines(max_batch: int, max_parked: int, kind: str = "qwen3"):
    a = BuiltinEngine(make(kind), EngineConfig(max_batch=max_batch, max_seq_len=256, max_parked=max_parked))
    b = BuiltinEngine(make(kind), EngineConfig(max_batch=max_batch, max_seq_len=256, max_parked=0))
    return a, b


@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_runner_prefill_after_prefix_equals_fresh(kind):
    model = make(kind)
    runner = (FastRunner if kind == "qwen3" else HFRunner)(model, max_slots=3, max_seq_len=64)
    ps = [tokens(40, 1), tokens(25, 2), tokens(9, 3)]
    with torch.inference_mode():
        runner.prefill(0, [p[:30] for p in ps])  # slot 2 keeps only 9 positions (its whole prompt)
        got = runner.prefill(0, [ps[0][20:], ps[1][24:], ps[2]], [20, 24, 0])
        ref = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in ps])
        assert runner.lens[:3] == [40, 25, 9]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        step = runner.decode(torch.tensor([5, 6, 7]))
        ref = torch.stack(
            [model(torch.tensor([p + [x]])).logits[0, -1] for p, x in zip(ps, [5, 6, 7], strict=True)]
        )
        torch.testing.assert_close(step, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("kind", "t"), [("qwen3", 0.0), ("qwen3", 1.0), ("gpt2", 0.0)])
def test_multi_turn_outputs_equal_with_and_without_reuse(kind, t):
    reuse, plain = engines(max_batch=4, max_parked=4, kind=kind)
    try:
        a = sessions(reuse, 4, turns=3, t=t)
        b = sessions(plain, 4, turns=3, t=t)
        sa, sb = reuse.stats(), plain.stats()
    finally:
        reuse.stop()
        plain.stop()
    for x, y in zip(sum(a, []), sum(b, []), strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert sb["prefix_hit_tokens"] == 0 and sb["parked"] == 0
    # Turns 2 and 3 reuse everything but the last sampled token (never fed back) of the previous turn.
    k = [[len(c.token_ids) for c in s] for s in a]
    expected = sum(2 * (30 + 3 * i) + 2 * k[i][0] + k[i][1] + 7 - 2 for i in range(4))
    assert sa["prefix_hit_tokens"] == sb["prefill_tokens"] - sa["prefill_tokens"] == expected
    assert sa["parked"] == 4


def test_no_reuse_across_weight_update():
    eng = BuiltinEngine(make(), EngineConfig(max_batch=2, max_seq_len=128, max_parked=2))
    try:
        p = tokens(40, 5)
        first = eng.generate([req(p, n=5)])[0]
        assert eng.stats()["parked"] == 1
        new = {
            k: (v * 1.5).numpy() for k, v in eng.model.state_dict().items() if k.endswith("up_proj.weight")
        }
        eng.update_weights(1, new)
        assert eng.stats()["parked"] == 0
        follow = p + first.token_ids + [3, 4]
        out = eng.generate([req(follow, n=6)])[0]
        st = eng.stats()
        assert st["prefix_hit_tokens"] == 0 and st["prefill_tokens"] == len(p) + len(follow)
        with torch.no_grad():
            ref = eng.model.generate(
                torch.tensor([follow]), do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None
            )
        assert out.token_ids == ref[0, len(follow) :].tolist() and out.versions == [1] * 6
    finally:
        eng.stop()


def test_divergent_prompt_reuses_only_the_common_part():
    reuse, plain = engines(max_batch=2, max_parked=2)
    try:
        p = tokens(50, 7)
        for e in (reuse, plain):
            e.generate([req(p, n=4)])
        hit0 = reuse.stats()["prefix_hit_tokens"]
        diverged = p[:30] + [(x + 1) % V for x in p[30:]]
        out = reuse.generate([req(diverged, n=8)])[0]
        assert reuse.stats()["prefix_hit_tokens"] - hit0 == 30
        assert out.token_ids == plain.generate([req(diverged, n=8)])[0].token_ids
        # Too short a common part (below MIN_REUSE) is no hit; a prompt equal to a parked sequence
        # recomputes only its last token.
        short = p[: MIN_REUSE - 1] + [(x + 1) % V for x in p[MIN_REUSE - 1 :]]
        same = diverged + out.token_ids[:-1]
        h1 = reuse.stats()["prefix_hit_tokens"]
        a, b = reuse.generate([req(short, n=5), req(same, n=5)])
        assert reuse.stats()["prefix_hit_tokens"] - h1 == len(same) - 1
        assert [a.token_ids, b.token_ids] == [
            c.token_ids for c in plain.generate([req(short, n=5), req(same, n=5)])
        ]
    finally:
        reuse.stop()
        plain.stop()


def test_eviction_and_relocation_under_slot_pressure():
    # Two active slots, two parked: parked KV gets evicted (LRU) and moved out of the way of new sessions.
    reuse, plain = engines(max_batch=2, max_parked=2)
    try:
        ps = [tokens(20 + i, 20 + i) for i in range(4)]
        firsts = [reuse.generate([req(p, n=3)])[0] for p in ps]  # one at a time: each parks in slot 0 first
        assert reuse.stats()["parked"] == 2
        h = reuse.stats()["prefix_hit_tokens"]
        follow = [p + c.token_ids + [9] for p, c in zip(ps, firsts, strict=True)]
        # Sessions 0 and 1 were evicted; 2 and 3 reuse. Four at once: the batch is full, two queue.
        outs = reuse.generate([req(f, n=5) for f in reversed(follow)])
        assert reuse.stats()["prefix_hit_tokens"] - h == sum(len(p) + 2 for p in ps[2:])
        ref = [plain.generate([req(f, n=5)])[0] for f in reversed(follow)]
        assert [c.token_ids for c in outs] == [c.token_ids for c in ref]
        assert reuse.stats()["parked"] == 2
        assert reuse.health() == IDLE_HEALTH
    finally:
        reuse.stop()
        plain.stop()


def test_same_parked_prefix_claimed_once_and_bad_requests_still_fail_cleanly():
    reuse, plain = engines(max_batch=4, max_parked=4)
    try:
        p = tokens(30, 11)
        first = reuse.generate([req(p, n=4)])[0]
        follow = p + first.token_ids + [1, 2, 3]
        h = reuse.stats()["prefix_hit_tokens"]
        bad = [req([]), req([1, V + 5]), req(list(range(300))), req(follow, p=0.0)]
        outs = reuse.generate([req(follow, n=6), *bad, req(follow, n=6), req(p, n=6)])
        assert [c.finish_reason for c in outs] == ["length"] + ["error"] * 4 + ["length"] * 2
        assert reuse.stats()["prefix_hit_tokens"] - h == len(p) + 3  # one request took the parked slot
        assert outs[0].token_ids == outs[5].token_ids == plain.generate([req(follow, n=6)])[0].token_ids
        assert outs[6].token_ids == plain.generate([req(p, n=6)])[0].token_ids
        assert reuse.health() == IDLE_HEALTH
    finally:
        reuse.stop()
        plain.stop()


def record_copies(eng: BuiltinEngine) -> list[tuple[int, int]]:
    """The (source, destination) slots of every KV copy ``eng``'s runner makes from now on, appended as they
    happen (the runner's own ``move`` still does the copy)."""
    copies: list[tuple[int, int]] = []
    move = eng._runner.move

    def recorded(src: int, dst: int) -> None:
        copies.append((src, dst))
        move(src, dst)

    eng._runner.move = recorded
    return copies


def test_a_lockstep_group_back_in_any_order_is_prefilled_where_it_parked():
    # Four sessions finish a turn at the same step and park in slots 0..3; their next turns arrive in
    # reverse order. Admission puts each where its KV lies, so no KV is copied, and the outputs are those
    # of an engine without reuse.
    reuse, plain = engines(max_batch=4, max_parked=4)
    copies = record_copies(reuse)
    try:
        ps = [tokens(24 + i, 40 + i) for i in range(4)]
        firsts = reuse.generate([req(p, n=5) for p in ps])
        assert copies == []  # retiring together from the last slot down: each parks where it ran
        follow = [p + c.token_ids + [7, 8] for p, c in zip(ps, firsts, strict=True)]
        h = reuse.stats()["prefix_hit_tokens"]
        outs = reuse.generate([req(f, n=6) for f in reversed(follow)])
        assert reuse.stats()["prefix_hit_tokens"] - h == sum(len(p) + 4 for p in ps)
        assert copies == []
        ref = plain.generate([req(f, n=6) for f in reversed(follow)])
        assert [c.token_ids for c in outs] == [c.token_ids for c in ref]
        np.testing.assert_allclose([c.logprobs for c in outs], [c.logprobs for c in ref], atol=1e-5)
    finally:
        reuse.stop()
        plain.stop()


def test_sessions_finishing_together_park_in_place_and_one_runner_fills_the_gap():
    # Slots 0-2 finish at the same step while slot 3 runs on: slots 1 and 2 stay parked where they are,
    # slot 0 is parked in a free slot and slot 3 moves down into it (two copies; retiring one at a time,
    # each from the last running slot, took six). Their next turns match an engine without reuse.
    reuse, plain = engines(max_batch=4, max_parked=4)
    copies = record_copies(reuse)
    try:
        ps = [tokens(20 + i, 60 + i) for i in range(4)]
        firsts = reuse.generate([req(p, n=3 if i < 3 else 6) for i, p in enumerate(ps)])
        assert len(copies) == 2 and copies[1] == (3, 0), copies
        assert reuse.stats()["parked"] == 4
        follow = [p + c.token_ids + [5, 6] for p, c in zip(ps, firsts, strict=True)]
        h = reuse.stats()["prefix_hit_tokens"]
        outs = reuse.generate([req(f, n=4) for f in follow])
        assert reuse.stats()["prefix_hit_tokens"] - h == sum(len(f) - 3 for f in follow)
        ref = plain.generate([req(f, n=4) for f in follow])
        assert [c.token_ids for c in outs] == [c.token_ids for c in ref]
        np.testing.assert_allclose([c.logprobs for c in outs], [c.logprobs for c in ref], atol=1e-5)
    finally:
        reuse.stop()
        plain.stop()
