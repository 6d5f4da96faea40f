"""Attention kernels behind one interface, each beside the fp32 reference it is tested against.

Design notes: docs/internals.md, section `tiered/hybrid/attention/kernels.py`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from tiered.hybrid.attention.interface import (
    AttendFn,
    Kernel,
    PagedFn,
    PagedPrefix,
    Span,
    attend_from_paged,
    prefix_runs,
    prefix_segments,
)
from tiered.hybrid.attention.native import DTYPES as NATIVE_DTYPES
from tiered.hybrid.attention.native import attend_ as native_attend_
from tiered.hybrid.attention.native import attend_paged_ as native_attend_paged_
from tiered.hybrid.attention.native import windowed as native_windowed
from tiered.hybrid.attention.vllm_cpu import KERNEL as VLLM_CPU
from tiered.native.library import unavailable as native_unavailable

PartFn = Callable[[Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor]]
"""(q [1, h, n, Dh], k [1, hkv, S, Dh], v, causal) -> (out [1, h, n, Dh] in q's dtype, lse [1, h, n] fp32).
Causal is lower-right aligned: query i sees keys up to S - n + i."""


# ---- the shared driver: parts merged by log-sum-exp --------------------------------------------


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention over keys A ∪ B from its parts over A and over B, with its log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = (lse_a - top).exp_(), (lse_b - top).exp_()
    total = wa + wb
    out = out_a * (wa / total)[..., None].to(out_a.dtype) + out_b * (wb / total)[..., None].to(out_b.dtype)
    return out, total.log_().add_(top)


def _merge_blocks(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """`_merge` along dim 0: parts [n, h, m, Dh] over n disjoint key sets, with their log-sum-exps
    [n, h, m], as one [1, h, m, Dh] and its log-sum-exp (weighted in fp32)."""
    if out.shape[0] == 1:
        return out, lse
    top = lse.amax(0)
    weights = (lse - top).exp_()
    total = weights.sum(0)
    merged = torch.einsum("nhmd,nhm->hmd", out.float(), weights.div_(total))
    return merged[None].to(out.dtype), total.log_().add_(top)[None]


# Elements of part outputs one call over several prefix blocks may return (each block's queries
# are the same, so a call over n blocks returns n outputs before they are merged).
PREFIX_SCRATCH_ELEMENTS = 1 << 23


def _prefix_part(
    part: PartFn, q4: Tensor, runs: list[tuple[Tensor, Tensor]], kv_heads: slice
) -> tuple[Tensor | None, Tensor | None]:
    """Queries q4 [1, h, m, Dh] over KV heads `kv_heads` of a prefix in place (`prefix_runs`), no
    mask: the blocks of a run are a batch of one `part` call (the queries broadcast over them),
    merged by log-sum-exp, as many blocks a call as PREFIX_SCRATCH_ELEMENTS allows."""
    out = lse = None
    h, m, d = q4.shape[1:]
    step = max(1, PREFIX_SCRATCH_ELEMENTS // (h * m * d))
    for pk, pv in runs:
        k4, v4 = (t[:, :, kv_heads].transpose(1, 2).to(q4.dtype) for t in (pk, pv))  # [blocks, hkv, rows, Dh]
        for b in range(0, k4.shape[0], step):
            kb, vb = k4[b : b + step], v4[b : b + step]
            o, s = _merge_blocks(*part(q4.expand(kb.shape[0], -1, -1, -1), kb, vb, False))
            out, lse = (o, s) if out is None or lse is None else _merge(out, lse, o, s)
    return out, lse


class PartCalls(NamedTuple):
    """How `_by_parts_` calls: the part kernel, over `kv_heads_per_call` KV heads a call (None: all)."""

    part: PartFn
    kv_heads_per_call: int | None


def _by_parts_(
    calls: PartCalls, q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None
) -> None:
    """`part` calls over the shared prefix, read in place from its blocks, for the queries of all
    spans (requests that share a prefix read it once, no copy per request), one per visible range,
    one causal over each span's own keys; merged by log-sum-exp. Calls cover `kv_heads_per_call`
    KV heads (None: all), so scratch is that many query groups' output, not another [L, H, Dh] tensor."""
    part, kv_heads_per_call = calls
    runs = prefix_runs(prefix)
    num_kv_heads = k.shape[1]
    per_call = kv_heads_per_call or num_kv_heads
    group = q.shape[1] // num_kv_heads
    first, last = spans[0].q_start, spans[-1].q_start + spans[-1].num
    for j in range(0, num_kv_heads, per_call):
        heads = slice(j * group, (j + per_call) * group)
        q4 = q[:, heads].permute(1, 0, 2)[None]  # [1, h, L, Dh]
        k4, v4 = (t[:, j : j + per_call].permute(1, 0, 2)[None] for t in (k, v))  # [1, hkv, *, Dh]
        out_p, lse_p = _prefix_part(part, q4[:, :, first:last], runs, slice(j, j + per_call))
        for p in spans:
            qs, ks = slice(p.q_start, p.q_start + p.num), slice(p.k_start, p.k_start + p.num)
            out, lse = part(q4[:, :, qs], k4[:, :, ks], v4[:, :, ks], True)
            for a, b in p.visible:
                out, lse = _merge(out, lse, *part(q4[:, :, qs], k4[:, :, a:b], v4[:, :, a:b], False))
            if out_p is not None and lse_p is not None:
                rows = slice(p.q_start - first, p.q_start - first + p.num)
                out, lse = _merge(out, lse, out_p[:, :, rows], lse_p[:, :, rows])
            q[qs, heads].copy_(out[0].transpose(0, 1))
        del out_p  # before the next call allocates its own


# ---- parts -------------------------------------------------------------------------------------


def _flash_part(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal)
    return out, lse


# ---- whole kernels -----------------------------------------------------------------------------


def _flash_head_paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
    _by_parts_(PartCalls(_flash_part, 1), q, k, v, spans, prefix)


def _flash_paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
    _by_parts_(PartCalls(_flash_part, None), q, k, v, spans, prefix)


def _flash_f32_paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
    q32 = q.float()
    _by_parts_(PartCalls(_flash_part, None), q32, k.float(), v.float(), spans, prefix)  # the prefix widened per run
    q.copy_(q32)


def masked_paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
    """Per span: its keys concatenated (the prefix's blocks, visible ranges, own) and SDPA with a
    lower-right causal mask."""
    # Imported here: the module pulls in torch._dynamo, which a process whose forwards never
    # take this path (the probes, the API process, an engine on another kernel) need not load.
    from torch.nn.attention.bias import causal_lower_right

    prefix_parts = prefix_segments(prefix)
    for p in spans:
        parts = (
            prefix_parts
            + [(k[a:b], v[a:b]) for a, b in p.visible]
            + [(k[p.k_start : p.k_start + p.num], v[p.k_start : p.k_start + p.num])]
        )
        ks, vs = torch.cat([kk for kk, _ in parts]), torch.cat([vv for _, vv in parts])
        mask = causal_lower_right(p.num, ks.shape[0]) if ks.shape[0] > p.num else None
        qp = q[p.q_start : p.q_start + p.num]
        q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (qp, ks.to(q.dtype), vs.to(q.dtype)))
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        qp.copy_(out[0].transpose(0, 1))


masked_ = attend_from_paged(masked_paged_)


# Queries a windowed call attends at once: their keys are the window plus this many rows.
WINDOW_QUERY_BLOCK = 256


@functools.cache
def windowed_calls(window: int | None, softcap: float | None = None) -> tuple[AttendFn, PagedFn]:
    """The AttendFn and the paged call (the prefix read from its blocks) of `windowed`."""

    def paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
        prefix_parts = prefix_segments(prefix)
        for p in spans:
            segs = prefix_parts + [(k[a:b], v[a:b]) for a, b in p.visible]
            segs.append((k[p.k_start : p.k_start + p.num], v[p.k_start : p.k_start + p.num]))
            before = sum(sk.shape[0] for sk, _ in segs[:-1])  # keys ahead of its own: positions 0 .. before-1
            for qb in range(0, p.num, WINDOW_QUERY_BLOCK):
                qe = min(qb + WINDOW_QUERY_BLOCK, p.num)
                # key positions any of them sees
                lo, hi = (0 if window is None else max(0, before + qb - window + 1)), before + qe
                ks, vs = _key_rows(segs, lo, hi)
                qpos = torch.arange(before + qb, before + qe, device=q.device)[:, None]
                kpos = torch.arange(lo, hi, device=q.device)[None, :]
                mask = kpos <= qpos if window is None else (kpos <= qpos) & (kpos > qpos - window)
                qp = q[p.q_start + qb : p.q_start + qe]
                q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (qp, ks.to(q.dtype), vs.to(q.dtype)))
                if softcap is None:
                    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
                else:
                    out = _softcapped(q4, k4, v4, mask, softcap)
                qp.copy_(out[0].transpose(0, 1))

    return attend_from_paged(paged_), paged_


def windowed(window: int | None, softcap: float | None = None) -> AttendFn:
    """An attention call where each query sees only the last `window` keys up to its own
    (HF's sliding window: key j visible from query position p when p - window < j <= p), for the
    layers of a sliding-window model once a forward reaches past the window; None: every key up to
    its own. Per span, its keys in position order are the prefix, its visible ranges, then its own
    (causal); each block of WINDOW_QUERY_BLOCK queries attends over only the keys its window can
    reach, with a band mask, so memory and time grow with the window, not the prompt. With
    `softcap` (Gemma 2) each scaled score becomes softcap * tanh(score / softcap) before the mask
    and the softmax, which SDPA cannot do: the block's scores are computed out, in fp32."""
    return windowed_calls(window, softcap)[0]


def window_calls(kernel: Kernel, window: int) -> tuple[AttendFn, PagedFn | None]:
    """`kernel`'s calls for a sliding window of `window` keys: its own where it has them (the C++
    kernel masks by position), else the PyTorch `windowed` calls; either reads the prefix in place."""
    return kernel.windowed(window) if kernel.windowed is not None else windowed_calls(window)


def _softcapped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softcap: float) -> Tensor:
    """SDPA's answer ([1, heads, queries, head_dim]) with each scaled score soft-capped first;
    scores and softmax in fp32, query heads grouped over their shared KV head."""
    heads, kv_heads, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    qg = q[0].float().reshape(kv_heads, heads // kv_heads * n, d)
    scores = torch.bmm(qg, k[0].float().transpose(1, 2)).mul_(d**-0.5)
    scores = scores.div_(softcap).tanh_().mul_(softcap).view(kv_heads, heads // kv_heads, n, -1)
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1).view(kv_heads, heads // kv_heads * n, -1)
    out = torch.bmm(probs, v[0].float()).view(1, heads, n, d)
    return out.to(q.dtype)


def _key_rows(segs: list[tuple[Tensor, Tensor]], lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """K and V of key positions [lo, hi) of segments laid end to end (a copy only where it spans several)."""
    ks, vs, at = [], [], 0
    for sk, sv in segs:
        n = sk.shape[0]
        a, b = max(lo, at) - at, min(hi, at + n) - at
        if a < b:
            ks.append(sk[a:b])
            vs.append(sv[a:b])
        at += n
    if len(ks) == 1:
        return ks[0], vs[0]
    return torch.cat(ks), torch.cat(vs)


def _varlen_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int
) -> Tensor:  # pragma: no cover - needs CUDA (tests swap in a CPU stand-in to check the packing)
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    options: dict[str, Any] = {}
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # a torch whose varlen_attn takes equal head counts only
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "window_size" in params:
        options["window_size"] = (-1, 0)  # causal, aligned to the last key
    else:
        options["is_causal"] = True
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    return out  # type: ignore[return-value]


def varlen_paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
    """CUDA: one FlashAttention-2 call (torch's `varlen_attn`) for all spans. Each span is one
    sequence whose keys are packed as [prefix, visible ranges, own]; FA2 aligns its causal mask
    to the bottom right when a sequence has more keys than queries (flash-attn >= 2.1), so query
    i of a span sees every key before its own block and its own first i + 1. The packing copies
    the shared prefix from its blocks once per span (a few MiB a layer for a visit: microseconds
    at HBM speed); FA2's own paged form would read it in place."""
    prefix_parts = prefix_segments(prefix)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    cu_q, cu_k = [0], [0]
    for p in spans:
        parts = prefix_parts + [(k[a:b], v[a:b]) for a, b in p.visible]
        parts.append((k[p.k_start : p.k_start + p.num], v[p.k_start : p.k_start + p.num]))
        keys += [kk for kk, _ in parts]
        values += [vv for _, vv in parts]
        cu_q.append(cu_q[-1] + p.num)
        cu_k.append(cu_k[-1] + sum(kk.shape[0] for kk, _ in parts))
    first, last = spans[0].q_start, spans[-1].q_start + spans[-1].num
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    cu_q_t, cu_k_t = (torch.tensor(cu, dtype=torch.int32, device=q.device) for cu in (cu_q, cu_k))
    out = _varlen_attn(
        q[first:last],
        torch.cat(keys).to(q.dtype),
        torch.cat(values).to(q.dtype),
        cu_q_t,
        cu_k_t,
        max(lengths_q),
        max(lengths_k),
    )
    q[first:last].copy_(out)


varlen_ = attend_from_paged(varlen_paged_)


def reference_(
    q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix_k: Tensor | None, prefix_v: Tensor | None
) -> None:
    """The truth: `masked_` with every input widened to fp32, written back in q's dtype."""
    q32 = q.float()
    pk, pv = (None, None) if prefix_k is None or prefix_v is None else (prefix_k.float(), prefix_v.float())
    masked_(q32, k.float(), v.float(), spans, pk, pv)
    q.copy_(q32)


KERNELS: dict[str, Kernel] = {
    kernel.name: kernel
    for kernel in (
        Kernel("flash-head", attend_from_paged(_flash_head_paged_), ("cpu",), attend_paged_=_flash_head_paged_),
        Kernel("flash", attend_from_paged(_flash_paged_), ("cpu",), attend_paged_=_flash_paged_),
        Kernel(  # fp32 is `flash` itself
            "flash-f32",
            attend_from_paged(_flash_f32_paged_),
            ("cpu",),
            (torch.bfloat16, torch.float16),
            attend_paged_=_flash_f32_paged_,
        ),
        Kernel(
            "native",
            native_attend_,
            ("cpu",),
            NATIVE_DTYPES,
            unavailable=native_unavailable,
            attend_paged_=native_attend_paged_,
            windowed=native_windowed,
        ),
        Kernel("masked", masked_, ("cpu", "cuda"), attend_paged_=masked_paged_),
        Kernel(  # FA2: half precisions only
            "varlen", varlen_, ("cuda",), (torch.bfloat16, torch.float16), attend_paged_=varlen_paged_
        ),
        VLLM_CPU,
    )
}
