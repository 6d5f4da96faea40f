"""A request prepared to compute (`Prepared`: its pinned prefix, the host-tier chunks to load into
it, the blocks it will fill, what it stores) and the chunks on their way to the host tier
(`StoreBatch`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tiered.request.tokens import HitSplit, TierRequest


@dataclass(slots=True)
class StoreBatch:
    """Chunks on their way to the host tier: `views[i]` ([2, layers, block_tokens, kv_heads,
    head_dim], an LMCache memory object) holds the chunk whose block key is `keys[i]`."""

    keys: list[int]
    views: list[Tensor]
    objs: list[Any]  # LMCache MemoryObj, in the order of keys
    ready: torch.cuda.Event | None = None  # cuda: recorded after the last device-to-host copy
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False  # set when `done`: LMCache took the chunks
    remove: bool = False  # not a store: take `keys` out of LMCache (`HostTier.remove`), in queue order

    def write_layer(self, layer: int, k: Tensor, v: Tensor, rows: Sequence[int], non_blocking: bool = False) -> None:
        """Copy `layer`'s K,V of chunk i from rows rows[i] to rows[i] + block_tokens of a forward's k, v."""
        bt = self.views[0].shape[2] if self.views else 0
        dst = [view[0, layer] for view in self.views] + [view[1, layer] for view in self.views]
        torch._foreach_copy_(
            dst, [k[r : r + bt] for r in rows] + [v[r : r + bt] for r in rows], non_blocking=non_blocking
        )


@dataclass(slots=True)
class HostLoad:
    """Host-tier chunks for device blocks, as the scheduler side planned them: looked up (each
    chunk referenced in the host tier by its `get`), the blocks allocated, pinned and indexed.
    `objs[i]`, the chunk of `keys[i]`, goes into device block `block_ids[i]`; the last `num_remote`
    came from a remote store, the `num_disk` before them from the local disk. The worker side runs
    it (`KVWorker.load`) before any forward reads the blocks: `filled` is then how many leading
    blocks hold their chunk (None: not run yet). `done` is set once it ran or was given up."""

    keys: list[int]
    objs: list[Any]
    block_ids: list[int]
    num_remote: int = 0
    num_disk: int = 0
    filled: int | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def failed(self) -> bool:
        """It ran and a chunk could not be read: the blocks from `filled` on hold nothing."""
        return self.filled is not None and self.filled < len(self.block_ids)


@dataclass(slots=True)
class Prepared:
    """A request ready to compute: its prefix (pinned blocks) and its plan for the computed part."""

    request: TierRequest
    split: HitSplit
    prefix_blocks: list[int]
    retained_blocks: list[int]  # device blocks for computed blocks first_retained_block.. (in order)
    store: StoreBatch | None  # LMCache memory the sink fills, for the blocks in `stored_blocks`
    prefetch_wait_seconds: float
    load_seconds: float  # host hits: looking them up (scheduler side), then loading them (`KVWorker.load`)
    first_retained_block: int = 0  # block index of retained_blocks[0]
    stored_blocks: list[int] = field(default_factory=list)  # block indices of store.keys
    store_allocate_seconds: float = 0.0  # LMCache memory for the stored chunks
    store_copy_seconds: float = 0.0  # the sink's copies into it
    committed: bool = False  # retained blocks indexed before the forward ended (`KVTiers.commit`)
    loads: list[HostLoad] = field(default_factory=list)  # host hits of `prefix_blocks`, to load first

    @property
    def store_seconds(self) -> float:
        """What storing cost this request's forward thread."""
        return self.store_allocate_seconds + self.store_copy_seconds

    @property
    def num_prefix_tokens(self) -> int:
        """Cached tokens the forward reads as the prefix (every hit token)."""
        return self.split.num_hit_tokens
