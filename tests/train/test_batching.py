"""Packing: micro-batch limits, per-token alignment, packed logprobs equal unpacked ones (real tiny model)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tandem.core.records import SegmentBuilder
from tandem.train.batching import SequenceInput, pack, plan_micro_batches, token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _load(path, impl):
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32, attn_implementation=impl
    )
    return model.eval()


def _segment(rng, n_prompt, n_sampled):
    b = SegmentBuilder()
    b.add_context(rng.integers(0, 512, n_prompt).tolist())
    b.add_sampled(rng.integers(0, 512, n_sampled).tolist(), [-1.0] * n_sampled, [0] * n_sampled)
    return b.build()


def test_plan_respects_limit_and_isolates_long_sequences():
    lengths = [5, 3, 12, 4, 2, 6]
    plan = plan_micro_batches(lengths, 8)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert sum(lengths[i] for i in b) <= 8 or len(b) == 1
    assert [2] in plan  # 12 > 8: alone
    assert plan == plan_micro_batches(lengths, 8)  # deterministic
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_micro_batches(lengths, 0)


def test_pack_layout_positions_masks_and_advantages():
    rng = np.random.default_rng(0)
    segs = [_segment(rng, 3, 2), _segment(rng, 2, 4), _segment(rng, 20, 5)]
    advs = [0.5, -1.0, 2.0]
    seqs = [SequenceInput(s, advs[i], group=0, trajectory=i) for i, s in enumerate(segs)]
    mbs = pack(seqs, micro_batch_tokens=12)
    assert len(mbs) == 2
    small = next(mb for mb in mbs if mb.seq_ids == [0, 1])
    assert small.input_ids.shape == (1, 11)
    assert small.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert small.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1]
    assert small.advantages.tolist() == [0.5] * 5 + [-1.0] * 6
    assert small.seq_index.tolist() == [0] * 5 + [1] * 6
    assert torch.isnan(small.sampler_logprobs[small.loss_mask == 0]).all()
    big = next(mb for mb in mbs if mb.seq_ids == [2])
    assert big.num_tokens == 25 and big.num_sampled == 5  # longer than the limit: alone, not cut


def test_first_token_of_a_sequence_is_never_trained():
    b = SegmentBuilder()
    b.add_sampled([5, 6], [-1.0, -1.0], [0, 0])
    (mb,) = pack([SequenceInput(b.build(), 1.0)], 64)
    assert mb.loss_mask.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(model_dir, impl):
    model = _load(model_dir, impl)
    rng = np.random.default_rng(1)
    segs = [_segment(rng, 4, 3), _segment(rng, 1, 1), _segment(rng, 6, 5), _segment(rng, 3, 2)]
    (packed,) = pack([SequenceInput(s, 1.0) for s in segs], micro_batch_tokens=64)
    with torch.no_grad():
        got = token_logprobs(model, packed, with_entropy=True)
        for k, seg in enumerate(segs):
            ids = torch.from_numpy(seg.token_ids.astype(np.int64))
            # reference: each sequence alone, logprob of token i from logits at i - 1
            logp = torch.log_softmax(model(ids[None], use_cache=False).logits[0], -1)
            want = torch.cat([torch.zeros(1), logp[:-1].gather(-1, ids[1:, None])[:, 0]])
            sel = packed.seq_index == k
            torch.testing.assert_close(got.logprobs[sel], want, atol=1e-5, rtol=0)
            want_ent = -(logp.exp() * logp).sum(-1)[:-1]
            m = torch.from_numpy(seg.loss_mask[1:]).bool()
            torch.testing.assert_close(got.entropy[sel][1:][m], want_ent[m], atol=1e-5, rtol=0)
        # Sanity: without restarting positions the sequences do attend to each other and results differ.
        flat = packed.input_ids
        crossed = model(flat, use_cache=False).logits[0]
        last = packed.seq_index == len(segs) - 1
        alone = model(flat[:, last], use_cache=False).logits[0]
        assert (crossed[last] - alone).abs().max() > 1e-3


def test_packed_logprobs_carry_gradients(model_dir):
    model = _load(model_dir, "sdpa")
    rng = np.random.default_rng(2)
    (mb,) = pack([SequenceInput(_segment(rng, 3, 3), 1.0), SequenceInput(_segment(rng, 2, 2), 1.0)], 64)
    out = token_logprobs(model, mb)
    (out.logprobs * mb.loss_mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
