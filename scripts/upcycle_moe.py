"""Sparse upcycling of a dense tandem model into a Qwen3MoeForCausalLM that can already solve tasks.

Every MoE layer gets ``--experts`` copies of the dense layer's MLP, each multiplied elementwise by
``1 + noise * N(0, 1)`` (so experts differ and routing matters), and a router initialised at
``N(0, router_std)``; attention, norms and embeddings are copied unchanged. With ``norm_topk_prob`` the
top-k weights sum to 1, so at ``--noise 0`` the MoE computes exactly the dense model's function (checked:
the script prints the largest logit difference to the dense model on a random batch for the noise used,
and fails if the zero-noise model differs by more than 1e-4).

Usage: python scripts/upcycle_moe.py models/tandem-base models/tandem-moe-upcycled [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tandem.model.moe import TOKENIZER_FILES


def upcycle(dense: torch.nn.Module, experts: int, top_k: int, noise: float, router_std: float, seed: int):
    c = dense.config
    cfg = Qwen3MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[],
    )  # fmt: skip
    moe = Qwen3MoeForCausalLM(cfg)
    src = dense.state_dict()
    missing, unexpected = moe.load_state_dict(
        {k: v for k, v in src.items() if ".mlp." not in k}, strict=False
    )
    assert not unexpected, unexpected
    assert all(".mlp." in k for k in missing), missing
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, layer in enumerate(moe.model.layers):
            mlp = dense.model.layers[i].mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)  # (2I, H): gate first
            for e in range(experts):
                for dst, w in (
                    (layer.mlp.experts.gate_up_proj, gate_up),
                    (layer.mlp.experts.down_proj, mlp.down_proj.weight),
                ):
                    dst[e].copy_(w * (1 + noise * torch.randn(w.shape, generator=g)))
            layer.mlp.gate.weight.copy_(router_std * torch.randn(layer.mlp.gate.weight.shape, generator=g))
    return moe.eval()


def max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, vocab: int) -> float:
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((a(ids).logits - b(ids).logits).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dense", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.05, help="relative std of each expert's perturbation")
    p.add_argument("--router-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    dense = AutoModelForCausalLM.from_pretrained(a.dense, dtype=torch.float32).eval()
    exact = upcycle(dense, a.experts, a.top_k, 0.0, a.router_std, a.seed)
    diff0 = max_logit_diff(dense, exact, dense.config.vocab_size)
    if diff0 > 1e-4:
        raise SystemExit(
            f"error: the zero-noise upcycled model differs from {a.dense} by {diff0:.3g} in logits"
        )
    moe = upcycle(dense, a.experts, a.top_k, a.noise, a.router_std, a.seed)
    diff = max_logit_diff(dense, moe, dense.config.vocab_size)
    a.out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(a.out)
    for name in TOKENIZER_FILES:
        if (a.dense / name).is_file():
            shutil.copy2(a.dense / name, a.out / name)
    n = sum(t.numel() for t in moe.parameters())
    print(
        f"wrote {a.out}: Qwen3MoeForCausalLM, {n / 1e6:.1f}M parameters, {a.experts} experts top-{a.top_k}; "
        f"max |logit - dense logit| {diff0:.2g} at noise 0, {diff:.3g} at noise {a.noise}"
    )


if __name__ == "__main__":
    main()
