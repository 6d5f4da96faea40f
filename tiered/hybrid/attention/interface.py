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


PagedFn = Callable[[Tensor, Tensor, Tensor, list[Span], PagedPrefix], object]
"""(q, k, v, spans, the prefix by block id) -> anything; writes q as `AttendFn` does."""


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
