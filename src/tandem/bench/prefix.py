"""`tandem bench prefix`: the engine's per-session prefix reuse on a simulated multi-turn workload.

Workload: ``sessions`` concurrent agent sessions, each ``turns`` turns; turn 1 sends a ``prompt``-token
context, every turn samples exactly ``sampled`` tokens (temperature 1, no stop) and the next turn resends the
whole context plus ``obs`` observation tokens, as soon as that session's previous turn returns (tools take
no time here). The same workload (same seeds) runs on the engine with ``max_parked=sessions`` and with
``max_parked=0``; reported: wall time, prefill tokens actually computed, tokens reused. Sets torch threads
(restored on return); one engine runs at a time.

Before anything is loaded (and, from the CLI, before this module is imported), ``preflight.check_prefix``
refuses (``BenchInputError``, naming the option) thread counts outside 1..4 per CPU, counts < 1, sessions
whose longest turn (``prompt + turns x (sampled + obs)`` tokens) exceeds the model's context, and sessions
whose KV cache (``2 x sessions`` slots of that length: the engine with reuse parks every session) exceeds
the memory available (``tandem.bench.limits``).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tandem.bench import preflight
from tandem.core.config import EngineConfig
from tandem.core.generation import GenerationRequest, SamplingParams
from tandem.engine.builtin import BuiltinEngine


def _model(path: str) -> PreTrainedModel:
    if Path(path).is_dir():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    from tandem.model import build_model, qwen3_config  # same shape as the shipped base model

    return build_model(qwen3_config("default", vocab_size=4096), 0).eval()


def _workload(
    eng: BuiltinEngine, sessions: int, turns: int, prompt: int, sampled: int, obs: int, seed: int = 1
) -> float:
    vocab = eng.vocab_size
    g = torch.Generator().manual_seed(seed)
    ctx = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(sessions)]
    done_turns = [0] * sessions

    def submit(i: int) -> Future:
        sp = SamplingParams(max_new_tokens=sampled, temperature=1.0, seed=1000 * i + done_turns[i])
        return eng.submit(GenerationRequest(ctx[i], sp))

    t0 = time.perf_counter()
    inflight = {submit(i): i for i in range(sessions)}
    while inflight:
        finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
        for f in finished:
            i = inflight.pop(f)
            c = f.result()
            if c.finish_reason == "error":
                raise RuntimeError(f"session {i} failed: {c.error}")
            done_turns[i] += 1
            if done_turns[i] < turns:
                o = torch.randint(
                    0, vocab, (obs,), generator=torch.Generator().manual_seed(i * 7919 + done_turns[i])
                )
                ctx[i] = ctx[i] + c.token_ids + o.tolist()
                inflight[submit(i)] = i
    return time.perf_counter() - t0


def run(
    model_path: str = "models/tandem-base",
    sessions: int = 32,
    turns: int = 4,
    prompt: int = preflight.PREFIX_PROMPT_TOKENS,
    sampled: int = preflight.PREFIX_SAMPLED_TOKENS,
    obs: int = preflight.PREFIX_OBS_TOKENS,
    threads: int = 2,
) -> dict[str, Any]:
    preflight.check_prefix(model_path, sessions, turns, prompt, sampled, obs, threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(model_path)
        seq = prompt + turns * (sampled + obs)
        out: dict[str, Any] = {}
        for parked in (sessions, 0):
            cfg = EngineConfig(max_batch=sessions, max_seq_len=seq, max_parked=parked)
            eng = BuiltinEngine(model, cfg)
            try:
                _workload(eng, 2, 2, prompt, 4, 4, seed=2)  # warm-up, other prompts (kernels, allocator)
                before = eng.stats()
                wall = _workload(eng, sessions, turns, prompt, sampled, obs)
                st = eng.stats()
            finally:
                eng.stop()
            out["reuse" if parked else "no_reuse"] = {
                "wall_s": round(wall, 2),
                "prefill_tokens": st["prefill_tokens"] - before["prefill_tokens"],
                "prefix_hit_tokens": st["prefix_hit_tokens"] - before["prefix_hit_tokens"],
                "tokens_generated": st["tokens_generated"] - before["tokens_generated"],
            }
        out["speedup"] = round(out["no_reuse"]["wall_s"] / out["reuse"]["wall_s"], 2)
        return out
    finally:
        torch.set_num_threads(old)
