"""What the tiers say about one request: its block keys, its hit split, its prepared plan, the
chunks it hands the host tier, its prefix as the forward reads it; and the bounded set of keys
the host tier is believed to hold."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tiered.hybrid.forward import LayerKV
from tiered.offload.device_tier import DeviceTier, block_keys


@dataclass(frozen=True, slots=True)
class HitSplit:
    """Where a request's tokens come from: the prefix (device hits, host hits, disk hits and remote
    hits, in runs that may alternate), then the misses. Host hits: chunks in the host tier's memory;
    disk hits: chunks its local disk backend held and its memory did not
    (`cache.host.lmcache.local_disk`); remote hits: chunks found in a shared remote store
    (`cache.host.lmcache.remote_url`) that this engine's own host tier did not hold."""

    num_device_hit_tokens: int
    num_host_hit_tokens: int
    num_miss_tokens: int
    num_remote_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0

    @property
    def num_hit_tokens(self) -> int:
        """Prefix tokens found cached in any tier (device, host, disk or remote)."""
        return self.num_device_hit_tokens + self.num_loaded_tokens

    @property
    def num_loaded_tokens(self) -> int:
        """Prefix tokens a load brings onto the device: from the host tier's memory, its disk or a remote store."""
        return self.num_host_hit_tokens + self.num_disk_hit_tokens + self.num_remote_hit_tokens

    @property
    def num_tokens(self) -> int:
        """All of the request's tokens: hits plus misses."""
        return self.num_hit_tokens + self.num_miss_tokens


def common_prefix_len(a: Tensor, b: Tensor, limit: int) -> int:
    """Leading tokens a and b have in common, at most `limit`."""
    n = min(limit, a.numel(), b.numel())
    if n <= 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


@dataclass(slots=True)
class TierRequest:
    """What the tiers need of a request: its tokens and their block keys, computed once."""

    request_id: str
    token_ids: Tensor  # [T] int64, on the CPU
    keys: list[int] = field(default_factory=list)
    salt: str | None = None  # vLLM's cache_salt: shares cached KV only with the same salt
    adapter: str | None = None  # a LoRA adapter's identity: shares cached KV only with the same adapter

    @classmethod
    def make(
        cls,
        request_id: str,
        token_ids: Sequence[int] | Tensor,
        block_tokens: int,
        salt: str | None = None,
        adapter: str | None = None,
    ) -> TierRequest:
        """Build a request from its token ids, computing its block keys (salted by `salt` and `adapter`) once."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        return cls(request_id, ids, block_keys(ids.tolist(), block_tokens, salt, adapter), salt, adapter)


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
class Prepared:
    """A request ready to compute: its prefix (pinned blocks) and its plan for the computed part."""

    request: TierRequest
    split: HitSplit
    prefix_blocks: list[int]
    retained_blocks: list[int]  # device blocks for computed blocks first_retained_block.. (in order)
    store: StoreBatch | None  # LMCache memory the sink fills, for the blocks in `stored_blocks`
    prefetch_wait_seconds: float
    load_seconds: float
    first_retained_block: int = 0  # block index of retained_blocks[0]
    stored_blocks: list[int] = field(default_factory=list)  # block indices of store.keys
    store_allocate_seconds: float = 0.0  # LMCache memory for the stored chunks
    store_copy_seconds: float = 0.0  # the sink's copies into it
    committed: bool = False  # retained blocks indexed before the forward ended (`KVTiers.commit`)

    @property
    def store_seconds(self) -> float:
        """What storing cost this request's forward thread."""
        return self.store_allocate_seconds + self.store_copy_seconds

    @property
    def num_prefix_tokens(self) -> int:
        """Cached tokens the forward reads as the prefix (every hit token)."""
        return self.split.num_hit_tokens


class PrefixKV(Sequence[LayerKV]):
    """The prefix as the forward wants it, gathered from the pool one layer at a time."""

    def __init__(self, tier: DeviceTier, block_ids: list[int], num_layers: int) -> None:
        self._tier, self._blocks, self._num_layers = tier, block_ids, num_layers

    def __len__(self) -> int:
        return self._num_layers

    @property
    def num_tokens(self) -> int:
        """Tokens the prefix holds: its blocks times the tier's block size."""
        return len(self._blocks) * self._tier.block_tokens

    def __getitem__(self, layer: int) -> LayerKV:  # type: ignore[override]
        return self._tier.layer_kv(layer, self._blocks)
