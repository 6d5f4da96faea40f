"""What every host tier offers the KV tiers: its counters and its calls. Two kinds: LMCache in this
process (`host_tier.HostTier`), or a pipeline's index of the LMCache tiers its stage processes
hold (`tiered.engine.pipeline.host.StagedHost`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from tiered.config import HostTierConfig
from tiered.request.plan import StoreBatch


@dataclass(slots=True)
class HostTierStats:
    """Counters since start. Seconds are wall time of the named stage, on the thread that ran it."""

    num_hit_tokens: int = 0
    num_remote_hit_tokens: int = 0  # of those, found in the remote store (`remote_url`) only
    num_disk_hit_tokens: int = 0  # of those, read from the local disk (`local_disk`): not in memory
    num_disk_write_failures: int = 0  # chunks the local disk could not take (full, read-only): memory only
    num_stored_tokens: int = 0
    num_failures: int = 0
    num_loads: int = 0
    num_loaded_bytes: int = 0
    load_lookup_seconds: float = 0.0  # which backend holds which key
    load_get_seconds: float = 0.0  # LMCache's batched_get (a remote backend reads here)
    load_copy_seconds: float = 0.0  # memory objects into device blocks; disk files read into them
    num_stores: int = 0
    num_stored_bytes: int = 0
    store_allocate_seconds: float = 0.0  # engine thread: LMCache's allocator (waits for memory included)
    store_wait_seconds: float = 0.0  # of those, waiting for memory that disk writes or queued stores held
    store_copy_seconds: float = 0.0  # the forward's KV sink (measured by the caller: `count_store_copy`)
    store_put_seconds: float = 0.0  # store thread: LMCache's batched_put
    store_thread_cpu_seconds: float = 0.0  # CPU time the store thread used (thread_time)
    store_throttle_seconds: float = 0.0  # sleeps that kept the store thread under its CPU share
    num_dropped_chunks: int = 0  # not stored: queue full, no LMCache memory, or dropped at close
    num_pending_stores: int = 0  # submitted, not yet put

    @property
    def load_seconds(self) -> float:
        """Seconds loads took in all: key lookup, LMCache's get and the copies into device blocks."""
        return self.load_lookup_seconds + self.load_get_seconds + self.load_copy_seconds

    @property
    def load_bytes_per_second(self) -> float:
        """Bytes loaded per second of load time (0 before any load)."""
        return self.num_loaded_bytes / self.load_seconds if self.load_seconds else 0.0

    @property
    def store_seconds(self) -> float:
        """Seconds stores cost the forward's thread (allocation and the sink's copies)."""
        return self.store_allocate_seconds + self.store_copy_seconds


class Host(Protocol):
    """A host tier as `KVTiers` and `PrefixLoader` use it (`HostTier` documents each call)."""

    cfg: HostTierConfig
    capacity_chunks: int  # chunks its local backends hold
    remote_url: str | None
    has_disk: bool  # a local disk behind its memory (`in_memory` tells the two apart)
    # Its `load` only queues the copy for the workers that hold the chunks (a pipeline's stages),
    # in order with the other instructions its index decides: it is called at lookup, not deferred.
    queues_loads: bool
    model_name: str
    on_stored: Callable[[StoreBatch], None] | None
    # Called with keys the tier is known to have given up (a pipeline's index); LMCache evicts silently.
    on_forgotten: Callable[[list[int]], None] | None

    def get(self, keys: Sequence[int]) -> tuple[list[Any], int, int]:
        """Chunks of the leading `keys` held, each with a reference, how many came from the remote
        store (the last ones) and how many from a local disk (those before them)."""
        ...

    def in_memory(self, key: int) -> bool:
        """Whether the chunk of `key` is in the tier's memory (not only on its disk); no I/O, no lock."""
        ...

    def load(
        self,
        objs: Sequence[Any],
        block_ids: Sequence[int],
        views: Callable[[Sequence[int]], list[Tensor]],
        num_remote: int = 0,
        num_disk: int = 0,
    ) -> int:
        """Copy chunks `get` returned into the device-tier blocks `block_ids`, releasing them; returns
        how many leading blocks were filled (fewer when a chunk could not be read)."""
        ...

    def evict_from_memory(self, keys: Sequence[int]) -> int:
        """Leave the chunks of `keys` on the tier's disk only (the start-up profile); returns how many are."""
        ...

    def release(self, objs: Sequence[Any]) -> None:
        """Drop the references of chunks `get` returned that will not be loaded."""
        ...

    def touch(self, keys: Sequence[int]) -> None:
        """Mark held `keys` as just used, so the tier evicts them later."""
        ...

    def missing(self, keys: Sequence[int]) -> list[int]:
        """Of `keys`, those the tier does not hold."""
        ...

    def begin_store(self, keys: list[int]) -> StoreBatch | None:
        """Room to store the chunks of a leading part of `keys`; None when there is none."""
        ...

    def write_block(self, store: StoreBatch, block_id: int, views: Callable[[Sequence[int]], list[Tensor]]) -> None:
        """Copy the device-tier block `block_id` into the store's one chunk."""
        ...

    def count_store_copy(self, seconds: float) -> None:
        """Add `seconds` the forward's KV sink spent copying into store chunks to the counters."""
        ...

    def submit(self, batch: StoreBatch) -> bool:
        """Hand a written batch over to be stored; False if it was dropped instead."""
        ...

    def abort_store(self, batch: StoreBatch) -> None:
        """Give up a batch whose forward did not run, freeing what `begin_store` reserved."""
        ...

    def flush(self) -> None:
        """Wait until every batch submitted so far is stored or dropped."""
        ...

    def clear(self) -> None:
        """Drop every chunk the tier holds."""
        ...

    def reset_stats(self) -> None:
        """Zero the counters."""
        ...

    def stats(self) -> HostTierStats:
        """A copy of the counters."""
        ...

    def close(self) -> None:
        """Shut the tier down when the engine stops."""
        ...
