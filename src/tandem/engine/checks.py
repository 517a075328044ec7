"""Validation shared by every engine: requests and weight updates are checked before anything is touched.

Invariants:
- ``check_request`` returns an error message naming the bad field (a value out of range or of the wrong
  type: prompt ids, ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop_token_ids``), or the
  number of new tokens the request may sample (``max_new_tokens`` clamped to the room left in
  ``max_seq_len``).
- ``convert_tensors`` / ``convert_patches`` raise ``EngineError`` naming the tensor for an unknown name, a
  shape mismatch, an index outside the tensor or values that are not numbers of the target's kind, before
  any value is written; ``uint16`` data for a floating-point target is read as bfloat16 bit patterns (the
  trainer's publish format), and other integer, bool or complex data for it is refused (a cast would have
  turned bit patterns sent as int32 into weights near 1e9 without a word).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from tandem.core.errors import EngineError
from tandem.core.generation import MIN_TEMPERATURE, GenerationRequest

Patches = dict[str, tuple[np.ndarray, np.ndarray]]
"""``patch_weights`` input: tensor name -> (flat indices, new values)."""
OnLive = Callable[[], None] | None
"""``patch_weights`` callback: called once the engine serves the new version."""


def as_values(value: np.ndarray | torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A tensor of ``value``; uint16 data for a floating-point target is read as bfloat16 bit patterns.
    Other integer, bool and complex data for a floating-point target is refused (``TypeError``): cast to the
    target's type it would be wrong values (an fp32 bit pattern sent as int32 became a number near 1e9)."""
    t = torch.as_tensor(np.ascontiguousarray(value) if isinstance(value, np.ndarray) else value)
    if t.dtype == torch.uint16 and target.is_floating_point():
        t = t.view(torch.bfloat16)
    if target.is_floating_point() and not t.is_floating_point():
        kind = str(t.dtype).removeprefix("torch.")
        raise TypeError(
            f"has values of dtype {kind} for a floating-point tensor (send floats, or uint16 bfloat16 bits)"
        )
    return t


def check_request(req: GenerationRequest, vocab_size: int, max_seq_len: int) -> str | int:
    """Error message, or the number of new tokens this request may sample."""
    ids, sp = req.prompt_ids, req.params
    if not isinstance(ids, (list, tuple, np.ndarray)):
        return f"prompt_ids must be a list of token ids, got {type(ids).__name__}"
    if len(ids) == 0:
        return "empty prompt: prompt_ids must hold at least one token id"
    bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
    if bad:
        return f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
    room = max_seq_len - len(ids)
    if room < 1:
        return (
            f"prompt of {len(ids)} tokens leaves no room in max_seq_len={max_seq_len}; "
            "shorten the prompt or raise engine.max_seq_len"
        )
    if not _is_int(sp.max_new_tokens) or sp.max_new_tokens < 1:
        return f"max_new_tokens={sp.max_new_tokens!r} must be an integer >= 1"
    if not _is_real(sp.temperature) or not (sp.temperature == 0 or sp.temperature >= MIN_TEMPERATURE):
        return f"temperature={sp.temperature!r} must be 0 (greedy) or a number >= {MIN_TEMPERATURE}"
    if not _is_real(sp.top_p) or not 0.0 < sp.top_p <= 1.0:
        return f"top_p={sp.top_p!r} must be a number in (0, 1]"
    if sp.seed is not None and not _is_int(sp.seed):
        return f"seed={sp.seed!r} must be an integer or None"
    stops = sp.stop_token_ids
    if not isinstance(stops, (list, tuple)) or not all(_is_int(t) for t in stops):
        return f"stop_token_ids={stops!r} must be a list of integer token ids"
    return min(sp.max_new_tokens, room)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """A finite number, not a bool (an integer of any size counts)."""
    if _is_int(x):
        return True
    return isinstance(x, (float, np.floating)) and math.isfinite(x)


def convert_tensors(
    targets: dict[str, torch.Tensor], tensors: dict[str, np.ndarray | torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Full replacement tensors, validated against ``targets`` (name -> current tensor)."""
    converted: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        target = targets.get(name)
        if target is None:
            raise EngineError(
                f"update_weights: unknown tensor {name!r}; names are the model's state_dict keys"
            )
        try:
            t = as_values(value, target)
        except (TypeError, ValueError, RuntimeError) as e:
            raise EngineError(
                f"update_weights: tensor {name!r} is not usable: {e}; nothing was applied"
            ) from e
        if tuple(t.shape) != tuple(target.shape):
            raise EngineError(
                f"update_weights: tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                f"{tuple(target.shape)}; nothing was applied"
            )
        converted[name] = t
    return converted


def convert_patches(
    targets: dict[str, torch.Tensor], patches: dict[str, tuple[np.ndarray, np.ndarray]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Element patches ``name -> (flat_index, values)``, validated against ``targets``."""
    converted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (index, values) in patches.items():
        target = targets.get(name)
        if target is None:
            raise EngineError(f"patch_weights: unknown tensor {name!r}; names are the state_dict keys")
        idx = torch.as_tensor(np.asarray(index, dtype=np.int64))
        try:
            val = as_values(values, target).to(target.dtype)
        except (TypeError, ValueError, RuntimeError) as e:
            raise EngineError(
                f"patch_weights: tensor {name!r} is not usable: {e}; nothing was applied"
            ) from e
        if idx.dim() != 1 or idx.shape != val.shape:
            raise EngineError(
                f"patch_weights: tensor {name!r} needs 1-D index and values of equal length, got "
                f"{tuple(idx.shape)} and {tuple(val.shape)}"
            )
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= target.numel()):
            raise EngineError(
                f"patch_weights: tensor {name!r} has an index outside [0, {target.numel()}); "
                "nothing was applied"
            )
        converted[name] = (idx, val)
    return converted
