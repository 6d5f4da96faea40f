"""The KV tiers' scheduler side: the hit split, allocation, pins, retention and offload.

Per request: `prepare` walks the request's blocks in order, taking runs of device-tier blocks
and looking up runs of host-tier chunks, each given a new device block (or taking what `prefetch`
already loaded), pins all of them, and plans which computed blocks stay on the device (retention
policy) and which go to the host tier (suffix policy `offload`: the computed chunks the host
tier lacks; with `write_policy: on-evict` not the retained ones, which go when evicted). The
worker side (`KVWorker`, tiered/offload/worker.py) then loads the host chunks into their blocks,
gives the forward the prefix by block id and a sink that writes retained blocks into the pool
and copies stored chunks straight into LMCache memory (on cuda: device-to-pinned-host copies on
a side stream, layer by layer as the forward proceeds). `finish` indexes retained blocks,
unpins, and queues the chunks for the host tier's store thread: the forward never waits for a
store. `abort` gives back what a request that did not run held, loads that failed included.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from tiered.config import CacheConfig
from tiered.hybrid.args import ModelArgs
from tiered.offload.device_tier import DeviceTier, DeviceTierStats
from tiered.offload.host_base import Host, HostTierStats
from tiered.offload.host_keys import HostKeys
from tiered.offload.host_tier import HostTier
from tiered.offload.loading import PrefixLoader, max_prefix_blocks
from tiered.offload.worker import KVWorker
from tiered.request.plan import HostLoad, Prepared, StoreBatch
from tiered.request.tokens import HitSplit, TierRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """Counters of both tiers: the device tier's, and the host tier's (None when there is none)."""

    device: DeviceTierStats
    host: HostTierStats | None


class _Found(NamedTuple):
    """A request's cached prefix as `prepare` found it: its pinned device blocks, those given host
    chunks (of them, those from its disk and from a remote store), seconds waited for its prefetch
    and spent looking up, and the loads the worker runs."""

    prefix: list[int]
    from_host: set[int]
    from_disk: set[int]
    from_remote: set[int]
    wait: float
    load: float
    loads: list[HostLoad]


@dataclass(frozen=True, slots=True)
class TierSetup:
    """What the tiers hold KV for: the model's shape, the KV dtype and device, this engine's id,
    and the model's identity (LMCache's model name in the host tier's keys: engines that share a
    remote store share chunks when they give the same one; default: `instance_id`)."""

    args: ModelArgs
    dtype: torch.dtype
    device: str
    instance_id: str
    model_identity: str | None = None


class KVTiers:
    """Device tier + (optional) host tier, with the retention and suffix policies of `CacheConfig`.

    Threads: the engine loop calls everything; the prefetch thread loads (`loader`); the host
    tier's store thread reports finished stores (`_stored`). `host_keys` states its own rule.
    """

    def __init__(
        self,
        cfg: CacheConfig,
        setup: TierSetup,
        device_tier: DeviceTier | None = None,
        host_tier: Host | None = None,
    ) -> None:
        """`device_tier`: a pipeline's index (`DeviceTier(hold_kv=False)`: its stages hold the KV and
        it sized their pools); default: a pool of `cfg.device_tier_bytes` in this process.
        `host_tier`: a pipeline's index of its stages' LMCache tiers (`tiered.engine.pipeline.host`);
        default, with `cfg.suffix: offload`: LMCache in this process."""
        args, dtype, device = setup.args, setup.dtype, setup.device
        self.cfg = cfg
        self.args = args
        self.device = torch.device(device)
        self.block_tokens = cfg.block_tokens
        if device_tier is None:
            device_tier = DeviceTier(args, cfg.block_tokens, cfg.device_tier_bytes, dtype, device)
        self.device_tier = device_tier
        self.host_tier: Host | None = host_tier
        if cfg.suffix == "offload":
            if self.host_tier is None:
                self.host_tier = HostTier(
                    cfg.host, cfg.block_tokens, args, dtype, setup.instance_id, model_name=setup.model_identity
                )
            self.host_tier.on_stored = self._stored
            if cfg.host.write_policy == "on-evict":
                self.device_tier.on_evict = self._evicted
        self._dtype = dtype
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.host_keys = HostKeys(2 * self.host_tier.capacity_chunks + 1024 if self.host_tier else 0)
        if self.host_tier is not None:
            self.host_tier.on_forgotten = lambda keys: self._changed(self.host_keys.forget(keys))
        # Keys whose tier changed (stored, loaded, evicted, forgotten), from any thread, until the
        # scheduler takes them (`take_changed`); collected only once it asked (`track_changes`).
        self._changes: set[int] | None = None
        self._changes_lock = threading.Lock()
        self.device_tier.on_change = lambda key: self._changed((key,))
        self.loader = PrefixLoader(self.device_tier, self.host_tier, self.host_keys, self._changed)
        self.worker = KVWorker(self.device_tier, self.host_tier, args.num_layers, self._copy_stream)
        log.debug("%s", self.describe())

    def describe(self) -> str:
        """The tiers in one line: device blocks and bytes, the host tier, the policies."""
        dt, cfg = self.device_tier, self.cfg
        return (
            f"device tier: {dt.num_blocks} blocks of {cfg.block_tokens} tokens "
            f"({dt.num_blocks * dt.bytes_per_block / 2**20:.1f} MiB); host tier: "
            f"{self._describe_host() if self.host_tier else 'off'}; retention {cfg.retention}, suffix {cfg.suffix}"
        )

    def _describe_host(self) -> str:
        host = self.host_tier
        assert host is not None
        text = f"LMCache ({self.cfg.host.write_policy}, store thread <= {self.cfg.host.store_cpu_share:.0%} of a core"
        if host.remote_url:  # keys hash ints only: equal in every engine whatever its PYTHONHASHSEED
            text += f"; shared remote store {host.remote_url}, keys of model {host.model_name}"
        return text + ")"

    def new_request(
        self,
        request_id: str,
        token_ids: Sequence[int] | Tensor,
        salt: str | None = None,
        adapter: str | None = None,
    ) -> TierRequest:
        """A request's tier view: its tokens and block keys (salted by `salt`, `adapter` and the RoPE
        regime the model computes a prompt of its length in), computed once."""
        n = len(token_ids) if not isinstance(token_ids, Tensor) else token_ids.numel()
        return TierRequest.make(request_id, token_ids, self.block_tokens, salt, adapter, self.args.rope_regime(n))

    # ---- scoring (no side effects) ---------------------------------------------------------

    def estimate(self, req: TierRequest) -> HitSplit:
        """The hit split by hashes alone (device index, then known host keys, in the host tier's
        memory or only on its disk): no I/O, no locks.

        Runs of device and host blocks may alternate (with `on-evict`, a prefix's first blocks
        can leave the device before its last ones). This is what the scheduler scores with
        before every pick; `prepare` finds the truth."""
        n = req.token_ids.numel()
        max_blocks = max_prefix_blocks(req, self.block_tokens)
        num_device = num_host = num_disk = i = 0
        host = self.host_tier if self.host_tier is not None and self.host_tier.has_disk else None
        while i < max_blocks:
            run = self.device_tier.count_cached(req.keys, max_blocks, i)
            num_device += run
            i += run
            start = i
            while i < max_blocks and req.keys[i] in self.host_keys:
                if host is not None and not host.in_memory(req.keys[i]):
                    num_disk += 1
                i += 1
            num_host += i - start
            if run == 0 and i == start:
                break
        bt = self.block_tokens
        num_host -= num_disk
        num_miss = n - (num_device + num_host + num_disk) * bt
        return HitSplit(num_device * bt, num_host * bt, num_miss, num_disk_hit_tokens=num_disk * bt)

    def track_changes(self) -> None:
        """From now on, collect the keys whose tier changes, for `take_changed`."""
        with self._changes_lock:
            if self._changes is None:
                self._changes = set()

    def take_changed(self) -> set[int]:
        """The keys whose tier changed since the last call (hit splits that name them are stale)."""
        with self._changes_lock:
            if self._changes is None:
                return set()
            changed, self._changes = self._changes, set()
        return changed

    def _changed(self, keys: Iterable[int]) -> None:
        with self._changes_lock:
            if self._changes is not None:
                self._changes.update(keys)

    # ---- loading ---------------------------------------------------------------------------

    def prepare(
        self,
        req: TierRequest,
        shared_keys: Collection[int] = (),
        planned_keys: set[int] | None = None,
        park: bool = False,
    ) -> Prepared:
        """Pin the request's prefix (host hits looked up and given blocks: `Prepared.loads`, which the
        worker runs before the forward) and plan its retention and offload.

        `shared_keys`: block keys of other waiting requests, for the `prefix` retention policy.
        `planned_keys`: keys of blocks an earlier request of the same batch already keeps and
        stores (it computes them for both); this request's leading computed
        blocks among them are neither kept nor stored again. Its own plan is added to the set.
        `park`: a piece of a request that resumes later: every computed block stays on the device
        whatever the retention policy (those that find no room go to the host tier)."""
        prefetched, wait = self.loader.take_prefetch(req.request_id)
        prefix, loaded, load = self.loader.find_prefix(req, defer=True)
        try:
            found = _Found(
                prefix,
                set(prefetched.blocks) | set(loaded.blocks),
                prefetched.from_disk | loaded.from_disk,
                prefetched.from_remote | loaded.from_remote,
                wait,
                load,
                loaded.pending,
            )
            return self._plan(req, found, shared_keys, planned_keys, park)
        except BaseException:
            for pending in loaded.pending:
                self.loader.undo(pending)
            self.device_tier.unpin(prefix)  # what _plan pinned it released itself
            raise

    def _plan(
        self,
        req: TierRequest,
        found: _Found,
        shared_keys: Collection[int],
        planned_keys: set[int] | None,
        park: bool = False,
    ) -> Prepared:
        prefix, from_host, from_disk, from_remote, wait, load, loads = found
        bt = self.block_tokens
        num_host = sum(1 for b in prefix if b in from_host)
        num_disk = sum(1 for b in prefix if b in from_disk)
        num_remote = sum(1 for b in prefix if b in from_remote)
        n = req.token_ids.numel()
        split = HitSplit(
            (len(prefix) - num_host) * bt,
            (num_host - num_remote - num_disk) * bt,
            n - len(prefix) * bt,
            num_remote * bt,
            num_disk * bt,
        )
        self.device_tier.num_hit_tokens += split.num_device_hit_tokens
        self.device_tier.num_queried_tokens += n

        num_full = n // bt
        first_own = len(prefix)
        while planned_keys is not None and first_own < num_full and req.keys[first_own] in planned_keys:
            first_own += 1
        computed = range(first_own, num_full)
        keep = len(computed) if park else len(self._retention(req, computed, shared_keys))
        retained = self.device_tier.allocate(keep)
        store, stored, held = None, list[int](), list[int]()
        if self.host_tier is not None:
            # Chunks the host tier lacks; with on-evict, not those staying on the device.
            first = first_own + (len(retained) if self.cfg.host.write_policy == "on-evict" else 0)
            for j in range(first, num_full):
                (held if req.keys[j] in self.host_keys else stored).append(j)
            if held:  # computed again behind a missing chunk: used now, the stores below must not evict them
                self.host_tier.touch([req.keys[j] for j in held])
            start = time.perf_counter()
            store = self.host_tier.begin_store([req.keys[j] for j in stored])
            stored = stored[: len(store.keys)] if store is not None else []
        prepared = Prepared(req, split, prefix, retained, store, wait, load, first_own, stored, loads=loads)
        if store is not None:
            prepared.store_allocate_seconds = time.perf_counter() - start
        if planned_keys is not None:
            planned_keys.update(req.keys[first_own : first_own + len(retained)])
            planned_keys.update(req.keys[j] for j in stored)
        return prepared

    def num_kept_blocks(self) -> int:
        """At most how many of a request's computed blocks stay cached for a later request sharing
        them: all where a host tier takes them, else what the retention policy keeps on the device
        (a bound for the scheduler's predictions; room decides the rest)."""
        if self.host_tier is not None:
            return sys.maxsize
        if self.cfg.retention == "none" or self.device_tier.num_blocks == 0:
            return 0
        return self.cfg.retention_cap_tokens // self.block_tokens

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

    # ---- after the forward ------------------------------------------------------------------

    def commit(self, prepared: Prepared) -> None:
        """Index the retained blocks (they stay pinned): hits for requests planned from now on. Before
        the forward ends only where every reader runs after the writer (a pipeline's stages take
        batches in order); `finish` does it otherwise."""
        if prepared.committed:
            return
        req, bt = prepared.request, self.block_tokens
        first = prepared.first_retained_block
        for i, b in enumerate(prepared.retained_blocks):
            j = first + i
            self.device_tier.cache(b, req.keys[j], req.token_ids[j * bt : (j + 1) * bt].tolist())
        prepared.committed = True

    def finish(self, prepared: Prepared) -> None:
        """Index retained blocks (if not yet), release pins, and queue computed chunks for the host tier."""
        self.commit(prepared)
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
        self.host_keys.storing(store.keys)
        self.host_tier.submit(store)

    def _stored(self, batch: StoreBatch) -> None:
        """On the store thread: a batch is in LMCache (or was dropped)."""
        self._changed(self.host_keys.stored(batch.keys, batch.ok))

    def _evicted(self, block_id: int, key: int, token_ids: tuple[int, ...]) -> None:
        """`on-evict`: the device tier is about to reuse a block; store it first if the host lacks it."""
        if self.host_tier is None or key in self.host_keys:
            return
        store = self.host_tier.begin_store([key])
        if store is None:
            return
        start = time.perf_counter()
        self.host_tier.write_block(store, block_id, self.device_tier.blocks)
        self.host_tier.count_store_copy(time.perf_counter() - start)
        self._submit(store)

    def abort(self, prepared: Prepared) -> None:
        """Release a prepared request that did not run (nothing retained or stored); its host loads
        that did not fill their blocks (never run, or a chunk unreadable) take those blocks out of
        the index."""
        for load in prepared.loads:
            if load.filled is None or load.failed:
                self.loader.undo(load)
        if prepared.committed:
            self.device_tier.uncache(prepared.retained_blocks)
        self.device_tier.unpin(prepared.prefix_blocks + prepared.retained_blocks)
        if prepared.store is not None and self.host_tier is not None:
            self.host_tier.abort_store(prepared.store)

    def forget_host(self) -> None:
        """The host tier's contents are lost (a pipeline's stages restarted): no key is a host hit."""
        self._changed(self.host_keys.clear())

    def flush(self) -> None:
        """Wait until every store submitted to the host tier so far has finished (no-op without one)."""
        if self.host_tier is not None:
            self.host_tier.flush()

    def clear(self) -> None:
        """Empty both tiers (unpinned device blocks, everything in the host tier)."""
        self.device_tier.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        self._changed(self.host_keys.clear())

    def stats(self) -> TierStats:
        """A snapshot of the device and host tiers' counters."""
        return TierStats(self.device_tier.stats(), self.host_tier.stats() if self.host_tier else None)

    def prefetch(self, req: TierRequest, after: Sequence[Prepared] = ()) -> None:
        """Start loading `req`'s host-resident prefix in the background once the host loads of the
        requests `after` (a step's) have run (`PrefixLoader.prefetch`)."""
        self.loader.prefetch(req, [load for p in after for load in p.loads])

    def drop_prefetch(self, request_id: str) -> None:
        """Forget a prefetch for a request that will not run (what it loaded stays cached)."""
        self.loader.drop_prefetch(request_id)

    def close(self) -> None:
        """Stop the prefetch thread, then close the host tier."""
        self.loader.close()
        if self.host_tier is not None:
            self.host_tier.close()
