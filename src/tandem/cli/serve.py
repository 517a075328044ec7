"""`tandem serve`: the OpenAI-compatible rollout gateway in front of an inference engine, in the foreground.

Invariants: options are checked before the model is loaded, so a refused configuration fails at once; every
user error (a non-loopback host without --api-key, an engine that is not available, an unknown --dtype or
--log-level, --threads outside 1..``MAX_THREADS``, a KV cache of --max-batch + --max-parked sequences of
--max-seq-len tokens larger than the machine's memory, a missing model directory, an address in use) prints
one ``error:`` line naming the value and exits with status 2. The
engine is closed when the server exits (Ctrl-C, or SIGTERM/SIGHUP: exit status 128 + the signal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from tandem.cli.checks import kv_memory_problem, threads_problem
from tandem.core.errors import TandemError
from tandem.engine.gateway.config import GatewayConfig

REPO_ROOT = Path(__file__).resolve().parents[3]
ENGINES = ("auto", "builtin", "vllm")
DTYPES = ("float32", "bfloat16")
_DEFAULTS = GatewayConfig()


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _model_dir(path: Path) -> Path:
    """Relative paths resolve against the working directory first, then the repository root."""
    if path.is_absolute() or path.exists():
        return path.resolve() if path.exists() else path
    candidate = REPO_ROOT / path
    return candidate if candidate.exists() else path


def _gateway_config(**fields: object) -> GatewayConfig:
    try:
        return GatewayConfig(**fields)  # type: ignore[arg-type]
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "gateway"
        _fail(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        raise  # unreachable: _fail exits


def _option_problem(engine: str, dtype: str, log_level: str, threads: int) -> str | None:
    """Why ``--engine``, ``--dtype``, ``--log-level`` or ``--threads`` cannot work, or None."""
    from uvicorn.config import LOG_LEVELS

    if engine not in ENGINES:
        return f"--engine {engine!r} is unknown; choose one of {', '.join(ENGINES)}"
    if dtype not in DTYPES:
        return f"--dtype {dtype!r} is unknown; choose one of {', '.join(DTYPES)}"
    if log_level.lower() not in LOG_LEVELS:
        return f"--log-level {log_level!r} is unknown; choose one of {', '.join(LOG_LEVELS)}"
    return threads_problem("--threads", threads)


def serve(
    model: Annotated[
        Path, typer.Option(help="Local HF model directory (config.json, weights, tokenizer).")
    ] = (Path("models/tandem-base")),
    engine: Annotated[
        str,
        typer.Option(
            help="Inference engine: auto | builtin | vllm (vllm needs `pip install -e .\\[vllm]`); "
            "auto picks the one that decodes the model faster on this machine (measured once, cached; "
            "engine.auto_measure)."
        ),
    ] = "auto",
    host: Annotated[
        str, typer.Option(help="Address to listen on; non-loopback needs --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one).")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="TANDEM_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    ] = None,
    max_concurrent: Annotated[
        int, typer.Option(help="Chat requests in flight at once; more get 429 with Retry-After.")
    ] = _DEFAULTS.max_concurrent,
    max_sessions: Annotated[
        int, typer.Option(help="Session records kept in memory (least recently used evicted).")
    ] = _DEFAULTS.max_sessions,
    max_seq_len: Annotated[
        int, typer.Option(help="Context length of the engine (prompt + completion).")
    ] = 1024,
    max_batch: Annotated[int, typer.Option(help="Sequences decoded together (continuous batching).")] = 64,
    max_parked: Annotated[
        int, typer.Option(help="Finished sessions whose KV is kept for their next turn.")
    ] = 64,
    threads: Annotated[int, typer.Option(help="Torch threads of the engine.")] = 2,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16.")] = "float32",
    seed: Annotated[
        int, typer.Option(help="Engine seed (requests without a seed derive theirs from it).")
    ] = 0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve OpenAI /v1/chat/completions with token-exact session records (/v1/tandem/sessions/ID)."""
    cfg = _gateway_config(
        host=host,
        port=port,
        api_key=api_key,
        max_concurrent=max_concurrent,
        max_sessions=max_sessions,
        model_name=_model_dir(model).name,
    )
    from tandem.core.procs import gc_freeze_enabled

    try:
        gc_freeze_enabled()
    except ValueError as e:
        _fail(str(e))
    problem = _option_problem(engine, dtype, log_level, threads)
    if problem:
        _fail(problem)
    if engine == "vllm":
        from tandem.engine.vllm import vllm_available

        reason = vllm_available()
        if reason is not None:
            _fail(f"--engine vllm: {reason}")
    if max_seq_len < 2 or max_batch < 1 or max_parked < 0:
        _fail(
            f"--max-seq-len ({max_seq_len}) must be >= 2, --max-batch ({max_batch}) >= 1, --max-parked "
            f"({max_parked}) >= 0"
        )
    path = _model_dir(model)
    if not path.is_dir() or not (path / "config.json").is_file():
        _fail(
            f"--model {str(model)!r} is not a model directory (needs config.json, weights and tokenizer.json)"
        )
    problem = kv_memory_problem(
        path, ("--max-batch", max_batch), ("--max-parked", max_parked), ("--max-seq-len", max_seq_len), dtype
    )
    if problem:
        _fail(problem)

    from tandem.core.config import EngineConfig
    from tandem.engine.choice import choose_engine

    # auto measures (or reads the measurement of) the engines as they will serve: these threads and batch
    serving = EngineConfig(
        kind=engine, max_batch=max_batch, max_seq_len=max_seq_len, max_parked=max_parked, threads=threads
    )
    engine, engine_reason = choose_engine(serving, path)

    from tandem.engine.gateway import bind_socket, create_app, run_forever

    try:
        sock = bind_socket(cfg.host, cfg.port)
    except OSError as e:
        _fail(f"cannot listen on {cfg.host}:{cfg.port}: {e}")
        return

    import torch

    from tandem.engine import create_engine
    from tandem.model import load_chat_format

    torch.set_num_threads(threads)
    try:
        chat = load_chat_format(path)
        eng = create_engine(path, serving.model_copy(update={"kind": engine}), dtype=dtype, seed=seed)
    except TandemError as e:
        sock.close()
        _fail(str(e))
        return
    app = create_app(eng, chat, chat.tokenizer, cfg)
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    where = f"http://{shown}:{sock.getsockname()[1]}/v1"
    typer.echo(f"serving {cfg.model_name} on {where} (engine {engine}: {engine_reason})")
    eng.start()
    from tandem.core.procs import freeze_heap

    freeze_heap()  # the served state lives as long as the process: full GC passes skip it
    from tandem.sandbox.cleanup import exit_on_signals

    # uvicorn re-raises the SIGTERM it caught once it has shut down; with the default action that killed the
    # process before the engine was closed (vLLM's engine core and its rendezvous file in the temp dir)
    exit_on_signals()
    try:
        run_forever(app, sock, log_level=log_level)
    finally:
        getattr(eng, "close", eng.stop)()  # close: vLLM also frees its engine core and rendezvous file
        sock.close()
