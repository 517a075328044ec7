"""Layer 2: the RL trainer: GRPO loss, group-relative advantages, packing, optimizer step, checkpoints.

Weights leave the trainer only through ``Trainer.publish_state`` (the publish/apply seam); checkpoints are
atomic directories that are also loadable HF model directories.
"""

from tandem.train.advantages import StepAdvantages, compute_advantages, group_advantages, is_zero_variance
from tandem.train.batching import MicroBatch, SequenceInput, pack, plan_micro_batches, token_logprobs
from tandem.train.checkpoint import checkpoint_path, latest_checkpoint, list_checkpoints, read_state
from tandem.train.loss import grpo_loss
from tandem.train.trainer import Trainer, load_causal_lm

__all__ = [
    "MicroBatch", "SequenceInput", "StepAdvantages", "Trainer", "checkpoint_path", "compute_advantages",
    "group_advantages", "grpo_loss", "is_zero_variance", "latest_checkpoint", "list_checkpoints",
    "load_causal_lm", "pack", "plan_micro_batches", "read_state", "token_logprobs",
]  # fmt: skip
