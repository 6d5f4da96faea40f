"""Which attention kernel runs on this machine: the fastest correct one at the engine's shapes.

Which kernel is fastest depends on the CPU (AMX, AVX512-BF16, AVX2), the precision and the core
count, so it is measured, never assumed: at start-up every kernel that runs on the device is
timed on the shape classes of a prefill-only engine (many requests on one shared prefix; one
long suffix on a long prefix; a fresh causal prompt), each checked against the fp32 reference,
and the fastest whose error is within bounds is used. Each is timed as the forward calls it: the
prefix read from a pool laid out as the device tier's, by block id, its blocks scattered. The
choice is cached on disk per exact setup (CPU model and flags, torch, threads, dtype, head
shapes, the native library's build) like the JCT profile; the config's `attention.kernel` forces
one instead. A kernel that needs a library this process lacks (`vllm-cpu`:
`attention.vllm_library`) is not available, so neither measured nor accepted.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from tiered.config import AttentionConfig, ConfigError
from tiered.hybrid.attention import vllm_cpu
from tiered.hybrid.attention.interface import AttendFn, PagedFn, PagedPrefix, Span
from tiered.hybrid.attention.kernels import KERNELS, reference_, window_calls, windowed
from tiered.hybrid.measured import cache_key, load_cached, save_cached
from tiered.hybrid.precision import cpu_flags, cpu_name
from tiered.native import library as native_library

log = logging.getLogger(__name__)

# Max |out - reference| a kernel may have: outputs are convex combinations of V rows (|v| ~ 1),
# so these are absolute. bf16: a few roundings of 2^-8; fp32: summation order only.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
SELECT_VERSION = 2

# How a timed kernel reads the shape's prefix: one contiguous tensor; its paged call on a pool laid
# out as the device tier's (as the forward calls it); or that pool gathered into one tensor first,
# then its plain call (the copy timed with it).
PREFIX_LAYOUTS = ("contiguous", "paged", "gathered")
# The device tier's block size the engine's choice is timed at (config `cache.block_tokens`'s default).
BLOCK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class ShapeClass:
    """`requests` requests of `new_tokens` each, on one shared cached prefix of `prefix_tokens`."""

    name: str
    requests: int
    new_tokens: int
    prefix_tokens: int

    def spans(self) -> list[Span]:
        """One causal span per request, each over its own `new_tokens` queries and keys."""
        n = self.new_tokens
        return [Span(i * n, i * n, n) for i in range(self.requests)]

    def flops(self, num_heads: int, head_dim: int, window: int | None = None) -> float:
        """Multiply-adds x 2 of QK^T and PV over the pairs a causal prefill attends (with a sliding
        `window`: a query at position p attends min(p + 1, window) keys)."""
        P, n = self.prefix_tokens, self.new_tokens
        if window is None:
            pairs = self.requests * (n * P + n * (n + 1) / 2)
        else:
            pairs = self.requests * sum(min(p + 1, window) for p in range(P, P + n))
        return 4 * pairs * num_heads * head_dim


# The visit shape (8 posts x 160 tokens on a 1,792-token profile), a long suffix on a long prefix,
# and a fresh causal prompt: what the engine's batches look like.
SHAPE_CLASSES = (
    ShapeClass("visit 8x160 on 1792", 8, 160, 1792),
    ShapeClass("suffix 1296 on 1792", 1, 1296, 1792),
    ShapeClass("causal 2048", 1, 2048, 0),
)


@dataclass(frozen=True, slots=True)
class KernelTiming:
    """One kernel on one shape class: its best time, throughput, max error and whether it is within bounds."""

    kernel: str
    shape: str
    seconds: float
    gflops: float
    max_error: float
    ok: bool


@dataclass(frozen=True, slots=True)
class KernelShape:
    """The attention a kernel is chosen for: query heads, KV heads, head size, dtype, device."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str


def make_inputs(
    shape: ShapeClass, heads: KernelShape, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Seeded q [L, H, Dh], own k, v [L, Hkv, Dh] and a prefix [P, Hkv, Dh] (None when P = 0)."""
    num_heads, num_kv_heads, head_dim, dtype, device = (
        heads.num_heads,
        heads.num_kv_heads,
        heads.head_dim,
        heads.dtype,
        heads.device,
    )
    g = torch.Generator().manual_seed(seed)
    L = shape.requests * shape.new_tokens

    def rand(*size: int) -> Tensor:
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(L, num_heads, head_dim), rand(L, num_kv_heads, head_dim), rand(L, num_kv_heads, head_dim)
    if not shape.prefix_tokens:
        return q, k, v, None, None
    return q, k, v, rand(shape.prefix_tokens, num_kv_heads, head_dim), rand(shape.prefix_tokens, num_kv_heads, head_dim)


def scattered_pool(prefix_k: Tensor, prefix_v: Tensor, block_tokens: int) -> PagedPrefix:
    """A prefix [P, Hkv, Dh] in a pool laid out as the device tier's ([blocks, 2, layers, rows, Hkv,
    Dh], one layer's view), its blocks among as many other ones and no two at consecutive ids (a
    pool after much churn: each block a separate read)."""
    num_tokens, kv_heads, head_dim = prefix_k.shape
    n = -(-num_tokens // block_tokens)
    pool = torch.zeros(2 * n, 2, 1, block_tokens, kv_heads, head_dim, dtype=prefix_k.dtype, device=prefix_k.device)
    ids = torch.arange(2 * n - 2, -1, -2)  # descending even ids, on the CPU as the tiers keep them
    for side, rows in enumerate((prefix_k, prefix_v)):
        padded = torch.zeros(n * block_tokens, kv_heads, head_dim, dtype=rows.dtype, device=rows.device)
        padded[:num_tokens] = rows
        pool[ids.to(pool.device), side, 0] = padded.view(n, block_tokens, kv_heads, head_dim)
    return PagedPrefix(pool[:, 0, 0], pool[:, 1, 0], ids, num_tokens)


def gather(prefix: PagedPrefix) -> tuple[Tensor, Tensor]:
    """A paged prefix copied out of its pool into one tensor each for K and V, as the device tier's
    `layer_kv` does for the forward where a kernel cannot read the pool."""
    ids = prefix.block_ids
    k, v = (pool.index_select(0, ids.to(pool.device)).flatten(0, 1)[: prefix.num_tokens] for pool in prefix[:2])
    return k, v


def _attend(
    calls: tuple[AttendFn, PagedFn | None],
    layout: str,
    pool: PagedPrefix | None,
    inputs: tuple[Tensor, Tensor, list[Span], Tensor | None, Tensor | None],
    q: Tensor,
) -> None:
    """One timed call: the contiguous prefix, or the pool read in place or gathered first (`layout`)."""
    attend, paged = calls
    k, v, spans, pk, pv = inputs
    if pool is None:
        attend(q, k, v, spans, pk, pv)
    elif layout == "paged" and paged is not None:
        paged(q, k, v, spans, pool)
    else:
        attend(q, k, v, spans, *gather(pool))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_kernels(
    kernels: list[str],
    shapes: tuple[ShapeClass, ...],
    heads: KernelShape,
    repeats: int = 2,
    window: int | None = None,
    prefix_layout: str = "contiguous",
    block_tokens: int = BLOCK_TOKENS,
) -> list[KernelTiming]:
    """Each kernel on each shape: best-of-`repeats` seconds (after a warm-up) and the error. With
    `window`, each kernel's calls for that sliding window (`window_calls`, as the forward takes
    them) against the PyTorch windowed call in fp32. `prefix_layout` (PREFIX_LAYOUTS): how the
    prefix is read, from a `scattered_pool` of `block_tokens` a block unless contiguous."""
    if prefix_layout not in PREFIX_LAYOUTS:
        raise ValueError(f"prefix layout {prefix_layout!r} is not one of {', '.join(PREFIX_LAYOUTS)}")
    out = []
    device = heads.device
    for shape in shapes:
        q, k, v, pk, pv = make_inputs(shape, heads)
        spans = shape.spans()
        pool = None
        if prefix_layout != "contiguous" and pk is not None and pv is not None:
            pool = scattered_pool(pk, pv, block_tokens)
        expected = q.clone()
        if window is None:
            reference_(expected, k, v, spans, pk, pv)
            expected = expected.float()
        else:
            expected = expected.float()
            fp32 = (None if t is None else t.float() for t in (pk, pv))
            windowed(window)(expected, k.float(), v.float(), spans, *fp32)
        for name in kernels:
            kernel = KERNELS[name]
            calls = (kernel.attend_, kernel.attend_paged_) if window is None else window_calls(kernel, window)
            call = functools.partial(_attend, calls, prefix_layout, pool, (k, v, spans, pk, pv))
            got = q.clone()
            try:
                call(got)
            except (RuntimeError, ValueError, TypeError) as e:  # a library kernel that fails here is refused
                log.warning("attention kernel %s failed on %s: %s", name, shape.name, e)
                out.append(KernelTiming(name, shape.name, math.inf, 0.0, math.inf, False))
                continue
            error = (got.float() - expected).abs().max().item()
            best = math.inf
            for _ in range(repeats):
                work = q.clone()
                _sync(device)
                start = time.perf_counter()
                call(work)
                _sync(device)
                best = min(best, time.perf_counter() - start)
            ok = error <= TOLERANCE[heads.dtype]
            gflops = shape.flops(heads.num_heads, heads.head_dim, window) / best / 1e9
            out.append(KernelTiming(name, shape.name, best, gflops, error, ok))
    return out


def fastest(timings: list[KernelTiming]) -> str:
    """The kernel correct on every shape with the least time relative to the best on each shape
    (each shape class counts the same, whatever its size)."""
    shapes = {t.shape for t in timings}
    best = {s: min(t.seconds for t in timings if t.shape == s) for s in shapes}
    scores: dict[str, float] = {}
    failed = {t.kernel for t in timings if not t.ok}
    for t in timings:
        if t.kernel not in failed:
            scores[t.kernel] = scores.get(t.kernel, 0.0) + t.seconds / best[t.shape]
    if not scores:
        raise RuntimeError("no attention kernel is within its error bound on this machine")
    return min(scores, key=scores.__getitem__)


def available(device: str, dtype: torch.dtype | None = None, head_dim: int | None = None) -> list[str]:
    """The kernels that run on this device (and dtype, head size), their libraries loaded if needed."""
    return [name for name, kernel in KERNELS.items() if kernel.runs_on(device, dtype, head_dim)]


def choose_kernel(config: AttentionConfig, heads: KernelShape, max_tokens: int) -> str:
    """`attention.kernel` if it names a kernel (checked to run on the device), else the fastest
    measured on the engine's shapes up to `max_tokens` (cached in `attention.profile_cache_dir`)."""
    requested, cache_dir = config.kernel, config.profile_cache_dir
    num_heads, num_kv_heads, head_dim, dtype, device = (
        heads.num_heads,
        heads.num_kv_heads,
        heads.head_dim,
        heads.dtype,
        heads.device,
    )
    vllm_cpu.use_library(config.vllm_library)
    names = available(device, dtype, head_dim)
    if requested != "auto":
        if requested not in names:
            kernel = KERNELS.get(requested)
            reason = kernel.unavailable() if kernel is not None and kernel.unavailable is not None else None
            raise ConfigError(
                f"config key 'attention.kernel': '{requested}' does not run on {device} in {dtype} "
                f"with head dim {head_dim}{f' ({reason})' if reason else ''} (here: {', '.join(names)}, or auto)"
            )
        return requested
    shapes = tuple(
        ShapeClass(s.name, s.requests, min(s.new_tokens, max_tokens), min(s.prefix_tokens, max_tokens - s.new_tokens))
        for s in SHAPE_CLASSES
        if s.new_tokens <= max_tokens
    )
    parts = {
        "version": SELECT_VERSION,
        "kernels": names,
        "device": device,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "flags": sorted(cpu_flags()),
        "heads": [num_heads, num_kv_heads, head_dim],
        "shapes": [asdict(s) for s in shapes],
        "prefix": ["paged", BLOCK_TOKENS],
        "native_build": native_library.build_id() if "native" in names else None,
    }
    if device.startswith("cuda"):
        parts["gpu"] = torch.cuda.get_device_name(torch.device(device))
    key = cache_key(parts)
    cached = load_cached(cache_dir, "attention", key)
    if isinstance(cached, dict) and cached.get("kernel") in names:
        log.info("attention kernel: %s (measured before, cached)", cached["kernel"])
        return str(cached["kernel"])
    start = time.perf_counter()
    timings = time_kernels(names, shapes, heads, prefix_layout="paged")
    choice = fastest(timings)
    table = "; ".join(
        f"{t.kernel} {t.shape}: {t.gflops:.0f} GFLOP/s{'' if t.ok else f' (error {t.max_error:.2g}: refused)'}"
        for t in timings
    )
    log.info(
        "attention kernel: %s, the fastest of %d measured in %.1f s", choice, len(names), time.perf_counter() - start
    )
    log.debug("attention kernels measured: %s", table)
    save_cached(cache_dir, "attention", key, {"kernel": choice, "timings": [asdict(t) for t in timings]}, parts)
    return choice
