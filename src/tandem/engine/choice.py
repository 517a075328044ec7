"""Which engine serves a model when ``engine.kind = "auto"``: the built-in engine where it is the faster one
on this machine, vLLM elsewhere.

Invariants:
- ``choose_engine`` returns ``builtin`` or ``vllm`` (never ``auto``) and a one-line reason naming what
  decided it; an explicit ``builtin`` or ``vllm`` is returned unchanged.
- The built-in engine is chosen whenever the caller needs it (a feature only it has), whenever vLLM cannot
  be imported, and on CPU-only machines for mixture-of-experts models (the crossover was measured on dense
  ones) and for models of unknown size. On CPU otherwise, with ``EngineConfig.auto_measure``, the engine
  that decoded this model faster on this machine (``tandem.engine.calibrate``: measured once, cached); without
  it, or when the measurement fails (the reason says so), vLLM from ``EngineConfig.vllm_from_params``
  parameters. vLLM is imported only when it could be chosen, since the import takes seconds.
- ``resolve_run_engine`` gives a run config whose ``engine.kind`` is concrete, so every engine actor of one
  run, its config.toml and a resume all use the same engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.core.config import EngineConfig, RunConfig, model_is_moe
from tandem.core.generation import VLLM_MAX_TEMPERATURE


def _vllm_probe() -> str | None:
    from tandem.engine.vllm import vllm_available

    return vllm_available()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _measure(config: EngineConfig, model_path: str | Path) -> dict[str, Any]:
    from tandem.engine.calibrate import measured_rates

    return measured_rates(model_path, config.threads, config.max_batch)


def choose_engine(
    config: EngineConfig,
    model_path: str | Path,
    needs_builtin: str | None = None,
    vllm_probe: Callable[[], str | None] = _vllm_probe,
    measure: Callable[[EngineConfig, str | Path], dict[str, Any]] = _measure,
) -> tuple[str, str]:
    """(kind, reason) for serving the model directory ``model_path`` with ``config``. ``needs_builtin``
    names the setting that only the built-in engine supports, if any; ``vllm_probe`` returns None when
    vLLM is usable, else why not; ``measure`` returns both engines' decode rates here (``builtin``,
    ``vllm`` tokens/s; see ``tandem.engine.calibrate.measured_rates``)."""
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
        if config.auto_measure:
            why_not = vllm_probe()
            if why_not is not None:
                return "builtin", f"auto: {why_not}"
            return _measured_choice(config, model_path, params, measure)
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


def _measured_choice(
    config: EngineConfig,
    model_path: str | Path,
    params: int,
    measure: Callable[[EngineConfig, str | Path], dict[str, Any]],
) -> tuple[str, str]:
    """The faster engine by ``measure``; the parameter threshold when measuring fails."""
    from tandem.engine.calibrate import CalibrationError

    try:
        rates = measure(config, model_path)
    except CalibrationError as e:
        kind = "vllm" if params >= config.vllm_from_params else "builtin"
        threshold = f"engine.vllm_from_params={config.vllm_from_params:,}"
        return kind, f"auto: {params:,} parameters vs {threshold}, since measuring failed ({e})"
    kind = "vllm" if rates["vllm"] > rates["builtin"] else "builtin"
    how = "cached" if rates.get("cached") else f"measured now, {rates.get('seconds', 0):.0f} s"
    return kind, (
        f"auto: decodes faster on this machine: built-in {rates['builtin']:.0f} tokens/s, vLLM "
        f"{rates['vllm']:.0f} ({how}; {config.threads} threads; {rates.get('cache', 'no cache')})"
    )


def builtin_only_setting(cfg: RunConfig) -> str | None:
    """The first setting of ``cfg`` that only the built-in engine supports, as ``name=value``, or None."""
    if cfg.train.deterministic:
        return "train.deterministic=true"
    if cfg.train.router_replay == "r3":
        return "train.router_replay='r3'"
    if cfg.rollout.top_p < 1.0:
        return f"rollout.top_p={cfg.rollout.top_p}"
    for name, value in (
        ("rollout.temperature", cfg.rollout.temperature),
        ("eval.temperature", cfg.eval.temperature),
    ):
        if value > VLLM_MAX_TEMPERATURE:
            return f"{name}={value}"
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
