"""The device tier: a preallocated pool of KV blocks on the device, indexed by chained hashes.

A block holds K and V of `block_tokens` consecutive tokens for every layer. Its key is
hash(parent key, its token ids), so equal keys mean equal prefixes up to hash collisions; a hit
also compares the stored token ids to rule those out. Blocks in use by a request are pinned
(reference-counted); unpinned cached blocks are evicted least recently used first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered.hybrid.args import ModelArgs
from tiered.hybrid.attention.interface import PagedPrefix


@dataclass(slots=True)
class _Block:
    key: int
    token_ids: tuple[int, ...]
    ref_count: int = 0


@dataclass(slots=True)
class DeviceTierStats:
    """A snapshot of the pool's occupancy and its hit, query and eviction counters."""

    num_blocks: int
    num_used_blocks: int
    num_pinned_blocks: int
    num_hit_tokens: int
    num_queried_tokens: int
    num_evictions: int


class DeviceTier:
    """Pool of `num_blocks` KV blocks, `kv` [num_blocks, 2, layers, block_tokens, kv_heads, head_dim].

    Block-major: a block is one contiguous [2, layers, block_tokens, ...] region, the layout of an
    LMCache chunk (KV_2LTD), so moving a block to or from the host tier is one contiguous copy; a
    layer's K of a block ([block_tokens, kv_heads, head_dim]) is contiguous too, so gathering a
    prefix layer by layer copies whole rows. Thread-safe: the engine loop and the prefetch
    thread both allocate and pin.
    """

    def __init__(
        self,
        args: ModelArgs,
        block_tokens: int,
        budget_bytes: int,
        dtype: torch.dtype,
        device: str | torch.device,
        *,
        num_blocks: int | None = None,
        hold_kv: bool = True,
    ) -> None:
        """`num_blocks`: the pool's size (default: what `budget_bytes` holds). `hold_kv=False`: the
        index alone, with a pool of no layers: a pipeline's coordinator decides, and each stage
        process keeps its layers' KV in a pool of the same block ids (tiered/pipeline)."""
        self.block_tokens = block_tokens
        self.bytes_per_block = block_tokens * args.kv_bytes_per_token(dtype)
        self.num_blocks = budget_bytes // self.bytes_per_block if num_blocks is None else num_blocks
        layers = args.num_layers if hold_kv else 0
        shape = (self.num_blocks, 2, layers, block_tokens, args.num_kv_heads, args.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._lock = threading.RLock()
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._blocks: dict[int, _Block] = {}  # block id -> cached block
        self._index: dict[int, int] = {}  # key -> block id
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached block ids, oldest first
        self._pins: dict[int, int] = {}  # block id -> pins of an allocated, not yet cached block
        # Called with (block id, key, token ids) when a cached block is evicted.
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None
        # Called with a key whenever it enters or leaves the index (the scheduler re-scores).
        self.on_change: Callable[[int], None] | None = None
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0
        self.num_evictions = 0

    # ---- lookups ---------------------------------------------------------------------------

    def match(
        self, keys: Sequence[int], token_ids: Sequence[int], count: bool = True, start: int = 0, pin: bool = False
    ) -> list[int]:
        """Block ids of the longest cached run of blocks `start`, `start + 1`, ..., ending at most
        (len(token_ids) - 1) tokens into the request; pinned (under the same lock) if `pin`.

        The cap keeps the last token computed: its logits are the request's whole output.
        O(blocks) dictionary lookups plus a token comparison per hit (rules out collisions).
        """
        max_blocks = min(len(keys), (len(token_ids) - 1) // self.block_tokens)
        hits: list[int] = []
        with self._lock:
            for i in range(start, max_blocks):
                block_id = self._index.get(keys[i])
                if block_id is None:
                    break
                first = i * self.block_tokens
                if self._blocks[block_id].token_ids != tuple(token_ids[first : first + self.block_tokens]):
                    break
                hits.append(block_id)
            if pin:
                self.pin(hits)
            if count:
                self.num_hit_tokens += len(hits) * self.block_tokens
                self.num_queried_tokens += len(token_ids)
        return hits

    def count_cached(self, keys: Sequence[int], max_blocks: int, start: int = 0) -> int:
        """Keys from `start` on that are cached, by hash alone: the scheduler's cheap estimate of `match`."""
        index = self._index
        n = start
        while n < max_blocks and keys[n] in index:
            n += 1
        return n - start

    # ---- pinning and allocation ------------------------------------------------------------

    def pin(self, block_ids: Sequence[int]) -> None:
        """Add one pin to each block: a cached one is not evictable until its last pin goes."""
        with self._lock:
            for b in block_ids:
                if b in self._blocks:
                    self._blocks[b].ref_count += 1
                    self._lru.pop(b, None)
                else:
                    self._pins[b] = self._pins.get(b, 0) + 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop one pin; an uncached block whose last pin goes is freed, a cached one becomes evictable."""
        with self._lock:
            for b in block_ids:
                block = self._blocks.get(b)
                if block is not None:
                    block.ref_count -= 1
                    if block.ref_count == 0:
                        self._lru[b] = None
                else:
                    self._pins[b] -= 1
                    if self._pins[b] == 0:
                        del self._pins[b]
                        self._free.append(b)

    def allocate(self, num_blocks: int) -> list[int]:
        """Up to `num_blocks` pinned, uncached blocks, evicting LRU blocks as needed."""
        with self._lock:
            out: list[int] = []
            while len(out) < num_blocks:
                if not self._free and not self._evict_one():
                    break
                b = self._free.pop()
                self._pins[b] = 1
                out.append(b)
            return out

    def cache(self, block_id: int, key: int, token_ids: Sequence[int]) -> bool:
        """Index an allocated block under `key` (it stays pinned by its allocator).

        Returns False if `key` is already cached (the block stays uncached, freed on unpin)."""
        with self._lock:
            if key in self._index:
                return False
            pins = self._pins.pop(block_id)
            self._blocks[block_id] = _Block(key, tuple(token_ids), ref_count=pins)
            self._index[key] = block_id
        if self.on_change is not None:
            self.on_change(key)
        return True

    def _evict_one(self) -> bool:
        if not self._lru:
            return False
        block_id, _ = self._lru.popitem(last=False)
        block = self._blocks.pop(block_id)
        del self._index[block.key]
        if self.on_evict is not None:
            self.on_evict(block_id, block.key, block.token_ids)
        if self.on_change is not None:
            self.on_change(block.key)
        self._free.append(block_id)
        self.num_evictions += 1
        return True

    def clear(self) -> None:
        """Evict every unpinned block."""
        with self._lock:
            while self._evict_one():
                pass

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Take cached blocks out of the index, keeping their pins (their contents were never
        written: a batch indexed before its forward ended, then failed); freed on their last unpin."""
        keys = []
        with self._lock:
            for b in block_ids:
                block = self._blocks.pop(b, None)
                if block is None:
                    continue
                del self._index[block.key]
                self._lru.pop(b, None)
                keys.append(block.key)
                if block.ref_count:
                    self._pins[b] = block.ref_count
                else:
                    self._free.append(b)
        if self.on_change is not None:
            for key in keys:
                self.on_change(key)

    def forget(self) -> None:
        """The pool's contents are lost (a pipeline stage process died): no key hits any more. Unpinned
        blocks are freed; pinned ones stay allocated, uncached, until their last pin goes."""
        with self._lock:
            cached = list(self._blocks)
        self.uncache(cached)  # notifies on_change outside the lock, as every change here does

    # ---- data ------------------------------------------------------------------------------

    def layer_kv(self, layer: int, block_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """K, V of `block_ids` in order for one layer: each [len * block_tokens, kv_heads, head_dim]."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        k = self.kv[:, 0, layer].index_select(0, idx)
        v = self.kv[:, 1, layer].index_select(0, idx)
        return k.flatten(0, 1), v.flatten(0, 1)

    def write_layer(self, layer: int, block_ids: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Write K, V [len * block_tokens, kv_heads, head_dim] of one layer into `block_ids` (converted
        to the pool's dtype when the forward computes in another)."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        shape = (len(block_ids), self.block_tokens, *k.shape[1:])
        self.kv[:, 0, layer].index_copy_(0, idx, k.reshape(shape).to(self.kv.dtype))
        self.kv[:, 1, layer].index_copy_(0, idx, v.reshape(shape).to(self.kv.dtype))

    def blocks(self, block_ids: Sequence[int]) -> list[Tensor]:
        """Views of whole blocks, each [2, layers, block_tokens, kv_heads, head_dim]."""
        return [self.kv[b] for b in block_ids]

    def reset_stats(self) -> None:
        """Zero the hit, query and eviction counters (after the start-up profile's requests)."""
        with self._lock:
            self.num_hit_tokens = self.num_queried_tokens = self.num_evictions = 0

    def stats(self) -> DeviceTierStats:
        """The pool's occupancy and counters now."""
        with self._lock:
            # A cached block is in the LRU exactly when nothing pins it; uncached ones are all pinned.
            pinned = len(self._blocks) - len(self._lru) + len(self._pins)
            return DeviceTierStats(
                num_blocks=self.num_blocks,
                num_used_blocks=self.num_blocks - len(self._free),
                num_pinned_blocks=pinned,
                num_hit_tokens=self.num_hit_tokens,
                num_queried_tokens=self.num_queried_tokens,
                num_evictions=self.num_evictions,
            )


class PrefixKV(Sequence[tuple[Tensor, Tensor]]):
    """The prefix as the forward wants it: a layer's K,V gathered from the pool (`prefix[layer]`),
    or read in place through its block ids (`paged`, for a kernel that can)."""

    def __init__(self, tier: DeviceTier, block_ids: list[int], num_layers: int) -> None:
        self._tier, self._blocks, self._num_layers = tier, block_ids, num_layers
        self._ids: Tensor | None = None

    def paged(self, layer: int, dtype: torch.dtype) -> PagedPrefix | None:
        """Layer `layer`'s views of the pool and the prefix's block ids (None: the pool keeps KV in
        another dtype than `dtype`, so reading it means converting it, and gathering is cheaper)."""
        kv = self._tier.kv
        if kv.dtype != dtype:
            return None
        if self._ids is None:
            self._ids = torch.tensor(self._blocks, dtype=torch.int64)
        return PagedPrefix(kv[:, 0, layer], kv[:, 1, layer], self._ids, self.num_tokens)

    def __len__(self) -> int:
        return self._num_layers

    @property
    def num_tokens(self) -> int:
        """Tokens the prefix holds: its blocks times the tier's block size."""
        return len(self._blocks) * self._tier.block_tokens

    def __getitem__(self, layer: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return self._tier.layer_kv(layer, self._blocks)
