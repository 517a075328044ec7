"""`tandem bench pipeline`: the same config in sync and async mode for the same wall-clock budget.

Invariant: both modes run one after the other with identical config except ``orchestrator.mode`` (an
``engine.kind = "auto"`` resolved once, so both run the same engine, named in ``engine``), identical time
budget, and the same held-out evaluation of their final models; the JSON reports what each measured.

What bounds the speedup on one machine: per mode, ``machine_busy_cores`` is the mean number of the machine's
cores busy during the training loop (every process: engine, trainer, the sandboxes of tool calls and
grading, Ray) and ``core_s_per_sample`` that divided by samples/s. ``speedup_cap = cpus /
sync.machine_busy_cores`` is the speedup async would reach if it kept every core busy at sync's CPU cost per
sample; work that costs more CPU when it shares the cores (async's ``core_s_per_sample`` above sync's) keeps
async below it. Both are None where ``/proc/stat`` cannot be read.

``check_run_root`` creates ``run_root`` or refuses it (``BenchInputError``) before the engine is resolved
(which may measure engines) or Ray starts.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from tandem.bench.limits import BenchInputError
from tandem.core.config import RunConfig


def check_run_root(run_root: Path | None) -> None:
    """Create ``run_root`` (None: nothing to do) or raise ``BenchInputError`` saying why it cannot hold the
    two runs: an existing non-directory, a directory that cannot be created or is not writable."""
    if run_root is None:
        return
    if run_root.exists() and not run_root.is_dir():
        raise BenchInputError(f"--run-root {str(run_root)!r} is not a directory; pass a directory")
    try:
        run_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchInputError(
            f"--run-root {str(run_root)!r} cannot be created ({e.strerror or e}); pass a writable directory"
        ) from None
    if not os.access(run_root, os.W_OK | os.X_OK):
        raise BenchInputError(f"--run-root {str(run_root)!r} is not writable; pass a writable directory")


def run(cfg: RunConfig, budget_s: float = 150.0, run_root: Path | None = None) -> dict[str, Any]:
    import ray

    from tandem.engine.choice import resolve_run_engine
    from tandem.orchestrator import eval_model, train

    check_run_root(run_root)
    root = Path(run_root or tempfile.mkdtemp(prefix="tandem-bench-pipeline-"))
    cfg, reason = resolve_run_engine(cfg)  # both modes on the same engine
    out: dict[str, Any] = {"budget_s": budget_s, "run_dir": str(root), "engine": cfg.engine.kind}
    out["engine_reason"] = reason
    for mode in ("sync", "async"):
        c = cfg.model_copy(deep=True)
        c.orchestrator.mode = mode
        c.orchestrator.steps = 10_000
        c.orchestrator.time_budget_s = budget_s
        c.eval.before_after = False
        c.train.checkpoint_every = 0
        res = train(c, root / mode, quiet=False)
        ev = eval_model(c, str(root / mode / "final_model"))
        entry = {
            "samples_per_s": round(res.samples_per_s, 4),
            "trainer_busy": round(res.trainer_busy, 4),
            "engine_busy": round(res.engine_busy, 4),
            "heldout_pass1": round(ev["pass@1"], 4),
            "steps": res.steps,
            "samples": res.samples,
        }
        cores = res.machine_busy_cores
        entry["machine_busy_cores"] = None if cores is None else round(cores, 3)
        entry["core_s_per_sample"] = None if cores is None else round(cores / max(res.samples_per_s, 1e-9), 4)
        if mode == "async":
            entry["staleness_hist"] = res.staleness_hist
        out[mode] = entry
    if ray.is_initialized():
        ray.shutdown()
    out["speedup"] = round(out["async"]["samples_per_s"] / max(out["sync"]["samples_per_s"], 1e-9), 4)
    out["cpus"] = os.cpu_count()
    sync_cores = out["sync"]["machine_busy_cores"]
    out["speedup_cap"] = round(out["cpus"] / sync_cores, 3) if sync_cores else None
    out["targets"] = {
        "speedup>=1.8": out["speedup"] >= 1.8,
        "async_trainer_busy>=0.85": out["async"]["trainer_busy"] >= 0.85,
        "async_pass1>=sync-0.05": out["async"]["heldout_pass1"] >= out["sync"]["heldout_pass1"] - 0.05,
    }
    return out
