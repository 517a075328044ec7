"""Layer 2: the RL trainer: GRPO loss, group-relative advantages, packing, optimizer step, checkpoints.

Weights leave the trainer only through ``Trainer.publish_state`` (the publish/apply seam); checkpoints are
atomic directories that are also loadable HF model directories.
"""

from tandem.core.lazy import lazy_exports

_WHERE = {
    "StepAdvantages": "tandem.train.advantages",
    "compute_advantages": "tandem.train.advantages",
    "group_advantages": "tandem.train.advantages",
    "is_zero_variance": "tandem.train.advantages",
    "MicroBatch": "tandem.train.batching",
    "SequenceInput": "tandem.train.batching",
    "pack": "tandem.train.batching",
    "plan_micro_batches": "tandem.train.batching",
    "token_logprobs": "tandem.train.batching",
    "checkpoint_path": "tandem.train.checkpoint",
    "latest_checkpoint": "tandem.train.checkpoint",
    "list_checkpoints": "tandem.train.checkpoint",
    "read_state": "tandem.train.checkpoint",
    "grpo_loss": "tandem.train.loss",
    "Trainer": "tandem.train.trainer",
    "load_causal_lm": "tandem.train.trainer",
}
"""Public names and their modules: imported on first use, so that importing one light submodule (e.g.
``tandem.train.midtrain`` for the CLI) does not load torch and transformers."""

__getattr__ = lazy_exports(__name__, _WHERE)


__all__ = [
    "MicroBatch", "SequenceInput", "StepAdvantages", "Trainer", "checkpoint_path", "compute_advantages",
    "group_advantages", "grpo_loss", "is_zero_variance", "latest_checkpoint", "list_checkpoints",
    "load_causal_lm", "pack", "plan_micro_batches", "read_state", "token_logprobs",
]  # fmt: skip
