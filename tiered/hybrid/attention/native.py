"""`native`: every span's attention in one C++ call (csrc/attend.cpp), the prefix read in place
through a block table.

Design notes: docs/internals.md, section `tiered/hybrid/attention/native.py`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from tiered.hybrid.attention.interface import AttendFn, PagedFn, PagedPrefix, contiguous_prefix
from tiered.native import library as native_library
from tiered.native.library import library


class Span(Protocol):
    """What this module reads of kernels.Span (kernels.py imports this module to register it)."""

    @property
    def q_start(self) -> int:
        """First query row of the span."""

    @property
    def k_start(self) -> int:
        """First key row of the span's own (causal) keys."""

    @property
    def num(self) -> int:
        """Queries in the span (as many as its own keys)."""

    @property
    def visible(self) -> tuple[tuple[int, int], ...]:
        """Key row ranges every query of the span sees."""


log = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")
DTYPES = (torch.float32, torch.bfloat16)


def _encode(spans: Sequence[Span]) -> tuple[Tensor, Tensor]:
    """Spans as int64 [n, 5] (q_start, k_start, num, first and end index of its visible ranges)
    and the visible ranges as int64 [m, 2]."""
    rows: list[tuple[int, ...]] = []
    ranges: list[tuple[int, int]] = []
    for p in spans:
        rows.append((p.q_start, p.k_start, p.num, len(ranges), len(ranges) + len(p.visible)))
        ranges += p.visible
    return (
        torch.tensor(rows, dtype=torch.int64).reshape(-1, 5),
        torch.tensor(ranges, dtype=torch.int64).reshape(-1, 2),
    )


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in `dtype` with unit stride in its last dim (the only layout the library reads)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def attend_paged_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: Sequence[Span],
    prefix: PagedPrefix | None,
    isa: str = "auto",
    window: int | None = None,
) -> str:
    """`attend_` with the shared prefix (None: none) read through its block table. q [L, H, Dh]
    fp32 or bf16 is overwritten; k, v and the pools are used in q's dtype. With `window` (a
    sliding window, HF's rule) a query at position p sees only keys at positions above p - window,
    positions counted from the prefix's first token through the visible ranges to the own keys.
    Returns the ISA path that ran (`isa`: auto or one of ISAS; a path this CPU cannot run is an error)."""
    pool_k, pool_v, block_ids, prefix_tokens = prefix if prefix is not None else (None, None, None, 0)
    ops = library()
    if ops is None:
        raise RuntimeError("the native attention kernel is not available here (see the log for why)")
    if q.dtype not in DTYPES:
        raise ValueError(f"native attention computes in float32 or bfloat16, not {q.dtype}")
    encoded, ranges = _encode(spans)
    has_prefix = pool_k is not None and pool_v is not None and block_ids is not None and prefix_tokens > 0
    pk = _rows(pool_k, q.dtype) if has_prefix and pool_k is not None else None
    pv = _rows(pool_v, q.dtype) if has_prefix and pool_v is not None else None
    ids = block_ids.to(torch.int64).contiguous() if has_prefix and block_ids is not None else None
    if q.stride(-1) != 1:
        raise ValueError("native attention writes q in place: its last dim must have unit stride")
    return str(
        ops.attend_(
            q,
            _rows(k, q.dtype),
            _rows(v, q.dtype),
            encoded,
            ranges,
            pk,
            pv,
            ids,
            prefix_tokens if has_prefix else 0,
            window or 0,
            isa,
        )
    )


def attend_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: Sequence[Span],
    prefix_k: Tensor | None,
    prefix_v: Tensor | None,
    window: int | None = None,
) -> None:
    """The AttendFn: a contiguous prefix [P, Hkv, Dh] is the pool of one block of P tokens
    (`window`: as in `attend_paged_`)."""
    attend_paged_(q, k, v, spans, contiguous_prefix(prefix_k, prefix_v), window=window)


@functools.cache
def windowed(window: int) -> tuple[AttendFn, PagedFn]:
    """The AttendFn and the paged call of a sliding window of `window` keys (one pair per size)."""
    return functools.partial(attend_, window=window), functools.partial(attend_paged_, window=window)


def build_id() -> str:
    """The native library's build (a hash of its sources, torch and compiler): what a cost measured
    through this kernel belongs to."""
    return native_library.build_id()
