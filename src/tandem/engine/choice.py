"""Which engine serves a model when ``engine.kind = "auto"``: the built-in engine where it is the faster one
on this machine, vLLM elsewhere.

Invariants:
- ``choose_engine`` returns ``builtin`` or ``vllm`` (never ``auto``) and a one-line reason naming what
  decided it; an explicit ``builtin`` or ``vllm`` is returned unchanged.
- The built-in engine is chosen whenever the caller needs it (a feature only it has), whenever vLLM cannot
  be imported, and on CPU-only machines for mixture-of-experts models (the crossover was measured on dense
  ones) and for models below ``EngineConfig.vllm_from_params`` parameters or of unknown size. vLLM is
  imported only when the size (or CUDA) would choose it, since the import takes seconds.
- ``resolve_run_engine`` gives a run config whose ``engine.kind`` is concrete, so every engine actor of one
  run, its config.toml and a resume all use the same engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tandem.core.config import EngineConfig, RunConfig, model_is_moe


def _vllm_probe() -> str | None:
    from tandem.engine.vllm import vllm_available

    return vllm_available()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_engine(
    config: EngineConfig,
    model_path: str | Path,
    needs_builtin: str | None = None,
    vllm_probe: Callable[[], str | None] = _vllm_probe,
) -> tuple[str, str]:
    """(kind, reason) for serving the model directory ``model_path`` with ``config``. ``needs_builtin``
    names the setting that only the built-in engine supports, if any; ``vllm_probe`` returns None when
    vLLM is usable, else why not."""
    if config.kind != "auto":
        return config.kind, f"engine.kind={config.kind!r} (set explicitly)"
    if needs_builtin is not None:
        return "builtin", f"auto: {needs_builtin} needs the built-in engine"
    from tandem.model.load import checkpoint_parameters

    params = checkpoint_parameters(model_path)
    cuda = _cuda()
    if not cuda:
        if model_is_moe(model_path):
            return (
                "builtin",
                "auto: a mixture-of-experts model on CPU (where vLLM overtakes the built-in engine was "
                "measured on dense models; the built-in engine also records routing for replay)",
            )
        if params is None:
            return "builtin", f"auto: the parameter count of {str(model_path)!r} is unknown (no safetensors)"
        if params < config.vllm_from_params:
            return (
                "builtin",
                f"auto: {params:,} parameters < engine.vllm_from_params={config.vllm_from_params:,} "
                "(the built-in engine is the faster one there)",
            )
    why_not = vllm_probe()
    if why_not is not None:
        return "builtin", f"auto: vLLM would serve this model, but {why_not}"
    if cuda:
        return "vllm", "auto: a CUDA device and vLLM are available"
    return "vllm", f"auto: {params:,} parameters >= engine.vllm_from_params={config.vllm_from_params:,}"


def builtin_only_setting(cfg: RunConfig) -> str | None:
    """The first setting of ``cfg`` that only the built-in engine supports, as ``name=value``, or None."""
    if cfg.train.deterministic:
        return "train.deterministic=true"
    if cfg.train.router_replay == "r3":
        return "train.router_replay='r3'"
    if cfg.rollout.top_p < 1.0:
        return f"rollout.top_p={cfg.rollout.top_p}"
    return None


def resolve_run_engine(
    cfg: RunConfig, vllm_probe: Callable[[], str | None] = _vllm_probe
) -> tuple[RunConfig, str]:
    """``cfg`` with a concrete ``engine.kind`` (see ``choose_engine``), and the reason for it."""
    kind, reason = choose_engine(cfg.engine, cfg.model.path, builtin_only_setting(cfg), vllm_probe)
    if kind == cfg.engine.kind:
        return cfg, reason
    engine = cfg.engine.model_copy(update={"kind": kind})
    return cfg.model_copy(update={"engine": engine}), reason
