"""`tandem bench engine`: the built-in engine against plain ``model.generate`` of transformers.

Same model, same batch of prompts, same number of new tokens (no early stop for either), sampling at
temperature 1. Each side is warmed up once, then timed ``repeats`` times, alternating the two sides, and the
best time of each counts (the least disturbed by other load on a shared machine); throughput is generated
tokens per second of wall time, prefill included. The ratio is measured in one process.
This is the one place that changes global torch settings (threads), restored on return.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import PreTrainedModel

from tandem.core.config import EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine.builtin import BuiltinEngine


def _default_model(seed: int = 0) -> PreTrainedModel:
    """A random-init Qwen3 of the shipped base model's shape (about 5.8M parameters at vocab 4096)."""
    from tandem.model import build_model, qwen3_config

    return build_model(qwen3_config("default", vocab_size=4096), seed).eval()


def _time_hf(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> float:
    attention = torch.ones_like(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompts,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return dt


def _time_engine(engine: BuiltinEngine, prompts: torch.Tensor, new_tokens: int, seed: int) -> float:
    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed + i))
        for i, p in enumerate(prompts.tolist())
    ]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    bad = [c for c in outs if len(c.token_ids) != new_tokens]
    if bad:
        raise RuntimeError(
            f"engine returned {len(bad[0].token_ids)} tokens instead of {new_tokens}: {bad[0]}"
        )
    return dt


def run(
    model_path: str | None = None,
    batch: int = 16,
    new_tokens: int = 64,
    prompt_len: int = 64,
    threads: int = 2,
    repeats: int = 3,
) -> dict[str, Any]:
    """Run the comparison and return the benchmark's JSON object."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if model_path is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
        else:
            model = _default_model()
        vocab = int(model.get_input_embeddings().weight.shape[0])
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g)
        n_params = sum(p.numel() for p in model.parameters())
        config = EngineConfig(
            max_batch=max(batch, 1), max_seq_len=prompt_len + new_tokens, threads=threads, max_parked=0
        )
        engine = BuiltinEngine(model, config, seed=0)
        engine.start()
        hf_times, eng_times = [], []
        try:
            for k in range(repeats + 1):  # round 0 is the warm-up of each side
                hf_times.append(_time_hf(model, prompts, new_tokens))
                eng_times.append(_time_engine(engine, prompts, new_tokens, seed=k * batch))
        finally:
            engine.stop()
        hf_dt, eng_dt = min(hf_times[1:]), min(eng_times[1:])
    finally:
        torch.set_num_threads(old_threads)
    total = batch * new_tokens
    eng_tps, hf_tps = total / eng_dt, total / hf_dt
    return {
        "results": [
            {"engine": "builtin", "tokens_per_s": round(eng_tps, 1)},
            {"engine": "hf_generate", "tokens_per_s": round(hf_tps, 1)},
        ],
        "speedup_vs_hf_generate": round(eng_tps / hf_tps, 3),
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "threads": threads,
        "repeats": repeats,
        "model_params": n_params,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
