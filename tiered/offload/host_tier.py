"""The host tier: LMCache 0.5.6 used as a library (with `lmcache_setup.py`, the only modules that import it).

Design notes: docs/internals.md, section `tiered/offload/host_tier.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from tiered.config import HostTierConfig
from tiered.hybrid.args import ModelArgs
from tiered.offload import lmcache_setup as lm
from tiered.offload.host_base import HostTierStats
from tiered.request.plan import StoreBatch

log = logging.getLogger(__name__)

_KEY_MASK = (1 << 64) - 1  # LMCache prints chunk hashes in hex: keep them unsigned
STORE_WAIT_POLL_S = 0.002  # how often a store waiting for LMCache memory tries again


class _DiskChunk:
    """A chunk of LMCache's local disk, read straight into its device-tier block by `copy_into` (no
    staging in LMCache's memory, which the stores share). Pinned in the disk backend from `get` until
    released, so that LMCache's eviction leaves its file alone meanwhile."""

    __slots__ = ("backend", "key", "meta")

    def __init__(self, backend: Any, key: Any, meta: Any) -> None:
        self.backend, self.key, self.meta = backend, key, meta  # meta: the disk index's entry, pinned

    @property
    def path(self) -> str:
        """The chunk's file."""
        return str(self.meta.path)

    def read_into(self, block: Tensor, bounce: Callable[[], Tensor]) -> bool:
        """The file's bytes into `block` (a device-tier block, the chunk's layout); False when the
        file is gone or shorter than the block. A block not in CPU memory, or not contiguous, is
        filled from `bounce()` (a CPU buffer of the block's size, pinned where cuda is used)."""
        direct = block.device.type == "cpu" and block.is_contiguous()
        target = block if direct else bounce()
        raw: Any = target.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes, writable
        try:
            with open(self.path, "rb") as f:  # buffered: reads on until the block is full or the file ends
                n = f.readinto(raw)
        except OSError:
            return False
        if n != target.numel() * target.element_size():
            return False
        if not direct:
            block.copy_(target.view(block.shape))
        return True

    def ref_count_down(self) -> None:
        """Release: unpin the entry this read pinned (not one stored again under the key since)."""
        with self.backend.disk_lock:
            self.meta.unpin()

    def forget(self) -> None:
        """The file could not be read: take the chunk out of LMCache's disk index (its bytes given
        back to LMCache's accounting, as its eviction would) and remove what is left of the file."""
        with self.backend.disk_lock:
            if self.backend.dict.get(self.key) is not self.meta:
                return  # gone already, or stored again since: not ours to remove
            del self.backend.dict[self.key]
            self.backend.current_cache_size -= self.meta.size
            self.backend.usage -= self.meta.size
            self.backend.cache_policy.update_on_force_evict(self.key)
        with contextlib.suppress(OSError):
            os.remove(self.meta.path)


class HostTier:
    """LMCache's storage (CPU, disk, remote backends as configured) keyed by our block keys."""

    queues_loads = False  # `load` copies the chunks itself: the worker side calls it before the forward

    def __init__(
        self,
        cfg: HostTierConfig,
        block_tokens: int,
        args: ModelArgs,
        dtype: torch.dtype,
        instance_id: str,
        *,
        model_name: str | None = None,
        evict: bool = True,
    ) -> None:
        """`instance_id` names this tier's LMCache engine in the process; `model_name` (default:
        the instance id) is LMCache's model name, part of every chunk key: engines that share a
        remote store (`remote_url`) share chunks when they give the same name (the model's identity).
        `evict=False`: a store finds no memory rather than evict (a pipeline stage's:
        tiered/engine/pipeline/host.py)."""
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        self.cfg = cfg
        self.block_tokens = block_tokens
        self.instance_id = instance_id
        self.model_name = model_name = model_name or instance_id
        self.chunk_shape = (2, args.num_layers, block_tokens, args.num_kv_heads, args.head_dim)
        self.chunk_bytes = block_tokens * args.kv_bytes_per_token(dtype)
        self._dtype, self._evict = dtype, evict
        self._engine, config = lm.start_lmcache(cfg.lmcache, args, block_tokens, dtype, instance_id, model_name)
        local_gb = float(config.max_local_cpu_size or 0) + (
            float(config.max_local_disk_size or 0) if config.local_disk else 0.0
        )
        # How many chunks this tier's local backends hold (a remote store's size is unknown: keys we
        # learn of it are bounded with the local ones, and a forgotten one costs only a lookup).
        self.capacity_chunks = int(local_gb * 2**30 / self.chunk_bytes)
        self.remote_url: str | None = config.remote_url or None
        self._storage = self._engine.storage_manager
        lm.bound_reuse_record(self._storage, self.capacity_chunks)
        lm.fix_remote_close(self._storage)
        # LMCache's local disk backend (`local_disk`), whose chunks its CPU backend may no longer hold.
        self.has_disk = lm.guard_disk_writes(self._storage, self._disk_write_failed)
        self._memory = self._storage.storage_backends.get("LocalCPUBackend")
        self._disk = self._storage.storage_backends.get("LocalDiskBackend")
        self._bounce = threading.local()  # per thread: a disk chunk's way to a block outside CPU memory
        self._fmt = MemoryFormat.KV_2LTD
        self._obj_shape = torch.Size([2, args.num_layers, block_tokens, args.num_kv_heads * args.head_dim])
        self._key = lambda k: CacheEngineKey(model_name, 1, 0, k & _KEY_MASK, dtype, None)
        self._lock = threading.Lock()  # LMCache calls, `_pending` and the counters
        self._pending: dict[int, tuple[StoreBatch, int]] = {}  # key -> (batch, index): not put yet
        self._queue: deque[StoreBatch] = deque()
        self._wake = threading.Condition(self._lock)
        self._last: StoreBatch | None = None  # the latest batch submitted (flush waits for it)
        self._closed = False
        self.stats_ = HostTierStats()
        # Called on the store thread after each batch was put (`batch.ok`) or dropped.
        self.on_stored: Callable[[StoreBatch], None] | None = None
        self.on_forgotten: Callable[[list[int]], None] | None = None  # never called: LMCache evicts silently
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._store_loop, name="tiered-host-store", daemon=True)
        self._thread.start()
        # LMCache's worker threads are not daemons: an engine left open (an exception in the
        # caller) would hang interpreter exit. This hook runs before non-daemon threads are
        # joined (the one concurrent.futures uses); Python's `atexit` runs too late for that.
        if (register := getattr(threading, "_register_atexit", None)) is not None:
            register(self.close)

    def _disk_write_failed(self, exc: OSError) -> None:
        """A chunk LMCache could not write to its disk (full, read-only, failing): it stays in memory only."""
        with self._lock:
            self.stats_.num_disk_write_failures += 1
            self._failed("disk write", exc)

    def in_memory(self, key: int) -> bool:
        """Whether the chunk of `key` is in the tier's memory (else it is on its disk or remote, or
        gone). Lock-free: one dict lookup, read as the scheduler estimates."""
        return self._memory is None or self._key(key) in self._memory.hot_cache

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats_.num_failures += 1
        if what not in self._warned:
            self._warned.add(what)
            log.warning("host tier %s failed (%s: %s); recomputing instead", what, type(exc).__name__, exc)

    # ---- loads -----------------------------------------------------------------------------

    def get(self, keys: Sequence[int]) -> tuple[list[Any], int, int]:
        """Memory objects of the leading `keys` this tier holds (pending stores included), how
        many of them came from the remote store (the last ones: LMCache looks in its memory, then
        its disk, then the remote store) and how many from its local disk (those before them).

        Each returned object carries a reference: pass the list to `copy_into` (or `release`)."""
        out: list[Any] = []
        remote: set[int] = set()
        disk: set[int] = set()
        with self._lock:
            start = time.perf_counter()
            i = 0
            while i < len(keys) and keys[i] in self._pending:  # written by a forward, not put yet
                batch, j = self._pending[keys[i]]
                if batch.ready is not None:
                    batch.ready.synchronize()
                batch.objs[j].ref_count_up()
                out.append(batch.objs[j])
                i += 1
            rest = [(self._key(k), n, n + 1) for n, k in enumerate(keys[i:])]
            found: dict[int, Any] = {}
            try:
                mapping = self._storage.get_block_mapping(rest) if rest else {}
                lookup = time.perf_counter()
                self.stats_.load_lookup_seconds += lookup - start
                for location, chunks in mapping.items():
                    if location == "LocalDiskBackend" and self._disk is not None:
                        found.update(self._pin_on_disk(chunks))
                        disk.update(c[1] for c in chunks)
                        continue
                    objs = self._storage.batched_get([c[0] for c in chunks], location=location)
                    found.update((c[1], obj) for c, obj in zip(chunks, objs, strict=True))
                    if location == "RemoteBackend":
                        remote.update(c[1] for c in chunks)
                self.stats_.load_get_seconds += time.perf_counter() - lookup
            except Exception as exc:  # noqa: BLE001 - any host-tier fault degrades to a miss
                self._failed("retrieve", exc)
                for obj in found.values():  # fetched from a backend before another failed
                    if obj is not None:
                        obj.ref_count_down()
                found = {}
            n = 0
            while n in found and found[n] is not None:
                out.append(found.pop(n))
                n += 1
            for obj in found.values():  # behind a gap: not usable as a prefix
                if obj is not None:
                    obj.ref_count_down()
            num_remote = sum(1 for r in remote if r < n)
            num_disk = sum(1 for d in disk if d < n)
            lm.touch_local(self._storage, [self._key(k) for k in keys[: len(out)]])  # a hit: just used
        return out, num_remote, num_disk

    def _pin_on_disk(self, chunks: Sequence[tuple[Any, int, int]]) -> dict[int, _DiskChunk | None]:
        """The disk's chunks (LMCache's (key, index, index + 1)), each pinned with its file's path and
        counted as just used by the disk's eviction policy (as LMCache's own reads do), the first
        last: a prefix's first chunk is evicted after its later ones; None for one LMCache evicted
        since its lookup."""
        assert self._disk is not None
        out: dict[int, _DiskChunk | None] = {}
        with self._disk.disk_lock:
            for key, index, _ in reversed(chunks):
                meta = self._disk.dict.get(key)
                if meta is not None:
                    meta.pin()
                    self._disk.cache_policy.update_on_hit(key, self._disk.dict)
                out[index] = _DiskChunk(self._disk, key, meta) if meta is not None else None
        return out

    def _bounce_buffer(self) -> Tensor:
        """This thread's CPU buffer of one chunk (the engine's and the prefetch thread's loads overlap)."""
        bounce: Tensor | None = getattr(self._bounce, "buffer", None)
        if bounce is None:
            pin = torch.cuda.is_available()
            bounce = self._bounce.buffer = torch.empty(self.chunk_shape, dtype=self._dtype, pin_memory=pin)
        return bounce

    def load(
        self,
        objs: Sequence[Any],
        block_ids: Sequence[int],
        views: Callable[[Sequence[int]], list[Tensor]],
        num_remote: int = 0,
        num_disk: int = 0,
    ) -> int:
        """`copy_into` the device-tier blocks `block_ids` (`views` gives their tensors)."""
        return self.copy_into(objs, views(block_ids), num_remote, num_disk)

    def copy_into(self, objs: Sequence[Any], blocks: Sequence[Tensor], num_remote: int = 0, num_disk: int = 0) -> int:
        """Copy chunk i into `blocks[i]` (a device-tier block), then release the objects; the
        last `num_remote` of them came from the remote store, the `num_disk` before those from disk.

        Returns how many leading blocks hold their chunk: all of them, unless a disk file vanished
        or was cut short (LMCache cleared, a failing disk); the blocks after it are not filled."""
        start = time.perf_counter()
        in_memory = [(b, obj) for b, obj in zip(blocks, objs, strict=True) if not isinstance(obj, _DiskChunk)]
        if in_memory:
            srcs = [obj.tensor.view(self.chunk_shape) for _, obj in in_memory]
            non_blocking = blocks[0].device.type == "cuda"
            torch._foreach_copy_([b for b, _ in in_memory], srcs, non_blocking=non_blocking)
            if non_blocking:
                torch.cuda.current_stream(blocks[0].device).synchronize()  # the objects are released below
        n = 0
        while n < len(objs) and (
            not isinstance(objs[n], _DiskChunk) or objs[n].read_into(blocks[n], self._bounce_buffer)
        ):
            n += 1
        seconds = time.perf_counter() - start
        with self._lock:
            for obj in objs:
                obj.ref_count_down()
            if n < len(objs):  # LMCache forgets the chunk: it is stored again once recomputed
                self._failed("disk read", OSError(f"{objs[n].path} is missing or shorter than a chunk"))
                objs[n].forget()
            num_disk = max(0, min(num_disk, n - (len(objs) - num_remote - num_disk)))
            num_remote = max(0, n - (len(objs) - num_remote))
            self.stats_.num_loads += 1
            self.stats_.num_loaded_bytes += n * self.chunk_bytes
            self.stats_.load_copy_seconds += seconds
            self.stats_.num_hit_tokens += n * self.block_tokens
            self.stats_.num_remote_hit_tokens += num_remote * self.block_tokens
            self.stats_.num_disk_hit_tokens += num_disk * self.block_tokens
        return n

    def release(self, objs: Sequence[Any]) -> None:
        """Drop the references `get` took on objects that will not be copied."""
        with self._lock:
            for obj in objs:
                obj.ref_count_down()

    # ---- stores ----------------------------------------------------------------------------

    def touch(self, keys: Sequence[int]) -> None:
        """Held `keys` a forward computes again (behind a lost chunk): just used (see `KVTiers._plan`)."""
        with self._lock:
            lm.touch_local(self._storage, [self._key(k) for k in keys])

    def missing(self, keys: Sequence[int]) -> list[int]:
        """Of `keys`, those this tier holds neither in LMCache nor pending (all of them if LMCache fails)."""
        with self._lock:
            try:
                return [k for k in keys if k not in self._pending and self._storage.contains(self._key(k)) is None]
            except Exception as exc:  # noqa: BLE001 - a failing tier holds nothing we can use
                self._failed("lookup", exc)
                return list(keys)

    def begin_store(self, keys: list[int]) -> StoreBatch | None:
        """LMCache memory for the chunks of `keys`, evicting its LRU chunks as needed.

        Memory that writes to LMCache's disk (or stores queued for LMCache) hold frees within
        moments: a store waits for it up to `store_wait_s`, as a chunk dropped now is recomputed
        at its next use. Beyond that only a leading part of `keys` gets memory (`batch.keys` says
        which); None when none does. One allocation per chunk: LMCache 0.5.6's batched
        allocation evicts only in its layer-wise mode."""
        if not keys:
            return None
        objs: list[Any] = []
        with self._lock:
            start = time.perf_counter()
            deadline = start + self.cfg.store_wait_s
            waited = 0.0
            try:
                while len(objs) < len(keys):
                    obj = self._storage.allocate(
                        self._obj_shape, self._dtype, self._fmt, eviction=self._evict, busy_loop=False
                    )
                    if obj is not None:
                        objs.append(obj)
                        continue
                    if not self._memory_on_its_way() or time.perf_counter() >= deadline:
                        break
                    began = time.perf_counter()
                    self._lock.release()  # the store thread needs it to let go of what it put
                    try:
                        time.sleep(STORE_WAIT_POLL_S)
                    finally:
                        self._lock.acquire()
                    waited += time.perf_counter() - began
            except Exception as exc:  # noqa: BLE001
                self._failed("store", exc)
            self.stats_.store_allocate_seconds += time.perf_counter() - start
            self.stats_.store_wait_seconds += waited
            self.stats_.num_dropped_chunks += len(keys) - len(objs)
        if not objs:
            return None
        return StoreBatch(keys[: len(objs)], [obj.tensor.view(self.chunk_shape) for obj in objs], objs)

    def _memory_on_its_way(self) -> bool:
        """Under the lock: whether LMCache memory is held by what frees it unaided (stores queued
        for LMCache, chunks being written to its disk), and LMCache may evict it then."""
        if not self._evict:
            return False
        if self._queue or self._pending:
            return True
        return self._disk is not None and bool(self._disk.disk_worker.put_tasks)

    def write_block(self, store: StoreBatch, block_id: int, views: Callable[[Sequence[int]], list[Tensor]]) -> None:
        """The device-tier block `block_id` into the store's one chunk (cuda: on the current stream)."""
        block = views([block_id])[0]
        store.views[0].copy_(block, non_blocking=block.device.type == "cuda")
        if block.device.type != "cuda":
            return
        store.ready = torch.cuda.Event()
        store.ready.record(torch.cuda.current_stream(block.device))

    def count_store_copy(self, seconds: float) -> None:
        """Add the seconds the forward's KV sink spent writing into store chunks (measured by the caller)."""
        with self._lock:
            self.stats_.store_copy_seconds += seconds

    def submit(self, batch: StoreBatch) -> bool:
        """Queue a written batch for LMCache; False (and the batch dropped) if the queue is full."""
        with self._lock:
            if not self._closed and len(self._queue) < self.cfg.max_pending_stores:
                for i, (k, obj) in enumerate(zip(batch.keys, batch.objs, strict=True)):
                    obj.ref_count_up()  # `_pending`'s own reference: readable until LMCache has it
                    self._pending.setdefault(k, (batch, i))
                self._queue.append(batch)
                self._last = batch
                self.stats_.num_pending_stores += 1
                self._wake.notify()
                return True
            self._release(batch, queued=False)
        self._finished(batch)
        return False

    def remove(self, keys: list[int]) -> None:
        """Take `keys` out of LMCache after every store queued before (tiered/engine/pipeline/host.py)."""
        with self._lock:
            if keys and not self._closed:
                for k in keys:  # a store of it not yet put is no longer readable (a later one will be)
                    self._pending.pop(k, None)
                self._queue.append(batch := StoreBatch(keys, [], [], remove=True))
                self._last = batch
                self._wake.notify()

    def abort_store(self, batch: StoreBatch) -> None:
        """A batch whose forward did not run: give its memory back (not counted as dropped)."""
        with self._lock:
            for obj in batch.objs:
                obj.ref_count_down()
        batch.done.set()

    def _release(self, batch: StoreBatch, queued: bool) -> None:
        """Under the lock: drop a batch not put (its memory back to LMCache, its pending keys gone)."""
        for obj in batch.objs:
            obj.ref_count_down()
            if queued:
                obj.ref_count_down()
        self._forget_pending(batch)
        self.stats_.num_dropped_chunks += len(batch.keys)

    def _forget_pending(self, batch: StoreBatch) -> None:
        for k in batch.keys:
            if self._pending.get(k, (None, 0))[0] is batch:
                del self._pending[k]

    def _finished(self, batch: StoreBatch) -> None:
        batch.done.set()
        if self.on_stored is not None:
            self.on_stored(batch)

    def _store_loop(self) -> None:
        # Not torch.set_num_threads(1): that would set the whole process's (the forward's) threads.
        share = self.cfg.store_cpu_share
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()  # close() drops only what is still queued
            if batch.remove:
                self._remove(batch)
                continue
            cpu = time.thread_time()
            if batch.ready is not None:
                batch.ready.synchronize()
            start = time.perf_counter()
            try:
                # Outside our lock (LMCache's backends lock themselves): a slow backend holds up
                # this thread only, never an allocation or a load. LMCache takes its own
                # reference to each object and drops the one we allocated with.
                # The last chunk first: LMCache's LRU then evicts a prefix from its end.
                self._storage.batched_put([self._key(k) for k in reversed(batch.keys)], batch.objs[::-1])
                batch.ok = True
            except Exception as exc:  # noqa: BLE001 - a failed put leaves its memory to LMCache
                with self._lock:
                    self._failed("store", exc)
            put = time.perf_counter() - start
            with self._lock:
                self._forget_pending(batch)
                for obj in batch.objs:
                    obj.ref_count_down()  # `_pending`'s reference
                if batch.ok:
                    self.stats_.num_stores += 1
                    self.stats_.num_stored_tokens += len(batch.keys) * self.block_tokens
                    self.stats_.num_stored_bytes += len(batch.keys) * self.chunk_bytes
                else:
                    self.stats_.num_dropped_chunks += len(batch.keys)
                self.stats_.store_put_seconds += put
                self.stats_.num_pending_stores -= 1
                used = time.thread_time() - cpu
                self.stats_.store_thread_cpu_seconds += used
            self._finished(batch)
            if share < 1.0 and not self._closed:  # stay under `share` of one core, by this thread's clock
                pause = used * (1.0 - share) / share
                with self._lock:
                    self.stats_.store_throttle_seconds += pause
                time.sleep(pause)

    def _remove(self, batch: StoreBatch) -> None:
        try:
            self._storage.batched_remove([self._key(k) for k in batch.keys])
        except Exception as exc:  # noqa: BLE001 - a chunk left behind is only memory, evicted in time
            with self._lock:
                self._failed("remove", exc)
        batch.done.set()

    def flush(self) -> None:
        """Wait until every batch submitted so far is in LMCache (or dropped)."""
        with self._lock:
            last = self._last
        if last is not None:
            last.done.wait()

    # ---- the rest --------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop everything LMCache holds (tests and benchmarks)."""
        self.flush()
        with self._lock:
            self._engine.clear()

    def evict_from_memory(self, keys: Sequence[int], timeout_s: float = 10.0) -> int:
        """Take the chunks of `keys` out of the tier's memory once its disk holds them (the start-up
        profile's disk loads: a prefix only the disk holds). Returns how many are on disk only now."""
        backend = self._storage.storage_backends.get("LocalDiskBackend")
        if backend is None:
            return 0
        self.flush()
        cache_keys = [self._key(k) for k in keys]
        deadline = time.monotonic() + timeout_s  # LMCache writes its files in its own threads
        while any(backend.exists_in_put_tasks(k) for k in cache_keys) and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            on_disk = [k for k in cache_keys if backend.contains(k)]
            for k in on_disk:
                self._storage.remove(k, locations=["LocalCPUBackend"])
        return len(on_disk)

    def num_local_chunks(self) -> int:
        """Chunks LMCache's local backends hold now."""
        with self._lock:
            return lm.count_local(self._storage)

    def reset_stats(self) -> None:
        """Zero the counters (after the engine's start-up profile, so they count served traffic)."""
        with self._lock:
            pending = self.stats_.num_pending_stores
            self.stats_ = HostTierStats(num_pending_stores=pending)

    def stats(self) -> HostTierStats:
        """A copy of the counters, taken under the lock."""
        with self._lock:
            return replace(self.stats_)

    def close(self) -> None:
        """Stop the store thread: its backlog is put first (`on_close: drain`) or dropped (`drop`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            dropped = [b for b in self._queue if not b.remove] if self.cfg.on_close == "drop" else []
            for batch in dropped:
                self._release(batch, queued=True)
                self.stats_.num_pending_stores -= 1
            if dropped:
                for batch in self._queue:
                    batch.done.set()  # removals too: nothing will put or remove anything now
                self._queue.clear()
            self._wake.notify()
        for batch in dropped:
            self._finished(batch)
        self._thread.join()
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        if left := lm.drain_remote_puts(self._storage):
            log.warning("closing the host tier with %d remote puts still in flight", left)
        LMCacheEngineBuilder.destroy(self.instance_id)
