"""Layer 4: wiring on Ray — engines, rollout workers, the trajectory buffer and the trainer, in sync or async
mode with bounded staleness (see ``run.py`` for the loop and ``actors.py`` for the admission invariants)."""

from tandem.core.lazy import lazy_exports

_WHERE = {
    "eval_model": "tandem.orchestrator.evaluation",
    "RunResult": "tandem.orchestrator.run",
    "train": "tandem.orchestrator.run",
}
"""Public names and their modules, imported on first use (importing ``tandem.orchestrator.compare`` for the
CLI does not start loading Ray, torch and transformers)."""

__getattr__ = lazy_exports(__name__, _WHERE)


__all__ = ["RunResult", "eval_model", "train"]
