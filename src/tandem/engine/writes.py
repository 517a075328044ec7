"""Element writes into served weights: what ``FastRunner.plan_patch`` plans and the engine applies.

Invariants:
- ``apply_writes`` sets ``flat[index] = values`` for each ``Write``, bit-exact for any dtype (CPU tensors go
  through a compiled scatter on integer views of the same memory); positions are trusted (planned by the
  runner from validated patches).
- ``transposed`` lists a matrix's writes into its transposed buffer in buffer order (values reordered).
- ``clone_nested``/``copy_nested`` copy a weight bank (nested dicts, lists and tuples of tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Write:
    """Set ``flat[index] = values`` (``flat`` is a 1-D view of a parameter or a derived buffer).

    ``deferred``: the forward never reads ``flat`` (a parameter the runner serves from derived buffers), so
    the engine may apply this write after its pause, off the serving path (``BuiltinEngine.patch_weights``).
    ``bank``: the copy of the served weights ``flat`` belongs to (``FastRunner`` banks), None for an HF
    parameter.
    """

    flat: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor
    deferred: bool = False
    bank: int | None = None


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def warm_apply_writes(dtypes: set[torch.dtype]) -> None:
    """Compile (or load from numba's cache) the scatter for these parameter dtypes and the transposed-order
    planner now, so that the first delta update pays neither (about 1.5 s to compile, 0.3 s to load):
    the scatter would be inside the engine's pause, the planner on the way to it."""
    with torch.inference_mode():
        for dt in dtypes:
            flat = torch.zeros(2, dtype=dt)
            apply_writes([Write(flat, torch.tensor([1]), flat[:1].clone())])
            transposed(torch.tensor([1], dtype=torch.int64), flat[:1].clone(), in_dim=2, stride=2, offset=0)


def apply_writes(writes: list[Write]) -> None:
    """Scatter planned writes (call under ``torch.inference_mode``: derived buffers are inference tensors).

    CPU tensors go through a compiled scatter loop on integer views of the same memory (bit-exact for any
    dtype): about 2x faster than ``index_copy_`` at the few-percent densities of RL weight deltas, and this
    scatter is the whole engine pause of a delta update. Other devices use ``index_copy_``."""
    from tandem.weights.decode_kernels import scatter

    for w in writes:
        size = w.flat.element_size()
        if w.flat.device.type == "cpu" and size in _INT_VIEW and w.values.dtype == w.flat.dtype:
            view = _INT_VIEW[size]
            scatter(w.flat.view(view).numpy(), w.index.numpy(), w.values.contiguous().view(view).numpy())
        else:
            w.flat.index_copy_(0, w.index, w.values)


def transposed(
    flat_index: torch.Tensor, values: torch.Tensor, in_dim: int, stride: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in a transposed buffer (``W[o, i]`` at ``i * stride + offset + o``) of W's flat indices,
    in buffer order, with the values reordered to match: the scatter then walks the buffer front to back
    (about 2x faster than in W's order, whose consecutive writes are ``stride`` elements apart). One
    compiled pass computes both (values moved as integers of their width, so any dtype stays bit-exact)."""
    from tandem.weights.decode_kernels import transposed_order

    idx = flat_index.contiguous().numpy()
    values = values.contiguous()
    view = _INT_VIEW.get(values.element_size())
    pos = np.empty_like(idx)
    if view is None or values.device.type != "cpu" or values.dim() != 1:
        perm = np.empty_like(idx)
        transposed_order(idx, np.arange(idx.shape[0], dtype=np.int64), in_dim, stride, offset, pos, perm)
        return torch.from_numpy(pos), values[torch.from_numpy(perm)]
    out = torch.empty_like(values)
    transposed_order(idx, values.view(view).numpy(), in_dim, stride, offset, pos, out.view(view).numpy())
    return torch.from_numpy(pos), out


def clone_nested(v: Any) -> Any:
    """A deep copy of a bank entry (tensors cloned; lists, tuples and dicts rebuilt)."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: clone_nested(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(clone_nested(x) for x in v)
    return v


def copy_nested(dst: Any, src: Any) -> None:
    """Copy every tensor of bank entry ``src`` into the same place of ``dst`` (same structure)."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif isinstance(src, dict):
        for k, x in src.items():
            copy_nested(dst[k], x)
    elif isinstance(src, (list, tuple)):
        for d, x in zip(dst, src, strict=True):
            copy_nested(d, x)
