"""In-process evaluation of a model directory on a task split (no Ray): what ``tandem eval`` runs.

Invariant: uses the same harness, sandbox, reward and pass@k estimator as the evaluation inside a training
run, so ``eval_before.json``/``eval_after.json`` and ``tandem eval --json`` are comparable.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.core.config import RunConfig


def eval_model(
    cfg: RunConfig,
    model_path: str,
    split: str = "heldout",
    samples_per_task: int | None = None,
    ks: tuple[int, ...] = (1,),
    n_tasks: int | None = None,
) -> dict[str, Any]:
    """Evaluate ``model_path`` on ``split`` and return ``{"pass@1", "n", ...}``. Every argument is checked
    before anything is loaded (a bad one is a ``ValueError`` naming the option, in about a second rather than
    after an engine start)."""
    if split not in ("heldout", "train"):
        raise ValueError(f"--split must be 'heldout' or 'train', got {split!r}")
    for option, value in (("--n-tasks", n_tasks), ("--samples", samples_per_task)):
        if value is not None and value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}; omit it for the config's default")
    spt = max(cfg.eval.samples_per_task, max(ks)) if samples_per_task is None else samples_per_task
    if max(ks) > spt:
        raise ValueError(f"pass@{max(ks)} needs --samples >= {max(ks)}, got --samples {spt}")
    import torch

    from tandem.engine import create_engine
    from tandem.engine.choice import builtin_only_setting, choose_engine
    from tandem.env.sources import tasks_for
    from tandem.model import load_chat_format
    from tandem.rollout import RolloutWorker, evaluate
    from tandem.rollout.worker import apply_limits

    torch.set_num_threads(max(1, cfg.engine.threads))
    chat = load_chat_format(model_path)
    n = cfg.tasks.heldout_size if n_tasks is None else n_tasks
    tasks = [apply_limits(t, cfg) for t in tasks_for(cfg.tasks, split, n)]
    kind, _ = choose_engine(cfg.engine, model_path, builtin_only_setting(cfg))
    engine = create_engine(
        model_path,
        cfg.engine.model_copy(update={"kind": kind}),
        dtype=cfg.model.dtype,
        seed=cfg.train.seed,
        deterministic=cfg.train.deterministic,
    )
    engine.start()

    async def generate(request):
        return await asyncio.wrap_future(engine.submit(request))

    worker = RolloutWorker(generate, chat, cfg, seed=cfg.train.seed)
    try:
        result = asyncio.run(evaluate(worker, tasks, spt, ks, cfg.eval.temperature, concurrency=16))
    finally:
        getattr(engine, "close", engine.stop)()  # close: the vLLM engine also frees its engine core
    result["model"] = model_path
    result["split"] = split
    return result
