"""The `tandem` command: train, midtrain, eval, sandbox, bench, report.

Invariant: every user error (bad config, missing model, bad flag value) exits with status 2 and one message
naming the field or value and what to do; no traceback for errors tandem raises on purpose.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.core.config import RunConfig, load_config
from tandem.core.errors import TandemError

app = typer.Typer(
    help="tandem: asynchronous RL for tool-using coding agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: each prints one JSON object with --json.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

REPO_ROOT = Path(__file__).resolve().parents[3]
PRESETS = {"default": "default.toml", "smoke": "smoke.toml"}


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _preflight(check: Callable[..., None], *args: Any) -> None:
    """Run a benchmark's option check (``tandem.bench.preflight``) before its module, and with it torch, is
    imported: a refused option costs about a second instead of 3-7."""
    try:
        check(*args)
    except ValueError as e:
        fail(str(e))


def resolve_model_path(path: str) -> str:
    """Relative model paths resolve against the working directory first, then the repository root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p.resolve()) if p.exists() else str(p)
    candidate = REPO_ROOT / p
    return str(candidate) if candidate.exists() else str(p)


def build_config(preset: str | None, config: Path | None, overrides: list[str] | None) -> RunConfig:
    base_path = None
    if preset is not None:
        if preset not in PRESETS:
            fail(f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        base_path = REPO_ROOT / "configs" / PRESETS[preset]
    try:
        cfg = load_config(base_path, overrides) if config is None else load_config(config, overrides)
        if config is not None and base_path is not None:
            fail("pass either --preset or --config, not both")
    except TandemError as e:
        fail(str(e))
    cfg.model.path = resolve_model_path(cfg.model.path)
    return cfg


MODEL_OPTION_FIX = "pass --model DIR"
"""The fix a model-path error names for commands that take the model as ``--model``."""


def check_model_path(path: str, fix: str = "pass --set model.path=DIR") -> None:
    """Fail unless ``path`` is a model directory; ``fix`` says which option takes another one."""
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        fail(
            f"model path {path!r} is not a model directory (needs config.json and tokenizer files); "
            f"{fix} or build one with `tandem midtrain`"
        )


def check_engine_memory(cfg: RunConfig, model_path: str, engines: int) -> None:
    """Fail unless ``engines`` KV caches of the configured sizes fit this machine's memory (a cache past it
    failed inside the engine: for ``train``, an actor's allocator traceback after Ray had started). The
    built-in engine keeps its cache in ``model.dtype``; vLLM (and ``auto``, which may pick it) in 16 bits."""
    from tandem.cli.checks import kv_memory_problem

    e = cfg.engine
    problem = kv_memory_problem(
        Path(model_path),
        ("engine.max_batch", e.max_batch),
        ("engine.max_parked", e.max_parked),
        ("engine.max_seq_len", e.max_seq_len),
        cfg.model.dtype if e.kind == "builtin" else "bfloat16",
        engines,
    )
    if problem:
        fail(problem)


SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a config field: key=value.")]
PresetOpt = Annotated[str | None, typer.Option(help="Config preset: default | smoke.")]
ConfigOpt = Annotated[Path | None, typer.Option(help="A run config TOML file.")]


@app.command()
def train(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    run_dir: Annotated[Path, typer.Option(help="Directory for metrics, checkpoints and the report.")] = Path(
        "runs/default"
    ),
    set_: SetOpt = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue from the latest checkpoint in --run-dir with the run's recorded config.toml "
            "(--set changes it; every change is printed before the run starts)."
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="Join the Ray cluster at this address (host:port of its head) instead of starting a local "
            "one; without it, RAY_ADDRESS in the environment names the cluster to join, as for Ray tools."
        ),
    ] = None,
) -> None:
    """Run RL training (async by default) and write metrics, checkpoints and report.md to --run-dir."""
    from tandem.cli.checks import writable_dir_problem

    if problem := writable_dir_problem("--run-dir", run_dir, keep=False):  # a file, a path under one, /sys
        fail(problem)
    recorded = run_dir / "config.toml"
    if resume and preset is None and config is None:
        if not recorded.is_file():  # the default config would have replaced the run's settings silently
            fail(
                f"--resume: {str(recorded)!r} is missing, so the run's settings are unknown; restore it, or "
                "pass --config FILE (or --preset NAME) with the settings the run was started with"
            )
        config = recorded  # a resume continues with the run's own settings (--set may extend its budget)
    if preset is None and config is None:
        preset = "default"
    overrides = list(set_ or [])
    if ray_address:
        overrides.append(f'orchestrator.ray_address="{ray_address}"')
    cfg = build_config(preset, config, overrides)
    check_model_path(cfg.model.path)
    from tandem.core.stopping import StoppedError
    from tandem.orchestrator import train as run_train
    from tandem.orchestrator.run import cluster_address

    if not cluster_address(cfg):  # a local cluster: the engines run on this machine
        check_engine_memory(cfg, cfg.model.path, cfg.engine.num_engines)

    try:
        result = run_train(cfg, run_dir, resume=resume)
    except StoppedError as e:  # Ctrl-C, SIGTERM or SIGHUP: saved and released; exit 128 + the signal
        typer.echo(str(e), err=True)
        raise typer.Exit(e.exit_code) from None
    except (TandemError, FileNotFoundError) as e:
        fail(str(e))
    typer.echo(f"report: {run_dir / 'report.md'}")
    if result.eval_before and result.eval_after:
        typer.echo(
            f"held-out pass@1: {result.eval_before['pass@1']:.3f} -> {result.eval_after['pass@1']:.3f}"
        )


@app.command("eval")
def eval_(
    model: Annotated[str, typer.Option(help="Model directory to evaluate.")] = "models/tandem-base",
    split: Annotated[str, typer.Option(help="heldout | train")] = "heldout",
    k: Annotated[list[int] | None, typer.Option(help="Report pass@k (repeatable); default 1.")] = None,
    samples: Annotated[
        int | None, typer.Option(help="Samples per task (default eval.samples_per_task).")
    ] = None,
    n_tasks: Annotated[int | None, typer.Option(help="Number of tasks (default tasks.heldout_size).")] = None,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Evaluate a model on the held-out split: pass@1 (and pass@k)."""
    cfg = build_config(preset if preset or config else "default", config, set_)
    model_path = resolve_model_path(model)
    check_model_path(model_path, MODEL_OPTION_FIX)
    check_engine_memory(cfg, model_path, 1)
    ks = tuple(sorted(set(k or [1])))
    if any(x < 1 for x in ks):
        fail(f"--k must be >= 1, got {ks}")
    from tandem.orchestrator import eval_model
    from tandem.sandbox.cleanup import exit_on_signals

    exit_on_signals()  # its sandboxes are made on worker threads, which cannot set it: SIGTERM then cleans up
    try:
        result = eval_model(cfg, model_path, split, samples, ks, n_tasks)
    except (TandemError, ValueError) as e:
        fail(str(e))
    if json_:
        typer.echo(json.dumps(result))
    else:
        for key in sorted(result):
            typer.echo(f"{key}: {result[key]}")


PIPELINE_MAX_BUDGET_S = 7 * 24 * 3600
"""Longest `bench pipeline --budget-s` (a week; each mode runs that long, so more is a typo)."""


@bench_app.command("pipeline")
def bench_pipeline(
    budget_s: Annotated[float, typer.Option(help="Wall-clock training budget per mode, seconds.")] = 150.0,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_root: Annotated[Path | None, typer.Option(help="Where to keep both runs.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Sync vs async for the same wall-clock budget: samples/s, busy fractions, held-out pass@1, and the
    machine's busy cores per mode with the speedup that many cores allow (speedup_cap)."""
    if not 0 < budget_s <= PIPELINE_MAX_BUDGET_S:
        fail(
            f"--budget-s must be a number of seconds > 0 and at most a week ({PIPELINE_MAX_BUDGET_S}), "
            f"got {budget_s}"
        )
    cfg = build_config(preset if preset or config else "default", config, set_)
    check_model_path(cfg.model.path)
    from tandem.bench.pipeline import run
    from tandem.core.stopping import StoppedError
    from tandem.sandbox.cleanup import exit_on_signals

    exit_on_signals()  # between the runs (engine choice, evaluations): SIGTERM cleans up and exits 143
    try:
        out = run(cfg, budget_s, run_root)
    except StoppedError as e:  # during a run: that run's stop path saved and released it
        typer.echo(f"bench pipeline stopped; nothing is reported. {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("engine")
def bench_engine(
    model: Annotated[
        str | None, typer.Option(help="One real model directory instead of the random --sizes.")
    ] = None,
    sizes: Annotated[
        str,
        typer.Option(
            help="Comma-separated random-weight sizes: default (~5.8M), 15m, 30m (~27M), 100m (~100M)."
        ),
    ] = "default,15m,100m",
    engines: Annotated[
        str, typer.Option(help="Comma-separated engines: builtin, vllm, hf_generate.")
    ] = "builtin,vllm,hf_generate",
    batch: Annotated[int, typer.Option(help="Prompts per batch.")] = 16,
    new_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 64,
    prompt_len: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 64,
    threads: Annotated[int, typer.Option(help="Torch threads.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed rounds after the warm-up (best counts).")] = 3,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Built-in engine vs vLLM vs transformers `model.generate`: tokens/s and time to first token per size."""
    from tandem.bench import preflight

    size_list = tuple(x.strip() for x in sizes.split(",") if x.strip())
    engine_list = tuple(x.strip() for x in engines.split(",") if x.strip())
    path = None
    if model is not None:
        path = resolve_model_path(model)
        check_model_path(path, MODEL_OPTION_FIX)
    args = (size_list, engine_list, batch, new_tokens, prompt_len, threads, repeats)
    _preflight(preflight.check_engine, path, *args)
    from tandem.bench.engine import run

    try:  # checked again by run, which the library's callers use
        out = run(
            path,
            sizes=size_list,
            engines=engine_list,
            batch=batch,
            new_tokens=new_tokens,
            prompt_len=prompt_len,
            threads=threads,
            repeats=repeats,
        )
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("prefix")
def bench_prefix(
    model: Annotated[str, typer.Option(help="Model directory.")] = "models/tandem-base",
    sessions: Annotated[int, typer.Option(help="Concurrent sessions.")] = 32,
    turns: Annotated[int, typer.Option(help="Turns per session.")] = 4,
    threads: Annotated[int, typer.Option(help="Torch threads.")] = 2,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Engine with and without per-session prefix reuse on the same multi-turn workload."""
    from tandem.bench import preflight

    path = resolve_model_path(model)
    check_model_path(path, MODEL_OPTION_FIX)
    turn = (preflight.PREFIX_PROMPT_TOKENS, preflight.PREFIX_SAMPLED_TOKENS, preflight.PREFIX_OBS_TOKENS)
    _preflight(preflight.check_prefix, path, sessions, turns, *turn, threads)
    from tandem.bench.prefix import run

    try:  # checked again by run, which the library's callers use
        out = run(path, sessions=sessions, turns=turns, threads=threads)
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("codec")
def bench_codec(
    size_gb: Annotated[float, typer.Option(help="Synthetic workload size, GiB of bf16 weights.")] = 1.0,
    model: Annotated[str, typer.Option(help="Model directory of the tandem_train workload.")] = (
        "models/tandem-base"
    ),
    steps: Annotated[int, typer.Option(help="Consecutive version pairs measured in tandem_train.")] = 3,
    warmup: Annotated[int, typer.Option(help="Optimizer steps before the measured versions.")] = 6,
    train_lr: Annotated[
        float | None, typer.Option(help="Override the default run's lr in tandem_train.")
    ] = None,
    threads: Annotated[int, typer.Option(help="Threads for the *_threadsN numbers.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed repeats; the best counts.")] = 3,
    workload: Annotated[
        list[str] | None, typer.Option(help="tandem_train | synthetic_1gb (repeatable).")
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Lossless weight-delta codec vs zstd, XOR+zstd, indices+values and ZipNN on real AdamW updates."""
    from tandem.bench import preflight

    for option, value in (("--size-gb", size_gb), ("--train-lr", train_lr)):
        if value is not None and not 0 < value < math.inf:
            fail(f"{option} must be a finite number > 0, got {value}")
    chosen = tuple(workload or preflight.CODEC_WORKLOADS)
    path = resolve_model_path(model)
    if "tandem_train" in chosen:
        check_model_path(path, MODEL_OPTION_FIX)
    _preflight(preflight.check_codec, size_gb, path, steps, warmup, threads, repeats, train_lr, chosen)
    from tandem.bench.codec import run_codec_bench

    try:
        out = run_codec_bench(
            size_gb=size_gb, model_path=path, steps=steps, warmup=warmup, threads=threads,
            repeats=repeats, train_lr=train_lr, workloads=chosen,
        )  # fmt: skip
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("sync")
def bench_sync(
    model: Annotated[str, typer.Option(help="Model the engines serve and the trainer updates.")] = (
        "models/tandem-base"
    ),
    relays: Annotated[int, typer.Option(help="Relays (regions), each with its own throttled link.")] = 2,
    engines: Annotated[int, typer.Option(help="Engine processes, spread over the relays.")] = 4,
    bandwidth_mbps: Annotated[float, typer.Option(help="Each relay's upstream link, Mbit/s.")] = 100.0,
    deltas: Annotated[int, typer.Option(help="Delta versions to publish and time.")] = 8,  # DEFAULT_DELTAS
    warmup_deltas: Annotated[
        int, typer.Option(help="Untimed delta versions first (the first one is reported as first_delta_s).")
    ] = 1,
    lr: Annotated[
        float | None, typer.Option(help="Learning rate of the real trainer steps (default: per size).")
    ] = None,
    size: Annotated[
        str,
        typer.Option(help="100m: random-init 100M-param Qwen3 with --model's tokenizer; default: --model"),
    ] = "100m",
    host_share: Annotated[
        bool,
        typer.Option(
            "--host-share/--no-host-share",
            help="Engines on this host share one decode per delta (a run's default with several engines).",
        ),
    ] = True,
    host_leader: Annotated[
        bool,
        typer.Option(
            "--host-leader/--no-host-leader",
            help="With a host share, a process of its own leads every step (weights.host_leader).",
        ),
    ] = False,
    busy_engines: Annotated[
        int, typer.Option(help="Engines under a steady decode load (engine 0's rate is the one reported).")
    ] = 1,
    loop_priority_boost: Annotated[
        int | None,
        typer.Option(
            help="engine.loop_priority_boost of every engine (0-39; 0: the process's own; unset: automatic, "
            "10 on a host without a trainer, as here)."
        ),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Publish -> relays -> engines: time to serve a new version as a delta vs as a full checkpoint."""
    path = resolve_model_path(model)
    check_model_path(path, MODEL_OPTION_FIX)
    from tandem.bench.sync import run_sync_bench

    try:
        out = run_sync_bench(
            path,
            relays,
            engines,
            bandwidth_mbps,
            deltas,
            lr,
            size=size,
            host_share=host_share,
            warmup_deltas=warmup_deltas,
            host_leader=host_leader,
            busy_engines=busy_engines,
            loop_priority_boost=loop_priority_boost,
        )
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("sandbox")
def bench_sandbox(
    n: Annotated[int, typer.Option(help="Sandboxes in the burst.")] = 200,
    concurrency: Annotated[int, typer.Option(help="Sandboxes (and plain processes) at a time.")] = 4,
    pool_size: Annotated[int, typer.Option(help="Ready sandboxes the warm pool keeps.")] = 8,
    big_mb: Annotated[int, typer.Option(help="Size of the large workspace, MiB.")] = 100,
    scratch: Annotated[
        str, typer.Option(help="Where sandboxes' private directories go: auto, tmpfs or disk.")
    ] = "auto",
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A burst of sandboxes on copy-on-write clones of a 100 MB workspace vs the same command unsandboxed."""
    from tandem.bench.sandbox import run_sandbox_bench

    if scratch not in ("auto", "tmpfs", "disk"):
        fail(f"--scratch must be auto, tmpfs or disk, got {scratch!r}")
    try:
        out = run_sandbox_bench(
            n=n, concurrency=concurrency, big_mb=big_mb, pool_size=pool_size, scratch=scratch
        )
    except (ValueError, TandemError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("gateway")
def bench_gateway(
    model: Annotated[str, typer.Option(help="Model directory.")] = "models/tandem-base",
    sessions: Annotated[int, typer.Option(help="Concurrent sessions.")] = 32,
    turns: Annotated[int, typer.Option(help="Turns per session.")] = 3,
    max_tokens: Annotated[int, typer.Option(help="Tokens sampled per turn (EOS ignored).")] = 32,
    threads: Annotated[int, typer.Option(help="Torch threads.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed rounds per side; the best counts.")] = 5,
    client_procs: Annotated[int, typer.Option(help="Client (harness) processes sharing the sessions.")] = 1,
    engine: Annotated[
        str, typer.Option(help="auto (what tandem serve picks) | builtin | vllm; both sides use it.")
    ] = "auto",
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The OpenAI gateway (official openai client, real HTTP) vs the same engine called in-process."""
    from tandem.bench import preflight

    path = resolve_model_path(model)
    check_model_path(path, MODEL_OPTION_FIX)
    args = (sessions, turns, max_tokens, threads, repeats, client_procs, engine)
    _preflight(preflight.check_gateway, path, *args)
    from tandem.bench.gateway import run_gateway_bench

    try:
        out = run_gateway_bench(
            path,
            sessions=sessions,
            turns=turns,
            max_tokens=max_tokens,
            threads=threads,
            repeats=repeats,
            client_procs=client_procs,
            engine_kind=engine,
        )
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


@bench_app.command("mismatch")
def bench_mismatch(
    model: Annotated[str, typer.Option(help="Dense model directory (its tokenizer also serves the MoE).")] = (
        "models/tandem-base"
    ),
    prompts: Annotated[int, typer.Option(help="Prompts sampled per setting (even: groups of two).")] = 16,
    prompt_len: Annotated[int, typer.Option(help="Random prompt tokens per prompt.")] = 32,
    new_tokens: Annotated[int, typer.Option(help="Tokens sampled per prompt (no early stop).")] = 64,
    threads: Annotated[int, typer.Option(help="Torch threads of the engine and the trainer.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of prompts, sampling and the tiny MoE's weights.")] = 0,
    publish: Annotated[
        str, typer.Option(help="Precision the engine gets the weights in: bfloat16 (delta path) | float32.")
    ] = "bfloat16",
    repeats: Annotated[int, typer.Option(help="Rounds per setting, modes interleaved; best counts.")] = 3,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Sampler-vs-trainer mismatch (kl_k3, max |dlogp|), MoE routing agreement and slowdown per mode."""
    from tandem.bench import preflight

    path = resolve_model_path(model)
    check_model_path(path, MODEL_OPTION_FIX)
    args = (prompts, prompt_len, new_tokens, threads, seed, publish, repeats)
    _preflight(preflight.check_mismatch, path, *args)
    from tandem.bench.mismatch import run_mismatch_bench

    try:
        out = run_mismatch_bench(
            path,
            prompts=prompts,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            threads=threads,
            seed=seed,
            publish_dtype=publish,
            repeats=repeats,
        )
    except (TandemError, ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(out) if json_ else json.dumps(out, indent=2))


def _mount_subcommands() -> None:
    from tandem.cli import env as env_cli
    from tandem.cli import midtrain as midtrain_cli
    from tandem.cli import report as report_cli
    from tandem.cli import sandbox as sandbox_cli
    from tandem.cli import serve as serve_cli
    from tandem.cli import weights as weights_cli
    from tandem.cli import weights_serve

    app.command("serve")(serve_cli.serve)
    app.add_typer(sandbox_cli.app, name="sandbox")
    app.add_typer(env_cli.app, name="env")
    weights_cli.weights_app.command("serve")(weights_serve.serve)
    weights_cli.weights_app.command("relay")(weights_serve.relay)
    app.add_typer(weights_cli.weights_app, name="weights")
    app.command("midtrain")(midtrain_cli.midtrain_command)
    app.add_typer(report_cli.app, name="report")


_mount_subcommands()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
