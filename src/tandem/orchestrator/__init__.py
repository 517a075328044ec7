"""Layer 4: wiring on Ray — engines, rollout workers, the trajectory buffer and the trainer, in sync or async
mode with bounded staleness (see ``run.py`` for the loop and ``actors.py`` for the admission invariants)."""

from tandem.orchestrator.evaluation import eval_model
from tandem.orchestrator.run import RunResult, train

__all__ = ["RunResult", "eval_model", "train"]
