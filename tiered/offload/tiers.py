"""The two KV tiers behind one interface: hit split, loading, retention and offload.

Per request: `prepare` walks the request's blocks in order, taking runs of device-tier blocks
and loading runs of host-tier chunks into device blocks (or taking what `prefetch` already
loaded), pins all of them, and plans which computed blocks stay on the device (retention
policy) and which go to the host tier (suffix policy `offload`: the computed chunks the host
tier lacks; with `write_policy: on-evict` not the retained ones, which go when evicted). The
forward then gets the prefix as KV and a sink that writes retained blocks into the pool and
copies stored chunks straight into LMCache memory (on cuda: device-to-pinned-host copies on a
side stream, layer by layer as the forward proceeds). `finish` indexes retained blocks, unpins,
and queues the chunks for the host tier's store thread: the forward never waits for a store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered.config import CacheConfig, ForwardMode
from tiered.hybrid.forward import KVSink, forward
from tiered.hybrid.model import CausalLM, ModelArgs
from tiered.offload.device_tier import DeviceTier, DeviceTierStats
from tiered.offload.host_tier import HostTier, HostTierStats
from tiered.offload.request import BoundedKeys, HitSplit, PrefixKV, Prepared, StoreBatch, TierRequest

log = logging.getLogger(__name__)


def _one_thread() -> None:
    """Run this thread's torch ops on one core: a second OpenMP team beside the forward's would
    oversubscribe the cores (and its threads spin after each op), slowing every forward."""
    torch.set_num_threads(1)


@dataclass(slots=True)
class TierStats:
    device: DeviceTierStats
    host: HostTierStats | None


class KVTiers:
    """Device tier + (optional) host tier, with the retention and suffix policies of `CacheConfig`.

    Threads: the engine loop calls everything; the prefetch thread loads; the host tier's store
    thread reports finished stores (`_stored`). `host_keys` and `_storing_keys` change under
    `_keys_lock`; the scheduler's estimate reads them without it (single membership tests).
    """

    def __init__(
        self,
        cfg: CacheConfig,
        args: ModelArgs,
        dtype: torch.dtype,
        device: str,
        instance_id: str,
        model_identity: str | None = None,
    ) -> None:
        """`model_identity` names the model in the host tier's keys (LMCache's model name): engines
        that share a remote store share chunks when they give the same one. Default: `instance_id`."""
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
                cfg.host, cfg.block_tokens, args.num_layers, args.num_kv_heads, args.head_dim, dtype, instance_id,
                model_identity,
            )  # fmt: skip
            self.host_tier.on_stored = self._stored
            if cfg.host.write_policy == "on-evict":
                self.device_tier.on_evict = self._evicted
        self._dtype = dtype
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="tiered-prefetch", initializer=_one_thread)
        self._prefetches: dict[str, Future[tuple[list[int], set[int]]]] = {}
        # Keys of chunks stored in the host tier, for cheap scoring. LMCache may evict behind our
        # back: a load that finds less drops the missing keys (a stale key costs one lookup).
        # Bounded: LMCache evicts silently, so keys of long-gone chunks would pile up forever; the
        # oldest are dropped past twice what the tier can hold (a dropped live key costs a recompute).
        self.host_keys = BoundedKeys(2 * self.host_tier.capacity_chunks + 1024 if self.host_tier else 0)
        self._storing_keys: set[int] = set()  # queued for the store thread: readable, counted as host-resident
        self._keys_lock = threading.Lock()
        self.on_change: Callable[[Iterable[int]], None] | None = None
        self.device_tier.on_change = lambda key: self._changed((key,))
        log.info(
            "device tier: %d blocks of %d tokens (%.1f MiB); host tier: %s; retention %s, suffix %s",
            self.device_tier.num_blocks,
            cfg.block_tokens,
            cfg.device_tier_bytes / 2**20,
            self._describe_host() if self.host_tier else "off",
            cfg.retention,
            cfg.suffix,
        )

    def _describe_host(self) -> str:
        host = self.host_tier
        assert host is not None
        text = f"LMCache ({self.cfg.host.write_policy}, store thread <= {self.cfg.host.store_cpu_share:.0%} of a core"
        if host.remote_url:  # keys hash ints only: equal in every engine whatever its PYTHONHASHSEED
            text += f"; shared remote store {host.remote_url}, keys of model {host.model_name}"
        return text + ")"

    def new_request(
        self, request_id: str, token_ids: Sequence[int] | Tensor, salt: str | None = None, adapter: str | None = None
    ) -> TierRequest:
        return TierRequest.make(request_id, token_ids, self.block_tokens, salt, adapter)

    # ---- scoring (no side effects) ---------------------------------------------------------

    def _in_host(self, key: int) -> bool:
        return key in self.host_keys or key in self._storing_keys

    def estimate(self, req: TierRequest) -> HitSplit:
        """The hit split by hashes alone (device index, then known host keys): no I/O, no locks.

        Runs of device and host blocks may alternate (with `on-evict`, a prefix's first blocks
        can leave the device before its last ones). This is what the scheduler scores with
        before every pick; `prepare` finds the truth."""
        n = req.token_ids.numel()
        max_blocks = self._max_blocks(req)
        num_device = num_host = i = 0
        while i < max_blocks:
            run = self.device_tier.count_cached(req.keys, max_blocks, i)
            num_device += run
            i += run
            start = i
            while i < max_blocks and self._in_host(req.keys[i]):
                i += 1
            num_host += i - start
            if run == 0 and i == start:
                break
        bt = self.block_tokens
        return HitSplit(num_device * bt, num_host * bt, n - (num_device + num_host) * bt)

    def _changed(self, keys: Iterable[int]) -> None:
        if self.on_change is not None:
            self.on_change(keys)

    # ---- loading ---------------------------------------------------------------------------

    def _max_blocks(self, req: TierRequest) -> int:
        return min(len(req.keys), (req.token_ids.numel() - 1) // self.block_tokens)

    def _host_run_end(self, req: TierRequest, first_block: int, use_remote: bool) -> tuple[int, int]:
        """Where the run of host chunks from `first_block` ends by our key index, and where it may
        end: with a shared remote store (which other engines fill), the prompt's end, for LMCache to
        look up. Either way the run stops before the next block the device holds (loading it
        again would only duplicate it)."""
        max_blocks = self._max_blocks(req)

        def on_device(j: int) -> bool:
            return j > first_block and self.device_tier.count_cached(req.keys, j + 1, j) > 0

        known = first_block
        while known < max_blocks and self._in_host(req.keys[known]) and not on_device(known):
            known += 1
        if not (use_remote and self.host_tier is not None and self.host_tier.remote_url):
            return known, known
        end = known
        while end < max_blocks and not on_device(end):
            end += 1
        return known, end

    def _load_from_host(self, req: TierRequest, first_block: int, known: int, end: int) -> tuple[list[int], int, bool]:
        """Load the run of host chunks first_block..end (`_host_run_end`) into new device blocks
        (they end pinned and cached); returns them, how many of them (the last ones) came from the
        remote store, and whether LMCache had fewer chunks than asked for (no use asking the
        remote store again).

        Chunks that find no free device block are not loaded: they are recomputed."""
        if self.host_tier is None or end == first_block:
            return [], 0, False
        keys = req.keys[first_block:end]
        objs, num_remote = self.host_tier.get(keys)
        short = len(objs) < len(keys)
        if len(objs) < known - first_block:  # keys we believed held, and LMCache lacks (evicted)
            self._forget_host_keys(keys[len(objs) : known - first_block])
        if not objs:
            return [], 0, short
        blocks = self.device_tier.allocate(len(objs))
        if len(blocks) < len(objs):
            self.host_tier.release(objs[len(blocks) :])
        if not blocks:
            return [], 0, short
        num_remote = max(0, num_remote - (len(objs) - len(blocks)))
        self.host_tier.copy_into(objs[: len(blocks)], self.device_tier.blocks(blocks), num_remote)
        bt = self.block_tokens
        for i, b in enumerate(blocks):
            j = first_block + i
            self.device_tier.cache(b, req.keys[j], req.token_ids[j * bt : (j + 1) * bt].tolist())
        if num_remote:  # in the host tier's reach now: the scheduler's estimate counts them as host hits
            with self._keys_lock:
                self.host_keys.update(keys[len(blocks) - num_remote : len(blocks)])
        return blocks, num_remote, short

    def _find_prefix(self, req: TierRequest, tokens: list[int]) -> tuple[list[int], list[int], set[int], float]:
        """Pin the request's prefix: alternate runs of device hits and host loads, in block order.

        Returns (prefix blocks, those loaded from the host tier, those of them that came from the
        remote store, seconds spent loading)."""
        prefix: list[int] = []
        loaded: list[int] = []
        remote: set[int] = set()
        seconds = 0.0
        use_remote = True  # until the remote store has had fewer chunks than asked for
        try:
            while True:
                prefix += self.device_tier.match(req.keys, tokens, count=False, start=len(prefix), pin=True)
                known, end = self._host_run_end(req, len(prefix), use_remote)
                start = time.perf_counter()
                run, num_remote, short = self._load_from_host(req, len(prefix), known, end)
                use_remote = use_remote and not short
                if end > len(prefix):
                    seconds += time.perf_counter() - start
                if not run:
                    return prefix, loaded, remote, seconds
                prefix += run
                loaded += run
                remote.update(run[len(run) - num_remote :])
        except BaseException:
            self.device_tier.unpin(prefix)
            raise

    def _forget_host_keys(self, keys: Sequence[int]) -> None:
        with self._keys_lock:
            gone = [k for k in keys if k in self.host_keys]
            self.host_keys.difference_update(gone)
        if gone:
            self._changed(gone)

    def prefetch(self, req: TierRequest) -> None:
        """Start loading `req`'s host-resident prefix into the device tier in the background.

        The loaded blocks are cached and left unpinned: if another request runs first they
        simply stay in the device tier (evictable) like any other cached block."""
        if self.host_tier is None or req.request_id in self._prefetches:
            return

        def run() -> tuple[list[int], set[int]]:
            prefix, loaded, remote, _ = self._find_prefix(req, req.token_ids.tolist())
            self.device_tier.unpin(prefix)
            return loaded, remote

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
        stores (it computes them for both); this request's leading computed
        blocks among them are neither kept nor stored again. Its own plan is added to the set."""
        tokens = req.token_ids.tolist()
        prefetched: list[int] = []
        from_remote: set[int] = set()
        wait = 0.0
        future = self._prefetches.pop(req.request_id, None)
        if future is not None:
            start = time.perf_counter()
            prefetched, from_remote = future.result()
            wait = time.perf_counter() - start
        prefix, loaded, remote, load = self._find_prefix(req, tokens)
        try:
            from_host = set(prefetched) | set(loaded)
            return self._plan(req, prefix, from_host, from_remote | remote, wait, load, shared_keys, planned_keys)
        except BaseException:
            self.device_tier.unpin(prefix)  # what _plan pinned it released itself
            raise

    def _plan(
        self,
        req: TierRequest,
        prefix: list[int],
        from_host: set[int],
        from_remote: set[int],
        wait: float,
        load: float,
        shared_keys: Collection[int],
        planned_keys: set[int] | None,
    ) -> Prepared:
        bt = self.block_tokens
        num_host = sum(1 for b in prefix if b in from_host)
        num_remote = sum(1 for b in prefix if b in from_remote)
        n = req.token_ids.numel()
        split = HitSplit(
            (len(prefix) - num_host) * bt, (num_host - num_remote) * bt, n - len(prefix) * bt, num_remote * bt
        )
        self.device_tier.num_hit_tokens += split.num_device_hit_tokens
        self.device_tier.num_queried_tokens += n

        num_full = n // bt
        first_own = len(prefix)
        while planned_keys is not None and first_own < num_full and req.keys[first_own] in planned_keys:
            first_own += 1
        computed = range(first_own, num_full)
        retained = self.device_tier.allocate(len(self._retention(req, computed, shared_keys)))
        store, stored = None, []
        if self.host_tier is not None:
            # Chunks the host tier lacks; with on-evict, not those staying on the device.
            first = first_own + (len(retained) if self.cfg.host.write_policy == "on-evict" else 0)
            stored = [j for j in range(first, num_full) if not self._in_host(req.keys[j])]
            start = time.perf_counter()
            store = self.host_tier.begin_store([req.keys[j] for j in stored])
            stored = stored[: len(store.keys)] if store is not None else []
        prepared = Prepared(req, split, prefix, retained, store, wait, load, first_own, stored)
        if store is not None:
            prepared.store_allocate_seconds = time.perf_counter() - start
        if planned_keys is not None:
            planned_keys.update(req.keys[first_own : first_own + len(retained)])
            planned_keys.update(req.keys[j] for j in stored)
        return prepared

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
        """The forward's KV sink: keep retained blocks on the device, copy stored chunks into LMCache memory."""
        bt = self.block_tokens
        retained = prepared.retained_blocks
        store = prepared.store
        stream = self._copy_stream
        first_computed = prepared.num_prefix_tokens
        first_retained = prepared.first_retained_block * bt - first_computed
        rows = [j * bt - first_computed for j in prepared.stored_blocks]

        def sink(layer: int, k: Tensor, v: Tensor) -> None:
            # k, v: [new tokens, Hkv, Dh]; token 0 is the first computed one (a block boundary).
            if retained:
                s, e = first_retained, first_retained + len(retained) * bt
                self.device_tier.write_layer(layer, retained, k[s:e], v[s:e])
            if store is None:
                return
            start = time.perf_counter()
            dst = [view[0, layer] for view in store.views] + [view[1, layer] for view in store.views]
            src = [k[r : r + bt] for r in rows] + [v[r : r + bt] for r in rows]
            if stream is None:
                torch._foreach_copy_(dst, src)
            else:
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(dst, src, non_blocking=True)
                k.record_stream(stream)  # the forward frees k, v after this call
                v.record_stream(stream)
            prepared.store_copy_seconds += time.perf_counter() - start

        return sink

    def finish(self, prepared: Prepared) -> None:
        """Index retained blocks, release pins, and queue computed chunks for the host tier."""
        req, bt = prepared.request, self.block_tokens
        first = prepared.first_retained_block
        for i, b in enumerate(prepared.retained_blocks):
            j = first + i
            self.device_tier.cache(b, req.keys[j], req.token_ids[j * bt : (j + 1) * bt].tolist())
        self.device_tier.unpin(prepared.prefix_blocks + prepared.retained_blocks)
        store = prepared.store
        if store is not None and self.host_tier is not None:
            if self._copy_stream is not None:
                store.ready = torch.cuda.Event()
                store.ready.record(self._copy_stream)
            self.host_tier.count_store_copy(prepared.store_copy_seconds)
            self._submit(store)

    def _submit(self, store: StoreBatch) -> None:
        assert self.host_tier is not None
        with self._keys_lock:
            self._storing_keys.update(store.keys)
        self.host_tier.submit(store)

    def _stored(self, batch: StoreBatch) -> None:
        """On the store thread: a batch is in LMCache (or was dropped)."""
        changed = list(batch.keys)
        with self._keys_lock:
            if batch.ok:
                changed += self.host_keys.update(batch.keys)  # the dropped ones changed too
            self._storing_keys.difference_update(batch.keys)
        self._changed(changed)

    def _evicted(self, block_id: int, key: int, token_ids: tuple[int, ...]) -> None:
        """`on-evict`: the device tier is about to reuse a block; store it first if the host lacks it."""
        if self.host_tier is None or self._in_host(key):
            return
        store = self.host_tier.begin_store([key])
        if store is None:
            return
        start = time.perf_counter()
        block = self.device_tier.kv[block_id]
        if self._copy_stream is None:
            store.views[0].copy_(block)
        else:  # on the current stream: the block's next writer queues behind this copy
            store.views[0].copy_(block, non_blocking=True)
            store.ready = torch.cuda.Event()
            store.ready.record(torch.cuda.current_stream(self.device))
        self.host_tier.count_store_copy(time.perf_counter() - start)
        self._submit(store)

    def abort(self, prepared: Prepared) -> None:
        """Release a prepared request that did not run (nothing retained or stored)."""
        self.device_tier.unpin(prepared.prefix_blocks + prepared.retained_blocks)
        if prepared.store is not None and self.host_tier is not None:
            self.host_tier.abort_store(prepared.store)

    def flush(self) -> None:
        if self.host_tier is not None:
            self.host_tier.flush()

    def clear(self) -> None:
        """Empty both tiers (unpinned device blocks, everything in the host tier)."""
        self.device_tier.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        with self._keys_lock:
            gone = list(self.host_keys)
            self.host_keys.clear()
        self._changed(gone)

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
