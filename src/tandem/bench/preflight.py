"""Up-front checks of `tandem bench` options, importable without torch, transformers or Ray.

A benchmark's own module imports torch (and most of them transformers through the engine): 3-7 s on two
cores before a single option could be looked at. The CLI runs a benchmark's check from here first, so a typo
is refused in about the time Python takes to start; each benchmark's run function calls the same check
again before it builds anything, for callers that skip the CLI.

Invariants:
- each ``check_*`` raises ``limits.BenchInputError`` (a ``ValueError``) naming the first option out of range
  and returns None otherwise; it builds, loads and writes nothing;
- what a check reads is the model directory's ``config.json`` and safetensors headers
  (``tandem.bench.limits``), the presets of ``tandem.model.build``, ``/proc/meminfo`` and, last of all
  checks and only in ``check_gateway``, the model's tokenizer (which imports transformers) to measure the
  sessions' longest context; the bounds and why are in ``tandem.bench.limits``;
- this module imports only the standard library, ``limits`` and (inside functions) light tandem modules;
  a test checks that a refused option leaves torch, transformers and Ray unimported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tandem.bench import limits

ENGINE_BENCH_ENGINES = ("builtin", "vllm", "hf_generate")
"""Engines `tandem bench engine` compares."""

GATEWAY_ENGINES = ("auto", "builtin", "vllm")
"""Engines `tandem bench gateway` runs both of its sides on."""

GATEWAY_MAX_SEQ_LEN = 1024
"""The engine's context per session (``EngineConfig.max_seq_len``) on both sides of `tandem bench gateway`."""

GATEWAY_TOOL_RESULT = "exit 0\nstdout:\n2 passed, 0 failed (round {r}, session {i}, turn {t})\n"
"""The tool message every later turn of a `tandem bench gateway` session sends back."""

CODEC_WORKLOADS = ("tandem_train", "synthetic_1gb")
"""Workloads of `tandem bench codec`."""

SYNTHETIC_BYTES_PER_PARAM = 18
"""Least memory per synthetic parameter, held at once during the last optimizer step: fp32 master (4),
AdamW's two moments (8), the gradient (4) and the bf16 version published before it (2)."""

RANDOM_MODEL_VOCAB = 4096
"""Vocabulary of the random-weight models the engine and prefix benchmarks build."""

PREFIX_PROMPT_TOKENS, PREFIX_SAMPLED_TOKENS, PREFIX_OBS_TOKENS = 300, 40, 40
"""`tandem bench prefix`'s default turn: its opening context, the tokens sampled per turn and the observation
tokens each later turn adds."""


# ============================================================================ engine
def engine_model_configs(model_path: str | None, sizes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Name -> model config of every model `tandem bench engine` builds or loads."""
    if model_path is not None:
        return {Path(model_path).name: limits.read_config(model_path)}
    from tandem.model.build import SIZES as PRESETS

    return {size: {**PRESETS[size], "vocab_size": RANDOM_MODEL_VOCAB} for size in sizes}


def check_engine(
    model_path: str | None, sizes: tuple[str, ...], engines: tuple[str, ...], batch: int, new_tokens: int,
    prompt_len: int, threads: int, repeats: int,
) -> None:  # fmt: skip
    """`tandem bench engine`: known sizes and engines, counts >= 1, threads, rounds, ``prompt_len +
    new_tokens`` within each model's context, and the engines' KV caches within the memory available."""
    from tandem.model.build import SIZES as PRESETS

    unknown = [e for e in engines if e not in ENGINE_BENCH_ENGINES]
    if unknown:
        raise limits.BenchInputError(
            f"--engines: {unknown[0]!r} is unknown; choose from {', '.join(ENGINE_BENCH_ENGINES)}"
        )
    unknown = [s for s in sizes if s not in PRESETS]
    if unknown:
        raise limits.BenchInputError(f"--sizes: {unknown[0]!r} is unknown; choose from {', '.join(PRESETS)}")
    if not engines or (model_path is None and not sizes):
        raise limits.BenchInputError("--engines and --sizes need at least one entry each")
    limits.require(
        limits.at_least("--batch", batch),
        limits.at_least("--new-tokens", new_tokens),
        limits.at_least("--prompt-len", prompt_len),
        limits.threads(threads),
        limits.repeats(repeats),
    )
    seq = prompt_len + new_tokens
    for name, config in engine_model_configs(model_path, sizes).items():
        holder = f"model {name!r} (max_position_embeddings)"
        limits.require(
            limits.fits_context(("--prompt-len", "--new-tokens"), seq, limits.context_of(config), holder)
        )
        # every engine holds one at once: fp32 like the model, vLLM's at least bf16
        kv = sum(batch * seq * limits.kv_bytes_per_token(config, 2 if e == "vllm" else 4) for e in engines)
        what = f"a KV cache of --batch x {seq} tokens in each of {len(engines)} engine(s), model {name!r}"
        limits.require(limits.fits_memory(("--batch",), kv, what))


# ============================================================================ prefix
def prefix_model_config(path: str) -> dict[str, Any]:
    """The config `tandem bench prefix` loads or builds (a model directory's, else the default preset)."""
    if Path(path).is_dir():
        return limits.read_config(path)
    from tandem.model.build import SIZES

    return {**SIZES["default"], "vocab_size": RANDOM_MODEL_VOCAB}


def check_prefix(
    model_path: str, sessions: int, turns: int, prompt: int, sampled: int, obs: int, threads: int
) -> None:
    """`tandem bench prefix`: threads, counts >= 1, the longest turn (``prompt + turns x (sampled + obs)``
    tokens) within the model's context, and the KV cache of ``2 x sessions`` slots (the engine with reuse
    parks every session) within the memory available."""
    limits.require(
        limits.at_least("--sessions", sessions),
        limits.at_least("--turns", turns),
        limits.threads(threads),
    )
    config = prefix_model_config(model_path)
    seq = prompt + turns * (sampled + obs)
    holder = f"the model ({Path(model_path).name}, max_position_embeddings)"
    how = f"a {prompt}-token prompt + --turns x {sampled + obs} sampled and observation tokens"
    limits.require(limits.fits_context(("--turns",), seq, limits.context_of(config), holder, how))
    kv = 2 * sessions * seq * limits.kv_bytes_per_token(config)
    limits.require(limits.fits_memory(("--sessions", "--turns"), kv, "the KV cache of 2 x --sessions slots"))


# ============================================================================ gateway
def check_gateway(
    model_path: str, sessions: int, turns: int, max_tokens: int, threads: int, repeats: int,
    client_procs: int, engine_kind: str,
) -> None:  # fmt: skip
    """`tandem bench gateway`: a known engine, counts >= 1, rounds, threads, client processes (at most 4 per
    CPU and at most ``sessions``), and the KV cache of ``2 x sessions`` slots of ``GATEWAY_MAX_SEQ_LEN``
    tokens within the memory available, and each session's longest context (``gateway_longest_context``)
    within ``GATEWAY_MAX_SEQ_LEN`` and the model's context."""
    if engine_kind not in GATEWAY_ENGINES:
        raise limits.BenchInputError(
            f"--engine {engine_kind!r} is unknown; choose one of {', '.join(GATEWAY_ENGINES)}"
        )
    limits.require(
        limits.at_least("--sessions", sessions),
        limits.at_least("--turns", turns),
        limits.at_least("--max-tokens", max_tokens),
        limits.repeats(repeats),
        limits.threads(threads),
        limits.processes("--client-procs", client_procs),
    )
    if client_procs > sessions:
        raise limits.BenchInputError(
            f"--client-procs must be <= --sessions (each client process runs sessions of its own), got "
            f"client_procs={client_procs} with sessions={sessions}"
        )
    config = limits.read_config(model_path)
    elem = 4 if engine_kind == "builtin" else 2  # the built-in engine's cache is fp32, vLLM's at least bf16
    kv = 2 * sessions * GATEWAY_MAX_SEQ_LEN * limits.kv_bytes_per_token(config, elem)
    what = f"the KV cache of 2 x --sessions slots of {GATEWAY_MAX_SEQ_LEN} tokens"
    limits.require(limits.fits_memory(("--sessions",), kv, what))
    from tandem.model import load_chat_format

    limit = min(GATEWAY_MAX_SEQ_LEN, limits.context_of(config))
    needed = gateway_longest_context(load_chat_format(model_path), sessions, turns, max_tokens, repeats)
    holder = "the engine (max_seq_len, at most the model's max_position_embeddings)"
    limits.require(limits.fits_context(("--turns", "--max-tokens"), needed, limit, holder))


def gateway_workload(sessions: int, r: int) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """Opening messages of each `tandem bench gateway` session of round ``r``, and the tools."""
    from tandem.core.config import TaskConfig
    from tandem.env.sources import tasks_for
    from tandem.env.tasks import TOOLS

    tasks = tasks_for(TaskConfig(), "train", sessions)
    opening = []
    for i in range(sessions):
        task = tasks[i % len(tasks)]
        msgs = [{"role": m.role, "content": m.content} for m in task.prompt]
        msgs[-1]["content"] += f" (run {r}.{i})"
        opening.append(msgs)
    return opening, TOOLS


def gateway_longest_context(chat: Any, sessions: int, turns: int, max_tokens: int, repeats: int) -> int:
    """Tokens of the longest session context of the last round of each side (their round numbers have the
    most digits): the rendered prompt, ``max_tokens`` per turn, and per later turn an end-of-turn token and
    the rendered tool message."""
    longest = 0
    for r in (2 * repeats, 2 * repeats + 1):
        opening, tools = gateway_workload(sessions, r)
        for i, messages in enumerate(opening):
            n = len(chat.render_prompt(messages, tools)) + turns * max_tokens
            for t in range(1, turns):
                tool = {"role": "tool", "content": GATEWAY_TOOL_RESULT.format(r=r, i=i, t=t)}
                n += 1 + len(chat.render_continuation([tool]))
            longest = max(longest, n)
    return longest


# ============================================================================ mismatch
def check_mismatch(
    model_path: str, prompts: int, prompt_len: int, new_tokens: int, threads: int, seed: int,
    publish_dtype: str, repeats: int,
) -> None:  # fmt: skip
    """`tandem bench mismatch`: an even ``prompts`` >= 2, counts >= 1, threads, rounds, the seed, the
    publish dtype, ``prompt_len + new_tokens`` within both models' context, and the engine's KV cache of one
    slot per prompt within the memory available."""
    if prompts < 2 or prompts % 2:
        raise limits.BenchInputError(
            f"--prompts must be an even number >= 2 (pairs form groups of two), got {limits.shown(prompts)}"
        )
    if publish_dtype not in ("bfloat16", "float32"):
        raise limits.BenchInputError(f"--publish must be bfloat16 or float32, got {publish_dtype!r}")
    limits.require(
        limits.at_least("--prompt-len", prompt_len),
        limits.at_least("--new-tokens", new_tokens),
        limits.threads(threads),
        limits.repeats(repeats),
        limits.seed(seed),
    )
    from tandem.model.build import MOE_SIZES

    dense = limits.read_config(model_path)
    for name, config in ((Path(model_path).name, dense), ("tiny-moe", MOE_SIZES["moe"])):
        holder = f"model {name!r} (max_position_embeddings)"
        limits.require(
            limits.fits_context(
                ("--prompt-len", "--new-tokens"), prompt_len + new_tokens, limits.context_of(config), holder
            )
        )
    kv = prompts * (prompt_len + new_tokens + 8) * limits.kv_bytes_per_token(dense)
    limits.require(limits.fits_memory(("--prompts",), kv, "the engine's KV cache of one slot per prompt"))


# ============================================================================ codec
def check_codec(
    size_gb: float, model_path: str, steps: int, warmup: int, threads: int, repeats: int,
    train_lr: float | None, workloads: tuple[str, ...],
) -> None:  # fmt: skip
    """`tandem bench codec`: known workloads, ``--size-gb`` a finite size of at least one parameter, steps,
    warm-up, threads, rounds, ``--train-lr`` in (0, 1], every problem at once; then each workload's least
    memory: ``tandem_train`` keeps ``warmup + steps + 1`` bf16 versions of the model, ``synthetic_1gb``
    ``SYNTHETIC_BYTES_PER_PARAM`` per parameter."""
    problems = [f"unknown workload {w!r} (choose from {', '.join(CODEC_WORKLOADS)})" for w in workloads
                if w not in CODEC_WORKLOADS]  # fmt: skip
    checks = {"--size-gb": (size_gb, size_gb >= 2**-29, ">= 2**-29 (one parameter)"),
              "--steps": (steps, steps >= 1, ">= 1"), "--warmup": (warmup, warmup >= 0, ">= 0")}  # fmt: skip
    if size_gb == math.inf:
        problems.append(f"--size-gb must be a finite number, got {size_gb}")
    problems += [f"{k} must be {rule}, got {limits.shown(v)}" for k, (v, ok, rule) in checks.items()
                 if not ok]  # fmt: skip
    checked = (limits.threads(threads), limits.repeats(repeats), limits.learning_rate("--train-lr", train_lr))
    problems += [p for p in checked if p is not None]
    if problems:
        raise limits.BenchInputError("; ".join(problems))
    if "tandem_train" in workloads:
        kept = (warmup + steps + 1) * 2 * limits.params_on_disk(model_path)
        what = "--warmup + --steps + 1 bf16 versions of the model"
        limits.require(limits.fits_memory(("--steps", "--warmup"), kept, what))
    if "synthetic_1gb" in workloads:
        need = math.ceil(size_gb * 2**29) * SYNTHETIC_BYTES_PER_PARAM
        what = f"{SYNTHETIC_BYTES_PER_PARAM} bytes per parameter, 2**29 parameters per GiB"
        limits.require(limits.fits_memory(("--size-gb",), need, what))
