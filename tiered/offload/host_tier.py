"""The host tier: LMCache 0.5.6 used as a library. The only module that imports `lmcache`.

Data flow. Store: after a forward, the KV of the request's computed full chunks sits in a host
staging tensor [layers, 2, tokens, kv_heads, head_dim]; `store_async` hands it to LMCache on a
background thread, whose connector copies each chunk into an LMCache memory object
([2, layers, chunk, kv_heads*head_dim], LMCache's KV_2LTD format). Retrieve: LMCache finds the
chunks of a token prefix and our connector copies each into a device-tier block.

LMCache keys chunks by chained prefix hashes and its lookup stops at the first missing chunk,
so the host tier only helps while it holds a contiguous prefix: we therefore store every
computed chunk (the host tier includes what the device tier keeps), not only the evicted ones.

Every LMCache call is guarded: an exception is logged once per kind, counted, and turns into a
miss, so a failing host tier degrades to recomputation and never fails a request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tiered.config import ConfigError, HostTierConfig
from tiered.offload.device_tier import DeviceTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StagedKV:
    """KV of tokens [first_token, first_token + n) on the host: [layers, 2, n, kv_heads, head_dim].

    `ready` (cuda only) is recorded after the last device-to-host copy was queued."""

    kv: Tensor
    first_token: int
    ready: torch.cuda.Event | None = None


@dataclass(slots=True)
class _IntoBlocks:
    """Retrieval target: chunk i (counting from `first_token`) goes to device block `block_ids[i]`."""

    tier: DeviceTier
    block_ids: Sequence[int]
    first_token: int


@dataclass(slots=True)
class HostTierStats:
    num_hit_tokens: int
    num_stored_tokens: int
    num_failures: int


def _connector_class() -> type:
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class TieredConnector(GPUConnectorInterface):  # type: ignore[misc]
        """Copies between LMCache memory objects and our tensors (staging or device-tier blocks)."""

        def __init__(self, num_layers: int, kv_width: int) -> None:
            self.num_layers = num_layers
            self.kv_width = kv_width

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.kv_width])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            staged: StagedKV = kwargs["staged"]
            s, e = start - staged.first_token, end - staged.first_token
            src = staged.kv[:, :, s:e]  # [L, 2, n, Hkv, Dh]
            memory_obj.tensor.copy_(src.transpose(0, 1).reshape(2, self.num_layers, e - s, self.kv_width))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            target: _IntoBlocks = kwargs["target"]
            tier = target.tier
            block = target.block_ids[(start - target.first_token) // tier.block_tokens]
            kv = memory_obj.tensor.to(tier.k.device, non_blocking=True)  # [2, L, n, Hkv*Dh]
            kv = kv.view(2, self.num_layers, end - start, *tier.k.shape[3:])
            tier.k[:, block, : end - start].copy_(kv[0])
            tier.v[:, block, : end - start].copy_(kv[1])

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            staged: StagedKV = kwargs["staged"]
            if staged.ready is not None:
                staged.ready.synchronize()
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, s, e, **kwargs)

    return TieredConnector


def _salted(salt: str | None) -> dict[str, str] | None:
    """LMCache puts `lmcache.tag.*` request configs into its chunk keys: a salt isolates chunks."""
    return None if salt is None else {"lmcache.tag.cache_salt": salt}


def _quiet_lmcache() -> None:
    """LMCache logs every store and retrieve at INFO (each of its loggers sets its own level)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)


def lmcache_config_keys() -> set[str]:
    from lmcache.v1 import config as lmcache_config

    return set(lmcache_config._CONFIG_DEFINITIONS)


class HostTier:
    """LMCache engine with our connector; lookups, retrievals into device blocks, async stores."""

    def __init__(
        self,
        cfg: HostTierConfig,
        block_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        instance_id: str,
    ) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        known = lmcache_config_keys()
        for key in cfg.lmcache:
            if key not in known:
                raise ConfigError(f"unknown config key 'cache.host.lmcache.{key}' (not an LMCache 0.5.6 key)")
        options = {
            **cfg.lmcache,
            "chunk_size": block_tokens,
            "save_unfull_chunk": False,
            "py_enable_gc": True,  # LMCache would otherwise disable Python's GC process-wide
        }
        self.block_tokens = block_tokens
        self.instance_id = instance_id
        config = LMCacheEngineConfig.from_dict(options)
        chunk_bytes = num_layers * 2 * block_tokens * num_kv_heads * head_dim * dtype.itemsize
        local_gb = float(config.max_local_cpu_size or 0) + (float(config.max_local_disk_size or 0)
                                                            if config.local_disk else 0.0)  # fmt: skip
        # How many chunks this tier can hold (a remote store: unknown, so a generous bound).
        self.capacity_chunks = int(local_gb * 2**30 / chunk_bytes) if not config.remote_url else 1 << 22
        metadata = LMCacheMetadata(
            model_name=instance_id,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=(num_layers, 2, block_tokens, num_kv_heads, head_dim),
            chunk_size=block_tokens,
        )
        connector = _connector_class()(num_layers, num_kv_heads * head_dim)
        self._engine = LMCacheEngineBuilder.get_or_create(
            instance_id, config, metadata, connector, lambda t, r: None, lambda o, r: o
        )
        self._engine.post_init()
        _quiet_lmcache()
        self._lock = threading.Lock()  # one LMCache call at a time
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="tiered-host-store")
        self.num_hit_tokens = 0
        self.num_stored_tokens = 0
        self.num_failures = 0
        self._warned: set[str] = set()
        self._closed = False
        # LMCache's worker threads are not daemons: an engine left open (an exception in the
        # caller) would hang interpreter exit. This hook runs before non-daemon threads are
        # joined (the one concurrent.futures uses); Python's `atexit` runs too late for that.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self.close)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.num_failures += 1
        if what not in self._warned:
            self._warned.add(what)
            log.warning("host tier %s failed (%s: %s); recomputing instead", what, type(exc).__name__, exc)

    def lookup(self, token_ids: Tensor, salt: str | None = None) -> int:
        """Tokens of the longest prefix of `token_ids` stored as full chunks (0 on failure)."""
        try:
            with self._lock:
                return int(self._engine.lookup(token_ids, request_configs=_salted(salt)))
        except Exception as exc:  # noqa: BLE001 - any host-tier fault degrades to a miss
            self._failed("lookup", exc)
            return 0

    def retrieve_into(
        self, token_ids: Tensor, first_block: int, tier: DeviceTier, block_ids: Sequence[int], salt: str | None = None
    ) -> int:
        """Load chunks first_block.. into `block_ids`; return how many leading ones arrived."""
        if not block_ids:
            return 0
        bt = self.block_tokens
        start, end = first_block * bt, (first_block + len(block_ids)) * bt
        tokens = token_ids[:end]
        mask = torch.zeros(end, dtype=torch.bool)
        mask[start:] = True
        try:
            with self._lock:
                got = self._engine.retrieve(
                    tokens, mask=mask, target=_IntoBlocks(tier, block_ids, start), request_configs=_salted(salt)
                )
        except Exception as exc:  # noqa: BLE001
            self._failed("retrieve", exc)
            return 0
        got = got[start:end]
        num = len(block_ids) if bool(got.all()) else int(torch.argmin(got.int()).item()) // bt
        self.num_hit_tokens += num * bt
        return num

    def store_async(self, token_ids: Tensor, staged: StagedKV, salt: str | None = None) -> Future[bool]:
        """Store chunks of `staged` (already full chunks) in the background; never raises.

        The future's result says whether the store succeeded."""
        end = staged.first_token + staged.kv.shape[2]
        tokens = token_ids[:end].clone()
        mask = torch.zeros(end, dtype=torch.bool)
        mask[staged.first_token :] = True

        def run() -> bool:
            try:
                with self._lock:
                    self._engine.store(tokens, mask=mask, staged=staged, request_configs=_salted(salt))
                self.num_stored_tokens += end - staged.first_token
                return True
            except Exception as exc:  # noqa: BLE001
                self._failed("store", exc)
                return False

        return self._stores.submit(run)

    def flush(self) -> None:
        """Wait for every store submitted so far."""
        self._stores.submit(lambda: None).result()

    def clear(self) -> None:
        """Drop everything LMCache holds (tests and benchmarks)."""
        self.flush()
        with self._lock:
            self._engine.clear()

    def stats(self) -> HostTierStats:
        return HostTierStats(self.num_hit_tokens, self.num_stored_tokens, self.num_failures)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        self._stores.shutdown(wait=True)
        LMCacheEngineBuilder.destroy(self.instance_id)
