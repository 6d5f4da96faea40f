"""LMCache's own conventions, kept for the host tier: set up before LMCache is first imported.

- `LMCACHE_CONFIG_FILE` and `LMCACHE_*` variables are read as LMCache reads them (its loader:
  file, then environment), below `cache.host.lmcache` (explicit overrides); our default host-tier
  size applies only where none of them sets it.
- Its usage telemetry is off unless `LMCACHE_TRACK_USAGE` says otherwise.
- It logs at WARNING unless `LMCACHE_LOG_LEVEL` says otherwise, through our handlers (one plain
  format, no ANSI colours), without its warnings about parts we do not use.
- Closing its Redis connector deadlocks in 0.5.6: `fix_remote_close` works around it.
- Its LRU policy's record of when each chunk was first stored (for its chunk-reuse statistic)
  is bounded by the tier's size, not by LMCache's 12.5 M entries (~1 GiB: it grew ~100 bytes per
  new chunk, the engine's RSS creep in the soak).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered.config import ConfigError
from tiered.config.tree import require_writable_dir
from tiered.hybrid.args import ModelArgs

# Set before LMCache is first imported (it reads them at import): a user's own values win.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
# Our default host-tier size, unless the YAML, LMCACHE_MAX_LOCAL_CPU_SIZE or LMCACHE_CONFIG_FILE sets one.
DEFAULT_LMCACHE = {"max_local_cpu_size": 0.25}


class _NotOurConcern(logging.Filter):
    """LMCache warnings about parts we do not use: its token hashing (we pass our own chunk keys,
    so neither its hash function nor PYTHONHASHSEED matters to it) and its cache controller; and its
    allocator's warning, on every store into a full tier, that it must evict first (a full tier is
    the steady state, and LMCache then evicts as designed)."""

    MARKS = (
        "PYTHONHASHSEED",
        "Could not load 'builtin'",
        "Controller message sender is not initialized",
        "because no memory is available",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop the records that carry one of MARKS."""
        message = record.getMessage()
        return not any(mark in message for mark in self.MARKS)


_NOT_OUR_CONCERN = _NotOurConcern()


def quiet_lmcache() -> None:
    """LMCache's loggers each carry their own coloured handler and do not propagate: route them
    through ours (one format for every process, no ANSI codes) at LMCACHE_LOG_LEVEL."""
    level = getattr(logging, os.environ.get("LMCACHE_LOG_LEVEL", "WARNING").upper(), logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
            logger.setLevel(level)
            if _NOT_OUR_CONCERN not in logger.filters:
                logger.addFilter(_NOT_OUR_CONCERN)


def lmcache_config(options: dict[str, Any]) -> Any:
    """LMCache's config as LMCache builds it (LMCACHE_CONFIG_FILE, then LMCACHE_* variables),
    then `options` on top; our defaults only for keys none of those set."""
    import yaml
    from lmcache.v1.config import load_engine_config_with_overrides

    from_env = {k[len("LMCACHE_") :].lower() for k in os.environ if k.startswith("LMCACHE_")}
    path = os.environ.get("LMCACHE_CONFIG_FILE")
    try:
        from_file = set(yaml.safe_load(Path(path).read_text()) or {}) if path else set()
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"LMCACHE_CONFIG_FILE '{path}' cannot be read as YAML: {exc}") from None
    defaults = {k: v for k, v in DEFAULT_LMCACHE.items() if k not in from_env | from_file}
    return load_engine_config_with_overrides(overrides={**defaults, **options})


def lmcache_config_keys() -> set[str]:
    """Every key LMCache's config knows (to check the keys of `cache.host.lmcache`)."""
    from lmcache.v1 import config as lmcache_config

    return set(lmcache_config._CONFIG_DEFINITIONS)


# Entries of LMCache's chunk-reuse record per chunk the tier can hold, and the most in any case:
# a record of a chunk long evicted only feeds a statistic. LMCache clears the record when full.
REUSE_RECORD_PER_CHUNK = 2
REUSE_RECORD_MIN = 1024
REUSE_RECORD_MAX = 1 << 18  # ~26 MiB at ~100 bytes an entry


def bound_reuse_record(storage_manager: Any, capacity_chunks: int) -> int:
    """Bound the chunk-reuse record of every LMCache backend policy that keeps one; returns the bound."""
    bound = max(REUSE_RECORD_MIN, min(REUSE_RECORD_PER_CHUNK * capacity_chunks, REUSE_RECORD_MAX))
    for backend in getattr(storage_manager, "storage_backends", {}).values():
        policy = getattr(backend, "cache_policy", None)
        if policy is not None and hasattr(policy, "max_num_chunk_hash"):
            policy.max_num_chunk_hash = bound
    return bound


# Seconds LMCache's remote job executor may take to drain at close (puts still in flight).
REMOTE_CLOSE_TIMEOUT_S = 10.0


def touch_local(storage_manager: Any, keys: Sequence[Any]) -> None:
    """Count the CPU backend's chunks of `keys` (CacheEngineKeys) as just used, the first key last:
    a prefix's first chunk is evicted after its later ones, as a hit should (LMCache 0.5.6 does
    it only for a pinned lookup's keys: its gets and our lookups leave the order as stored). Only
    under the LRU policy (under MRU a touch would mark the chunk to evict next)."""
    backend = storage_manager.storage_backends.get("LocalCPUBackend")
    if backend is None or type(backend.cache_policy).__name__ != "LRUCachePolicy":
        return
    with backend.cpu_lock:
        for key in reversed(keys):
            if key in backend.hot_cache:
                backend.cache_policy.update_on_hit(key, backend.hot_cache)


def count_local(storage_manager: Any) -> int:
    """Chunks LMCache's local backends hold."""
    return sum(len(getattr(b, "hot_cache", ())) for b in storage_manager.storage_backends.values())


def _redis_connectors(storage_manager: Any) -> list[tuple[Any, Any]]:
    """(connector, its job executor) of each of LMCache's Redis connectors, unwrapped."""
    out = []
    for backend in getattr(storage_manager, "storage_backends", {}).values():
        connector: Any = getattr(backend, "connection", None)
        while hasattr(connector, "getWrappedConnector"):  # LMCache's instrumenting wrappers
            connector = connector.getWrappedConnector()
        executor = getattr(connector, "pq_executor", None)
        if executor is not None and hasattr(executor, "shutdown_async") and hasattr(connector, "connection"):
            out.append((connector, executor))
    return out


def fix_remote_close(storage_manager: Any) -> int:
    """Work around LMCache 0.5.6's deadlock when closing its Redis connectors.

    Their `close` coroutine, run on LMCache's event loop, calls the job executor's blocking
    `shutdown`, which waits for a coroutine scheduled on that same loop: `LMCacheEngineBuilder.destroy`
    never returns. Each such connector gets a `close` that awaits the executor's own
    `shutdown_async` instead (what the blocking one schedules; bounded by REMOTE_CLOSE_TIMEOUT_S,
    as a worker cancelled mid-put can keep it from returning), then closes its connection pool.
    Returns how many connectors were fixed. (RESP's connector, which keeps a `client` and no
    `connection`, is not covered.)"""
    connectors = _redis_connectors(storage_manager)
    for connector, executor in connectors:

        async def close(connector: Any = connector, executor: Any = executor) -> None:
            try:
                await asyncio.wait_for(executor.shutdown_async(wait=True), REMOTE_CLOSE_TIMEOUT_S)
            except TimeoutError:
                logging.getLogger(__name__).warning(
                    "LMCache's remote store did not drain within %.0f s; closing it anyway", REMOTE_CLOSE_TIMEOUT_S
                )
            await connector.connection.aclose()

        connector.close = close
    return len(connectors)


def drain_remote_puts(storage_manager: Any, timeout_s: float = REMOTE_CLOSE_TIMEOUT_S) -> int:
    """Wait until LMCache's Redis connectors have no job queued or running: their puts send from
    LMCache memory, which closing frees (a put still sending would read freed memory, a crash).
    LMCache tracks batched puts nowhere else. Returns how many jobs were left at the deadline."""
    executors = [e for _, e in _redis_connectors(storage_manager)]
    deadline = time.monotonic() + timeout_s
    idle = 0
    while True:
        left = sum(getattr(e._queue, "_unfinished_tasks", 0) for e in executors)
        idle = idle + 1 if not left else 0
        if idle >= 5 or time.monotonic() > deadline:  # idle five polls running: no put between submit and queue
            return left
        time.sleep(0.01)


def reentrant_observability_lock() -> None:
    """Work around LMCache 0.5.6's self-deadlock in its `thread_safe` functions.

    They all take one module-wide `threading.Lock`; the allocator's `free` is one of them, and a
    memory object frees itself in `__del__`. When the garbage collector runs inside one of those
    functions (any allocation there may start it) and collects a memory object (one held in a
    reference cycle, such as a traceback of a failed remote lookup), `free` waits for the lock its
    own thread holds: the process hangs. A re-entrant lock lets the same thread in again; the
    functions it serialises (metric bookkeeping, the allocator) do not interleave their state.
    Idempotent; the lock must be replaced before LMCache first takes it (before its first engine)."""
    import lmcache.utils

    if not isinstance(lmcache.utils._shared_observability_lock, type(threading.RLock())):
        lmcache.utils._shared_observability_lock = threading.RLock()  # type: ignore[assignment]


def local_disk_paths(config: Any) -> list[str]:
    """The directories of LMCache's local disk backend in `config` ([] when it has none: no path, or
    no size), as LMCache reads them: comma-separated, each maybe prefixed `file://`."""
    if not config.local_disk or float(config.max_local_disk_size or 0) <= 0:
        return []
    return [p.strip().removeprefix("file://") for p in str(config.local_disk).split(",") if p.strip()]


def import_lmcache() -> None:
    """Import the LMCache modules a host tier starts with (a process that will start one can load
    them while it waits for something else)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: F401


def check_local_disk(config: Any) -> list[str]:
    """Each local disk directory made if missing and written once: a path that cannot hold the disk
    tier (a file, read-only, not creatable) is a ConfigError naming the key (LMCache would fail in
    its own thread, or kill the engine with a traceback). Returns the directories."""
    paths = local_disk_paths(config)
    for path in paths:
        require_writable_dir(path, "cache.host.lmcache.local_disk", "the disk tier")
    return paths


class _DiskWriteFailed(OSError):
    """A chunk's file could not be written (raised by the guarded `write_file` only)."""


def guard_disk_writes(storage_manager: Any, on_failure: Callable[[OSError], None]) -> bool:
    """Make a failed write of LMCache's local disk backend (disk full, read-only, I/O error) leave
    nothing behind: in LMCache 0.5.6 it raises in LMCache's worker thread after the chunk was
    admitted (its bytes counted, a reference and an in-flight mark held: never given back) and
    before the key is published. Here the partial file is removed, the admission undone, and
    `on_failure` called; the chunk stays in memory only (a later miss recomputes it). Returns
    whether there is a disk backend."""
    backend = getattr(storage_manager, "storage_backends", {}).get("LocalDiskBackend")
    if backend is None:
        return False
    write_file, save = backend.write_file, backend.async_save_bytes_to_disk

    def guarded_write(buffer: Any, path: str) -> None:
        try:
            write_file(buffer, path)
        except OSError as exc:
            raise _DiskWriteFailed(exc.errno, exc.strerror or str(exc), path) from exc

    def guarded_save(key: Any, memory_obj: Any, on_complete_callback: Any = None) -> None:
        try:
            save(key, memory_obj, on_complete_callback)
        except _DiskWriteFailed as exc:
            with contextlib.suppress(OSError):
                os.remove(backend._key_to_path(key))
            with backend.disk_lock:
                backend.current_cache_size -= memory_obj.get_physical_size()
            backend.disk_worker.remove_put_task(key)
            memory_obj.ref_count_down()  # the reference its put task took
            on_failure(exc)

    backend.write_file, backend.async_save_bytes_to_disk = guarded_write, guarded_save
    return True


def start_lmcache(
    lmcache_options: dict[str, Any],
    args: ModelArgs,
    block_tokens: int,
    dtype: torch.dtype,
    instance_id: str,
    model_name: str,
) -> tuple[Any, Any]:
    """An LMCache engine for chunks of `block_tokens` tokens of this model's KV, and its config.
    `lmcache_options` are LMCache's own keys (`cache.host.lmcache`): an unknown one is an error."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.metadata import LMCacheMetadata

    quiet_lmcache()  # the loggers its imports made; again below for those made by its engine
    reentrant_observability_lock()
    known = lmcache_config_keys()
    for key in lmcache_options:
        if key not in known:
            raise ConfigError(f"unknown config key 'cache.host.lmcache.{key}' (not an LMCache 0.5.6 key)")
    config = lmcache_config(
        {
            **lmcache_options,
            "chunk_size": block_tokens,
            "save_unfull_chunk": False,
            "py_enable_gc": True,  # LMCache would otherwise disable Python's GC process-wide
        }
    )
    check_local_disk(config)
    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(args.num_layers, 2, block_tokens, args.num_kv_heads, args.head_dim),
        chunk_size=block_tokens,
    )
    # We never call LMCache's token-level store/retrieve, so it needs no GPU connector.
    engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata, None, lambda t, r: None, lambda o, r: o)
    engine.post_init()
    quiet_lmcache()
    return engine, config
