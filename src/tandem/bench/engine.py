"""`tandem bench engine`: the built-in engine, the vLLM engine and plain ``model.generate`` of transformers.

For each model size (the shipped base model's shape, ~5.8M parameters, ``15m`` and ``100m``; ``30m`` on
request; random weights: throughput does not depend on them) every engine gets the same batch of prompts and
the same number of new tokens (no early stop), sampling at temperature 1. Two numbers per engine:

- ``tokens_per_s``: generated tokens per second of wall time for the whole batch, prefill included;
- ``ttft_s``: time to first token of the whole batch (the same batch with one new token: prefill-bound).

Each engine is warmed up once, then the engines are timed in turn ``repeats`` times and the best time of each
counts (the least disturbed by other load on a shared machine), all in one process, so the ratios hold on a
noisy machine. An engine that cannot run here (vLLM not installed) is reported with its error, not left out.
Per size, ``auto_picks`` is the engine ``engine.kind = "auto"`` chooses given this run's rates (it measures
both engines on the machine: ``tandem.engine.calibrate``), and ``threshold_picks`` the one its fallback
without a measurement chooses (``engine.vllm_from_params``), with ``threshold_picks_faster`` whether that is
the one of the two with more tokens/s here (None unless both ran).
This is the one place that changes global torch settings (threads), restored on return.

Before any model is built (and, from the CLI, before this module is imported),
``preflight.check_engine`` refuses (``BenchInputError``, naming the option) unknown sizes or engines,
counts < 1, thread counts outside 1..4 per CPU, more than ``limits.MAX_REPEATS`` rounds, ``prompt_len +
new_tokens`` beyond a model's context (``max_position_embeddings``; 256 for ``smoke``), and a batch whose
KV caches (one per engine asked for, ``batch x (prompt_len + new_tokens)`` tokens each) exceed the memory
available (``tandem.bench.limits``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tandem.bench import preflight
from tandem.core.config import EngineConfig
from tandem.engine.builtin import BuiltinEngine
from tandem.engine.calibrate import decode_seconds
from tandem.engine.choice import choose_engine

ENGINES = preflight.ENGINE_BENCH_ENGINES
SIZES = ("default", "15m", "100m")


def _random_model(size: str, seed: int = 0) -> PreTrainedModel:
    """A random-init Qwen3 of a size preset (``tandem.model.build.SIZES``) at vocab 4096."""
    from tandem.model import build_model, qwen3_config

    return build_model(qwen3_config(size, vocab_size=4096), seed).eval()


def _hf_generate(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
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


def _measure_size(
    size: str,
    model: PreTrainedModel,
    model_dir: Path,
    engines: tuple[str, ...],
    batch: int,
    new_tokens: int,
    prompt_len: int,
    threads: int,
    repeats: int,
) -> dict[str, Any]:
    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g)
    config = EngineConfig(
        max_batch=max(batch, 1), max_seq_len=prompt_len + new_tokens, threads=threads, max_parked=0
    )
    runners: dict[str, Callable[[int, int], float]] = {}
    errors: dict[str, str] = {}
    started: list[Any] = []
    for name in engines:
        if name == "hf_generate":
            runners[name] = lambda n, k: _hf_generate(model, prompts, n)
            continue
        try:
            if name == "builtin":
                eng: Any = BuiltinEngine(model, config, seed=0)
            else:
                from tandem.engine.vllm import VllmEngine

                eng = VllmEngine(model_dir, config, seed=0)
            eng.start()
        except Exception as e:  # noqa: BLE001 - reported in the result, the others still run
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        started.append(eng)
        runners[name] = lambda n, k, eng=eng: decode_seconds(eng, prompts.tolist(), n, seed=k * batch)
    times: dict[str, list[float]] = {n: [] for n in runners}
    firsts: dict[str, list[float]] = {n: [] for n in runners}
    try:
        for k in range(repeats + 1):  # round 0 is each engine's warm-up
            for name, fn in runners.items():
                times[name].append(fn(new_tokens, k))
                firsts[name].append(fn(1, k))
    finally:
        for eng in started:
            getattr(eng, "close", eng.stop)()
    total = batch * new_tokens
    results: list[dict[str, Any]] = []
    for name in engines:
        if name in errors:
            results.append({"engine": name, "error": errors[name]})
        else:
            tps = total / min(times[name][1:])
            ttft = min(firsts[name][1:])
            results.append({"engine": name, "tokens_per_s": round(tps, 1), "ttft_s": round(ttft, 4)})
    ok = [r for r in results if "tokens_per_s" in r]
    fastest = max(ok, key=lambda r: r["tokens_per_s"])["engine"] if ok else None
    threshold, _ = choose_engine(EngineConfig(auto_measure=False), model_dir)
    auto, threshold_faster = threshold, None
    if {"builtin", "vllm"} <= {r["engine"] for r in ok}:
        rates = {e: _tps(ok, e) for e in ("builtin", "vllm")}
        given = lambda c, p: rates  # noqa: E731 - auto's choice given this run's rates
        auto, _ = choose_engine(EngineConfig(), model_dir, vllm_probe=lambda: None, measure=given)
        threshold_faster = threshold == max(rates, key=lambda e: rates[e])
    return {
        "size": size,
        "model_params": sum(p.numel() for p in model.parameters()),
        "results": results,
        "fastest_tokens_per_s": fastest,
        "fastest_ttft": min(ok, key=lambda r: r["ttft_s"])["engine"] if ok else None,
        "auto_picks": auto,
        "threshold_picks": threshold,
        "threshold_picks_faster": threshold_faster,
    }


def _tps(results: list[dict[str, Any]], engine: str) -> float:
    return next(r["tokens_per_s"] for r in results if r["engine"] == engine)


def run(
    model_path: str | None = None,
    sizes: tuple[str, ...] = SIZES,
    engines: tuple[str, ...] = ENGINES,
    batch: int = 16,
    new_tokens: int = 64,
    prompt_len: int = 64,
    threads: int = 2,
    repeats: int = 3,
) -> dict[str, Any]:
    """Run the comparison and return the benchmark's JSON object (``model_path``: one real model instead of
    the random ``sizes``)."""
    preflight.check_engine(model_path, sizes, engines, batch, new_tokens, prompt_len, threads, repeats)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    out_sizes: list[dict[str, Any]] = []
    try:
        if model_path is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
            args = (engines, batch, new_tokens, prompt_len, threads, repeats)
            out_sizes.append(_measure_size(Path(model_path).name, model, Path(model_path), *args))
        for size in () if model_path is not None else sizes:
            model = _random_model(size)
            tmp = Path(tempfile.mkdtemp(prefix=f"tandem-bench-{size}-"))
            try:
                model.save_pretrained(tmp)  # vLLM loads from a directory
                args = (engines, batch, new_tokens, prompt_len, threads, repeats)
                out_sizes.append(_measure_size(size, model, tmp, *args))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            del model
    finally:
        torch.set_num_threads(old_threads)
    return {
        "sizes": out_sizes,
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "threads": threads,
        "repeats": repeats,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
