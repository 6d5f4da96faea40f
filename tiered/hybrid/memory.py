"""The memory peak of one forward, measured: cuda max allocated, or the cpu resident high-water mark.

On cpu the kernel's peak counter is reset (`/proc/self/clear_refs` with 5) just before the
forward and VmHWM read after it; the forward's peak is VmHWM minus the resident size before it.
Before the baseline a warm-up forward of whole chunks sets up what every later forward reuses
(the GEMM library's kernels), and glibc is asked to return the heap's free memory to the OS
(`malloc_trim`): what the warm-up freed is no longer resident, so the measured forward's own
allocations, and whatever of them the allocator keeps, count in its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tiered.allocator import block_cache
from tiered.config import ForwardMode
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.forward import BatchItem, LayerKV, forward_batch
from tiered.hybrid.model import CausalLM
from tiered.hybrid.spill import Spill

log = logging.getLogger(__name__)

# Entries kept by each of the GEMM library's caches of prepared kernels under a memory budget.
# There is one entry per matmul shape, and the row counts differ from forward to forward (a
# prompt's last chunk, a batch's rows), so at their defaults (1,024 entries each) the resident
# size grows with every new length served. One forward uses up to three row counts per
# projection shape (a whole chunk, the last chunk, the last rows): these entries hold them all,
# so none is evicted within a forward.
GEMM_CACHE_ENTRIES = 16
_GEMM_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, and ideep's over it


def bound_gemm_caches(entries: int = GEMM_CACHE_ENTRIES) -> None:
    """Bound oneDNN's primitive cache and ideep's cache over it to `entries` each, unless the
    environment sets them. They read their variables once, at this process's first matmul: call
    this before it (a process under engine.memory_budget_bytes, before its profile run)."""
    set_here = [name for name in _GEMM_CACHES if name not in os.environ]
    for name in set_here:
        os.environ[name] = str(entries)
    described = [f"{n}={os.environ[n]}{'' if n in set_here else ' (from the environment)'}" for n in _GEMM_CACHES]
    log.info("GEMM kernel caches: %s", ", ".join(described))


@dataclass(slots=True)
class ForwardPeak:
    """One measured forward: its tokens, peak memory (weights included), weights, seconds and how it was measured."""

    num_tokens: int
    peak_bytes: int  # weights + the forward's activations
    weights_bytes: int
    seconds: float
    method: str


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, looked up once (finding the C library may run `ldconfig`); None elsewhere."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def use_block_cache(model: CausalLM, chunk_tokens: int, cap: int | None) -> bool:
    """Under a memory budget, on the CPU: the block cache as this process's allocator (`cap` bytes
    cached, None: `block_cache.cap_bytes` for the model and `chunk_tokens`, 0: none). Whether it is."""
    if model.inv_freq.device.type != "cpu" or cap == 0:
        return False
    if cap is None:
        element_size = next(p.element_size() for p in model.parameters() if not p.is_meta)
        cap = block_cache.cap_bytes(model.args.intermediate_size, chunk_tokens, element_size)
    return block_cache.install(cap)


def _return_free_heap() -> None:
    """Unmap the block cache's cached blocks and ask glibc to give the free memory of its heaps back
    to the OS (nothing elsewhere)."""
    block_cache.release()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _reset_cpu_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def weights_bytes(model: CausalLM) -> int:
    """Bytes of the weights the model holds (a pipeline stage's parts on the meta device hold none)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


class GatheredPrefix(Sequence[LayerKV]):
    """A prefix that copies a layer's K,V out on each access, as the device tier's gather does."""

    def __init__(self, layers: list[LayerKV]) -> None:
        self._layers = layers
        self.num_tokens = layers[0][0].shape[0]

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, layer: int) -> LayerKV:  # type: ignore[override]
        k, v = self._layers[layer]
        return k.clone(), v.clone()


@dataclass(frozen=True, slots=True)
class PeakShape:
    """The forward whose peak is measured: `num_requests` requests of `num_tokens` new tokens
    each, on one shared prefix of `prefix_tokens` (held outside the forward, as the device tier
    holds it; a copy of each layer counts, as where the forward gathers and widens a prefix the
    pool keeps in a narrower dtype: the larger of the two cases). A pipeline stage's part of the model: a
    stage after the first (`first_stage=False`) starts from a residual stream [N, D] of random
    values, allocated inside the measured forward as the stage allocates the buffer it receives
    into; a stage before the last (`last_stage=False`) ends with its residual stream, not logits."""

    num_tokens: int
    num_requests: int = 1
    prefix_tokens: int = 0
    first_stage: bool = True
    last_stage: bool = True


def measure_forward_peak(
    model: CausalLM, shape: PeakShape, mode: ForwardMode, chunk_tokens: int, spill: Spill | None = None
) -> ForwardPeak:
    """Run one forward of `shape` on random tokens (its residual stream in `spill`'s directory when
    it asks for one that long) and return its memory peak."""
    num_tokens, num_requests, prefix_tokens = shape.num_tokens, shape.num_requests, shape.prefix_tokens
    first_stage, last_stage = shape.first_stage, shape.last_stage
    a = model.args
    g = torch.Generator().manual_seed(0)
    device = model.inv_freq.device
    dtype = compute_dtype(model)
    prefix = None
    if prefix_tokens:
        kv_shape = (prefix_tokens, a.num_kv_heads, a.head_dim)
        layers = [
            tuple(torch.randn(kv_shape, generator=g).to(device, dtype) for _ in "kv") for _ in range(a.num_layers)
        ]
        prefix = GatheredPrefix(layers)  # type: ignore[arg-type]
    items = [BatchItem(torch.randint(0, a.vocab_size, (num_tokens,), generator=g), prefix) for _ in range(num_requests)]
    # The warm-up runs whole chunks: a process's first forward of chunk-sized matmuls also sets up
    # what every later one reuses (the GEMM library's kernels and scratch), which is no activation.
    warm = [BatchItem(it.token_ids[: min(2 * chunk_tokens, num_tokens)], prefix) for it in items[:2]]

    def run(items: list[BatchItem]) -> None:
        hidden = None
        if not first_stage:
            num_rows = sum(it.token_ids.numel() for it in items)
            hidden = torch.randn((num_rows, a.hidden_size), generator=g).to(device, dtype)
        forward_batch(
            model, items, mode=mode, chunk_tokens=chunk_tokens, hidden=hidden, last_stage=last_stage, spill=spill
        )

    run(warm)  # warm-up
    weights = weights_bytes(model)
    total = num_requests * num_tokens
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        run(items)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        return ForwardPeak(total, torch.cuda.max_memory_allocated(device), weights, seconds, "cuda max allocated")
    _return_free_heap()
    baseline = _status_bytes("VmRSS")
    method = "VmHWM after clear_refs" if _reset_cpu_peak() else "VmHWM (not resettable: an upper bound)"
    start = time.perf_counter()
    run(items)
    seconds = time.perf_counter() - start
    return ForwardPeak(total, max(0, _status_bytes("VmHWM") - baseline) + weights, weights, seconds, method)


@dataclass(frozen=True, slots=True)
class ProfiledPeak:
    """The forward peak a start-up split counts: the largest over `peaks` (tokens -> bytes, weights
    included), each measured or, for the lengths in `extended`, read off a line through two measured
    ones."""

    peaks: dict[int, int]
    weights_bytes: int
    extended: dict[int, tuple[int, int]]  # a length -> the two measured lengths its peak extends

    @property
    def worst(self) -> int:
        """The length with the largest peak (the longest of equal ones)."""
        return max(self.peaks, key=lambda n: (self.peaks[n], n))

    @property
    def peak_bytes(self) -> int:
        """The largest peak, bytes (weights included)."""
        return self.peaks[self.worst]

    def describe(self, spill: Spill | None = None) -> str:
        """Each length's peak in MiB, saying which spilled and which were extended."""
        parts = []
        for n in sorted(self.peaks):
            how = " (spilled)" if spill is not None and n >= spill.min_tokens else ""
            if n in self.extended:
                lo, hi = self.extended[n]
                how += f" (extended from {lo} and {hi})"
            parts.append(f"{n} tokens{how} peak {self.peaks[n] / 2**20:.1f} MiB")
        return ", ".join(parts)


def profile_lengths(max_tokens: int, mode: ForwardMode, spill: Spill | None, cap: int) -> list[int]:
    """The lengths a start-up profile of `max_tokens` measures; where `max_tokens` is not among
    them, its peak is extended from the first two. A hybrid forward's peak is affine in its length
    within one regime (the chunk's scratch is fixed; the residual stream, unless it spills, and one
    layer's K,V grow per token), so past `cap` tokens two lengths of max_tokens' regime (both
    spilled when it spills) give it. With a spill the longest forward that keeps its stream in
    memory is measured too: it can peak above longer ones that spill."""
    lengths = [max_tokens]
    if mode == "hybrid" and 0 < cap < max_tokens:
        lo = cap // 2
        if spill is not None and max_tokens >= spill.min_tokens:
            lo = max(lo, spill.min_tokens)
        hi = max(cap, lo + cap // 2)
        if hi < max_tokens:
            lengths = [lo, hi]
    if spill is not None and 1 < spill.min_tokens <= max_tokens and spill.min_tokens - 1 not in lengths:
        lengths.append(spill.min_tokens - 1)
    return lengths


# The extension's slope is the measured one raised by this share: the resident peak's growth per
# token, measured between shorter lengths, can run a few percent under its growth further on.
EXTENSION_MARGIN = 0.05


def compute_dtype(model: CausalLM) -> torch.dtype:
    """The dtype the model's loaded weights compute in (a pipeline stage's other layers stay on the meta device)."""
    return next(p.dtype for p in model.parameters() if not p.is_meta)


def growth_floor(args: ModelArgs, dtype: torch.dtype) -> float:
    """The least a hybrid forward's peak grows by per token, bytes: one layer's K and V in `dtype`, alive
    whole while the layer runs. Two short lengths' readings can differ by less than their noise; the
    line's slope is never taken under this."""
    return float(args.kv_elems_per_token_per_layer * dtype.itemsize)


def extend_line(lo: int, peak_lo: int, hi: int, peak_hi: int, num_tokens: int, floor: float) -> int:
    """The peak at `num_tokens` > hi on the line through (lo, peak_lo) and (hi, peak_hi), its slope at
    least `floor` (growth_floor) and raised by EXTENSION_MARGIN (never below the peak at hi)."""
    return int(peak_hi + _extension_slope(lo, peak_lo, hi, peak_hi, floor) * (num_tokens - hi))


def extended_reach(lo: int, peak_lo: int, hi: int, peak_hi: int, limit: int, floor: float) -> int:
    """The longest length whose peak `extend_line` puts under `limit` bytes (hi when none past it
    is; no bound when the line does not rise, which only a `floor` of 0 allows: the largest int)."""
    slope = _extension_slope(lo, peak_lo, hi, peak_hi, floor)
    if slope <= 0:
        return sys.maxsize
    n = hi + max(0, int((limit - 1 - peak_hi) // slope))
    while n > hi and extend_line(lo, peak_lo, hi, peak_hi, n, floor) >= limit:  # the float division's rounding
        n -= 1
    return n


def _extension_slope(lo: int, peak_lo: int, hi: int, peak_hi: int, floor: float) -> float:
    return max(floor, (peak_hi - peak_lo) / (hi - lo)) * (1 + EXTENSION_MARGIN)


def profile_peak(
    model: CausalLM,
    max_tokens: int,
    mode: ForwardMode,
    chunk_tokens: int,
    spill: Spill | None = None,
    cap: int = 0,
    shape: Callable[[int], PeakShape] = PeakShape,
) -> ProfiledPeak:
    """The peak of a forward of `max_tokens` (`shape(n)`: the measured forward of n tokens), from the
    forwards `profile_lengths` names, in this process; `cap` 0 measures `max_tokens` itself."""
    lengths = profile_lengths(max_tokens, mode, spill, cap)
    measured = {n: measure_forward_peak(model, shape(n), mode, chunk_tokens, spill) for n in lengths}
    peaks = {n: p.peak_bytes for n, p in measured.items()}
    extended: dict[int, tuple[int, int]] = {}
    if max_tokens not in peaks:
        lo, hi = lengths[0], lengths[1]
        floor = growth_floor(model.args, compute_dtype(model))
        peaks[max_tokens] = extend_line(lo, peaks[lo], hi, peaks[hi], max_tokens, floor)
        extended[max_tokens] = (lo, hi)
    weights = next(iter(measured.values())).weights_bytes
    return ProfiledPeak(peaks, weights, extended)
