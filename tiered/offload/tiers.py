"""The two KV tiers behind one interface: hit split, loading, retention and offload.

Per request: `prepare` finds the prefix in the device tier, loads the next chunks from the host
tier into device blocks (or takes what `prefetch` already loaded), pins all of them, and plans
which computed blocks stay on the device (retention policy). The forward then gets the prefix
as KV and a sink that writes retained blocks into the pool and, with suffix policy `offload`,
copies computed full chunks into a host staging tensor (on cuda: device-to-pinned-host copies
on a side stream, layer by layer as the forward proceeds). `finish` indexes retained blocks,
unpins, and hands the staging tensor to the host tier asynchronously: the forward never waits
for a store.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tiered.config import CacheConfig, ForwardMode
from tiered.hybrid.forward import KVSink, LayerKV, forward
from tiered.hybrid.model import CausalLM, ModelArgs
from tiered.offload.device_tier import DeviceTier, DeviceTierStats, block_keys
from tiered.offload.host_tier import HostTier, HostTierStats, StagedKV

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HitSplit:
    """Where a request's tokens come from, in prefix order: device hits, host hits, misses."""

    num_device_hit_tokens: int
    num_host_hit_tokens: int
    num_miss_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_device_hit_tokens + self.num_host_hit_tokens + self.num_miss_tokens


@dataclass(slots=True)
class TierRequest:
    """What the tiers need of a request: its tokens and their block keys, computed once."""

    request_id: str
    token_ids: Tensor  # [T] int64, on the CPU
    keys: list[int] = field(default_factory=list)
    salt: str | None = None  # vLLM's cache_salt: shares cached KV only with the same salt

    @classmethod
    def make(
        cls, request_id: str, token_ids: Sequence[int] | Tensor, block_tokens: int, salt: str | None = None
    ) -> TierRequest:
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        return cls(request_id, ids, block_keys(ids.tolist(), block_tokens, salt), salt)


@dataclass(slots=True)
class Prepared:
    """A request ready to compute: its prefix (pinned blocks) and its plan for the computed part."""

    request: TierRequest
    split: HitSplit
    prefix_blocks: list[int]
    retained_blocks: list[int]  # device blocks for computed blocks first_retained_block.. (in order)
    staged: StagedKV | None
    prefetch_wait_seconds: float
    load_seconds: float
    first_retained_block: int = 0  # block index of retained_blocks[0]

    @property
    def num_prefix_tokens(self) -> int:
        return self.split.num_device_hit_tokens + self.split.num_host_hit_tokens


class PrefixKV(Sequence[LayerKV]):
    """The prefix as the forward wants it, gathered from the pool one layer at a time."""

    def __init__(self, tier: DeviceTier, block_ids: list[int], num_layers: int) -> None:
        self._tier, self._blocks, self._num_layers = tier, block_ids, num_layers

    def __len__(self) -> int:
        return self._num_layers

    @property
    def num_tokens(self) -> int:
        return len(self._blocks) * self._tier.block_tokens

    def __getitem__(self, layer: int) -> LayerKV:  # type: ignore[override]
        return self._tier.layer_kv(layer, self._blocks)


class BoundedKeys:
    """A set of keys that forgets its oldest ones past `cap` (insertion order)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def update(self, keys: Iterable[int]) -> list[int]:
        """Add keys; returns the ones dropped to stay within the cap."""
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        dropped = []
        while len(self._keys) > self.cap:
            dropped.append(self._keys.popitem(last=False)[0])
        return dropped

    def difference_update(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._keys.pop(k, None)

    def clear(self) -> None:
        self._keys.clear()


@dataclass(slots=True)
class TierStats:
    device: DeviceTierStats
    host: HostTierStats | None


class KVTiers:
    """Device tier + (optional) host tier, with the retention and suffix policies of `CacheConfig`."""

    def __init__(self, cfg: CacheConfig, args: ModelArgs, dtype: torch.dtype, device: str, instance_id: str) -> None:
        self.cfg = cfg
        self.args = args
        self.device = torch.device(device)
        self.block_tokens = cfg.block_tokens
        self.device_tier = DeviceTier(
            args.num_layers, args.num_kv_heads, args.head_dim, cfg.block_tokens, cfg.device_tier_bytes, dtype, device
        )
        self.host_tier: HostTier | None = None
        if cfg.suffix == "offload":
            self.host_tier = HostTier(
                cfg.host, cfg.block_tokens, args.num_layers, args.num_kv_heads, args.head_dim, dtype, instance_id
            )
        self._dtype = dtype
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="tiered-prefetch")
        self._prefetches: dict[str, Future[list[int]]] = {}
        # Keys of chunks stored in the host tier, for cheap scoring. LMCache may evict behind our
        # back: a load that finds less drops the missing keys (a stale key costs one lookup).
        # Bounded: LMCache evicts silently, so keys of long-gone chunks would pile up forever; the
        # oldest are dropped past twice what the tier can hold (a dropped live key costs a recompute).
        self.host_keys = BoundedKeys(2 * self.host_tier.capacity_chunks + 1024 if self.host_tier else 0)
        self._storing_keys: set[int] = set()  # in stores still in flight: counted as host-resident
        self.on_change: Callable[[Iterable[int]], None] | None = None
        self.device_tier.on_change = lambda key: self._changed((key,))
        log.info(
            "device tier: %d blocks of %d tokens (%.1f MiB); host tier: %s; retention %s, suffix %s",
            self.device_tier.num_blocks,
            cfg.block_tokens,
            cfg.device_tier_bytes / 2**20,
            "LMCache" if self.host_tier else "off",
            cfg.retention,
            cfg.suffix,
        )

    def new_request(self, request_id: str, token_ids: Sequence[int] | Tensor, salt: str | None = None) -> TierRequest:
        return TierRequest.make(request_id, token_ids, self.block_tokens, salt)

    # ---- scoring (no side effects) ---------------------------------------------------------

    def estimate(self, req: TierRequest) -> HitSplit:
        """The hit split by hashes alone (device index, then known host keys): no I/O, no locks.

        This is what the scheduler scores with before every pick; `prepare` finds the truth."""
        n = req.token_ids.numel()
        max_blocks = min(len(req.keys), (n - 1) // self.block_tokens)
        num_device = self.device_tier.count_cached(req.keys, max_blocks)
        num_host = 0
        host_keys, storing = self.host_keys, self._storing_keys
        while num_device + num_host < max_blocks and (
            req.keys[num_device + num_host] in host_keys or req.keys[num_device + num_host] in storing
        ):
            num_host += 1
        bt = self.block_tokens
        return HitSplit(num_device * bt, num_host * bt, n - (num_device + num_host) * bt)

    def _changed(self, keys: Iterable[int]) -> None:
        if self.on_change is not None:
            self.on_change(keys)

    # ---- loading ---------------------------------------------------------------------------

    def _load_from_host(self, req: TierRequest, first_block: int) -> tuple[list[int], int]:
        """Retrieve host chunks first_block.. into new device blocks (they end pinned and cached).

        Returns the loaded block ids and how many leading chunks the host tier holds. Chunks that
        find no free device block are not loaded: they are recomputed."""
        if self.host_tier is None:
            return [], 0
        n = req.token_ids.numel()
        if first_block >= len(req.keys):
            return [], first_block
        if req.keys[first_block] in self._storing_keys:
            self.host_tier.flush()  # the chunk is on its way: waiting for it beats recomputing it
        if req.keys[first_block] not in self.host_keys:
            # We know what this engine stored: skip LMCache's lookup (it hashes every token).
            return [], first_block
        found = min(self.host_tier.lookup(req.token_ids, req.salt), n - 1) // self.block_tokens
        self._forget_host_keys(req.keys[found:])
        if found <= first_block:
            return [], found
        blocks = self.device_tier.allocate(found - first_block)
        got = self.host_tier.retrieve_into(req.token_ids, first_block, self.device_tier, blocks, req.salt)
        if got < len(blocks):
            self._forget_host_keys(req.keys[first_block + got : found])
        loaded = blocks[:got]
        self.device_tier.unpin(blocks[got:])
        bt = self.block_tokens
        for i, b in enumerate(loaded):
            j = first_block + i
            self.device_tier.cache(b, req.keys[j], req.token_ids[j * bt : (j + 1) * bt].tolist())
        return loaded, found

    def _forget_host_keys(self, keys: Sequence[int]) -> None:
        gone = [k for k in keys if k in self.host_keys]
        if gone:
            self.host_keys.difference_update(gone)
            self._changed(gone)

    def prefetch(self, req: TierRequest) -> None:
        """Start loading `req`'s host-resident prefix into the device tier in the background.

        The loaded blocks are cached and left unpinned: if another request runs first they
        simply stay in the device tier (evictable) like any other cached block."""
        if self.host_tier is None or req.request_id in self._prefetches:
            return

        def run() -> list[int]:
            hits = self.device_tier.match(req.keys, req.token_ids.tolist(), count=False)
            loaded = self._load_from_host(req, len(hits))[0]
            self.device_tier.unpin(loaded)
            return loaded

        self._prefetches[req.request_id] = self._prefetcher.submit(run)

    def drop_prefetch(self, request_id: str) -> None:
        """Forget a prefetch for a request that will not run (what it loaded stays cached)."""
        self._prefetches.pop(request_id, None)

    def prepare(
        self, req: TierRequest, shared_keys: Collection[int] = (), planned_keys: set[int] | None = None
    ) -> Prepared:
        """Pin the request's prefix (loading host hits) and plan its retention and offload.

        `shared_keys`: block keys of other waiting requests, for the `prefix` retention policy.
        `planned_keys`: keys of blocks an earlier request of the same batch already keeps and
        stores (it computes them for both: DESIGN.md idea 5); this request's leading computed
        blocks among them are neither kept nor stored again. Its own plan is added to the set."""
        tokens = req.token_ids.tolist()
        prefetched: list[int] = []
        wait = 0.0
        future = self._prefetches.pop(req.request_id, None)
        if future is not None:
            start = time.perf_counter()
            prefetched = future.result()
            wait = time.perf_counter() - start
        hits = self.device_tier.match(req.keys, tokens, count=False)
        self.device_tier.pin(hits)
        try:
            return self._plan(req, tokens, hits, prefetched, wait, shared_keys, planned_keys)
        except BaseException:
            self.device_tier.unpin(hits)  # what _plan pinned it released itself
            raise

    def _plan(
        self,
        req: TierRequest,
        tokens: list[int],
        hits: list[int],
        prefetched: list[int],
        wait: float,
        shared_keys: Collection[int],
        planned_keys: set[int] | None,
    ) -> Prepared:
        bt = self.block_tokens
        start = time.perf_counter()
        loaded, num_host_blocks = self._load_from_host(req, len(hits))
        load = time.perf_counter() - start
        from_host = set(prefetched) | set(loaded)
        prefix = hits + loaded
        num_host = sum(1 for b in prefix if b in from_host)
        n = len(tokens)
        split = HitSplit((len(prefix) - num_host) * bt, num_host * bt, n - len(prefix) * bt)
        self.device_tier.num_hit_tokens += split.num_device_hit_tokens
        self.device_tier.num_queried_tokens += n

        num_full = n // bt
        first_own = len(prefix)
        while planned_keys is not None and first_own < num_full and req.keys[first_own] in planned_keys:
            first_own += 1
        computed = range(first_own, num_full)
        retain = self._retention(req, computed, shared_keys)
        retained = self.device_tier.allocate(len(retain))
        staged = None
        # Stage only chunks the host tier lacks (it may hold some that found no device block).
        first_stored = max(first_own, num_host_blocks)
        if self.host_tier is not None and first_stored < num_full:
            num = (num_full - first_stored) * bt
            shape = (self.args.num_layers, 2, num, self.args.num_kv_heads, self.args.head_dim)
            try:
                kv = torch.empty(shape, dtype=self._dtype, pin_memory=self._copy_stream is not None)
            except BaseException:
                self.device_tier.unpin(loaded + retained)
                raise
            staged = StagedKV(kv, first_stored * bt)
        if planned_keys is not None:
            planned_keys.update(req.keys[first_own : first_own + len(retained)])
            planned_keys.update(req.keys[first_stored:num_full] if staged is not None else ())
        return Prepared(req, split, prefix, retained, staged, wait, load, first_own)

    def _retention(self, req: TierRequest, computed: range, shared_keys: Collection[int]) -> list[int]:
        """Indices of computed blocks to keep on the device, as a contiguous run after the prefix."""
        cap = self.cfg.retention_cap_tokens // self.block_tokens
        policy = self.cfg.retention
        if policy == "none":
            return []
        out: list[int] = []
        for j in computed:
            if len(out) >= cap or (policy == "prefix" and req.keys[j] not in shared_keys):
                break
            out.append(j)
        return out

    def prefix_kv(self, prepared: Prepared) -> PrefixKV | None:
        if not prepared.prefix_blocks:
            return None
        return PrefixKV(self.device_tier, prepared.prefix_blocks, self.args.num_layers)

    # ---- during and after the forward ------------------------------------------------------

    def sink(self, prepared: Prepared) -> KVSink:
        """The forward's KV sink: keep retained blocks on the device, stage stored chunks."""
        bt = self.block_tokens
        retained = prepared.retained_blocks
        staged = prepared.staged
        stream = self._copy_stream
        first_computed = prepared.num_prefix_tokens
        first_retained = prepared.first_retained_block * bt - first_computed

        def sink(layer: int, k: Tensor, v: Tensor) -> None:
            # k, v: [new tokens, Hkv, Dh]; token 0 is the first computed one (a block boundary).
            if retained:
                s, e = first_retained, first_retained + len(retained) * bt
                self.device_tier.write_layer(layer, retained, k[s:e], v[s:e])
            if staged is not None:
                s = staged.first_token - first_computed
                e = s + staged.kv.shape[2]
                if stream is None:
                    staged.kv[layer, 0].copy_(k[s:e])
                    staged.kv[layer, 1].copy_(v[s:e])
                else:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        staged.kv[layer, 0].copy_(k[s:e], non_blocking=True)
                        staged.kv[layer, 1].copy_(v[s:e], non_blocking=True)
                    k.record_stream(stream)  # the forward frees k, v after this call
                    v.record_stream(stream)

        return sink

    def finish(self, prepared: Prepared) -> None:
        """Index retained blocks, release pins, and offload computed chunks asynchronously."""
        req, bt = prepared.request, self.block_tokens
        first = prepared.first_retained_block
        for i, b in enumerate(prepared.retained_blocks):
            j = first + i
            self.device_tier.cache(b, req.keys[j], req.token_ids[j * bt : (j + 1) * bt].tolist())
        self.device_tier.unpin(prepared.prefix_blocks + prepared.retained_blocks)
        if prepared.staged is not None and self.host_tier is not None:
            if self._copy_stream is not None:
                prepared.staged.ready = torch.cuda.Event()
                prepared.staged.ready.record(self._copy_stream)
            first_key = prepared.staged.first_token // bt
            keys = req.keys[first_key : first_key + prepared.staged.kv.shape[2] // bt]
            self._storing_keys.update(keys)
            future = self.host_tier.store_async(req.token_ids, prepared.staged, req.salt)

            def stored(done: Future[bool]) -> None:
                if done.result():
                    keys.extend(self.host_keys.update(keys))  # the dropped ones changed too
                self._storing_keys.difference_update(keys)
                self._changed(keys)

            future.add_done_callback(stored)

    def abort(self, prepared: Prepared) -> None:
        """Release a prepared request that did not run (nothing retained or stored)."""
        self.device_tier.unpin(prepared.prefix_blocks + prepared.retained_blocks)

    def flush(self) -> None:
        if self.host_tier is not None:
            self.host_tier.flush()

    def clear(self) -> None:
        """Empty both tiers (unpinned device blocks, everything in the host tier)."""
        self.device_tier.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        self._changed(list(self.host_keys))
        self.host_keys.clear()

    def stats(self) -> TierStats:
        return TierStats(self.device_tier.stats(), self.host_tier.stats() if self.host_tier else None)

    def close(self) -> None:
        self._prefetcher.shutdown(wait=True)
        if self.host_tier is not None:
            self.host_tier.close()


def forward_with_tiers(
    model: CausalLM,
    tiers: KVTiers,
    req: TierRequest,
    mode: ForwardMode = "hybrid",
    chunk_tokens: int = 1024,
    shared_keys: Collection[int] = (),
) -> tuple[Tensor, Prepared]:
    """One request through the tiers: prepare, forward over the misses, finish. Returns logits."""
    prepared = tiers.prepare(req, shared_keys)
    try:
        logits = forward(
            model,
            req.token_ids[prepared.num_prefix_tokens :],
            mode=mode,
            chunk_tokens=chunk_tokens,
            prefix_kv=tiers.prefix_kv(prepared),
            kv_sink=tiers.sink(prepared),
        )
    except BaseException:
        tiers.abort(prepared)
        raise
    tiers.finish(prepared)
    return logits, prepared
