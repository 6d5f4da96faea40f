"""The forward pass over a batch of requests, in three modes, through one code path.

Design notes: docs/internals.md, section `tiered/hybrid/forward.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered.allocator import block_cache
from tiered.config import ForwardMode
from tiered.hybrid.attention import KERNELS, AttendFn, Span
from tiered.hybrid.attention.interface import PagedFn
from tiered.hybrid.attention.kernels import window_calls, windowed_calls
from tiered.hybrid.lora import LoraRun, LoraSlice, LoraWeights
from tiered.hybrid.model import (
    CausalLM,
    DecoderLayer,
    kv_step,
    mlp_step_,
    o_proj_step_,
    q_step,
)
from tiered.hybrid.spill import ResidualFile, Spill
from tiered.request.validation import InputError

LayerKV = tuple[Tensor, Tensor]
"""K and V of one layer, each [tokens, kv_heads, head_dim]."""

KVSink = Callable[[int, Tensor, Tensor], None]
"""Receives (layer index, K, V) of the newly computed tokens; may keep, store or drop them.
The tensors are views into buffers the forward reuses or frees: copy what you keep."""


class ForwardInputError(InputError):
    """The request cannot be computed by this model (empty, out-of-vocabulary, too long)."""


@dataclass(slots=True)
class BatchItem:
    """One request of a batched forward: the tokens to compute after its optional prefix.

    Items given the *same* `prefix_kv` object share that prefix: it is read once per layer (in
    place from the device tier's pool, or gathered where it is a plain list or in another dtype)
    and all their queries attend to it in one call."""

    token_ids: Tensor  # [T] the tokens to compute
    prefix_kv: Sequence[LayerKV] | None = None  # K,V of the P tokens before them, per layer
    kv_sink: KVSink | None = None
    # A follower: its first `num_shared` tokens after the prefix equal those of item `lead` (same
    # prefix object), which computes them once for both; `token_ids` are the tokens after them.
    # Its sink still receives K,V of all its tokens after the prefix, the shared ones included.
    lead: int | None = None
    num_shared: int = 0
    # The request's LoRA adapter (None: the base model). Its prefix KV must be this adapter's.
    adapter: LoraWeights | None = None
    # Its RoPE regime (`ModelArgs.rope_regime`: LongRoPE's long factors or not), that of the whole
    # request (a part of it computed now has the whole request's); None: from its prefix and tokens.
    # Its prefix KV must be of this regime.
    rope_regime: int | None = None


def _check_shape(token_ids: Tensor) -> None:
    """A non-empty 1-D tensor of ids, or ForwardInputError saying so. Which ids are valid is the
    engine's edge's to check (`tiered.request.validation`, once per request), not every forward's."""
    if token_ids.ndim != 1 or token_ids.numel() == 0:
        raise ForwardInputError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")


def _check_lead(items: Sequence[BatchItem], i: int) -> None:
    item = items[i]
    if item.lead is None:
        return
    lead = items[item.lead] if 0 <= item.lead < len(items) else None
    if (
        lead is None
        or lead.lead is not None
        or item.lead == i
        or lead.prefix_kv is not item.prefix_kv
        or lead.adapter is not item.adapter
    ):
        raise ForwardInputError(
            f"item {i}: lead {item.lead} must be another item, not a follower, on the same prefix and adapter"
        )
    if not 0 < item.num_shared <= lead.token_ids.numel():
        raise ForwardInputError(f"item {i}: num_shared {item.num_shared} must be in [1, {lead.token_ids.numel()}]")


def _num_prefix_tokens(model: CausalLM, item: BatchItem) -> int:
    """Tokens before the item's own tokens: its prefix and, for a follower, the shared ones."""
    a = model.args
    _check_shape(item.token_ids)
    num_prefix = 0
    if item.prefix_kv is not None:
        if len(item.prefix_kv) != a.num_layers:
            raise ForwardInputError(f"prefix_kv has {len(item.prefix_kv)} layers, the model {a.num_layers}")
        # A lazy prefix (the tiers' PrefixKV) states its length; gathering a layer to read it costs a copy.
        num_prefix = getattr(item.prefix_kv, "num_tokens", None) or item.prefix_kv[0][0].shape[0]
    num_prefix += item.num_shared if item.lead is not None else 0
    return num_prefix


def _attention(model: CausalLM, layer: int, reach: int) -> tuple[AttendFn, PagedFn | None]:
    """Layer `layer`'s attention calls in a forward whose last position is `reach` - 1: the model's
    kernel (and its call that reads a cached prefix in place, or None: the prefix is gathered), or,
    on a sliding-window layer that this forward reaches past, the kernel's windowed calls where it
    has them, else the PyTorch windowed calls."""
    window = model.args.layer_window(layer)
    if window is not None and reach <= window:
        window = None
    if model.args.attn_logit_softcap is not None:  # no fused kernel soft-caps scores
        return windowed_calls(window, model.args.attn_logit_softcap)
    kernel = KERNELS[model.attention]
    return (kernel.attend_, kernel.attend_paged_) if window is None else window_calls(kernel, window)


def forward(
    model: CausalLM,
    token_ids: Tensor,
    *,
    mode: ForwardMode = "hybrid",
    chunk_tokens: int = 1024,
    prefix_kv: Sequence[LayerKV] | None = None,
    kv_sink: KVSink | None = None,
    adapter: LoraWeights | None = None,
    rope_regime: int | None = None,
) -> Tensor:
    """Compute the tokens after an optional prefix; return the last token's logits [V] (fp32).

    `token_ids` [T] are the tokens to compute; `prefix_kv[layer]` holds K,V of the P tokens
    before them (positions 0..P-1), so the new tokens take positions P..P+T-1. `rope_regime`:
    that of the whole request, where these tokens are only a part of it (`BatchItem`)."""
    item = BatchItem(token_ids, prefix_kv, kv_sink, adapter=adapter, rope_regime=rope_regime)
    return forward_batch(model, [item], mode=mode, chunk_tokens=chunk_tokens)[0]


@torch.inference_mode()
def forward_batch(
    model: CausalLM,
    items: Sequence[BatchItem],
    *,
    mode: ForwardMode = "hybrid",
    chunk_tokens: int = 1024,
    hidden: Tensor | None = None,
    last_stage: bool = True,
    spill: Spill | None = None,
) -> Tensor:
    """One forward over every item; returns each item's last-token logits [len(items), V] (fp32).

    A pipeline stage (tiered/pipeline) runs it over its own layers: `hidden` [N, D] is the residual
    stream of the packed tokens from the stage before (not their embeddings); a stage before the
    last (`last_stage=False`) returns its residual stream [N, D] (packed alike on every stage).
    With `spill`, a hybrid forward of the whole model over at least `spill.min_tokens` tokens keeps
    its residual stream in a file there (`tiered.hybrid.spill`), not in memory."""
    if not items:
        raise ForwardInputError("a batch needs at least one request")
    for i in range(len(items)):
        _check_lead(items, i)
    block_cache.release()  # every forward starts with the block cache empty: its peak is its own
    prefix_lens = [_num_prefix_tokens(model, it) for it in items]
    regimes = [_regime(model, it, n) for it, n in zip(items, prefix_lens, strict=True)]
    for i, it in enumerate(items):
        if it.lead is not None and regimes[it.lead] != regimes[i]:
            raise ForwardInputError(f"item {i}: its RoPE regime {regimes[i]} is not its lead's ({regimes[it.lead]})")
    if mode == "chunked" and (hidden is not None or not last_stage):
        raise ValueError("forward mode 'chunked' runs the whole model per chunk: it cannot run as a pipeline stage")
    if mode == "chunked":  # a comparison mode: request by request, a follower computing its shared tokens
        device = model.inv_freq.device
        last_hidden: list[Tensor] = []
        for it, num_before, regime in zip(items, prefix_lens, regimes, strict=True):
            ids = it.token_ids
            if it.lead is not None:
                ids = torch.cat([items[it.lead].token_ids[: it.num_shared], ids])
                num_before -= it.num_shared
            last_hidden.append(_chunked(model, it, ids.to(device), chunk_tokens, num_before, regime))
        return model.last_token_logits(torch.stack(last_hidden))
    if mode not in ("hybrid", "vanilla"):
        raise ValueError(f"unknown forward mode '{mode}' (expected vanilla, chunked or hybrid)")
    # Only the last token of each request leaves the last layer, so hybrid computes that layer's
    # queries, attention, o_proj and MLP for those rows alone (its K,V still for every token).
    trim = last_stage and mode == "hybrid"
    spill = spill if trim and hidden is None else None
    x = _layer_by_layer(model, items, prefix_lens, regimes, chunk_tokens, mode == "vanilla", hidden, trim, spill)
    if not last_stage:
        return x
    return model.last_token_logits(x if trim else x[_last_rows(items).to(x.device)])


def _regime(model: CausalLM, item: BatchItem, num_prefix: int) -> int:
    """The item's RoPE regime: as given, or that of its prefix and tokens together."""
    if item.rope_regime is not None:
        return item.rope_regime
    return model.args.rope_regime(num_prefix + item.token_ids.numel())


def _last_rows(items: Sequence[BatchItem]) -> Tensor:
    """Each item's last row among the packed tokens, in item order."""
    order, groups = _pack(items)
    rows = [seg for g in groups for seg in g.segments]
    last = torch.empty(len(items), dtype=torch.long)
    for idx, (_, e) in zip(order, rows, strict=True):
        last[idx] = e - 1
    return last


@dataclass(slots=True)
class _Group:
    """Requests that share one prefix object, packed next to each other."""

    prefix_kv: Sequence[LayerKV] | None
    segments: list[tuple[int, int]]  # rows of the packed tokens, one per request
    shared: list[tuple[int, int] | None]  # per segment: the lead's rows a follower also sees


def _pack(items: Sequence[BatchItem]) -> tuple[list[int], list[_Group]]:
    """Packing order and the groups: items of one prefix adjacent, and groups of one adapter
    adjacent (one run of rows per adapter), each in order of first appearance."""
    by_prefix: dict[tuple[int, int], list[int]] = {}
    for i, it in enumerate(items):
        key = id(it.prefix_kv) if it.prefix_kv is not None else -1 - i  # no prefix: a group of its own
        by_prefix.setdefault((key, id(it.adapter)), []).append(i)
    adapter_rank: dict[int, int] = {}
    for _, adapter in by_prefix:
        adapter_rank.setdefault(adapter, len(adapter_rank))
    by_prefix = dict(sorted(by_prefix.items(), key=lambda kv: adapter_rank[kv[0][1]]))  # stable
    order = [i for members in by_prefix.values() for i in members]
    first_row, start = {}, 0
    for i in order:
        first_row[i] = start
        start += items[i].token_ids.numel()
    groups = []
    for members in by_prefix.values():
        segments = [(first_row[i], first_row[i] + items[i].token_ids.numel()) for i in members]
        shared = [
            None if (lead := items[i].lead) is None else (first_row[lead], first_row[lead] + items[i].num_shared)
            for i in members
        ]
        groups.append(_Group(items[members[0]].prefix_kv, segments, shared))
    return order, groups


def _layer_by_layer(
    model: CausalLM,
    items: Sequence[BatchItem],
    prefix_lens: list[int],
    regimes: list[int],
    chunk: int,
    hold_kv: bool,
    hidden: Tensor | None = None,
    last_rows_only: bool = False,
    spill: Spill | None = None,
) -> Tensor:
    """hybrid (chunk < N, KV dropped per layer) and vanilla (chunk = N, KV held to the end).

    Per layer: K,V of all packed tokens, chunk by chunk; then, chunk by chunk, the chunk's
    queries, their attention (over each request's prefix, its earlier tokens and, causally, its
    own tokens in the chunk), o_proj and the MLP, updating the residual in place. Keys are
    complete before any residual changes, so updating chunk by chunk is exact; queries exist for
    one chunk at a time. Returns the residual stream of the packed tokens [N, D] (`hidden`, if
    given, is updated in place); with `last_rows_only`, the last layer runs past its K,V for each
    request's last row only and the result is their residual stream [R, D], in request order.
    With `spill` (given only with `last_rows_only`, without `hidden`) and at least
    `spill.min_tokens` tokens, the residual stream lives in a file: each chunk's rows are read,
    updated and written back."""
    a = model.args
    order, groups = _pack(items)
    device = model.inv_freq.device
    token_ids = torch.cat([items[i].token_ids for i in order]).to(device)
    positions = torch.cat([torch.arange(prefix_lens[i], prefix_lens[i] + items[i].token_ids.numel()) for i in order])
    long = None  # the rows in LongRoPE's long regime
    if any(regimes):
        long = torch.cat([torch.full((items[i].token_ids.numel(),), bool(regimes[i])) for i in order])
    N = token_ids.numel()
    chunk = N if hold_kv else min(chunk, N)
    bounds = [(s, min(s + chunk, N)) for s in range(0, N, chunk)]
    stream: _Stream
    if spill is not None and N >= spill.min_tokens:
        dtype = model.model.embed_tokens.weight.dtype
        stream = ResidualFile(spill.directory, N, a.hidden_size, dtype, chunk, device)
        for s, e in bounds:
            stream.write(s, model.embed(token_ids[s:e]))
    else:
        stream = _InMemory(model.embed(token_ids) if hidden is None else hidden)  # updated in place
    try:
        return _layers(model, items, (order, groups), (positions, long), stream, bounds, hold_kv, last_rows_only)
    finally:
        stream.close()


class _InMemory:
    """The residual stream [N, D] in memory: a chunk's rows are a view, updated in place."""

    def __init__(self, x: Tensor) -> None:
        self.x, self.dtype = x, x.dtype

    def read(self, start: int, end: int) -> Tensor:
        """Rows [start, end): a view of the stream."""
        return self.x[start:end]

    def write(self, start: int, rows: Tensor) -> None:
        """Nothing to store: `rows` is the view `read` returned, updated in place."""

    def rows(self, index: Tensor) -> Tensor:
        """The rows at `index` [R] (a copy [R, D])."""
        return self.x[index.to(self.x.device)]

    def close(self) -> None:
        """Nothing to release: the tensor belongs to the forward."""


_Stream = _InMemory | ResidualFile


def _layers(
    model: CausalLM,
    items: Sequence[BatchItem],
    packed: tuple[list[int], list[_Group]],
    rows_at: tuple[Tensor, Tensor | None],
    stream: _Stream,
    bounds: list[tuple[int, int]],
    hold_kv: bool,
    last_rows_only: bool,
) -> Tensor:
    """Every layer over the residual stream in `stream`, chunk by chunk (see `_layer_by_layer`);
    `rows_at`: each packed row's position, and whether it is in LongRoPE's long regime (None: none is)."""
    a = model.args
    order, groups = packed
    positions, long = rows_at
    device = model.inv_freq.device
    N, chunk, dtype = positions.numel(), bounds[0][1], stream.dtype
    q = torch.empty((chunk, a.num_heads, a.head_dim), dtype=dtype, device=device)  # one chunk's queries
    gate_buf = torch.empty((chunk, a.intermediate_size), dtype=dtype, device=device)
    up_buf = torch.empty_like(gate_buf)
    chunk_spans = [_spans(groups, s, e) for s, e in bounds]  # the same for every layer
    rows = [seg for g in groups for seg in g.segments]  # packed rows, in packing order
    runs = [_lora_runs(items, order, rows, s, e) for s, e in bounds]
    shared = [sh for g in groups for sh in g.shared]
    held: list[LayerKV] = []
    reach = int(positions.max()) + 1 if N else 0
    num_layers = len(model.layers)
    for i, layer in enumerate(model.layers):
        attend_, paged_ = _attention(model, i, reach)
        k = torch.empty((N, a.num_kv_heads, a.head_dim), dtype=dtype, device=device)
        v = torch.empty_like(k)
        lora = [LoraSlice(i, r) if r else None for r in runs]
        for (s, e), lo in zip(bounds, lora, strict=True):
            cos_sin = model.rope(i, positions[s:e], dtype, None if long is None else long[s:e])
            kv_step(layer, stream.read(s, e), cos_sin, (k[s:e], v[s:e]), lo)
        if hold_kv:
            held.append((k, v))
        else:
            _to_sinks(items, order, rows, shared, i, (k, v))
        prefixes = _LayerPrefixes(groups, i, dtype, paged_)
        if last_rows_only and i == num_layers - 1:
            out = _RowsOut(items, order, groups, positions, long)
            return _last_layer_rows(model, layer, stream, (k, v), prefixes, out, attend_)
        for (s, e), spans_of_chunk, lo in zip(bounds, chunk_spans, lora, strict=True):
            n = e - s
            xs = stream.read(s, e)
            q_step(layer, xs, *model.rope(i, positions[s:e], dtype, None if long is None else long[s:e]), q[:n], lo)
            for g, spans in spans_of_chunk:
                prefixes.attend(attend_, q, (k, v), spans, g)  # q[:n] now holds the attention output
                prefixes.release_before(e)  # one group's prefix alive at a time
            o_proj_step_(layer, xs, q[:n].view(n, -1), lo)
            mlp_step_(layer, xs, gate_buf, up_buf, lo)
            stream.write(s, xs)
        del k, v, prefixes
    for i, (k, v) in enumerate(held):
        _to_sinks(items, order, rows, shared, i, (k, v))
    assert isinstance(stream, _InMemory)  # a spilled stream ends in the last layer's rows above
    return stream.x


@dataclass(slots=True)
class _RowsOut:
    """What the last layer needs to compute each request's last row past its K,V."""

    items: Sequence[BatchItem]
    order: list[int]  # request indices in packing order
    groups: list[_Group]
    positions: Tensor  # [N] position of every packed row
    long: Tensor | None  # [N] whether each is in LongRoPE's long regime (None: none is)


def _last_layer_rows(
    model: CausalLM,
    layer: DecoderLayer,
    stream: _Stream,
    kv: LayerKV,
    prefixes: _LayerPrefixes,
    out: _RowsOut,
    attend_: AttendFn,
) -> Tensor:
    """The last layer for each request's last token: its query attends to everything the request
    sees (prefix, shared tokens, its own earlier tokens), then o_proj and the MLP. Rows are taken in
    packing order, so each group's queries are adjacent; returns them in request order [R, D]."""
    a = model.args
    ends = [e for g in out.groups for _, e in g.segments]  # packing order
    num_rows = len(ends)
    last = torch.tensor(ends) - 1
    xr = stream.rows(last)  # [R, D], a copy: the packed residual stream is left as the layer found it
    q = torch.empty((num_rows, a.num_heads, a.head_dim), dtype=xr.dtype, device=xr.device)
    lora_runs = _lora_runs(out.items, out.order, [(j, j + 1) for j in range(num_rows)], 0, num_rows)
    lo = LoraSlice(len(model.layers) - 1, lora_runs) if lora_runs else None
    long = None if out.long is None else out.long[last]
    q_step(layer, xr, *model.rope(len(model.layers) - 1, out.positions[last], xr.dtype, long), q, lo)
    row = 0
    for gi, g in enumerate(out.groups):
        spans = []
        for (s, e), shared in zip(g.segments, g.shared, strict=True):
            visible = tuple(r for r in (shared, (s, e - 1)) if r is not None and r[0] < r[1])
            spans.append(Span(row, e - 1, 1, visible))
            row += 1
        prefixes.attend(attend_, q, kv, spans, gi)  # q now holds the attention output
    o_proj_step_(layer, xr, q.view(num_rows, -1), lo)
    scratch = torch.empty((num_rows, a.intermediate_size), dtype=xr.dtype, device=xr.device)
    mlp_step_(layer, xr, scratch, torch.empty_like(scratch), lo)
    rank = torch.empty(num_rows, dtype=torch.long)
    rank[torch.tensor(out.order)] = torch.arange(num_rows)
    return xr[rank.to(xr.device)]


def _lora_runs(
    items: Sequence[BatchItem], order: list[int], rows: list[tuple[int, int]], start: int, end: int
) -> list[LoraRun]:
    """Runs of packed rows [start, end) that share an adapter (relative to `start`; base rows left out)."""
    runs: list[LoraRun] = []
    for idx, (s, e) in zip(order, rows, strict=True):
        adapter, lo, hi = items[idx].adapter, max(s, start), min(e, end)
        if adapter is None or lo >= hi:
            continue
        if runs and runs[-1].weights is adapter and runs[-1].end == lo - start:
            runs[-1] = LoraRun(runs[-1].start, hi - start, adapter)
        else:
            runs.append(LoraRun(lo - start, hi - start, adapter))
    return runs


def _spans(groups: list[_Group], start: int, end: int) -> list[tuple[int, list[Span]]]:
    """Per group, the parts of its requests inside packed rows [start, end), as attention spans
    (query rows relative to `start`; key rows absolute)."""
    out = []
    for gi, g in enumerate(groups):
        spans = []
        for (s, e), shared in zip(g.segments, g.shared, strict=True):
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                visible = tuple(r for r in (shared, (s, lo)) if r is not None and r[0] < r[1])
                spans.append(Span(lo - start, lo, hi - lo, visible))
        if spans:
            out.append((gi, spans))
    return out


class _LayerPrefixes:
    """One layer's cached prefixes. Read in place from the device tier's pool by block id where the
    kernel can (`paged_`) and the prefix offers it (the tiers' PrefixKV, KV in the compute dtype);
    otherwise gathered when a chunk first needs them and released once the chunks are past their
    group (groups are contiguous), so about one is alive at a time."""

    def __init__(self, groups: list[_Group], layer: int, dtype: torch.dtype, paged_: PagedFn | None = None) -> None:
        self._groups, self._layer, self._dtype, self._paged_ = groups, layer, dtype, paged_
        self._kv: dict[int, LayerKV] = {}

    def attend(self, attend_: AttendFn, q: Tensor, kv: LayerKV, spans: list[Span], group: int) -> None:
        """Group `group`'s spans' attention over its prefix and `kv`, written into q."""
        prefix = self._groups[group].prefix_kv
        paged = getattr(prefix, "paged", None) if self._paged_ is not None else None
        pages = paged(self._layer, self._dtype) if paged is not None else None
        if pages is not None and self._paged_ is not None:
            self._paged_(q, kv[0], kv[1], spans, pages)
        else:
            attend_(q, kv[0], kv[1], spans, *self.get(group))

    def get(self, group: int) -> tuple[Tensor | None, Tensor | None]:
        """A group's prefix K,V for this layer in the compute dtype, gathered on first ask (None, None: no prefix)."""
        prefix = self._groups[group].prefix_kv
        if prefix is None:
            return None, None
        if group not in self._kv:
            k, v = prefix[self._layer]
            # Tiers may keep KV narrower than the compute dtype (cache.kv_dtype): widen it here, per layer.
            self._kv[group] = (k.to(self._dtype), v.to(self._dtype))
        return self._kv[group]

    def release_before(self, row: int) -> None:
        """Drop the prefixes of groups whose rows all end by packed row `row`."""
        for g in [g for g in self._kv if self._groups[g].segments[-1][1] <= row]:
            del self._kv[g]


def _to_sinks(
    items: Sequence[BatchItem],
    order: list[int],
    rows: list[tuple[int, int]],
    shared: list[tuple[int, int] | None],
    layer: int,
    kv: LayerKV,
) -> None:
    """Each item's K,V after its prefix; a follower's start with the lead's shared rows."""
    k, v = kv
    for idx, (s, e), sh in zip(order, rows, shared, strict=True):
        sink = items[idx].kv_sink
        if sink is None:
            continue
        if sh is None:
            sink(layer, k[s:e], v[s:e])
        else:
            sink(layer, torch.cat([k[sh[0] : sh[1]], k[s:e]]), torch.cat([v[sh[0] : sh[1]], v[s:e]]))


def _chunked(model: CausalLM, item: BatchItem, token_ids: Tensor, chunk: int, num_prefix: int, regime: int) -> Tensor:
    """Sarathi-style chunked prefill of `token_ids` (the item's, a follower's with its shared ones
    first) after `num_prefix` tokens of its prefix: the whole model per chunk, all layers' K,V of
    the computed tokens kept; the prefix read where it is (by block id where the kernel can)."""
    prefix_kv, kv_sink, adapter = item.prefix_kv, item.kv_sink, item.adapter
    a = model.args
    T, P = token_ids.numel(), num_prefix
    chunk = min(chunk, T)
    dtype, device = model.model.embed_tokens.weight.dtype, token_ids.device
    shape = (T, a.num_kv_heads, a.head_dim)
    kv = [
        (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
        for _ in range(a.num_layers)
    ]
    q = torch.empty((chunk, a.num_heads, a.head_dim), dtype=dtype, device=device)
    gate_buf = torch.empty((chunk, a.intermediate_size), dtype=dtype, device=device)
    up_buf = torch.empty_like(gate_buf)
    hidden_last = q.new_empty(0)
    calls = [_attention(model, i, P + T) for i in range(a.num_layers)]
    group = [_Group(prefix_kv if P else None, [(0, T)], [None])]
    prefixes = [_LayerPrefixes(group, i, dtype, paged_) for i, (_, paged_) in enumerate(calls)]
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        x = model.embed(token_ids[s:e])  # [n, D]
        positions = torch.arange(P + s, P + e)
        firsts = {id(model.layer_inv_freq(i)): i for i in reversed(range(a.num_layers))}  # one, or Gemma's two
        rope = {key: model.rope(i, positions, dtype, bool(regime)) for key, i in firsts.items()}
        for i, layer in enumerate(model.layers):
            cos, sin = rope[id(model.layer_inv_freq(i))]
            k, v = kv[i]
            lo = LoraSlice(i, [LoraRun(0, n, adapter)]) if adapter is not None else None
            kv_step(layer, x, (cos, sin), (k[s:e], v[s:e]), lo)
            q_step(layer, x, cos, sin, q[:n], lo)
            spans = [Span(0, s, n, ((0, s),) if s else ())]  # the earlier chunks' tokens: all visible
            prefixes[i].attend(calls[i][0], q, (k, v), spans, 0)
            o_proj_step_(layer, x, q[:n].view(n, -1), lo)
            mlp_step_(layer, x, gate_buf, up_buf, lo)
        hidden_last = x[-1]
    if kv_sink is not None:
        for i, (k, v) in enumerate(kv):
            kv_sink(i, k, v)
    return hidden_last
