"""Layer 3: rollout workers run groups of agent sessions against engines and produce trajectories.

Workers are engine-agnostic: they receive a ``generate`` coroutine function (client side of an engine) and a
chat format, and never import engine internals.
"""

from tandem.rollout.evaluate import evaluate, pass_at_k
from tandem.rollout.worker import RolloutWorker, TaskStream

__all__ = ["RolloutWorker", "TaskStream", "evaluate", "pass_at_k"]
