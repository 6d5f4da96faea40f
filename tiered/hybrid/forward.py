"""One request's forward pass, in the three modes of DESIGN.md, through one code path.

- `hybrid` (ours): the layer loop runs each token-wise op (norm, q/k/v, RoPE, o_proj, MLP)
  chunk by chunk along the token axis into preallocated buffers, and attention once per layer
  over all tokens. Only the current layer's K,V exist; the KV sink receives them right after
  the layer's attention, then they are dropped.
- `vanilla`: the same loop with one chunk of all tokens, and every layer's K,V held until the
  end of the forward (what a general engine keeps for decoding).
- `chunked`: Sarathi-style; the whole model runs per token chunk, each chunk attending to the
  K,V of the chunks before it, so every layer's K,V is kept for the whole forward.

All modes take an optional prefix (K,V per layer for the first P tokens, e.g. cache hits) and
return the fp32 logits of the last token only: a prefill-only engine needs nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tiered.config import ForwardMode
from tiered.hybrid.model import CausalLM, attention_, mlp_step_, o_proj_step_, qkv_step, rope_cos_sin

LayerKV = tuple[Tensor, Tensor]
"""K and V of one layer, each [tokens, kv_heads, head_dim]."""

KVSink = Callable[[int, Tensor, Tensor], None]
"""Receives (layer index, K, V) of the newly computed tokens; may keep, store or drop them.
The tensors are views into buffers the forward reuses or frees: copy what you keep."""


class ForwardInputError(ValueError):
    """The request cannot be computed by this model (empty, out-of-vocabulary, too long)."""


def _check_inputs(model: CausalLM, token_ids: Tensor, prefix_kv: Sequence[LayerKV] | None) -> int:
    a = model.args
    if token_ids.ndim != 1 or token_ids.numel() == 0:
        raise ForwardInputError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
    lo, hi = int(token_ids.min()), int(token_ids.max())
    if lo < 0 or hi >= a.vocab_size:
        bad = lo if lo < 0 else hi
        raise ForwardInputError(f"token id {bad} is outside the vocabulary [0, {a.vocab_size})")
    num_prefix = 0
    if prefix_kv is not None:
        if len(prefix_kv) != a.num_layers:
            raise ForwardInputError(f"prefix_kv has {len(prefix_kv)} layers, the model {a.num_layers}")
        # A lazy prefix (the tiers' PrefixKV) states its length; gathering a layer to read it costs a copy.
        num_prefix = getattr(prefix_kv, "num_tokens", None) or prefix_kv[0][0].shape[0]
    total = num_prefix + token_ids.numel()
    if a.sliding_window is not None and total > a.sliding_window:
        raise ForwardInputError(
            f"{total} tokens exceed the model's sliding window of {a.sliding_window}; "
            "sliding-window attention is not supported"
        )
    return num_prefix


@torch.inference_mode()
def forward(
    model: CausalLM,
    token_ids: Tensor,
    *,
    mode: ForwardMode = "hybrid",
    chunk_tokens: int = 1024,
    prefix_kv: Sequence[LayerKV] | None = None,
    kv_sink: KVSink | None = None,
) -> Tensor:
    """Compute the tokens after an optional prefix; return the last token's logits [V] (fp32).

    `token_ids` [T] are the tokens to compute; `prefix_kv[layer]` holds K,V of the P tokens
    before them (positions 0..P-1), so the new tokens take positions P..P+T-1.
    """
    num_prefix = _check_inputs(model, token_ids, prefix_kv)
    token_ids = token_ids.to(model.inv_freq.device)
    if mode == "chunked":
        hidden_last = _chunked(model, token_ids, chunk_tokens, prefix_kv, num_prefix, kv_sink)
    elif mode in ("hybrid", "vanilla"):
        chunk = token_ids.numel() if mode == "vanilla" else chunk_tokens
        hidden_last = _layer_by_layer(
            model, token_ids, chunk, prefix_kv, num_prefix, kv_sink, hold_kv=(mode == "vanilla")
        )
    else:
        raise ValueError(f"unknown forward mode '{mode}' (expected vanilla, chunked or hybrid)")
    return model.last_token_logits(hidden_last)


def _new_layer_kv(model: CausalLM, num_tokens: int, dtype: torch.dtype, device: torch.device) -> LayerKV:
    a = model.args
    shape = (num_tokens, a.num_kv_heads, a.head_dim)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


def _copy_prefix(k: Tensor, v: Tensor, prefix_kv: Sequence[LayerKV] | None, layer: int, num_prefix: int) -> None:
    if num_prefix:
        pk, pv = prefix_kv[layer]  # type: ignore[index]
        k[:num_prefix].copy_(pk)
        v[:num_prefix].copy_(pv)


def _layer_by_layer(
    model: CausalLM,
    token_ids: Tensor,
    chunk: int,
    prefix_kv: Sequence[LayerKV] | None,
    num_prefix: int,
    kv_sink: KVSink | None,
    hold_kv: bool,
) -> Tensor:
    """hybrid (chunk < T, KV dropped per layer) and vanilla (chunk = T, KV held to the end)."""
    a = model.args
    T, P = token_ids.numel(), num_prefix
    x = model.model.embed_tokens(token_ids)  # [T, D] residual stream, updated in place
    chunk = min(chunk, T)
    bounds = [(s, min(s + chunk, T)) for s in range(0, T, chunk)]
    q = torch.empty((T, a.num_heads, a.head_dim), dtype=x.dtype, device=x.device)
    gate_buf = torch.empty((chunk, a.intermediate_size), dtype=x.dtype, device=x.device)
    up_buf = torch.empty_like(gate_buf)
    held: list[LayerKV] = []
    for i, layer in enumerate(model.layers):
        k, v = _new_layer_kv(model, P + T, x.dtype, x.device)
        _copy_prefix(k, v, prefix_kv, i, P)
        for s, e in bounds:
            cos, sin = rope_cos_sin(model.inv_freq, P + s, P + e, x.dtype)
            qkv_step(layer, x[s:e], cos, sin, q[s:e], k[P + s : P + e], v[P + s : P + e])
        attention_(q, k, v, P)  # q now holds the attention output [T, H, Dh]
        if hold_kv:
            held.append((k[P:], v[P:]))
        elif kv_sink is not None:
            kv_sink(i, k[P:], v[P:])
        del k, v
        for s, e in bounds:
            o_proj_step_(layer, x[s:e], q[s:e].view(e - s, -1))
            mlp_step_(layer, x[s:e], gate_buf, up_buf)
    if kv_sink is not None:
        for i, (k, v) in enumerate(held):
            kv_sink(i, k, v)
    return x[-1]


def _chunked(
    model: CausalLM,
    token_ids: Tensor,
    chunk: int,
    prefix_kv: Sequence[LayerKV] | None,
    num_prefix: int,
    kv_sink: KVSink | None,
) -> Tensor:
    """Sarathi-style chunked prefill: the whole model per chunk, all layers' K,V kept."""
    a = model.args
    T, P = token_ids.numel(), num_prefix
    chunk = min(chunk, T)
    dtype, device = model.model.embed_tokens.weight.dtype, token_ids.device
    kv = [_new_layer_kv(model, P + T, dtype, device) for _ in range(a.num_layers)]
    for i, (k, v) in enumerate(kv):
        _copy_prefix(k, v, prefix_kv, i, P)
    q = torch.empty((chunk, a.num_heads, a.head_dim), dtype=dtype, device=device)
    gate_buf = torch.empty((chunk, a.intermediate_size), dtype=dtype, device=device)
    up_buf = torch.empty_like(gate_buf)
    hidden_last = q.new_empty(0)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        x = model.model.embed_tokens(token_ids[s:e])  # [n, D]
        cos, sin = rope_cos_sin(model.inv_freq, P + s, P + e, dtype)
        for i, layer in enumerate(model.layers):
            k, v = kv[i]
            qkv_step(layer, x, cos, sin, q[:n], k[P + s : P + e], v[P + s : P + e])
            attention_(q[:n], k[: P + e], v[: P + e], P + s)
            o_proj_step_(layer, x, q[:n].view(n, -1))
            mlp_step_(layer, x, gate_buf, up_buf)
        hidden_last = x[-1]
    if kv_sink is not None:
        for i, (k, v) in enumerate(kv):
            kv_sink(i, k[P:], v[P:])
    return hidden_last
