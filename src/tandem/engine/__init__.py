"""Layer 2: inference engines. ``BuiltinEngine`` is the built-in transformers engine (CPU default, tests);
``VllmEngine`` (``tandem.engine.vllm``, the ``vllm`` extra) drives vLLM behind the same interface.
``create_engine`` picks one by ``EngineConfig.kind`` (``auto``: ``tandem.engine.choice``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.core.config import EngineConfig
from tandem.core.lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__, {"BuiltinEngine": "tandem.engine.builtin", "sample": "tandem.engine.sampling"}
)  # imported on first use: the gateway's config and the CLI import this package without torch

__all__ = ["BuiltinEngine", "create_engine", "sample"]


def create_engine(
    path: str | Path,
    config: EngineConfig,
    *,
    dtype: str = "float32",
    seed: int = 0,
    deterministic: bool = False,
) -> Any:
    """The engine ``config.kind`` names, loaded from the local model directory ``path`` (not started);
    ``auto`` is resolved here by ``tandem.engine.choice.choose_engine``. ``deterministic`` (the run's
    ``train.deterministic``) is built-in only: batch-invariant forwards."""
    kind = config.kind
    if kind == "auto":
        from tandem.engine.choice import choose_engine

        kind, _ = choose_engine(config, path, "train.deterministic=true" if deterministic else None)
    if kind == "vllm":
        if deterministic:
            raise ValueError(
                "deterministic mode (train.deterministic) needs engine.kind='builtin': vLLM's kernels are "
                "not batch-invariant"
            )
        from tandem.engine.vllm import VllmEngine

        return VllmEngine.from_path(path, config, dtype=dtype, seed=seed)
    from tandem.engine.builtin import BuiltinEngine

    return BuiltinEngine.from_path(path, config, dtype=dtype, seed=seed, deterministic=deterministic)
