"""Build tandem's small Qwen3 causal LMs from a named size preset.

Invariants: ``qwen3_config(preset, vocab_size)`` is a pure function; models tie input and output embeddings;
``build_model`` initialises weights from ``seed`` only (same seed, same config -> identical weights).
"""

from __future__ import annotations

from typing import Any

from tandem.model.chat import EOT

# Qwen3ForCausalLM sizes. "default" is the shipped tandem-base (~5.8M params at vocab 4096); "smoke" is a
# toy for tests that trains in seconds.
SIZES: dict[str, dict[str, Any]] = {
    "default": dict(
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=1024,
    ),
    "smoke": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=256,
    ),
}


def qwen3_config(preset: str = "default", vocab_size: int = 4096, eos_token_id: int = 0):  # -> Qwen3Config
    """The ``Qwen3Config`` of a size preset (``default`` or ``smoke``) for a tokenizer of ``vocab_size``."""
    from transformers import Qwen3Config

    if preset not in SIZES:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(SIZES)}")
    return Qwen3Config(
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
        **SIZES[preset],
    )


def build_model(config: Any, seed: int = 0):  # -> Qwen3ForCausalLM
    """A freshly initialised ``Qwen3ForCausalLM`` (float32, train mode) seeded by ``seed``."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float()


def num_params(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["EOT", "SIZES", "build_model", "num_params", "qwen3_config"]
