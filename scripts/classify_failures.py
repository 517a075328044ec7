"""Classify a model's sessions on built-in tasks by what it wrote: the reference body, a planted bug, or
something else (e.g. the right expression with a wrong constant), and whether the hidden tests passed.

A diagnostic for the default run's held-out result (docs/results.md, "Default training run"): it samples
with the same engine, harness, sandbox and reward as ``tandem eval`` and looks at each session's diff.

Classes (from the lines the session's diff adds to ``solution.py``): ``no_change`` (no diff), ``reference``
(the reference solution's last line is among them), ``bug`` (a planted bug's last line is), ``other``;
``+pass`` when every hidden test passed.

Also ``pass_by_family``: per task family, ``[hidden-test passes, sessions]``.

Usage: .venv/bin/python scripts/classify_failures.py [MODEL] [--split heldout] [--tasks 48] [--samples 4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json

import torch

from tandem.core.config import load_config
from tandem.engine import create_engine
from tandem.env.sources import tasks_for
from tandem.model import load_chat_format
from tandem.rollout import RolloutWorker
from tandem.rollout.worker import apply_limits


def classify(diff: str, solution: str, bugs: list[str]) -> str:
    """The class of one session's diff (see the module docstring)."""
    if not diff.strip():
        return "no_change"
    added = [
        line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
    ]
    if solution.strip().splitlines()[-1].strip() in added:
        return "reference"
    if any(b.strip().splitlines()[-1].strip() in added for b in bugs):
        return "bug"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="models/tandem-base")
    ap.add_argument("--split", default="heldout", choices=["heldout", "train"])
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config("configs/default.toml")
    torch.set_num_threads(args.threads)
    engine = create_engine(args.model, cfg.engine, dtype=cfg.model.dtype, seed=cfg.train.seed)
    engine.start()
    tasks = [apply_limits(t, cfg) for t in tasks_for(cfg.tasks, args.split, args.tasks)]

    async def generate(request):
        return await asyncio.wrap_future(engine.submit(request))

    worker = RolloutWorker(generate, load_chat_format(args.model), cfg, seed=1)

    async def run() -> list:
        sem = asyncio.Semaphore(16)

        async def one(task):
            async with sem:
                return task, await worker.run_group(task, args.samples, 1.0)

        return await asyncio.gather(*(one(t) for t in tasks))

    try:
        results = asyncio.run(run())
    finally:
        engine.stop()
    total: collections.Counter[str] = collections.Counter()
    by_level: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    by_family: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for task, group in results:
        for traj in group.trajectories:
            c = classify(traj.diff, task.meta["solution"], list(task.meta.get("bugs", [])))
            c += "+pass" if traj.reward.components.get("pass_fraction", 0.0) >= 1.0 else ""
            total[c] += 1
            by_family[task.meta["family"]][0] += c.endswith("+pass")
            by_family[task.meta["family"]][1] += 1
            by_level[str(task.meta.get("level"))][c] += 1
    out = {"model": args.model, "split": args.split, "tasks": len(tasks), "samples_per_task": args.samples}
    out |= {"classes": dict(total), "by_level": {k: dict(v) for k, v in sorted(by_level.items())}}
    out["pass_by_family"] = dict(sorted(by_family.items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
