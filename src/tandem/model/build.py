"""Build tandem's small Qwen3 causal LMs from a named size preset.

Invariants: ``qwen3_config(preset, vocab_size)`` is a pure function; models tie input and output embeddings;
``build_model`` initialises weights from ``seed`` only (same seed, same config -> identical weights).
Presets in ``SIZES`` are dense ``Qwen3ForCausalLM``; presets in ``MOE_SIZES`` are mixture-of-experts
``Qwen3MoeForCausalLM`` (every layer sparse; see ``tandem.model.moe`` for routing).
"""

from __future__ import annotations

from typing import Any

from tandem.model.chat import EOT


def _dense(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, head_dim: int = 64,
    context: int = 1024,
) -> dict[str, Any]:  # fmt: skip
    """One dense preset's ``Qwen3Config`` fields."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        max_position_embeddings=context,
    )


# Qwen3ForCausalLM sizes. "default" is the shipped tandem-base (~5.8M params at vocab 4096); "smoke" is a
# toy for tests that trains in seconds; "15m", "30m" and "100m" (~15M, ~27M and ~100M params at vocab 4096)
# are for engine benchmarks (where the built-in engine and vLLM cross over).
SIZES: dict[str, dict[str, Any]] = {
    "default": _dense(hidden=256, layers=6, heads=4, kv_heads=2, intermediate=768),
    "smoke": _dense(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, head_dim=32, context=256),
    "15m": _dense(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1152),
    "30m": _dense(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
    "100m": _dense(hidden=768, layers=13, heads=12, kv_heads=4, intermediate=2560),
}


# Qwen3MoeForCausalLM sizes. "moe": a tiny MoE (~1.4M params at vocab 4096, 8 experts, top-2) for tests and
# router-replay runs on a CPU.
MOE_SIZES: dict[str, dict[str, Any]] = {
    "moe": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=1024,
    ),
}


def qwen3_config(preset: str = "default", vocab_size: int = 4096, eos_token_id: int = 0):  # -> Qwen3Config
    """The ``Qwen3Config`` of a size preset (``SIZES``) for a tokenizer of ``vocab_size``; the
    ``Qwen3MoeConfig`` for a ``MOE_SIZES`` preset."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if preset not in SIZES and preset not in MOE_SIZES:
        raise ValueError(
            f"unknown model preset {preset!r}; choose one of {sorted(SIZES) + sorted(MOE_SIZES)}"
        )
    cls = Qwen3MoeConfig if preset in MOE_SIZES else Qwen3Config
    return cls(
        vocab_size=vocab_size,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        use_cache=True,
        **(MOE_SIZES[preset] if preset in MOE_SIZES else SIZES[preset]),
    )


def build_model(config: Any, seed: int = 0):  # -> Qwen3ForCausalLM | Qwen3MoeForCausalLM
    """A freshly initialised ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for a MoE config; float32, train
    mode) seeded by ``seed``."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cls = Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.float()


def num_params(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["EOT", "MOE_SIZES", "SIZES", "build_model", "num_params", "qwen3_config"]
