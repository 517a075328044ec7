"""Batch-invariant forward primitives (``train.deterministic``): the same token in the same context gets
bitwise the same logits whatever else shares its batch and wherever it sits in it.

Both the built-in engine (``tandem.engine.runner.FastRunner``, prefill and decode) and the trainer
(``tandem.train.deterministic``) run Qwen3/Qwen2/Llama-style decoders through the functions of this module
and nothing else, so the sampler's and the trainer's logprobs of the same tokens are equal bit for bit.

Why this is needed: a CPU GEMM (MKL/oneDNN) picks its kernel, blocking and remainder handling by the shape of
the call, so the same row of ``X @ W`` rounds differently when computed alone, inside a larger batch, or at
another position. What is used instead (each point checked by ``tests/train/test_deterministic.py``):

- ``linear``: rows are padded with zeros to a multiple of ``TILE_ROWS``; for K up to ``K_WHOLE_MAX`` the
  product is one call, above it it is taken in slices of ``K_CHUNK`` columns of K, one call per slice on all
  the rows, the partial products added in slice order (elementwise). Measured on this CPU
  (tests/train/test_deterministic.py checks it where it runs): for a row count that is a multiple of 16
  and K < 1024, a row's bits do not depend on the number of rows or its
  position (for K >= 1024 they do: hence the slices); a plain unpadded product changed row 0's bits in 62 of
  62 batch sizes. The weight must be the contiguous ``[K, N]`` transposed matrix (both sides build it the
  same way: ``torch.cat(ws).t().contiguous()``). The thread count is part of the shape: one thread and two
  threads round differently, so the engine and the trainer must run with the same number of threads (the
  run config enforces it).
- ``attention``: per query, scores over blocks of ``KEY_BLOCK`` keys by batched matmuls of fixed item shapes
  (``[R, D] @ [D, KEY_BLOCK]`` and ``[R, KEY_BLOCK] @ [KEY_BLOCK, D]`` per sequence, kv head and key block,
  R = the query rows padded to a multiple of ``QUERY_ROW_MULTIPLE``: measured, a row's bits do not depend on
  R nor on the item's place in the batch at these inner sizes), an exact max over
  all the query's keys, ``exp`` of masked scores (exactly 0 beyond the query's position), per-block sums of
  fixed length, and the blocks added in block order. Blocks past a query's position add exact zeros, so the
  number of blocks (the longest sequence of the batch) does not change a query's bits; nor does how the keys
  are stored: the trainer's packed sequences are copied into the block layout (``_key_blocks``), the
  engine's cache is kept in it (``block_cache_shape``, ``write_blocks``) and read through views, one
  batched call per block (``attention_blocks``): the items, and so their bits, are the same (checked: the
  engine's and the trainer's logprobs are equal).
- ``rms_norm``, ``rope``, SiLU-MLP and residual adds are elementwise or per-row reductions of fixed length
  (written out with plain ops so grad mode and inference mode run the same kernels).
- ``token_logprob``: ``log_softmax(logits / temperature)`` gathered at the token, the sampler's exact ops.
- Mixture-of-experts layers (Qwen3-MoE style: a top-k router ``mlp.gate`` and stacked experts
  ``mlp.experts``): ``moe_block`` runs on the real token rows only (gathered, in the caller's order), routes
  each row by ``linear`` + float softmax + top-k (+ renormalisation), the router's own ops per row; each
  expert multiplies the rows sent to it with ``linear`` (row bits independent of how many rows an expert
  gets), and a token's k expert outputs are added in its top-k order. So a token's routing and output bits
  do not depend on its batch either. A ``route`` callback (``tandem.model.moe.RouterHooks.process``) sees
  every layer's routing, to record it or replace it (R3/R2 replay), exactly as the router hooks do for the
  HF forward.

All functions are plain torch ops, so autograd works through them (gradients are not batch-invariant and
need not be). Costs: padding makes a one-row decode step multiply ``TILE_ROWS`` rows, and attention computes
whole key blocks; see the deterministic-mode numbers in the PR/report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

TILE_ROWS = 16
"""``linear`` pads its rows to a multiple of this."""
QUERY_ROW_MULTIPLE = 4
"""``attention`` pads each item's query rows to a multiple of this (a batched matmul with inner size 64-128
keeps a row's bits whatever the row count, measured for even counts; odd counts differ)."""
K_CHUNK = 512
"""Width of the K slices ``linear`` multiplies one call each when K >= ``K_WHOLE_MAX`` + 1 (MKL keeps a row's
bits independent of the number of rows only below K = 1024 on the machines measured)."""
K_WHOLE_MAX = 1023
"""Largest K that ``linear`` multiplies in one call (no slices)."""
KEY_BLOCK = 64
"""Keys per attention block."""


def linear(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ wt [K, N] (+ b)``, each output row's bits independent of the other rows (see the
    module docstring): rows padded with zeros to a multiple of ``TILE_ROWS``; for K above ``K_WHOLE_MAX``
    the product is taken in ``K_CHUNK``-wide slices of K (one call each) summed in slice order."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    pad = (-n) % TILE_ROWS
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    if k <= K_WHOLE_MAX:
        y = x2 @ wt
        if pad:
            y = y[:n]
        if b is not None:
            y = y + b
        return y.reshape(*lead, wt.shape[1])
    y = None
    for c in range(0, k, K_CHUNK):
        part = x2[:, c : c + K_CHUNK].contiguous() @ wt[c : c + K_CHUNK]
        y = part if y is None else y + part
    assert y is not None
    if pad:
        y = y[:n]
    if b is not None:
        y = y + b
    return y.reshape(*lead, wt.shape[1])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (per row, fixed length)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form), elementwise."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _key_blocks(x: torch.Tensor, nb: int, transpose: bool) -> torch.Tensor:
    """``x [S, Hkv, Lk, D]`` as ``nb`` zero-padded blocks of ``KEY_BLOCK`` keys, contiguous
    ``[S, Hkv, nb, B, D]`` (or ``[S, Hkv, nb, D, B]`` with ``transpose``): one copy, only the padding zeroed.
    Under autograd, the plain pad-and-reshape (same values, same layout)."""
    s_n, hkv, lk, d = x.shape
    bk = KEY_BLOCK
    if torch.is_grad_enabled() and x.requires_grad:
        xb = F.pad(x, (0, 0, 0, nb * bk - lk)).reshape(s_n, hkv, nb, bk, d)
        return (xb.transpose(-1, -2) if transpose else xb).contiguous()
    out = x.new_empty((s_n, hkv, nb, d, bk) if transpose else (s_n, hkv, nb, bk, d))
    view = out.transpose(-1, -2) if transpose else out  # [S, Hkv, nb, B, D]
    full, rem = divmod(lk, bk)
    if full:
        view[:, :, :full] = x[:, :, : full * bk].unflatten(2, (full, bk))
    if full < nb:
        view[:, :, full, :rem] = x[:, :, full * bk :]
        view[:, :, full, rem:] = 0
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of S sequences: query ``(s, i)`` at position ``qpos[s, i]`` attends keys
    ``0..qpos[s, i]`` of sequence ``s``.

    q ``[S, Lq, H, D]``, k/v ``[S, Hkv, Lk, D]`` (Lk > every qpos; keys past a query's position may hold
    anything finite), qpos ``[S, Lq]`` int64 -> ``[S, Lq, H, D]``. Batch-invariant per query (see the module
    docstring).
    """
    lk = k.shape[2]
    nb = -(-lk // KEY_BLOCK)
    kt = _key_blocks(k, nb, transpose=True)  # [S, Hkv, nb, D, B]
    vb = _key_blocks(v, nb, transpose=False)  # [S, Hkv, nb, B, D]
    return attention_blocks(q, kt, vb, qpos, scale)


def block_cache_shape(slots: int, kv_heads: int, max_len: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's key and value caches in block layout (``attention_blocks``): keys
    ``[slots, Hkv, NB, D, B]`` (each block transposed), values ``[slots, Hkv, NB, B, D]``."""
    nb = -(-max_len // KEY_BLOCK)
    return (slots, kv_heads, nb, head_dim, KEY_BLOCK), (slots, kv_heads, nb, KEY_BLOCK, head_dim)


def write_blocks(
    kt: torch.Tensor,
    vb: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store keys/values ``[N, Hkv, D]`` of cache slots ``slots`` at positions ``pos`` (both ``[N]``) in a
    layer's block-layout caches (``block_cache_shape``)."""
    blk, off = pos // KEY_BLOCK, pos % KEY_BLOCK
    kt[slots, :, blk, :, off] = k
    vb[slots, :, blk, off, :] = v


def attention_blocks(
    q: torch.Tensor, kt: torch.Tensor, vb: torch.Tensor, qpos: torch.Tensor, scale: float
) -> torch.Tensor:
    """``attention`` over keys and values already in block layout: kt ``[S, Hkv, NB, D, B]``, vb
    ``[S, Hkv, NB, B, D]`` (slices of ``block_cache_shape`` caches, or ``_key_blocks`` output); only the
    blocks up to the largest ``qpos`` are read (blocks past a query's position add exact zeros).

    Rows: per (sequence, kv head) the g query heads of each query, query-major, padded to a multiple of
    QUERY_ROW_MULTIPLE; one matmul item per (sequence, kv head, key block) takes all the rows at once. When
    the blocks are a prefix of a larger cache, each block's items are one batched call (a view of the cache,
    no copy); the items and so their bits are the same either way."""
    s_n, lq, h, d = q.shape
    hkv = kt.shape[1]
    g = h // hkv
    bk = KEY_BLOCK
    nb = int(qpos.max()) // bk + 1
    r = lq * g
    rows = r + (-r) % QUERY_ROW_MULTIPLE
    qr = q.reshape(s_n, lq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(s_n, hkv, r, d)
    rpos = qpos.repeat_interleave(g, dim=1)  # [S, r]
    if rows > r:
        qr = F.pad(qr, (0, 0, 0, rows - r))
        rpos = F.pad(rpos, (0, rows - r))  # padding rows attend key 0 only (finite, discarded)
    items = (s_n, hkv, nb)
    if kt.shape[2] == nb and kt.is_contiguous() and vb.is_contiguous():
        q3 = qr.unsqueeze(2).expand(*items, rows, d).contiguous().view(-1, rows, d)
        scores = torch.bmm(q3, kt.view(-1, d, bk)).view(*items, rows, bk) * scale
    else:  # a prefix of the cache's blocks: one call per block on views (slot and head dims merge)
        q2 = qr.contiguous().view(-1, rows, d)
        scores = (
            torch.stack([torch.bmm(q2, kt[:, :, j].reshape(-1, d, bk)) for j in range(nb)], dim=1).view(
                *items, rows, bk
            )
            * scale
        )
    kpos = torch.arange(nb * bk).view(1, 1, nb, 1, bk)
    masked = kpos > rpos.view(s_n, 1, 1, rows, 1)
    scores = scores.masked_fill(masked, float("-inf"))
    m = scores.detach().amax(dim=(2, 4), keepdim=True)  # exact; a constant for the gradient
    e = torch.exp(scores - m)
    part_l = e.sum(-1)  # [S, Hkv, nb, rows]
    if vb.shape[2] == nb and vb.is_contiguous():
        part_o = torch.bmm(e.reshape(-1, rows, bk), vb.view(-1, bk, d)).view(*items, rows, d)
    else:
        part_o = torch.stack(
            [torch.bmm(e[:, :, j].reshape(-1, rows, bk), vb[:, :, j].reshape(-1, bk, d)) for j in range(nb)],
            dim=1,
        ).view(*items, rows, d)
    acc_o, acc_l = part_o[:, :, 0], part_l[:, :, 0]
    for j in range(1, nb):  # in block order: blocks past a query's position add exact zeros
        acc_o = acc_o + part_o[:, :, j]
        acc_l = acc_l + part_l[:, :, j]
    out = (acc_o / acc_l.unsqueeze(-1))[:, :, :r]
    return out.reshape(s_n, hkv, lq, g, d).permute(0, 2, 1, 3, 4).reshape(s_n, lq, h, d)


def qkv(
    h: torch.Tensor,
    wt: torch.Tensor,
    b: torch.Tensor | None,
    heads: tuple[int, int, int],
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h ``[..., hidden]`` -> q ``[..., H, D]``, k/v ``[..., Hkv, D]`` (fused projection, optional per-head
    q/k norms, RoPE); ``heads = (H, Hkv, D)``."""
    n_heads, n_kv, hd = heads
    y = linear(h, wt, b)
    q, k, v = y.split((n_heads * hd, n_kv * hd, n_kv * hd), dim=-1)
    q = q.unflatten(-1, (n_heads, hd))
    k = k.unflatten(-1, (n_kv, hd))
    v = v.unflatten(-1, (n_kv, hd))
    if norms is not None:
        q = rms_norm(q, norms[0], eps)
        k = rms_norm(k, norms[1], eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def mlp_out(
    x: torch.Tensor,
    attn: torch.Tensor,
    wts: tuple[torch.Tensor, ...],
    bs: tuple[torch.Tensor | None, ...],
    post_norm: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Residual after attention (``attn`` flattened heads), then the SwiGLU MLP and its residual.
    ``wts``/``bs`` are a layer's (qkv, o, gate|up, down) transposed matrices and biases."""
    x = x + linear(attn, wts[1], bs[1])
    hh = rms_norm(x, post_norm, eps)
    g, u = linear(hh, wts[2], bs[2]).chunk(2, dim=-1)
    return x + linear(F.silu(g) * u, wts[3], bs[3])


def moe_out(
    x: torch.Tensor,
    attn: torch.Tensor,
    wts: tuple[torch.Tensor | None, ...],
    bs: tuple[torch.Tensor | None, ...],
    post_norm: torch.Tensor,
    eps: float,
    moe_w: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    router: Any,
    sel: tuple[torch.Tensor, ...],
    moe_layer: int,
    route_fn: RouteFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mlp_out`` of a MoE layer: attention residual, then ``moe_block`` on the rows ``sel`` and its
    residual; also returns the expert indices used ``[N, k]``."""
    assert wts[1] is not None
    x = x + linear(attn, wts[1], bs[1])
    out, idx = moe_block(rms_norm(x, post_norm, eps), sel, moe_w, router, moe_layer, route_fn)
    return x + out, idx


def logits(x: torch.Tensor, norm_w: torch.Tensor, head_t: torch.Tensor, eps: float) -> torch.Tensor:
    """Final norm and output head (float32)."""
    return linear(rms_norm(x, norm_w, eps), head_t).float()


def token_logprob(logits_: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` per row: logits ``[n, V]``, temperature and tokens
    ``[n]`` -> ``[n]``; the engine's sampler does exactly these ops (``tandem.engine.sampling``)."""
    logp = torch.log_softmax(logits_ / temperature.unsqueeze(1), dim=-1)
    return logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def fused_t(*ws: torch.Tensor) -> torch.Tensor:
    """The transposed, contiguous ``[K, N]`` matrix of stacked weights ``[N_i, K]`` (``linear`` takes it)."""
    return torch.cat(ws).t().contiguous()


def fused_bias(*mods: torch.nn.Module) -> torch.Tensor | None:
    """Stacked biases of linear modules (zeros for those without), None if none has one."""
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods])


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


RouteFn = Callable[[int, Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], Any]
"""``route(moe_layer, router_module, (logits, scores, indices))`` -> a replacement triple or None (keep):
the signature of ``tandem.model.moe.RouterHooks.process``."""


def is_moe_layer(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer's MLP is a top-k routed mixture of experts (``mlp.gate`` + ``mlp.experts``)."""
    mlp = getattr(layer, "mlp", None)
    return hasattr(mlp, "experts") and hasattr(getattr(mlp, "gate", None), "top_k")


def moe_weights(
    layer: torch.nn.Module, cast: Callable[[torch.Tensor], torch.Tensor] = _same
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's router ``[hidden, E]``, gate|up ``[E, hidden, 2I]`` and down ``[E, I, hidden]``
    matrices, transposed for ``linear`` (each expert's slice contiguous)."""
    mlp = layer.mlp
    return (
        cast(mlp.gate.weight).t().contiguous(),
        cast(mlp.experts.gate_up_proj).transpose(1, 2).contiguous(),
        cast(mlp.experts.down_proj).transpose(1, 2).contiguous(),
    )


def route(
    rows: torch.Tensor, router_t: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k router's ``(logits [N, E], scores [N, k], indices [N, k])`` of ``rows [N, hidden]``, the
    transformers router's ops with ``linear`` for its product."""
    logits = linear(rows, router_t)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype), idx


def experts(
    rows: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor
) -> torch.Tensor:
    """Each row's top-k experts (SwiGLU), weighted by ``scores``, added in top-k order: ``[N, hidden]``."""
    n, k = idx.shape
    inter = down_t.shape[1]
    parts = rows.new_zeros((n, k, rows.shape[1]))
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        g, u = linear(rows[tok], gate_up_t[e]).split((inter, inter), dim=-1)
        parts[tok, slot] = linear(F.silu(g) * u, down_t[e]) * scores[tok, slot].unsqueeze(1)
    out = parts[:, 0]
    for j in range(1, k):
        out = out + parts[:, j]
    return out


def moe_block(
    h: torch.Tensor,
    sel: tuple[torch.Tensor, ...],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    router: Any,
    moe_layer: int,
    route_fn: RouteFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE MLP of the rows ``h[sel]`` (the real tokens, in the caller's order; other positions get 0):
    ``(out shaped like h, the indices used [N, k])``. ``router`` is the layer's router module (its
    ``top_k``/``norm_topk_prob``, and what ``route_fn`` is told)."""
    rows = h[sel]
    out3 = route(rows, weights[0], int(router.top_k), bool(router.norm_topk_prob))
    if route_fn is not None:
        replaced = route_fn(moe_layer, router, out3)
        if replaced is not None:
            out3 = replaced
    _, scores, idx = out3
    y = experts(rows, scores, idx, weights[1], weights[2])
    out = h.new_zeros(h.shape)
    out[sel] = y
    return out, idx


def layer_weights(
    layer: torch.nn.Module, cast: Callable[[torch.Tensor], torch.Tensor] = _same
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """(qkv, o, gate|up, down) transposed matrices and biases of one HF decoder layer (differentiable when
    called with grad enabled); ``cast`` is applied to every parameter first. A MoE layer has only the
    attention's: its gate|up and down entries are None (see ``moe_weights``)."""
    a, m = layer.self_attn, layer.mlp
    qkv_m = (a.q_proj, a.k_proj, a.v_proj)
    if is_moe_layer(layer):
        att = (fused_t(*(cast(x.weight) for x in qkv_m)), fused_t(cast(a.o_proj.weight)))
        att_b = tuple(None if b is None else cast(b) for b in (fused_bias(*qkv_m), fused_bias(a.o_proj)))
        return (*att, None, None), (*att_b, None, None)  # type: ignore[return-value]
    gu = (m.gate_proj, m.up_proj)
    wts = (
        fused_t(*(cast(x.weight) for x in qkv_m)),
        fused_t(cast(a.o_proj.weight)),
        fused_t(*(cast(x.weight) for x in gu)),
        fused_t(cast(m.down_proj.weight)),
    )
    bs = tuple(
        None if b is None else cast(b)
        for b in (fused_bias(*qkv_m), fused_bias(a.o_proj), fused_bias(*gu), fused_bias(m.down_proj))
    )
    return wts, bs


def rope_table(model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, head_dim]`` of positions ``0..n-1`` from the model's own rotary module."""
    base = model.model
    emb = base.embed_tokens.weight
    with torch.no_grad():
        pos = torch.arange(n).unsqueeze(0)
        cos, sin = base.rotary_emb(emb[:1].unsqueeze(0).detach(), pos)
    return cos[0].to(emb.dtype), sin[0].to(emb.dtype)


def forward_tokens(
    model: torch.nn.Module,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cast: Callable[[torch.Tensor], torch.Tensor] = _same,
    sel: tuple[torch.Tensor, torch.Tensor] | None = None,
    route_fn: RouteFn | None = None,
) -> torch.Tensor:
    """Logits ``[S, L, V]`` of S right-padded sequences ``ids [S, L]`` (positions ``0..L-1``, no cache) from
    the HF model's parameters, each passed through ``cast`` first (e.g. the rounding the engines' copy went
    through); ``cos``/``sin`` from ``rope_table`` (at least L rows). The trainer's deterministic forward;
    differentiable. MoE layers route the positions ``sel = (sequence, position)`` (default: all of them),
    in that order, and report each layer's routing to ``route_fn`` (see ``moe_block``)."""
    base = model.model
    cfg = model.config
    eps = float(cfg.rms_norm_eps)
    att0 = base.layers[0].self_attn
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, att0.head_dim)
    s_n, t = ids.shape
    pos = torch.arange(t).unsqueeze(0).expand(s_n, t)
    if sel is None:
        sel = (torch.arange(s_n).repeat_interleave(t), torch.arange(t).repeat(s_n))
    c, s = cos[:t].unsqueeze(1), sin[:t].unsqueeze(1)  # [t, 1, D]
    embed = cast(base.embed_tokens.weight)
    x = F.embedding(ids, embed)
    moe_layer = 0
    for layer in base.layers:
        wts, bs = layer_weights(layer, cast)
        a = layer.self_attn
        norms = (cast(a.q_norm.weight), cast(a.k_norm.weight)) if hasattr(a, "q_norm") else None
        h = rms_norm(x, cast(layer.input_layernorm.weight), eps)
        q, k, v = qkv(h, wts[0], bs[0], heads, norms, eps, c, s)
        o = attention(q, k.transpose(1, 2), v.transpose(1, 2), pos, float(a.scaling))
        post = cast(layer.post_attention_layernorm.weight)
        if is_moe_layer(layer):
            mw = moe_weights(layer, cast)
            x, _ = moe_out(x, o.flatten(2), wts, bs, post, eps, mw, layer.mlp.gate, sel, moe_layer, route_fn)
            moe_layer += 1
        else:
            x = mlp_out(x, o.flatten(2), wts, bs, post, eps)
    head = model.get_output_embeddings().weight
    head_t = fused_t(embed if head is base.embed_tokens.weight else cast(head))
    return logits(x, cast(base.norm.weight), head_t, eps)
