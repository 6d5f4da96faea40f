"""What every attention kernel is: the spans it attends over, its call, and where it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class Span(NamedTuple):
    """Queries q[q_start : q_start + num] of one request: their own keys are k[k_start : k_start + num]
    (causal: the i-th sees the first i + 1), and every key row range in `visible` (the request's
    earlier tokens, tokens another request computed for it) is seen by all of them."""

    q_start: int
    k_start: int
    num: int
    visible: tuple[tuple[int, int], ...] = ()


AttendFn = Callable[[Tensor, Tensor, Tensor, list[Span], Tensor | None, Tensor | None], None]
"""(q [L, H, Dh], k [*, Hkv, Dh], v, spans, prefix_k [P, Hkv, Dh] | None, prefix_v) -> None; writes q."""


class PagedPrefix(NamedTuple):
    """A shared prefix read in place through a block table: its token t is row t % block_tokens of
    block block_ids[t // block_tokens] of pool_k / pool_v [num_blocks, block_tokens, Hkv, Dh] (any
    strides but a unit one in the last dim: a layer's view of the device tier's pool)."""

    pool_k: Tensor
    pool_v: Tensor
    block_ids: Tensor
    num_tokens: int


PagedFn = Callable[[Tensor, Tensor, Tensor, list[Span], PagedPrefix | None], object]
"""(q, k, v, spans, the prefix by block id or None) -> anything; writes q as `AttendFn` does."""


def contiguous_prefix(prefix_k: Tensor | None, prefix_v: Tensor | None) -> PagedPrefix | None:
    """A contiguous prefix [P, Hkv, Dh] as a pool of one block of P tokens (None: no prefix). The
    block ids stay on the CPU, as the tiers' are: reading them never waits for a device."""
    if prefix_k is None or prefix_v is None or prefix_k.shape[0] == 0:
        return None
    return PagedPrefix(prefix_k[None], prefix_v[None], torch.zeros(1, dtype=torch.int64), prefix_k.shape[0])


def attend_from_paged(paged_: PagedFn) -> AttendFn:
    """The AttendFn of a paged call: a contiguous prefix is handed over as one block."""

    def attend_(
        q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix_k: Tensor | None, prefix_v: Tensor | None
    ) -> None:
        paged_(q, k, v, spans, contiguous_prefix(prefix_k, prefix_v))

    return attend_


def prefix_runs(prefix: PagedPrefix | None) -> list[tuple[Tensor, Tensor]]:
    """A paged prefix as views of its pool, no copy: one (K, V) pair [blocks, rows, Hkv, Dh] per run
    of consecutive block ids, in order, the last block cut at `num_tokens` (a run of its own then)."""
    if prefix is None or prefix.num_tokens == 0:
        return []
    pool_k, pool_v, block_ids, num_tokens = prefix
    full, tail = divmod(num_tokens, pool_k.shape[1])
    ids = block_ids.tolist()
    if len(ids) < full + (1 if tail else 0):
        raise ValueError(f"{len(ids)} block ids cannot hold {num_tokens} tokens of {pool_k.shape[1]} a block")
    runs: list[tuple[Tensor, Tensor]] = []
    start = 0
    for i in range(1, full + 1):
        if i == full or ids[i] != ids[i - 1] + 1:
            a, b = ids[start], ids[i - 1] + 1
            runs.append((pool_k[a:b], pool_v[a:b]))
            start = i
    if tail:
        last = ids[full]
        runs.append((pool_k[last : last + 1, :tail], pool_v[last : last + 1, :tail]))
    return runs


def prefix_segments(prefix: PagedPrefix | None) -> list[tuple[Tensor, Tensor]]:
    """A paged prefix as (K, V) views [rows, Hkv, Dh] of its pool laid end to end, one per block (no copy)."""
    return [(k[i], v[i]) for k, v in prefix_runs(prefix) for i in range(k.shape[0])]


@dataclass(frozen=True, slots=True)
class Kernel:
    """A named attention kernel: its call, and the devices, dtypes and head sizes it runs on."""

    name: str
    attend_: AttendFn
    devices: tuple[str, ...]  # device types it runs on
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    head_dims: tuple[int, ...] | None = None  # None: any
    # A kernel that needs a library this process may lack: why it cannot run (None: it can).
    unavailable: Callable[[], str | None] | None = None
    # Its call that reads a cached prefix in place from the device tier's pool (None: the forward
    # gathers the prefix's rows for `attend_`).
    attend_paged_: PagedFn | None = None
    # Its calls (attend_, and paged or None) for a sliding window of the given size (None: the forward
    # uses the PyTorch windowed call).
    windowed: Callable[[int], tuple[AttendFn, PagedFn | None]] | None = None

    def runs_on(self, device: str, dtype: torch.dtype | None = None, head_dim: int | None = None) -> bool:
        """Whether this kernel can run here (and its library, if it needs one, loads)."""
        return (
            torch.device(device).type in self.devices
            and (dtype is None or dtype in self.dtypes)
            and (head_dim is None or self.head_dims is None or head_dim in self.head_dims)
            and (self.unavailable is None or self.unavailable() is None)
        )
