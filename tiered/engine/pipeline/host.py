"""The host tier with pipeline stages: one index in the coordinator, one LMCache tier per stage.

Design notes: docs/internals.md, section `tiered/engine/pipeline/host.py`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from tiered.config import Config, ConfigError, HostTierConfig
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.loader import DTYPES
from tiered.offload.device_tier import DeviceTier
from tiered.offload.host_base import HostTierStats
from tiered.offload.host_tier import HostTier
from tiered.request.plan import StoreBatch

log = logging.getLogger(__name__)

SAVE, LOAD, DROP = 0, 1, 2
# Each stage's LMCache holds this much more than its share of the index's chunks: stores land
# before the drops of the same batch, and its allocator needs room to spare.
STAGE_ROOM = 1.25


@dataclass(frozen=True, slots=True)
class HostOps:
    """What every stage's host tier does with one batch (the module docstring gives the order)."""

    before: list[tuple[int, int, int]] = field(default_factory=list)  # (SAVE | LOAD | DROP, key, block id)
    drops: list[int] = field(default_factory=list)  # after the forward


class StagedHost:
    """The coordinator's host tier: the index of the chunks every stage's LMCache holds (`Host`).
    Threads: the engine loop, the prefetch thread (loads) and nothing else; one lock."""

    def __init__(
        self, cfg: HostTierConfig, capacity_chunks: int, chunk_bytes: int, block_tokens: int, model_name: str
    ) -> None:
        self.cfg, self.capacity_chunks, self.model_name = cfg, capacity_chunks, model_name
        self.chunk_bytes, self.block_tokens = chunk_bytes, block_tokens
        self.remote_url: str | None = None
        self.has_disk = False  # the stages' LMCache tiers are memory only
        # `load` queues a LOAD for the stages, which run it before the next batch: queued at lookup,
        # so that it comes before any DROP of the same key a later store of the step makes.
        self.queues_loads = True
        self.on_stored: Callable[[StoreBatch], None] | None = None
        # Keys the index gave up (evicted or lost): the KV tiers forget them at once (LMCache's own
        # evictions are silent; the index's are known, so the scheduler's estimate stays exact).
        self.on_forgotten: Callable[[list[int]], None] | None = None
        self._held: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._ops = HostOps()
        self._fresh: set[int] = set()  # keys admitted since the last batch was sent (stored by it)
        self._lock = threading.Lock()
        self.stats_ = HostTierStats()

    # ---- the index, as LMCache would answer ------------------------------------------------

    def get(self, keys: Sequence[int]) -> tuple[list[Any], int, int]:
        """The leading `keys` every stage holds (the keys themselves stand for the chunks)."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._held:
                n += 1
            self._used(keys[:n])
        return list(keys[:n]), 0, 0

    def in_memory(self, key: int) -> bool:
        """Every chunk the stages hold is in their memory (their LMCache tiers have no disk here)."""
        return True

    def evict_from_memory(self, keys: Sequence[int]) -> int:
        """No disk to leave them on."""
        return 0

    def _used(self, keys: Sequence[int]) -> None:
        """Under the lock: held `keys` just used, the first last (a prefix is evicted from its end)."""
        for k in reversed(keys):
            if k in self._held:
                self._held.move_to_end(k)

    def missing(self, keys: Sequence[int]) -> list[int]:
        """Of `keys`, those the index does not hold."""
        with self._lock:
            return [k for k in keys if k not in self._held]

    def load(
        self,
        objs: Sequence[Any],
        block_ids: Sequence[int],
        views: Callable[[Sequence[int]], list[Tensor]],
        num_remote: int = 0,
        num_disk: int = 0,
    ) -> int:
        """Every stage loads chunk `objs[i]` into its block `block_ids[i]` before the next batch
        (all of them count as filled: a stage's miss is found then, `missed`)."""
        with self._lock:
            self._ops.before.extend((LOAD, key, b) for key, b in zip(objs, block_ids, strict=True))
            s = self.stats_
            s.num_loads += 1
            s.num_loaded_bytes += len(objs) * self.chunk_bytes
            s.num_hit_tokens += len(objs) * self.block_tokens
        return len(objs)

    def release(self, objs: Sequence[Any]) -> None:
        """Nothing to release: the keys stand for the chunks."""
        pass

    def touch(self, keys: Sequence[int]) -> None:
        """Held `keys` a forward computes again (behind a missing chunk): the most recently used."""
        with self._lock:
            self._used(keys)

    def begin_store(self, keys: list[int]) -> StoreBatch | None:
        """Admit `keys` (the least recently used ones beyond the capacity are dropped on every stage)."""
        if not keys:
            return None
        with self._lock:
            evicted: list[int] = []
            admitted = set(keys)
            # Evicted and admitted again before the batch is sent: its store stands (a DROP before the
            # forward, of a chunk held earlier, stays: the stage then stores the new one).
            self._ops.drops[:] = [k for k in self._ops.drops if k not in admitted]
            self._fresh |= admitted
            self._held.update((k, None) for k in keys)
            self._used(keys)
            while len(self._held) > self.capacity_chunks:
                evicted.append(key := self._held.popitem(last=False)[0])
                self._drop(key)
        self._forgotten(evicted)
        return StoreBatch(list(keys), [], [])

    def _forgotten(self, keys: list[int]) -> None:
        if keys and self.on_forgotten is not None:
            self.on_forgotten(keys)

    def _drop(self, key: int) -> None:
        """Under the lock: every stage takes `key` out of its LMCache: after the next forward when
        that forward stores it (admitted since the last batch was sent), else before it."""
        if key in self._fresh:
            self._ops.drops.append(key)
        else:
            self._ops.before.append((DROP, key, -1))

    def write_block(self, store: StoreBatch, block_id: int, views: Callable[[Sequence[int]], list[Tensor]]) -> None:
        """Every stage stores its device block `block_id` as `store.keys[0]` before the next batch."""
        with self._lock:
            self._ops.before.append((SAVE, store.keys[0], block_id))

    def count_store_copy(self, seconds: float) -> None:
        """Not counted: the stages' forwards do the copies."""
        pass

    def submit(self, batch: StoreBatch) -> bool:
        """The batch's forward ran (or its SAVE is queued): its chunks count as held, but for those a
        stage reported it could not store (`lost`) meanwhile."""
        with self._lock:
            lost = [k for k in batch.keys if k not in self._held]
            batch.keys = [k for k in batch.keys if k in self._held]
            self.stats_.num_stores += 1
            self.stats_.num_stored_tokens += len(batch.keys) * self.block_tokens
            self.stats_.num_stored_bytes += len(batch.keys) * self.chunk_bytes
        batch.ok = True
        batch.done.set()
        if self.on_stored is not None:
            if lost:  # not stored after all (the caller counted them as storing)
                self.on_stored(StoreBatch(lost, [], [], ok=False))
            self.on_stored(batch)
        return True

    def abort_store(self, batch: StoreBatch) -> None:
        """A batch whose forward did not run: its keys are lost (out of the index, dropped on every stage)."""
        self.lost(batch.keys)
        batch.done.set()

    def lost(self, keys: Sequence[int]) -> None:
        """Chunks the host tier no longer has (a stage could not store or load them, or their batch
        failed): out of the index, and dropped on every stage."""
        with self._lock:
            gone = [k for k in keys if k in self._held]
            for k in gone:
                del self._held[k]
                self._ops.before.append((DROP, k, -1))  # a stage may hold a wrong one: before anything else
            self.stats_.num_dropped_chunks += len(gone)
        self._forgotten(gone)

    def take_ops(self) -> HostOps:
        """The instructions for the batch about to be sent."""
        with self._lock:
            ops, self._ops = self._ops, HostOps()
            self._fresh.clear()
        return ops

    @property
    def keys(self) -> list[int]:
        """The index's keys, least recently used first."""
        with self._lock:
            return list(self._held)

    # ---- the rest --------------------------------------------------------------------------

    def forget(self) -> None:
        """The stages were restarted: their tiers are empty, and so is the index."""
        with self._lock:
            self._held.clear()
            self._ops = HostOps()
            self._fresh.clear()

    def clear(self) -> None:
        """Empty the index; every stage drops each chunk with the next batch."""
        with self._lock:
            for k in list(self._held):
                self._drop(k)
            self._held.clear()

    def flush(self) -> None:
        """Nothing to wait for: the stages store with each batch."""
        pass

    def reset_stats(self) -> None:
        """Zero the counters."""
        with self._lock:
            self.stats_ = HostTierStats()

    def stats(self) -> HostTierStats:
        """A copy of the counters."""
        with self._lock:
            return replace(self.stats_)

    def close(self) -> None:
        """Nothing to close: each stage closes its own LMCache tier."""
        pass


def staged_host(config: Config, args: ModelArgs, kv_dtype: str, model_name: str) -> StagedHost | None:
    """With `cache.suffix: offload`: the index of the stages' host tiers, as many chunks of the
    whole model as the configured LMCache size holds (each stage holds its layers' part of each)."""
    if config.cache.suffix != "offload":
        return None
    from tiered.offload.lmcache_setup import lmcache_config

    host, bt = config.cache.host, config.cache.block_tokens
    chunk_bytes = bt * args.kv_bytes_per_token(DTYPES[kv_dtype])
    capacity = int(float(lmcache_config(host.lmcache).max_local_cpu_size or 0) * 2**30 // chunk_bytes)
    if capacity < 1:
        raise ConfigError(
            f"config key 'cache.host.lmcache.max_local_cpu_size': holds no {chunk_bytes}-byte chunk of the model"
        )
    log.info(
        "host tier: LMCache in every stage, one index of %d chunks (%.1f MiB of the whole model's K,V)",
        capacity,
        capacity * chunk_bytes / 2**20,
    )
    return StagedHost(host, capacity, chunk_bytes, bt, model_name)


def stage_host_config(
    cfg: HostTierConfig, capacity_chunks: int, stage_chunk_bytes: int, in_flight_chunks: int
) -> HostTierConfig:
    """A stage's LMCache: room for the index's chunks of its layers, STAGE_ROOM to spare, and the
    chunks the batches in the pipe may store before their DROPs run (`in_flight_chunks`), in its
    CPU memory; no disk or remote backend (the config refuses them with stages)."""
    size_gb = (capacity_chunks * STAGE_ROOM + in_flight_chunks) * stage_chunk_bytes / 2**30 + 1 / 1024
    lmcache = {**cfg.lmcache, "max_local_cpu_size": size_gb, "local_disk": None, "remote_url": None}
    # Its stores must not be dropped for a full queue: the index counts them as held.
    return replace(cfg, lmcache=lmcache, max_pending_stores=max(cfg.max_pending_stores, 1 << 16))


class StageHost:
    """A stage's LMCache tier of its layers, doing what the coordinator's `StagedHost` decided."""

    def __init__(
        self, cfg: HostTierConfig, block_tokens: int, args: ModelArgs, dtype: torch.dtype, stage: int, model_name: str
    ) -> None:
        # LMCache never evicts on its own here (the index does): a store without room is reported dropped.
        self.tier = HostTier(
            cfg, block_tokens, args, dtype, f"stage-{stage}-{uuid.uuid4().hex[:8]}", model_name=model_name, evict=False
        )
        self.missed: list[int] = []  # this batch's LOADs that found no chunk
        self.dropped: list[int] = []  # this batch's stores that found no memory

    def before(self, ops: HostOps, pool: DeviceTier) -> None:
        """The batch's SAVEs, LOADs and DROPs before its forward, in order."""
        for kind, key, block in ops.before:
            if kind == SAVE:
                self._save(key, pool.blocks([block]))
                continue
            if kind == DROP:
                self.tier.remove([key])
                continue
            objs, _, _ = self.tier.get([key])
            if objs:
                self.tier.copy_into(objs, pool.blocks([block]))
            else:
                self.missed.append(key)

    def _save(self, key: int, block: list[Tensor]) -> None:
        store = self.begin_store([key])
        if store is not None:
            store.views[0].copy_(block[0])
            self.submit(store)

    def begin_store(self, keys: list[int]) -> StoreBatch | None:
        """LMCache memory for `keys` (those it has none for are reported dropped)."""
        store = self.tier.begin_store(keys)
        got = len(store.keys) if store is not None else 0
        self.dropped += keys[got:]
        return store

    def submit(self, store: StoreBatch) -> None:
        """Queue a written store for LMCache; its keys are reported dropped if it is refused."""
        if not self.tier.submit(store):
            self.dropped += store.keys

    def after(self, ops: HostOps) -> tuple[list[int], list[int]]:
        """The batch's DROPs (behind its stores); returns and resets what went wrong (missed, dropped)."""
        self.tier.remove(ops.drops)
        out = self.missed, self.dropped
        self.missed, self.dropped = [], []
        return out

    def holds(self, keys: Sequence[int]) -> tuple[list[int], int]:
        """Of `keys`, those this stage's LMCache lacks, and how many chunks it holds beyond them
        (after its queued stores and drops)."""
        self.tier.flush()
        missing = self.tier.missing(keys)
        return missing, self.tier.num_local_chunks() - (len(keys) - len(missing))

    def close(self) -> None:
        """Close this stage's LMCache tier."""
        self.tier.close()
