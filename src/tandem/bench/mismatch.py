"""`tandem bench mismatch`: sampler-vs-trainer logprob mismatch and MoE routing agreement per numerics mode.

Settings: the dense model (``model``, the shipped base model by default) in modes ``default`` and
``deterministic``; a tiny random-init Qwen3-MoE (``tandem.model.moe.write_model_dir``, preset ``moe``, the
dense model's tokenizer, written to a temporary directory) in ``default``, ``deterministic``, ``r3`` and
``r2``. Modes: ``default`` = the trainer and engine as configured by default; ``deterministic`` =
``train.deterministic = true`` and ``BuiltinEngine(deterministic=True)`` (``tandem.model.deterministic``; a
row carries ``error`` instead of numbers when a mode cannot run, e.g. deterministic mode on the MoE);
``r3`` / ``r2`` = ``train.router_replay`` (``tandem.train.routing``).

Method (in-process, no Ray; one setting at a time, torch threads set to ``threads`` and restored): a
``Trainer`` loads the model (fp32 master weights) and a ``BuiltinEngine`` serves them as the trainer
publishes them (``publish_dtype``, default bfloat16: what engines hold on the default weight-delta path,
where the MoE's routers can flip on rounding), then samples a fixed batch: ``prompts`` prompts of
``prompt_len`` random token ids (seeded), ``new_tokens`` tokens each at temperature 1, top_p 1, no stop
token, a seed per request. Each completion becomes a one-segment trajectory exactly as the rollout harness
builds it (``SegmentBuilder``: prompt as context, completion as sampled tokens with the sampler's
logprobs/versions/log masses; MoE: ``routed_experts`` through ``tandem.env.harness.segment_routes``);
consecutive trajectories form groups of two with rewards 0 and 1 (non-zero advantages, so the trainer
forwards every one). The trainer then takes ONE ``step`` with ``epochs = 2``
(so every mode does the same work: the no-grad old-logprob pass, which also measures the mismatch and
routing agreement under pre-update weights, then two updates, in which r2 replays the old pass's routes and
r3 the sampler's). Reported from the trainer's own metrics: ``kl_k3`` = ``mismatch_kl_k3``,
``max_abs_dlogp`` = ``mismatch_abs_dlogp_max``, ``routing_agreement`` = ``routing_used_agreement`` (the
experts the trainer's forward used vs the sampler's; null for a dense model) and ``router_own_agreement`` =
``routing_agreement`` (the trainer's own router, before any replay, vs the sampler's). ``slowdown`` =
(engine generate + trainer step wall time) of the mode over that of the same
model's ``default`` row, measured in the same run (model loading and warm-ups excluded: a short untimed
default setting per model first, then per setting a short generate and a no-grad forward). Each setting
runs ``repeats`` times, the modes interleaved, and the least disturbed engine and trainer times count (the
numerics are the same every round).

``targets`` maps ``"<model> <mode> <condition>"`` to a boolean computed from the measured rows only (false
when a row it needs has an error): per model, deterministic kl_k3 == 0, max_abs_dlogp == 0 and slowdown <=
1.3; for the MoE, r3 routing_agreement == 1.0 and r3 kl_k3 <= 0.5 x default kl_k3.

Before any model is loaded (and, from the CLI, before this module is imported), ``preflight.check_mismatch``
refuses (``BenchInputError``, naming the option) an odd or too small ``prompts``, counts < 1, thread counts
outside 1..4 per CPU, more than ``limits.MAX_REPEATS`` rounds, a seed outside 0..2**63-1, ``prompt_len +
new_tokens`` beyond either model's context (``max_position_embeddings``) and prompts whose KV cache in the
engine exceeds the memory available (``tandem.bench.limits``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.bench import preflight
from tandem.core.config import EngineConfig, TrainConfig
from tandem.core.generation import Completion, GenerationRequest, SamplingParams
from tandem.core.records import Group, Reward, SegmentBuilder, Trajectory
from tandem.engine.builtin import BuiltinEngine
from tandem.env.harness import segment_routes
from tandem.train.trainer import Trainer, load_causal_lm

DENSE_MODES = ("default", "deterministic")
MOE_MODES = ("default", "deterministic", "r3", "r2")
DETERMINISTIC_SLOWDOWN_MAX = 1.3
R3_KL_FRACTION_MAX = 0.5


def _mode_settings(mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(BuiltinEngine keyword arguments, TrainConfig overrides) of a mode."""
    if mode == "default":
        return {}, {}
    if mode in ("r2", "r3"):
        return {}, {"router_replay": mode}
    if mode == "deterministic":
        return {"deterministic": True}, {"deterministic": True}
    raise ValueError(f"unknown mode {mode!r}")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _groups(prompts: list[list[int]], completions: list[Completion]) -> list[Group]:
    """One-segment trajectories built as the rollout harness builds them, in groups of two (rewards 0, 1)."""
    trajs = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if c.finish_reason == "error":
            raise RuntimeError(f"the engine failed on prompt {i}: {c.error}")
        b = SegmentBuilder()
        b.add_context(p)
        b.add_sampled(c.token_ids, c.logprobs, c.versions, c.logmass or None, 1.0)
        seg = b.build()
        seg.routed_experts = segment_routes(c.routed_experts, len(b), len(seg))
        trajs.append(Trajectory(f"bench{i // 2}", [seg], Reward(float(i % 2))))
    return [Group(trajs[i].task_id, trajs[i : i + 2]) for i in range(0, len(trajs), 2)]


def _run_setting(
    path: str,
    mode: str,
    prompts: list[list[int]],
    new_tokens: int,
    threads: int,
    seed: int,
    publish_dtype: str,
) -> dict[str, Any]:
    engine_kw, train_kw = _mode_settings(mode)
    max_len = max(len(p) for p in prompts) + new_tokens + 8
    ecfg = EngineConfig(max_batch=len(prompts), max_seq_len=max_len, max_parked=0, threads=threads)
    tcfg = TrainConfig(threads=threads, seed=seed, epochs=2, groups_per_step=len(prompts) // 2, **train_kw)
    trainer = Trainer(path, tcfg, publish_dtype=publish_dtype)  # sets torch threads
    engine = BuiltinEngine(load_causal_lm(path), ecfg, seed=seed, **engine_kw)
    # The engine serves the weights as the trainer publishes them (bf16-rounded on the default delta path).
    engine.update_weights(0, trainer.publish_state())
    try:
        warm = [GenerationRequest(p[:8], SamplingParams(max_new_tokens=4, seed=10_000 + i)) for i, p in
                enumerate(prompts[:2])]  # fmt: skip
        engine.generate(warm)
        reqs = [
            GenerationRequest(
                p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed * 1000 + i)
            )
            for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        completions = engine.generate(reqs)
        engine_s = time.perf_counter() - t0
    finally:
        engine.stop()
    groups = _groups(prompts, completions)
    with torch.no_grad():  # warm-up forward outside any step (no replay, nothing recorded for a step)
        trainer.model(input_ids=torch.tensor([prompts[0]]), use_cache=False)
    t0 = time.perf_counter()
    m = trainer.step(groups)
    train_s = time.perf_counter() - t0
    moe = trainer.routing.shape is not None
    return {
        "kl_k3": float(m["mismatch_kl_k3"]),
        "max_abs_dlogp": float(m["mismatch_abs_dlogp_max"]),
        "routing_agreement": float(m["routing_used_agreement"]) if moe and "routing_agreement" in m else None,
        "router_own_agreement": float(m["routing_agreement"]) if moe and "routing_agreement" in m else None,
        "mismatch_tokens": int(m["mismatch_tokens"]),
        "engine_s": round(engine_s, 3),
        "train_s": round(train_s, 3),
    }


def _targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Target name (``"<model> <mode> <condition>"``) -> whether its rows were measured and meet it."""

    def val(model: str, mode: str, key: str) -> float | None:
        row = next((r for r in rows if r["model"] == model and r["mode"] == mode), None)
        return None if row is None or "error" in row else row.get(key)

    out: dict[str, bool] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        modes = {r["mode"] for r in rows if r["model"] == model}
        if "deterministic" in modes:
            kl, dlogp = val(model, "deterministic", "kl_k3"), val(model, "deterministic", "max_abs_dlogp")
            slow = val(model, "deterministic", "slowdown")
            out[f"{model} deterministic kl_k3 == 0"] = kl is not None and kl == 0
            out[f"{model} deterministic max_abs_dlogp == 0"] = dlogp is not None and dlogp == 0
            out[f"{model} deterministic slowdown <= {DETERMINISTIC_SLOWDOWN_MAX}"] = (
                slow is not None and slow <= DETERMINISTIC_SLOWDOWN_MAX
            )
        if "r3" in modes:
            agree = val(model, "r3", "routing_agreement")
            kl_r3, kl_default = val(model, "r3", "kl_k3"), val(model, "default", "kl_k3")
            out[f"{model} r3 routing_agreement == 1.0"] = agree is not None and agree == 1.0
            out[f"{model} r3 kl_k3 <= {R3_KL_FRACTION_MAX} x default kl_k3"] = (
                kl_r3 is not None and kl_default is not None and kl_r3 <= R3_KL_FRACTION_MAX * kl_default
            )
    return out


def run_mismatch_bench(
    model_path: str = "models/tandem-base",
    prompts: int = 16,
    prompt_len: int = 32,
    new_tokens: int = 64,
    threads: int = 2,
    seed: int = 0,
    publish_dtype: str = "bfloat16",
    repeats: int = 3,
) -> dict[str, Any]:
    """Run every setting (see the module docstring) and return ``{"settings": [...], "targets": {...}}``."""
    preflight.check_mismatch(
        model_path, prompts, prompt_len, new_tokens, threads, seed, publish_dtype, repeats
    )
    old_threads = torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-moe-") as tmp:
            from tandem.model.moe import write_model_dir

            moe_path = str(
                write_model_dir(Path(tmp) / "tiny-moe", "moe", tokenizer_dir=model_path, seed=seed)
            )
            for name, path, modes in ((Path(model_path).name, model_path, DENSE_MODES),
                                      ("tiny-moe", moe_path, MOE_MODES)):  # fmt: skip
                vocab = int(load_causal_lm(path).get_input_embeddings().weight.shape[0])
                ids = _prompts(prompts, prompt_len, vocab, seed)
                try:  # untimed: one-time costs (autograd, allocator, kernels) must not land on `default`
                    _run_setting(path, "default", ids[:2], min(new_tokens, 4), threads, seed, publish_dtype)
                except Exception:  # noqa: BLE001, S110 - the timed default setting reports the error
                    pass
                best: dict[str, dict[str, Any]] = {}
                errors: dict[str, str] = {}
                for _ in range(repeats):  # modes interleaved, so slow spells of a shared machine spread out
                    for mode in modes:
                        if mode in errors:
                            continue
                        try:
                            out = _run_setting(path, mode, ids, new_tokens, threads, seed, publish_dtype)
                        except Exception as e:  # noqa: BLE001 - a mode that fails is reported, never faked
                            errors[mode] = f"{type(e).__name__}: {e}"
                            continue
                        if mode not in best:
                            best[mode] = out
                        else:  # the numerics are the same every round; the least disturbed time counts
                            for key in ("engine_s", "train_s"):
                                best[mode][key] = min(best[mode][key], out[key])
                base = best.get("default")
                base_s = base["engine_s"] + base["train_s"] if base else None
                for mode in modes:
                    row: dict[str, Any] = {"model": name, "mode": mode}
                    if mode in errors:
                        row["error"] = errors[mode]
                    else:
                        row.update(best[mode])
                        total = row["engine_s"] + row["train_s"]
                        row["slowdown"] = round(total / base_s, 3) if base_s else None
                    rows.append(row)
    finally:
        torch.set_num_threads(old_threads)
    return {
        "settings": rows,
        "targets": _targets(rows),
        "config": {
            "prompts": prompts,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "threads": threads,
            "seed": seed,
            "publish_dtype": publish_dtype,
            "repeats": repeats,
            "trainer_epochs": 2,
            "temperature": 1.0,
        },  # fmt: skip
    }


__all__ = ["DENSE_MODES", "MOE_MODES", "run_mismatch_bench"]
