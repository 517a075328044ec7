"""Mixture-of-experts routing: find a model's routers, record the experts each token gets, replay given ones.

Works with transformers' top-k router modules (``Qwen3MoeTopKRouter`` and its siblings in transformers 5.x):
a module with ``top_k``, ``num_experts``, a 2-D ``weight`` and ``norm_topk_prob``, whose forward maps hidden
states ``[..., hidden]`` (flattened to ``[N, hidden]``) to ``(router_logits [N, E], scores [N, k],
indices [N, k])``; the experts module then mixes expert ``indices[n, j]`` with weight ``scores[n, j]``.

Invariants:
- "MoE layers" are the router modules in module order (= decoder layer order); dense layers (e.g.
  ``mlp_only_layers``) have none and are not counted. Routes are ``[tokens, moe_layers, top_k]`` expert ids
  in the router's own top-k order (descending probability), stored compactly (``routes_dtype``).
- ``RouterHooks`` records, per forward, each router's own top-k choice (``own()``), whatever it replays.
- Replay (``RouterHooks.replay``) replaces the router's indices with the given ones and its scores with
  ``softmax(router_logits)`` gathered at them (renormalised over the k when ``norm_topk_prob``), computed
  exactly as the router computes its own scores: replaying a model's own routes reproduces its forward
  bit for bit, and the router weight still gets gradient through the gathered softmax. Rows where
  ``replay_mask`` is False keep the router's own choice.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""Files copied from a base model directory by ``write_model_dir`` (those that exist)."""


@dataclass(frozen=True)
class MoeShape:
    """The routing shape of a model: routes of a token are ``[layers, top_k]`` ids in ``[0, num_experts)``."""

    layers: int
    top_k: int
    num_experts: int


def _is_router(module: Any) -> bool:
    w = getattr(module, "weight", None)
    return (
        hasattr(module, "top_k")
        and hasattr(module, "num_experts")
        and hasattr(module, "norm_topk_prob")
        and w is not None
        and getattr(w, "dim", lambda: 0)() == 2
    )


def routers(model: Any) -> list[Any]:
    """The model's top-k router modules in layer order (empty for a dense model)."""
    return [m for m in model.modules() if _is_router(m)]


def moe_shape(model: Any) -> MoeShape | None:
    """The routing shape of ``model``, or None if it has no top-k routers (a dense model)."""
    rs = routers(model)
    if not rs:
        return None
    ks = {int(r.top_k) for r in rs}
    es = {int(r.num_experts) for r in rs}
    if len(ks) != 1 or len(es) != 1:
        raise ValueError(f"routers disagree on top_k {sorted(ks)} or num_experts {sorted(es)}")
    return MoeShape(len(rs), ks.pop(), es.pop())


def routes_dtype(num_experts: int) -> np.dtype:
    """The compact dtype of expert ids: uint8 up to 256 experts, else int16."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


class RouterHooks:
    """Forward hooks on every router of ``model`` (see module invariants); a context manager that removes
    them on exit. Not thread-safe: one forward at a time."""

    def __init__(self, model: Any) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k router modules: it is not a MoE model")
        self.shape = moe_shape(model)
        self.replay: Any = None  # torch int64 [N, layers, top_k] or None
        self.replay_mask: Any = None  # torch bool [N] or None (all rows replayed)
        self._own: list[Any] = [None] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(
                    f"router {type(module).__name__} returned {type(output).__name__}; expected "
                    "(router_logits, scores, indices) as transformers' top-k routers do"
                )
            return self.process(layer, module, output)

        return hook

    def process(self, layer: int, module: Any, output: tuple[Any, Any, Any]) -> Any:
        """What the hook does with router ``module``'s output ``(logits, scores, indices)`` of MoE layer
        ``layer``: records the router's own indices and, while replaying, returns the replayed triple (else
        None: the output stands). Forwards that compute routing themselves (``tandem.model.deterministic``)
        call it directly."""
        logits, _, own = output
        self._own[layer] = own.detach()
        if self.replay is None:
            return None
        import torch

        idx = self.replay[:, layer]
        if idx.shape != own.shape:
            raise ValueError(
                f"replayed routes of MoE layer {layer} have shape {tuple(idx.shape)}, the router chose "
                f"{tuple(own.shape)} ([tokens, top_k]) in this forward"
            )
        if self.replay_mask is not None:
            idx = torch.where(self.replay_mask[:, None], idx, own)
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        scores = probs.gather(-1, idx)
        if module.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), idx

    def clear(self) -> None:
        """Forget the routes recorded by earlier forwards."""
        self._own = [None] * len(self.routers)

    def own(self) -> Any:
        """The routers' own top-k ids of the last forward: torch int64 ``[N, layers, top_k]``."""
        import torch

        if any(x is None for x in self._own):
            raise RuntimeError("no forward of the model was recorded since the last clear()")
        return torch.stack(self._own, dim=1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> RouterHooks:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def write_model_dir(
    out: str | Path, preset: str = "moe", *, tokenizer_dir: str | Path = "models/tandem-base", seed: int = 0
) -> Path:
    """Write a freshly initialised model of ``preset`` (``tandem.model.build``) to ``out`` as an HF model
    directory, with the tokenizer and chat-format files of ``tokenizer_dir`` (the shipped base model, vocab
    4096) copied in, so tandem can train and serve it. Returns ``out``."""
    import json

    from tandem.model.build import build_model, qwen3_config

    src = Path(tokenizer_dir)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{str(src)!r} has no tokenizer.json; pass tokenizer_dir=<a tandem model dir>"
        )
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(
        1 for t in tok.get("added_tokens", []) if t["content"] not in tok["model"]["vocab"]
    )
    base = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    vocab = max(vocab, int(base.get("vocab_size", 0)))
    eos = int(base.get("eos_token_id", 0) or 0)
    model = build_model(qwen3_config(preset, vocab_size=vocab, eos_token_id=eos), seed=seed)
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst
