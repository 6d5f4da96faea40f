"""`python -m benchmarks batch`: what batching and the prefix path buy, forward by forward.

Side by side in one process, on one model, timings interleaved (best of `repeats`):
- **visit**: N requests of `new` tokens each on one shared cached prefix of `prefix` tokens
  (a user's profile + N candidate posts), run one per forward vs packed into one forward;
  throughput and each side's achieved FLOP/s as a fraction of the measured matmul rate.
- **row-wise ops**: the batched visit with the native library's fused RMSNorm and
  SiLU-and-multiply against PyTorch's expressions of them.
- **hit saving**: `new` tokens on a cached prefix vs recomputing prefix + new tokens from
  scratch: the compute a cache hit saves (the issue's case: 1,296 new on 1,800 cached).
The prefix is held as a device-tier pool holds it (blocks gathered per layer), so the prefix
path's cost counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.mil import forward_flops, matmul_flops_per_s
from benchmarks.report import write_report
from tiered.config import AttentionConfig, AttentionKernel
from tiered.hybrid import pointwise
from tiered.hybrid.attention import KERNELS, Span
from tiered.hybrid.attention.select import KernelShape, choose_kernel
from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import DTYPES, load_model
from tiered.hybrid.memory import GatheredPrefix
from tiered.hybrid.model import CausalLM, use_attention
from tiered.native import library as native

log = logging.getLogger(__name__)


@dataclass(slots=True)
class VisitResult:
    num_requests: int
    new_tokens: int
    prefix_tokens: int
    single_seconds: float  # all requests, one forward each
    batched_seconds: float  # all requests, one forward
    speedup: float
    single_fraction_of_matmul: float
    batched_fraction_of_matmul: float


@dataclass(slots=True)
class AttentionResult:
    """The attention kernel alone at the visit's shape: every new token against the cached prefix."""

    num_queries: int
    num_keys: int
    seconds: float  # one layer, all heads
    flops_per_s: float
    fraction_of_matmul: float


@dataclass(slots=True)
class PointwiseResult:
    """The batched visit with the native library's fused row-wise ops (RMSNorm, SiLU-and-multiply)
    against PyTorch's expressions of them, timings interleaved."""

    fused_seconds: float
    pytorch_seconds: float
    speedup: float  # pytorch / fused


@dataclass(slots=True)
class HitSavingResult:
    new_tokens: int
    prefix_tokens: int
    with_prefix_seconds: float
    recompute_seconds: float
    saving: float  # recompute / with prefix
    ideal_saving: float  # by FLOPs alone


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """What `run_batch_bench` runs (the CLI's options, one to one; lengths in tokens)."""

    model_dir: str
    dtype: str  # the compute dtype: float32, bfloat16 or float16
    device: str
    json_path: str | None
    num_requests: int  # requests sharing the cached prefix (a visit's posts)
    new_tokens: int  # computed tokens per request
    prefix_tokens: int  # the cached prefix (the profile)
    hit_new_tokens: int  # new tokens of the hit-saving case
    chunk_tokens: int  # hybrid chunk size
    repeats: int  # timed runs per side; the best is kept
    # attention.kernel: auto (chosen as the engine does at start-up) or a kernel's name
    attention: AttentionKernel = "auto"


def run_batch_bench(opts: BatchOptions) -> dict[str, object]:
    """The visit (one per forward against batched), its attention alone, and what a hit saves; the JSON document."""
    dtype, device, chunk_tokens = opts.dtype, opts.device, opts.chunk_tokens
    model = load_model(opts.model_dir, dtype, device)
    a = model.args
    heads = KernelShape(a.num_heads, a.num_kv_heads, a.head_dim, DTYPES[dtype], device)
    longest = opts.prefix_tokens + opts.num_requests * opts.new_tokens
    use_attention(model, choose_kernel(AttentionConfig(kernel=opts.attention), heads, longest))
    log.info("attention kernel: %s", model.attention)
    g = torch.Generator().manual_seed(0)
    rate = matmul_flops_per_s(DTYPES[dtype], device)
    log.info("matmul rate (%s, 2048^3): %.1f GFLOP/s", dtype, rate / 1e9)
    profile = torch.randint(0, a.vocab_size, (opts.prefix_tokens,), generator=g)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward(model, profile, chunk_tokens=chunk_tokens, kv_sink=lambda i, k, v: kv.append((k.clone(), v.clone())))
    visit, batched = _visit(model, GatheredPrefix(kv), opts, rate, g)
    fused = _pointwise(batched, opts.repeats)
    attn = _attention_of_one_layer(model, kv[0], opts, rate, g)
    hit = _hit_saving(model, profile, GatheredPrefix(kv), opts.hit_new_tokens, opts.repeats, g)
    return write_report(
        opts.json_path,
        "batch",
        device,
        {
            "model": opts.model_dir,
            "dtype": dtype,
            "matmul_flops_per_s": rate,
            "visit": asdict(visit),
            "pointwise": asdict(fused) if fused is not None else None,
            "attention": asdict(attn),
            "hit_saving": asdict(hit),
        },
    )


def _visit(
    model: CausalLM, prefix: GatheredPrefix, opts: BatchOptions, rate: float, g: torch.Generator
) -> tuple[VisitResult, Callable[[], None]]:
    """A visit's requests on one cached prefix: one per forward against one batched forward; the
    result and the batched forward (to time again)."""
    num_requests, new_tokens, chunk_tokens = opts.num_requests, opts.new_tokens, opts.chunk_tokens
    a = model.args
    prefix_tokens = prefix.num_tokens
    posts = [torch.randint(0, a.vocab_size, (new_tokens,), generator=g) for _ in range(num_requests)]
    items = [BatchItem(p, prefix) for p in posts]

    def single() -> None:
        for p in posts:
            forward(model, p, chunk_tokens=chunk_tokens, prefix_kv=prefix)

    def batched() -> None:
        forward_batch(model, items, chunk_tokens=chunk_tokens)

    flops = num_requests * forward_flops(a, new_tokens, prefix_tokens)
    times = {"single": float("inf"), "batched": float("inf")}
    for _ in range(opts.repeats):  # interleaved, so drift hits both sides alike
        for name, fn in (("single", single), ("batched", batched)):
            times[name] = min(times[name], _best(fn, 1))
    visit = VisitResult(
        num_requests,
        new_tokens,
        prefix_tokens,
        times["single"],
        times["batched"],
        times["single"] / times["batched"],
        flops / times["single"] / rate,
        flops / times["batched"] / rate,
    )
    log.info(
        "visit: %d x %d new on %d cached: one per forward %.3f s, batched %.3f s (%.2fx); %.0f%% / %.0f%% of matmul",
        num_requests,
        new_tokens,
        prefix_tokens,
        visit.single_seconds,
        visit.batched_seconds,
        visit.speedup,
        100 * visit.single_fraction_of_matmul,
        100 * visit.batched_fraction_of_matmul,
    )
    return visit, batched


def _pointwise(batched: Callable[[], None], repeats: int) -> PointwiseResult | None:
    """The batched visit with the fused row-wise ops and with PyTorch's, interleaved (None where
    the native library is not available here)."""
    if not native.available():
        log.info("fused row-wise ops: the native library is not available here; not measured")
        return None
    times = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(repeats):
            for fused in (True, False):
                pointwise.use_fused(fused)
                times[fused] = min(times[fused], _best(batched, 1))
    finally:
        pointwise.use_fused(True)
    result = PointwiseResult(times[True], times[False], times[False] / times[True])
    log.info(
        "batched visit, row-wise ops fused %.3f s against PyTorch's %.3f s: %.2fx",
        result.fused_seconds,
        result.pytorch_seconds,
        result.speedup,
    )
    return result


def _attention_of_one_layer(
    model: CausalLM, layer_kv: tuple[torch.Tensor, torch.Tensor], opts: BatchOptions, rate: float, g: torch.Generator
) -> AttentionResult:
    """The attention of one layer alone, as the batched forward calls it: the visit's queries
    against the shared prefix in one call, then each request's own tokens (causal)."""
    num_requests, new_tokens = opts.num_requests, opts.new_tokens
    a = model.args
    prefix_tokens = layer_kv[0].shape[0]
    queries = num_requests * new_tokens
    dt = layer_kv[0].dtype
    q = torch.randn(queries, a.num_heads, a.head_dim, generator=g).to(dt)
    own_k, own_v = (torch.randn(queries, a.num_kv_heads, a.head_dim, generator=g).to(dt) for _ in "kv")
    spans = [Span(i * new_tokens, i * new_tokens, new_tokens) for i in range(num_requests)]
    attend_ = KERNELS[model.attention].attend_
    seconds = min(_best(lambda: attend_(q.clone(), own_k, own_v, spans, *layer_kv), 1) for _ in range(opts.repeats))
    pairs = queries * prefix_tokens + num_requests * new_tokens * (new_tokens + 1) / 2
    attn_flops = 4 * a.num_heads * a.head_dim * pairs
    attn = AttentionResult(queries, prefix_tokens, seconds, attn_flops / seconds, attn_flops / seconds / rate)
    log.info(
        "attention of one layer: %d queries on %d cached keys: %.1f ms, %.0f GFLOP/s (%.0f%% of matmul)",
        queries,
        prefix_tokens,
        1e3 * seconds,
        attn.flops_per_s / 1e9,
        100 * attn.fraction_of_matmul,
    )
    return attn


def _hit_saving(
    model: CausalLM,
    profile: torch.Tensor,
    prefix: GatheredPrefix,
    hit_new_tokens: int,
    repeats: int,
    g: torch.Generator,
) -> HitSavingResult:
    """New tokens on the cached prefix against recomputing prefix and new tokens: what a hit saves."""
    a = model.args
    prefix_tokens = profile.numel()
    new = torch.randint(0, a.vocab_size, (hit_new_tokens,), generator=g)
    whole = torch.cat([profile, new])
    hit_times = {"prefix": float("inf"), "recompute": float("inf")}
    for _ in range(repeats):
        hit_times["prefix"] = min(hit_times["prefix"], _best(lambda: forward(model, new, prefix_kv=prefix), 1))
        hit_times["recompute"] = min(hit_times["recompute"], _best(lambda: forward(model, whole), 1))
    ideal = forward_flops(a, prefix_tokens + hit_new_tokens) / forward_flops(a, hit_new_tokens, prefix_tokens)
    hit = HitSavingResult(
        hit_new_tokens,
        prefix_tokens,
        hit_times["prefix"],
        hit_times["recompute"],
        hit_times["recompute"] / hit_times["prefix"],
        ideal,
    )
    log.info(
        "hit saving: %d new on %d cached %.3f s vs recompute %.3f s: %.2fx (FLOPs alone: %.2fx)",
        hit_new_tokens,
        prefix_tokens,
        hit.with_prefix_seconds,
        hit.recompute_seconds,
        hit.saving,
        ideal,
    )
    return hit
