"""Deterministic (batch-invariant) mode, ``train.deterministic``: the primitives of
``tandem.model.deterministic`` give a row / a query the same bits whatever shares its batch; the built-in
engine gives a sequence the same logprob bits alone or among concurrent requests; the trainer's logprobs of
those tokens, packed with other sequences, equal the engine's bits (mismatch KL exactly 0); the run config
refuses what cannot be deterministic."""

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.core.config import EngineConfig, RunConfig, TrainConfig
from tandem.core.errors import EngineError
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.core.records import Group, Reward, SegmentBuilder, Trajectory
from tandem.engine import create_engine
from tandem.engine.builtin import BuiltinEngine
from tandem.model import deterministic as det
from tandem.train.batching import SequenceInput, pack
from tandem.train.deterministic import DeterministicLogprobs
from tandem.train.trainer import Trainer, load_causal_lm

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "tandem-base")


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- primitives --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), [(256, 768), (768, 256), (1024, 512), (2560, 768)])
def test_linear_row_is_the_same_alone_and_anywhere_in_any_batch(k, n, threads):
    torch.set_num_threads(threads)  # the fixture restores it
    g = torch.Generator().manual_seed(k)
    wt = torch.randn(n, k, generator=g).t().contiguous()
    b = torch.randn(n, generator=g)
    x = torch.randn(1000, k, generator=g)
    row = x[0]
    alone = det.linear(row[None], wt, b)[0]
    for m in (2, 5, 16, 17, 40, 300, 1000):
        for at in (0, m // 2, m - 1):
            batch = x[:m].clone()
            batch[at] = row
            assert torch.equal(det.linear(batch, wt, b)[at], alone), (m, at)
    # 3-D inputs are rows too
    assert torch.equal(det.linear(x[:12].view(3, 4, k), wt, b).view(12, n)[0], alone)


def test_plain_matmul_is_not_batch_invariant_here():
    """Why padding and K slices exist (printed, not asserted: were it invariant, they would only cost)."""
    g = torch.Generator().manual_seed(1)
    wt = torch.randn(768, 256, generator=g).t().contiguous()
    x = torch.randn(64, 256, generator=g)
    alone = x[:1] @ wt
    differs = [m for m in range(2, 64) if not torch.equal((x[:m] @ wt)[0], alone[0])]
    print(f"plain x @ W: row 0 differs from alone for {len(differs)}/62 batch sizes")


def test_row_ops_are_row_invariant():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 4096, generator=g)
    w = torch.randn(4096, generator=g)
    t = torch.rand(70, generator=g) + 0.5
    tok = torch.randint(0, 4096, (70,), generator=g)
    for m in (1, 3, 70):
        assert torch.equal(det.rms_norm(x[:m], w, 1e-6)[0], det.rms_norm(x[:1], w, 1e-6)[0])
        assert torch.equal(
            det.token_logprob(x[:m], t[:m], tok[:m])[0], det.token_logprob(x[:1], t[:1], tok[:1])[0]
        )


def test_two_threads_are_batch_invariant_too():
    """engine.threads == train.threads == 2 is allowed: rows are invariant within that thread count too."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(5)
    for k, n in ((256, 768), (1024, 512)):
        wt = torch.randn(n, k, generator=g).t().contiguous()
        x = torch.randn(100, k, generator=g)
        alone = det.linear(x[7:8], wt)[0]
        assert all(torch.equal(det.linear(x[: 8 + m], wt)[7], alone) for m in (0, 9, 92)), (k, n)
    big = torch.randn(5, 150_000, generator=g)  # a large vocabulary: one row alone vs in a batch
    t, tok = torch.ones(5), torch.arange(5)
    assert torch.equal(det.token_logprob(big[:1], t[:1], tok[:1])[0], det.token_logprob(big, t, tok)[0])
    q, k, v = _attn_inputs(6, 2, 80, 80)
    pos = torch.arange(80)[None].expand(2, 80)
    both = det.attention(q, k, v, pos, 0.125)
    assert torch.equal(det.attention(q[1:], k[1:], v[1:], pos[1:], 0.125)[0], both[1])


def _attn_inputs(seed, s, lq, lk, h=4, hkv=2, d=64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(s, lq, h, d, generator=g),
        torch.randn(s, hkv, lk, d, generator=g),
        torch.randn(s, hkv, lk, d, generator=g),
    )


def test_attention_query_is_the_same_alone_batched_and_as_decode():
    q, k, v = _attn_inputs(0, 1, 150, 150)
    pos = torch.arange(150)[None]
    full = det.attention(q, k, v, pos, 0.125)  # the trainer's view: the whole sequence at once
    # The same sequence among others of other lengths (padded keys and queries), at another batch position.
    q2, k2, v2 = _attn_inputs(1, 3, 200, 260)
    q2[2, :150], k2[2, :, :150], v2[2, :, :150] = q[0], k[0], v[0]
    pos2 = torch.arange(200)[None].expand(3, 200)
    assert torch.equal(det.attention(q2, k2, v2, pos2, 0.125)[2, :150], full[0])
    # Decode: query t alone against a cache holding other (finite) values past t; prefill after a prefix.
    for t in (0, 63, 64, 149):
        kc, vc = k2[:1].clone(), v2[:1].clone()
        kc[0, :, : t + 1], vc[0, :, : t + 1] = k[0, :, : t + 1], v[0, :, : t + 1]
        one = det.attention(q[:, t : t + 1], kc, vc, torch.tensor([[t]]), 0.125)
        assert torch.equal(one[0, 0], full[0, t]), t
    tail = det.attention(q[:, 100:], k, v, torch.arange(100, 150)[None], 0.125)
    assert torch.equal(tail[0], full[0, 100:])


def test_attention_has_gradients():
    q, k, v = (x.requires_grad_() for x in _attn_inputs(3, 2, 20, 20))
    det.attention(q, k, v, torch.arange(20)[None].expand(2, 20), 0.125).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
    # causal: the last query's keys do not influence the first query
    q, k, v = _attn_inputs(4, 1, 8, 8)
    k.requires_grad_()
    det.attention(q, k, v, torch.arange(8)[None], 0.125)[0, 0].sum().backward()
    assert torch.equal(k.grad[0, :, 1:], torch.zeros_like(k.grad[0, :, 1:]))


# ---- engine and trainer ------------------------------------------------------------------------------------


def _engine(**kw):
    cfg = dict(max_batch=8, max_seq_len=256, max_parked=0)
    cfg.update(kw)
    return BuiltinEngine.from_path(MODEL, EngineConfig(**cfg), deterministic=True)


def _req(prompt, seed, n, temperature=1.0, top_p=1.0):
    return GenerationRequest(
        prompt_ids=list(prompt),
        params=SamplingParams(max_new_tokens=n, temperature=temperature, top_p=top_p, seed=seed),
    )


TARGET = [5, 17, 99, 300, 42, 7, 8, 1000, 23, 61, 2000, 12]
OTHERS = [([3 + i, 50, 60 + i, 700] * (i + 1), 7 + i, 12 + 7 * i) for i in range(6)]


@pytest.fixture(scope="module")
def engine():
    eng = _engine()
    yield eng
    eng.stop()


def test_engine_logprobs_do_not_depend_on_the_batch(engine):
    alone = engine.generate([_req(TARGET, 123, 40, temperature=0.9, top_p=0.95)])[0]
    assert len(alone.token_ids) == 40
    others = [_req(p, s, n) for p, s, n in OTHERS]
    for at in (0, 3, 6):
        mixed = engine.generate([*others[:at], _req(TARGET, 123, 40, 0.9, 0.95), *others[at:]])[at]
        assert mixed.token_ids == alone.token_ids
        assert mixed.logprobs == alone.logprobs and mixed.logmass == alone.logmass
    # Admitted while the others are half-way through their decode (prefill and decode batches differ).
    futs = [engine.submit(r) for r in others]
    time.sleep(0.05)
    late = engine.submit(_req(TARGET, 123, 40, 0.9, 0.95)).result()
    [f.result() for f in futs]
    assert late.token_ids == alone.token_ids and late.logprobs == alone.logprobs


def test_prefix_reuse_gives_the_same_bits():
    fresh, reuse = _engine(), _engine(max_parked=4)
    try:
        first = reuse.generate([_req(TARGET, 1, 10)])[0]
        turn2 = [*TARGET, *first.token_ids, 77, 78, 79]
        a = reuse.generate([_req(turn2, 2, 20)])[0]
        assert reuse.stats()["prefix_hit_tokens"] > 0
        b = fresh.generate([_req(turn2, 2, 20)])[0]
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    finally:
        fresh.stop()
        reuse.stop()


def _segment(prompt, completion, temperature):
    b = SegmentBuilder()
    b.add_context(list(prompt))
    b.add_sampled(
        completion.token_ids, completion.logprobs, completion.versions, completion.logmass, temperature
    )
    return b.build()


def _groups(engine):
    """Two groups of two trajectories: the target (temperature 0.9, top-p 0.95) and the others."""
    reqs = [_req(TARGET, 123, 40, 0.9, 0.95), *[_req(p, s, n) for p, s, n in OTHERS[:3]]]
    outs = engine.generate(reqs)
    segs = [_segment(r.prompt_ids, c, r.params.temperature) for r, c in zip(reqs, outs, strict=True)]
    trajs = [Trajectory("t", [s], Reward(float(i % 2))) for i, s in enumerate(segs)]
    return [Group("a", trajs[:2]), Group("b", trajs[2:])]


def test_trainer_logprobs_equal_the_engine_bits_when_packed(engine):
    groups = _groups(engine)
    segs = [t.segments[0] for g in groups for t in g.trajectories]
    trainer = Trainer(MODEL, TrainConfig(deterministic=True, threads=1, micro_batch_tokens=512))
    mbs = pack([SequenceInput(s, 1.0) for s in segs], 512)
    assert len(mbs) < len(segs)  # sequences really are packed together
    dl = DeterministicLogprobs(trainer.model)
    for mb in mbs:
        with torch.no_grad():
            lp = dl(mb).logprobs
        m = mb.loss_mask > 0
        assert torch.equal(lp[m], mb.sampler_logprobs[m])
    metrics = trainer.step(groups)
    assert metrics["mismatch_tokens"] == sum(s.num_sampled for s in segs)
    assert metrics["mismatch_kl_k3"] == 0.0 and metrics["mismatch_abs_dlogp_max"] == 0.0
    assert metrics["updated"] == 1 and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0


def test_bf16_published_weights_still_give_exact_logprobs(element_patches):
    """The delta transport publishes bf16: the engine computes on the rounded weights, the trainer's
    deterministic forward reads its fp32 masters through the same rounding, so the bits still agree, also
    after updates: a full reload, then element patches (the delta path's ``patch_weights``)."""
    trainer = Trainer(MODEL, TrainConfig(deterministic=True, threads=1, lr=1e-3), publish_dtype="bfloat16")
    eng = _engine()
    try:
        state = trainer.publish_state()
        eng.update_weights(0, state)
        for step in range(3):
            groups = _groups(eng)
            metrics = trainer.step(groups)
            assert metrics["mismatch_kl_k3"] == 0.0 and metrics["mismatch_abs_dlogp_max"] == 0.0, step
            assert metrics["updated"] == 1
            new = trainer.publish_state()
            patches = element_patches(state, new)
            assert patches
            eng.patch_weights(trainer.version, patches)
            state = new
    finally:
        eng.stop()


def test_default_mode_is_not_exact_and_deterministic_mode_costs(engine):
    """Measured, printed (not asserted beyond sanity): the default trainer's mismatch on the same batch,
    and the slowdowns of deterministic mode for engine generation and one trainer forward."""
    groups = _groups(engine)
    segs = [t.segments[0] for g in groups for t in g.trajectories]
    default = Trainer(MODEL, TrainConfig(threads=1, micro_batch_tokens=512))
    print(
        "default-mode trainer mismatch_kl_k3 on the engine's batch:", default.step(groups)["mismatch_kl_k3"]
    )
    plain = BuiltinEngine.from_path(MODEL, EngineConfig(max_batch=8, max_seq_len=256, max_parked=0))
    reqs = [_req(p, s, n) for p, s, n in OTHERS] + [_req(TARGET, 5, 40)]
    times = {}
    try:
        for name, eng in (("default", plain), ("deterministic", engine)):
            eng.generate(reqs[:1])
            t0 = time.perf_counter()
            out = eng.generate(reqs)
            times[name] = (time.perf_counter() - t0, sum(len(c.token_ids) for c in out))
    finally:
        plain.stop()
    for name, (dt, n) in times.items():
        print(f"engine {name}: {n} tokens in {dt:.3f} s ({n / dt:.0f} tok/s)")
    print(f"engine slowdown: {times['deterministic'][0] / times['default'][0]:.2f}x")
    mb = pack([SequenceInput(s, 1.0) for s in segs], 512)[0]
    from tandem.train.batching import token_logprobs

    dl = DeterministicLogprobs(default.model)
    fns = {"default": lambda: token_logprobs(default.model, mb), "deterministic": lambda: dl(mb)}
    for label, backward in (("forward", False), ("forward+backward", True)):
        ft = {}
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(3):
                if backward:
                    fn().logprobs.sum().backward()
                else:
                    with torch.no_grad():
                        fn()
            ft[name] = (time.perf_counter() - t0) / 3
        print(
            f"trainer {label} of {mb.num_tokens} tokens ({len(mb.seq_ids)} sequences): default "
            f"{ft['default']:.3f} s, deterministic {ft['deterministic']:.3f} s "
            f"({ft['deterministic'] / ft['default']:.2f}x)"
        )


# ---- config ------------------------------------------------------------------------------------------------


def test_config_refuses_what_cannot_be_deterministic():
    RunConfig(train={"deterministic": True})
    with pytest.raises(ValueError, match=r"train\.deterministic=true with engine\.kind='vllm'"):
        RunConfig(train={"deterministic": True}, engine={"kind": "vllm"})
    with pytest.raises(ValueError, match=r"model\.dtype='bfloat16'"):
        RunConfig(train={"deterministic": True}, model={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"engine\.threads=2 != train\.threads=1"):
        RunConfig(train={"deterministic": True}, engine={"threads": 2})
    RunConfig(engine={"kind": "vllm"}, train={"deterministic": False})


def test_unsupported_models_and_other_dtypes_are_refused_with_the_reason(tmp_path):
    gelu = load_causal_lm(MODEL)
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="train.deterministic cannot run this model: hidden_act 'gelu'"):
        DeterministicLogprobs(gelu)
    with pytest.raises(EngineError, match="float32"):
        _engine_bf16()
    with pytest.raises(ValueError, match="engine.kind='builtin'"):
        create_engine(MODEL, EngineConfig(kind="vllm"), deterministic=True)


def _engine_bf16():
    return BuiltinEngine.from_path(
        MODEL, EngineConfig(max_batch=2, max_seq_len=64), dtype="bfloat16", deterministic=True
    )
