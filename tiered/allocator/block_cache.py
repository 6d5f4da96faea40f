"""The block cache (tiered/native/csrc/blocks.cpp): under a memory budget, the CPU allocator for tensors of
64 KiB or more, so that a forward's peak measured at start-up holds later and its chunk loop does
not fault its pages in afresh on every chunk.

Each such tensor gets its own mapping; a freed one is kept by its exact size, up to a cap, and
taken back by the next allocation of that size. Every forward starts with the cache emptied
(`release`), so its peak is its own allocations' plus at most the cap, whatever ran before. Where
the native library is not available the process keeps the C library's allocator (the budget's
measurement then depends on glibc's mmap threshold, see the README).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tiered.native.library import library, unavailable

log = logging.getLogger(__name__)

# Tensors smaller than this stay with the allocator the cache replaces (glibc's heap serves them well).
MIN_BYTES = 1 << 16
# The cap, in [chunk, intermediate_size] tensors of the compute dtype: between two uses of a size,
# a hybrid forward's chunk loop frees about this many of those tensors' bytes in blocks it takes
# back later (projections, the MLP's halves, the GEMM library's scratch).
CHUNK_TENSORS = 4

_ops: Any = None  # the native library's ops, once the cache is installed


@dataclass(frozen=True, slots=True)
class BlockStats:
    """What the cache holds and has done since it was installed."""

    cached_bytes: int
    live_bytes: int  # in tensors it allocated that are still alive
    hits: int  # allocations served from a cached block
    misses: int  # allocations that mapped a new block
    cap_bytes: int


def cap_bytes(intermediate_size: int, chunk_tokens: int, element_size: int) -> int:
    """The default cap for hybrid forwards of `chunk_tokens`-token chunks of a model whose MLP is
    `intermediate_size` wide."""
    return CHUNK_TENSORS * chunk_tokens * intermediate_size * element_size


def install(cap: int) -> bool:
    """Make the block cache this process's CPU allocator with `cap` bytes of cached blocks (again: set
    the cap). False, with the reason logged, where the native library is unavailable or the
    allocator in place cannot be replaced."""
    global _ops
    ops = library()
    if ops is None:
        log.warning("block cache unavailable (%s): tensors come from the C library's allocator", unavailable())
        return False
    if not ops.block_cache_install(MIN_BYTES, cap):
        log.warning("block cache not installed: another CPU allocator is in place")
        return False
    _ops = ops
    log.info("block cache: tensors of %d KiB or more mapped per block, %.1f MiB cached", MIN_BYTES >> 10, cap / 2**20)
    return True


def release() -> None:
    """Unmap every cached block (nothing when the cache is not installed)."""
    if _ops is not None:
        _ops.block_cache_release()


def stats() -> BlockStats | None:
    """The cache's counters; None when it is not installed."""
    return None if _ops is None else BlockStats(*_ops.block_cache_stats())
