"""`native`: every piece's attention in one C++ call (csrc/attend.cpp), the prefix read in place
through a block table.

The library is built on first use (or by `make venv`) and cached (`build.py`); when it cannot be
built or loaded, `available()` is False with the reason logged once, and the kernel is simply not
among those that run here: the PyTorch kernels remain. Nothing is built or loaded at import.

Inside the call: one task per (piece, KV head, block of query positions) whose rows are the
positions x the GQA group's query heads, so each K/V tile is read and widened to fp32 once for
the group; per key tile a small GEMM for the scores against K packed transposed, an online
softmax in fp32 (base 2), and the P V product into fp32 accumulators; output in q's dtype.
ISA paths: `scalar` (portable), `avx2` (AVX2 + FMA), `avx512` (AVX-512F), `avx512bf16`
(`_mm512_dpbf16_ps` for bf16 scores), picked at run time from the CPU's flags (`auto`) or
forced with `isa=`. Each path is tested against the fp32 reference where the CPU has its ISA
(tests/hybrid/test_attention.py), and the start-up choice (select.py) checks every kernel
against the reference on the machine itself and refuses a wrong one, so a path never computes
the engine's answers unchecked.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor


class Piece(Protocol):
    """What this module reads of kernels.Piece (kernels.py imports this module to register it)."""

    @property
    def q_start(self) -> int: ...
    @property
    def k_start(self) -> int: ...
    @property
    def num(self) -> int: ...
    @property
    def visible(self) -> tuple[tuple[int, int], ...]: ...


log = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")
DTYPES = (torch.float32, torch.bfloat16)


_WHY_NOT: list[str] = []  # why the library is unavailable, once _ops() has tried


@functools.cache
def _ops() -> Any | None:
    """The library's op namespace, built and loaded on first call; None (reason logged) if impossible."""
    from tiered.hybrid.attention.build import BuildError, build  # here: `python -m ...build` imports this package

    try:
        path = build()
        torch.ops.load_library(str(path))
        ops = torch.ops.tiered_native
        log.info("native attention kernel loaded (paths this CPU runs: %s)", ops.isas())
        return ops
    except BuildError as e:
        _WHY_NOT.append(str(e))
    except (OSError, RuntimeError) as e:
        _WHY_NOT.append(f"its library did not load: {e}")
    log.warning("native attention kernel unavailable: %s", _WHY_NOT[-1])
    return None


def available() -> bool:
    return _ops() is not None


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None: it can)."""
    return None if _ops() is not None else _WHY_NOT[-1]


def cpu_isas() -> list[str]:
    """The ISA paths this CPU runs, best first ([] when the library is unavailable)."""
    ops = _ops()
    return str(ops.isas()).split(",") if ops is not None else []


def _encode(pieces: Sequence[Piece]) -> tuple[Tensor, Tensor]:
    """Pieces as int64 [n, 5] (q_start, k_start, num, first and end index of its visible ranges)
    and the visible ranges as int64 [m, 2]."""
    rows: list[tuple[int, ...]] = []
    ranges: list[tuple[int, int]] = []
    for p in pieces:
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
    pieces: Sequence[Piece],
    pool_k: Tensor | None,
    pool_v: Tensor | None,
    block_ids: Tensor | None,
    prefix_tokens: int,
    isa: str = "auto",
) -> str:
    """`attend_` with the shared prefix read through a block table: its token t is row
    t % block_tokens of block block_ids[t // block_tokens] of pool_k / pool_v
    [num_blocks, block_tokens, Hkv, Dh]. q [L, H, Dh] fp32 or bf16 is overwritten; k, v and the
    pools are used in q's dtype. Returns the ISA path that ran (`isa`: auto or one of ISAS; a
    path this CPU cannot run is an error)."""
    ops = _ops()
    if ops is None:
        raise RuntimeError("the native attention kernel is not available here (see the log for why)")
    if q.dtype not in DTYPES:
        raise ValueError(f"native attention computes in float32 or bfloat16, not {q.dtype}")
    encoded, ranges = _encode(pieces)
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
            isa,
        )
    )


def attend_(
    q: Tensor, k: Tensor, v: Tensor, pieces: Sequence[Piece], prefix_k: Tensor | None, prefix_v: Tensor | None
) -> None:
    """The AttendFn: a contiguous prefix [P, Hkv, Dh] is the pool of one block of P tokens."""
    if prefix_k is None or prefix_v is None or prefix_k.shape[0] == 0:
        attend_paged_(q, k, v, pieces, None, None, None, 0)
        return
    ids = torch.zeros(1, dtype=torch.int64)
    attend_paged_(q, k, v, pieces, prefix_k[None], prefix_v[None], ids, prefix_k.shape[0])
