"""Forward passes of the built-in engine over a slot KV cache.

Two runners share one small interface (``prefill``, ``decode``, ``move``, ``release``, ``refresh``,
``plan_patch``, ``can_park``) over
``max_slots`` cache slots:

- ``FastRunner``: its own forward for Qwen3 / Qwen2 / Llama-style decoders (RMSNorm, optional per-head
  q_norm/k_norm, RoPE from the model's own rotary module, GQA, SwiGLU, tied or untied lm_head) over a
  preallocated cache ``[layers, slots, kv_heads, max_seq_len, head_dim]`` (in deterministic mode the block
  layout of ``det.block_cache_shape``, read in place by ``det.attention_blocks``).
- ``HFRunner``: fallback for any other causal LM; the HF forward per session with its own cache.

``FastRunner(..., deterministic=True)`` (``train.deterministic``) runs prefill and decode (a decode step is a
one-token prefill after each slot's cached positions) through ``tandem.model.deterministic``: a token's
logits are bitwise the same whatever shares its batch, and equal to the trainer's deterministic forward.

Invariants:
- The HF module owns the parameters. ``FastRunner`` reads norms and embeddings by reference; its matrices
  are derived buffers (fused, transposed) rebuilt by ``refresh()``: call it after changing weights, or change
  elements through ``plan_patch(param, flat_index, values)`` + ``apply_writes``, which update the parameter
  and its derived buffers in place (cost proportional to the number of changed elements). A plan refers to
  the buffers of the last ``refresh``; ``generation`` counts refreshes so a stale plan can be detected.
  The forward never reads a matrix parameter other than the embedding (dense models): a plan marks the
  writes to those parameters ``deferred`` (they may land after the engine's pause), and lists the writes to
  a transposed buffer in buffer order.
- With ``double_buffer`` the banks hold a copy of every parameter the forward uses, so a plan leaves out
  the writes to the HF parameters themselves (each such write touches ~40% of a copy's cache lines at RL
  densities, memory traffic a serving engine on the same host pays for: docs/results.md, Weight sync); the
  owner sets ``params_stale`` once it serves a patched bank, and ``restore_params()`` copies the served bank
  back into the parameters before anything reads them (``refresh`` refuses to run on stale parameters; the
  engine restores them for its ``model`` and before a full update).
- Active sessions occupy slots ``0..n-1`` (the engine compacts with ``move``), so a decode step works on
  views of the cache and never gathers it. ``lens[s]`` is the number of tokens cached in slot ``s``.
- ``prefill(first, prompts, starts)`` fills slot ``first+j`` from position ``starts[j]`` (0 by default): the
  slot's cached positions ``0..starts[j]-1`` are kept (prefix reuse) and the prompt is appended after them,
  attending to them; it returns the logits of each prompt's last token and sets ``lens = start + len``.
  ``decode`` appends one token to each of slots ``0..n-1`` and returns the logits after it.
- Slots at or beyond the active count may hold parked KV; ``move`` carries a slot's ``lens[src]`` positions.
- Routing (MoE models: ``HFRunner``, and ``FastRunner`` in deterministic mode, the only mode it serves MoE
  models in; ``records_routes``): each slot keeps the top-k expert ids of every position it holds,
  ``routes(slot)`` = ``[lens[slot], moe_layers, top_k]``; prefix reuse keeps the first ``start`` rows
  with the KV (parked slots carry their routes), ``move``/``release`` carry/drop them.
  ``feed(slot, token)`` appends one token without returning logits (the engine feeds a finished session's
  last sampled token so its routes exist too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from tandem.engine.writes import Write, clone_nested, copy_nested, transposed
from tandem.model import deterministic as det
from tandem.model.moe import RouterHooks, moe_shape, routes_dtype

_FAST_TYPES = {"qwen3", "qwen2", "llama"}
_DET_MOE_TYPES = {"qwen3_moe"}
"""Mixture-of-experts model types ``FastRunner`` serves in deterministic mode (``det.moe_block``)."""


def fast_supported(model: PreTrainedModel, deterministic: bool = False) -> str | None:
    """None if ``FastRunner`` (in deterministic mode when ``deterministic``) can serve this model, else the
    reason it cannot."""
    cfg = model.config
    types = _FAST_TYPES | _DET_MOE_TYPES if deterministic else _FAST_TYPES
    if cfg.model_type not in types:
        return f"model_type {cfg.model_type!r} is not one of {sorted(types)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers are not supported by the fast path"
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "model has no .model.layers"
    return None


def _mm(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ wt
    return y if b is None else y + b


class FastRunner:
    """Own batched forward with a slot KV cache (see module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_slots: int,
        max_seq_len: int,
        deterministic: bool = False,
        double_buffer: bool = False,
    ) -> None:
        self.model = model
        cfg = model.config
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self.deterministic = deterministic
        base = model.model
        self.layers = list(base.layers)
        self.hf_embed = self.embed = base.embed_tokens.weight
        self.hf_norm = self.norm_w = base.norm.weight
        self.eps = float(cfg.rms_norm_eps)
        self.lm_head = model.get_output_embeddings().weight
        att0 = self.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = att0.head_dim
        self.scaling = float(att0.scaling)
        self.q_out = self.n_heads * self.head_dim
        self.kv_out = self.n_kv * self.head_dim
        self.moe_layers = [i for i, layer in enumerate(self.layers) if det.is_moe_layer(layer)]
        if self.moe_layers and not deterministic:
            raise ValueError("FastRunner serves mixture-of-experts models in deterministic mode only")
        # Two banks of served weights (dense models): patches go to the idle one, activate() switches.
        self.double_buffer = double_buffer and not self.moe_layers
        self.params_stale = False  # the HF parameters lag the served bank (module invariants)
        self._param_of: dict[int, torch.Tensor] = {}  # id -> each parameter with derived buffers
        self.active = 0
        dense = [layer for layer in self.layers if not det.is_moe_layer(layer)]
        self.inter = dense[0].mlp.gate_proj.weight.shape[0] if dense else 0
        shape = moe_shape(model) if self.moe_layers else None
        self.records_routes = shape is not None
        self._route_shape = shape
        self._routes_dtype = routes_dtype(shape.num_experts) if shape is not None else np.dtype(np.uint8)
        self._routes: list[list[np.ndarray]] = [[] for _ in range(max_slots)]
        dtype = self.embed.dtype
        n_layers = len(self.layers)
        if deterministic:  # block layout (det.attention_blocks reads it in place): keys per block transposed
            kshape, vshape = det.block_cache_shape(max_slots, self.n_kv, max_seq_len, self.head_dim)
            self.k_cache = torch.zeros((n_layers, *kshape), dtype=dtype)
            self.v_cache = torch.zeros((n_layers, *vshape), dtype=dtype)
        else:
            shape = (n_layers, max_slots, self.n_kv, max_seq_len, self.head_dim)
            self.k_cache = torch.zeros(shape, dtype=dtype)
            self.v_cache = torch.zeros(shape, dtype=dtype)
        self.lens = [0] * max_slots
        with torch.inference_mode():
            pos = torch.arange(max_seq_len).unsqueeze(0)
            cos, sin = base.rotary_emb(self.embed[:1].unsqueeze(0), pos)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)  # [max_seq_len, head_dim]
        self.refresh()

    def refresh(self, both_banks: bool = True) -> None:
        """Rebuild the served weights (every bank) from the HF parameters (refused while ``params_stale``).

        Derived: per layer the fused q/k/v and gate/up matrices, and every matrix (lm_head too) transposed
        and contiguous, because ``x @ W_t`` is ~1.5x faster than ``F.linear(x, W)`` for the few-row inputs of
        a CPU decode step. This doubles the memory of the matrices, which is small for the models served here.
        With ``double_buffer`` there are two such banks, each also with its own copy of the embedding and the
        norms (a single bank reads those from the HF parameters by reference); both start equal.
        ``both_banks=False`` builds only the first (served) bank; ``add_second_bank`` then copies it.
        """
        if self.params_stale:
            raise RuntimeError("the HF parameters lag the served bank: restore_params() before refresh()")
        self.generation = getattr(self, "generation", 0) + 1
        with torch.inference_mode():
            first = self._build_bank(private=self.double_buffer)
            self._banks = [first]
            if self.double_buffer and both_banks:
                self._banks.append({k: clone_nested(v) for k, v in first.items()})
        self.activate(0)
        self._derived = self._derived_map()

    @property
    def banks(self) -> int:
        return len(self._banks)

    def sync_bank(self, dst: int) -> None:
        """Copy the served bank into bank ``dst`` in place (e.g. after a patch was written into the idle bank
        but never switched to)."""
        if dst == self.active or len(self._banks) <= dst:
            return
        with torch.inference_mode():
            copy_nested(self._banks[dst], self._banks[self.active])

    def add_second_bank(self) -> None:
        """Double buffering after ``refresh(both_banks=False)``: the second bank as a copy of the first.
        Counts as a refresh (``generation``): plans made before it lack the new bank's writes."""
        if self.double_buffer and len(self._banks) == 1:
            with torch.inference_mode():
                self._banks.append({k: clone_nested(v) for k, v in self._banks[0].items()})
            self.generation += 1
            self._derived = self._derived_map()

    def activate(self, bank: int) -> None:
        """Serve from ``bank`` from the next forward on (the engine calls it between two steps)."""
        b = self._banks[bank]
        self.wt, self.bs, self.moe_w = b["wt"], b["bs"], b["moe_w"]
        self.head_t, self.embed, self.norm_w, self.norms = b["head_t"], b["embed"], b["norm_w"], b["norms"]
        self.active = bank

    def _build_bank(self, private: bool) -> dict[str, Any]:
        def t(*ws: torch.Tensor) -> torch.Tensor:
            return torch.cat(ws).t().contiguous()

        def bias(*mods: torch.nn.Module) -> torch.Tensor | None:
            if all(m.bias is None for m in mods):
                return None
            return torch.cat(
                [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]
            )

        def own(w: torch.Tensor | None) -> torch.Tensor | None:
            return None if w is None else (w.detach().clone() if private else w)

        wt: list[tuple[torch.Tensor, ...]] = []
        bs: list[tuple[torch.Tensor | None, ...]] = []
        moe_w: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        norms: list[tuple[torch.Tensor | None, ...]] = []
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            qn, kn = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)
            ln = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, qn, kn)
            norms.append(tuple(own(w) for w in ln))
            if det.is_moe_layer(layer):  # attention as below; router and experts in moe_w
                att = (a.q_proj, a.k_proj, a.v_proj)
                wt.append((t(*(x.weight for x in att)), t(a.o_proj.weight), None, None))  # type: ignore[arg-type]
                bs.append((bias(*att), bias(a.o_proj), None, None))
                moe_w[i] = det.moe_weights(layer)
                continue
            qkv, gu = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
            wt.append(
                (
                    t(*(x.weight for x in qkv)),
                    t(a.o_proj.weight),
                    t(*(x.weight for x in gu)),
                    t(m.down_proj.weight),
                )
            )
            bs.append((bias(*qkv), bias(a.o_proj), bias(*gu), bias(m.down_proj)))
        return {
            "wt": wt, "bs": bs, "moe_w": moe_w, "norms": norms, "head_t": t(self.lm_head),
            "embed": own(self.hf_embed), "norm_w": own(self.hf_norm),
        }  # fmt: skip

    def _derived_map(self) -> dict[int, list[tuple[torch.Tensor, int, int, str]]]:
        """For each HF tensor the served buffers built from it: ``id -> [(buffer, column offset, bank,
        layout)]``, layout ``"t"`` (``W [out, in]`` transposed: ``W[o, i] == buffer[i, offset + o]``; a bias
        ``b [out]`` at ``buffer[offset + o]``), ``"experts"`` (``[E, O, I]`` as ``[E, I, O]``) or ``"same"``
        (a bank's private copy of the parameter: embedding, norms)."""
        out: dict[int, list[tuple[torch.Tensor, int, int, str]]] = {}

        def add(param: torch.Tensor, buf: torch.Tensor, off: int, bank: int, layout: str) -> None:
            out.setdefault(id(param), []).append((buf, off, bank, layout))
            self._param_of[id(param)] = param

        def place(mods: tuple[torch.nn.Module, ...], wt: torch.Tensor, bs: torch.Tensor | None, bank: int):
            off = 0
            for m in mods:
                add(m.weight, wt, off, bank, "t")
                if bs is not None and m.bias is not None:
                    add(m.bias, bs, off, bank, "t")
                off += m.weight.shape[0]

        for bank, b in enumerate(self._banks):
            for i, (layer, wt, bs) in enumerate(zip(self.layers, b["wt"], b["bs"], strict=True)):
                a, m = layer.self_attn, layer.mlp
                place((a.q_proj, a.k_proj, a.v_proj), wt[0], bs[0], bank)
                place((a.o_proj,), wt[1], bs[1], bank)
                if i in b["moe_w"]:  # router [E, H] -> [H, E]; experts [E, O, I] -> [E, I, O]
                    router_t, gu_t, down_t = b["moe_w"][i]
                    add(m.gate.weight, router_t, 0, bank, "t")
                    add(m.experts.gate_up_proj, gu_t, 0, bank, "experts")
                    add(m.experts.down_proj, down_t, 0, bank, "experts")
                else:
                    place((m.gate_proj, m.up_proj), wt[2], bs[2], bank)
                    place((m.down_proj,), wt[3], bs[3], bank)
                if self.double_buffer:
                    qn, kn = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)
                    hf = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, qn, kn)
                    for param, copy in zip(hf, b["norms"][i], strict=True):
                        if param is not None and copy is not None:
                            add(param, copy, 0, bank, "same")
            add(self.lm_head, b["head_t"], 0, bank, "t")
            if self.double_buffer:
                add(self.hf_embed, b["embed"], 0, bank, "same")
                add(self.hf_norm, b["norm_w"], 0, bank, "same")
        return out

    def _restorable(self, derived: Any) -> bool:
        """Whether a parameter with these derived buffers is left out of patches (module invariants): double
        buffering, and a copy in every bank that ``restore_params`` can invert."""
        return self.double_buffer and all(
            any(bank == b and layout in ("same", "t") for _, _, bank, layout in derived)
            for b in range(len(self._banks))
        )

    def restorable_ids(self) -> set[int]:
        """``id`` of every parameter patches leave out (see ``_restorable``)."""
        return {pid for pid, derived in self._derived.items() if self._restorable(derived)}

    def restore_params(self) -> None:
        """Copy the served bank back into every HF parameter that patches leave out (the inverse of the bank
        layouts; call with the weights not being written). Clears ``params_stale``."""
        with torch.inference_mode():
            for pid, derived in self._derived.items():
                if not self._restorable(derived):
                    continue
                param = self._param_of[pid]
                mine = [(buf, off, layout) for buf, off, bank, layout in derived if bank == self.active]
                buf, off, layout = min(mine, key=lambda x: x[2] != "same")  # a plain copy when there is one
                if layout == "same" or param.dim() == 1:
                    param.view(-1).copy_(buf.view(-1)[off : off + param.numel()])
                else:  # W[o, i] == buf[i, off + o]
                    param.copy_(buf[:, off : off + param.shape[0]].t())
        self.params_stale = False

    def plan_patch(self, param: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> list[Write]:
        """The element writes that set ``param.view(-1)[flat_index] = values`` in the parameter and in every
        served buffer built from it, in every bank. Planning does the index arithmetic; applying
        (``apply_writes``) only scatters, so the engine's pause is at most the scatter. A plan is valid until
        the next ``refresh``."""
        derived = self._derived.get(id(param), ())
        # The forward reads HF parameters only without double buffering, and then only the embedding, the
        # norms and (MoE) the routers: a write to any other parameter can land after the pause.
        unread = self.double_buffer or (
            bool(derived) and param.dim() == 2 and param is not self.hf_embed and not self.moe_layers
        )
        writes = [Write(param.view(-1), flat_index, values, deferred=unread)]
        if self._restorable(derived):
            writes = []  # the parameter itself is restored from the served bank when read
        planned: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # banks share layouts
        for buf, off, bank, layout in derived:
            key = (layout, off, buf.shape[-1])
            if key not in planned:
                if layout == "same" or param.dim() == 1:
                    planned[key] = (off + flat_index, values)
                elif layout == "experts":  # stacked experts: W[e, o, i] == buf[e, i, o]
                    _, out_dim, in_dim = param.shape
                    e, rest = flat_index // (out_dim * in_dim), flat_index % (out_dim * in_dim)
                    rows, cols = rest // in_dim, rest % in_dim
                    planned[key] = ((e * in_dim + cols) * out_dim + rows, values)
                else:
                    planned[key] = transposed(flat_index, values, param.shape[1], buf.shape[1], off)
            pos, ordered = planned[key]
            writes.append(Write(buf.view(-1), pos, ordered, bank=bank))
        return writes

    # ---- building blocks -------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., hidden] -> q [..., H, D], k/v [..., Hkv, D] with norms and RoPE applied."""
        qkv = _mm(h, self.wt[i][0], self.bs[i][0])
        q, k, v = qkv.split((self.q_out, self.kv_out, self.kv_out), dim=-1)
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        k = k.unflatten(-1, (self.n_kv, self.head_dim))
        v = v.unflatten(-1, (self.n_kv, self.head_dim))
        qn, kn = self.norms[i][2], self.norms[i][3]
        if qn is not None and kn is not None:
            q = self._rms(q, qn)
            k = self._rms(k, kn)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _mlp_out(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        wt, bs = self.wt[i], self.bs[i]
        x = x + _mm(attn, wt[1], bs[1])
        h = self._rms(x, self.norms[i][1])
        g, u = _mm(h, wt[2], bs[2]).split((self.inter, self.inter), dim=-1)
        return x + _mm(F.silu(g) * u, wt[3], bs[3])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms(x, self.norm_w) @ self.head_t).float()

    # ---- runner interface ------------------------------------------------------------------------

    def prefill(
        self, first_slot: int, prompts: list[list[int]], starts: list[int] | None = None
    ) -> torch.Tensor:
        """Fill slots ``first_slot..`` with the prompts (right-padded batch); logits [b, V] of last tokens."""
        if self.deterministic:
            return self._det_prefill(first_slot, prompts, starts or [0] * len(prompts))
        if starts is not None and any(starts):
            return self._prefill_after(first_slot, prompts, starts)
        b, t = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((b, t), dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, : len(p)] = torch.tensor(p, dtype=torch.long)
        last = torch.tensor([len(p) - 1 for p in prompts])
        s0, s1 = first_slot, first_slot + b
        cos, sin = self.cos[:t].unsqueeze(1), self.sin[:t].unsqueeze(1)  # [t, 1, D]
        x = F.embedding(ids, self.embed)  # [b, t, hidden]
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, self._rms(x, self.norms[i][0]), cos, sin)  # [b, t, h, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, Hkv, t, D]
            self.k_cache[i, s0:s1, :, :t] = k
            self.v_cache[i, s0:s1, :, :t] = v
            # Right padding + causal mask: real tokens never see the padding after them.
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, scale=self.scaling, enable_gqa=True
            )
            x = self._mlp_out(i, x, o.transpose(1, 2).flatten(2))
        for j, p in enumerate(prompts):
            self.lens[s0 + j] = len(p)
        return self._logits(x[torch.arange(b), last])

    def _after_layout(self, first_slot: int, prompts: list[list[int]], starts: list[int]):
        """Padded ids [b, t], positions [b, t] (clamped to the cache), end positions, and the real
        (row ``jj``, index ``ii``) pairs with the cache slots and positions they are written to."""
        b, t = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((b, t), dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, : len(p)] = torch.tensor(p, dtype=torch.long)
        st = torch.tensor(starts, dtype=torch.long)
        ends = [s + len(p) for s, p in zip(starts, prompts, strict=True)]
        pos = (st.unsqueeze(1) + torch.arange(t).unsqueeze(0)).clamp_(max=self.max_seq_len - 1)
        jj = torch.cat([torch.full((len(p),), j) for j, p in enumerate(prompts)])
        ii = torch.cat([torch.arange(len(p)) for p in prompts])
        return ids, pos, ends, jj, ii, jj + first_slot, st[jj] + ii

    def _prefill_after(self, first_slot: int, prompts: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Prefill each prompt after the ``starts[j]`` positions already cached in its slot.

        Only real positions are written (padding never reaches the cache, so no row writes past
        ``max_seq_len``); queries attend through an explicit mask to cache positions ``0..start+i``.
        """
        ids, pos, ends, jj, ii, slots, wpos = self._after_layout(first_slot, prompts, starts)
        b, t, t_kv = ids.shape[0], ids.shape[1], max(ends)
        cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # [b, t, 1, D]
        s0, s1 = first_slot, first_slot + b
        mask = torch.zeros((b, 1, t, t_kv), dtype=self.cos.dtype)
        mask.masked_fill_(
            (torch.arange(t_kv).view(1, 1, t_kv) > pos.unsqueeze(2)).unsqueeze(1), float("-inf")
        )
        x = F.embedding(ids, self.embed)
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, self._rms(x, self.norms[i][0]), cos, sin)  # [b, t, h, D]
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[slots, :, wpos] = k[jj, ii]
            vc[slots, :, wpos] = v[jj, ii]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                kc[s0:s1, :, :t_kv],
                vc[s0:s1, :, :t_kv],
                mask,
                scale=self.scaling,
                enable_gqa=True,
            )
            x = self._mlp_out(i, x, o.transpose(1, 2).flatten(2))
        for j, e in enumerate(ends):
            self.lens[s0 + j] = e
        last = torch.tensor([len(p) - 1 for p in prompts])
        return self._logits(x[torch.arange(b), last])

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens[s]`` to slot ``s`` for ``s < n = len(tokens)``; logits [n, V]."""
        if self.deterministic:  # a decode step is a one-token prefill after each slot's cached positions
            return self._det_prefill(0, [[int(t)] for t in tokens.tolist()], self.lens[: tokens.shape[0]])
        n = tokens.shape[0]
        lens = self.lens[:n]
        t = max(lens) + 1
        pos = torch.tensor(lens)
        rows = torch.arange(n)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [n, 1, D]
        # Additive mask [n, 1, 1, t]: slot s sees its own positions 0..lens[s] (the new token included).
        mask = torch.zeros((n, 1, 1, t), dtype=self.cos.dtype)
        mask.masked_fill_((torch.arange(t).unsqueeze(0) > pos.unsqueeze(1)).view(n, 1, 1, t), float("-inf"))
        g = self.n_heads // self.n_kv
        x = F.embedding(tokens, self.embed)  # [n, hidden]
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, self._rms(x, self.norms[i][0]), cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            # GQA without copies: the g query heads sharing a kv head act as g queries of one position.
            o = F.scaled_dot_product_attention(
                q.view(n, self.n_kv, g, self.head_dim), kc[:n, :, :t], vc[:n, :, :t], mask, scale=self.scaling
            )
            x = self._mlp_out(i, x, o.reshape(n, self.q_out))
        for s in range(n):
            self.lens[s] += 1
        return self._logits(x)

    def _det_prefill(self, first_slot: int, prompts: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Deterministic mode (``tandem.model.deterministic``): batch-invariant prefill of each prompt after
        the ``starts[j]`` positions cached in slot ``first_slot + j``; decode steps come here too."""
        ids, pos, ends, jj, ii, slots, wpos = self._after_layout(first_slot, prompts, starts)
        b = ids.shape[0]
        cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # [b, t, 1, D]
        s0, s1 = first_slot, first_slot + b
        heads = (self.n_heads, self.n_kv, self.head_dim)
        x = F.embedding(ids, self.embed)
        routes = []
        for i, layer in enumerate(self.layers):
            qn, kn = self.norms[i][2], self.norms[i][3]
            norms = (qn, kn) if qn is not None and kn is not None else None
            h = det.rms_norm(x, self.norms[i][0], self.eps)
            q, k, v = det.qkv(h, self.wt[i][0], self.bs[i][0], heads, norms, self.eps, cos, sin)
            kt, vb = self.k_cache[i], self.v_cache[i]
            det.write_blocks(kt, vb, slots, wpos, k[jj, ii], v[jj, ii])
            o = det.attention_blocks(q, kt[s0:s1], vb[s0:s1], pos, self.scaling)
            post = self.norms[i][1]
            if i in self.moe_w:
                x, idx = det.moe_out(
                    x,
                    o.flatten(2),
                    self.wt[i],
                    self.bs[i],
                    post,
                    self.eps,
                    self.moe_w[i],
                    layer.mlp.gate,
                    (jj, ii),
                    len(routes),
                )
                routes.append(idx)
            else:
                x = det.mlp_out(x, o.flatten(2), self.wt[i], self.bs[i], post, self.eps)
        if routes:  # [real tokens, moe layers, k]; prompt j's rows are a contiguous block, in order
            rows = torch.stack(routes, dim=1).numpy().astype(self._routes_dtype)
            at = 0
            for j, (p, st) in enumerate(zip(prompts, starts, strict=True)):
                if sum(len(c) for c in self._routes[s0 + j]) > st:  # prefix reuse: keep the first st rows
                    self._routes[s0 + j] = [self.routes(s0 + j)[:st]] if st > 0 else []
                self._routes[s0 + j].append(rows[at : at + len(p)])
                at += len(p)
        for j, e in enumerate(ends):
            self.lens[s0 + j] = e
        last = torch.tensor([len(p) - 1 for p in prompts])
        return det.logits(x[torch.arange(b), last], self.norm_w, self.head_t, self.eps)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s cache (and routes) into slot ``dst`` (compaction)."""
        t = self.lens[src]
        if self.deterministic:  # block layout: the blocks holding positions 0..t-1
            nb = -(-t // det.KEY_BLOCK)
            self.k_cache[:, dst, :, :nb] = self.k_cache[:, src, :, :nb]
            self.v_cache[:, dst, :, :nb] = self.v_cache[:, src, :, :nb]
        else:
            self.k_cache[:, dst, :, :t] = self.k_cache[:, src, :, :t]
            self.v_cache[:, dst, :, :t] = self.v_cache[:, src, :, :t]
        self.lens[dst], self.lens[src] = t, 0
        self._routes[dst], self._routes[src] = self._routes[src], []

    def release(self, slot: int) -> None:
        self.lens[slot] = 0
        self._routes[slot] = []

    def can_park(self, slot: int) -> bool:
        return True

    def feed(self, slot: int, token: int) -> None:
        """Append ``token`` to ``slot`` (KV and routes) without sampling after it (MoE: its routes)."""
        self._det_prefill(slot, [[int(token)]], [self.lens[slot]])

    def routes(self, slot: int) -> np.ndarray:
        """Expert ids of the positions ``slot`` holds: ``[lens[slot], moe_layers, top_k]`` (MoE models)."""
        chunks = self._routes[slot]
        if len(chunks) > 1:
            self._routes[slot] = chunks = [np.concatenate(chunks)]
        if not chunks:
            shape = self._route_shape
            return np.zeros(
                (0, shape.layers if shape else 0, shape.top_k if shape else 0), self._routes_dtype
            )
        return chunks[0]


class HFRunner:
    """Fallback: the HF model's own forward, one session at a time, each with its own cache. Records MoE
    routing per slot when the model has top-k routers (see module invariants)."""

    def __init__(self, model: PreTrainedModel, max_slots: int, max_seq_len: int) -> None:
        self.model = model
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self.caches: list[object | None] = [None] * max_slots
        self.lens = [0] * max_slots
        shape = moe_shape(model)
        self.records_routes = shape is not None
        self._hooks = RouterHooks(model) if shape is not None else None
        self._dtype = routes_dtype(shape.num_experts) if shape is not None else np.dtype(np.uint8)
        self._routes: list[list[np.ndarray]] = [[] for _ in range(max_slots)]  # per slot, chunks of rows

    generation = 0

    def refresh(self) -> None:
        pass

    def plan_patch(self, param: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> list[Write]:
        """The HF forward reads the parameters directly: patching them is all there is."""
        return [Write(param.view(-1), flat_index, values)]

    def _forward(self, slot: int, ids: list[int], cache: object | None) -> torch.Tensor:
        """Run ``ids`` after ``cache`` for ``slot``; append their routes; logits of the last token."""
        if self._hooks is not None:
            self._hooks.clear()
        r = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        self.caches[slot] = r.past_key_values
        if self._hooks is not None:
            self._routes[slot].append(self._hooks.own().numpy().astype(self._dtype))
        return r.logits[0, -1].float()

    def prefill(
        self, first_slot: int, prompts: list[list[int]], starts: list[int] | None = None
    ) -> torch.Tensor:
        out = []
        for j, p in enumerate(prompts):
            slot = first_slot + j
            start = starts[j] if starts is not None else 0
            cache = self.caches[slot] if start > 0 else None
            if cache is not None and self.lens[slot] > start:
                cache.crop(start - self.lens[slot])  # negative: drop that many trailing positions
            kept = self.routes(slot)[:start] if start > 0 and self.records_routes else None
            self._routes[slot] = [kept] if kept is not None else []
            out.append(self._forward(slot, p, cache))
            self.lens[slot] = start + len(p)
        return torch.stack(out)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        out = []
        for s in range(tokens.shape[0]):
            out.append(self._forward(s, [int(tokens[s])], self.caches[s]))
            self.lens[s] += 1
        return torch.stack(out)

    def feed(self, slot: int, token: int) -> None:
        """Append ``token`` to ``slot`` (KV and routes) without sampling after it."""
        self._forward(slot, [int(token)], self.caches[slot])
        self.lens[slot] += 1

    def routes(self, slot: int) -> np.ndarray:
        """Expert ids of the positions ``slot`` holds: ``[lens[slot], moe_layers, top_k]``."""
        chunks = self._routes[slot]
        if len(chunks) > 1:
            self._routes[slot] = chunks = [np.concatenate(chunks)]
        if not chunks:
            shape = self._hooks.shape if self._hooks is not None else None
            return np.zeros((0, shape.layers if shape else 0, shape.top_k if shape else 0), self._dtype)
        return chunks[0]

    def move(self, src: int, dst: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None
        self.lens[dst], self.lens[src] = self.lens[src], 0
        self._routes[dst], self._routes[src] = self._routes[src], []

    def release(self, slot: int) -> None:
        self.caches[slot], self.lens[slot] = None, 0
        self._routes[slot] = []

    def can_park(self, slot: int) -> bool:
        """Reuse needs a cache that can drop trailing positions (HF ``DynamicCache.crop``)."""
        return hasattr(self.caches[slot], "crop")
