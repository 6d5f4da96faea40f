"""A request as the tiers and the scheduler see it: its tokens and their chained block keys
(`TierRequest`), where its tokens come from (`HitSplit`). Imports nothing of ours: every layer
above uses these types."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

ROOT_KEY = 0


def _stable(kind: str, text: str) -> int:
    """A string as a 64-bit int, the same in every process (Python's str hash is salted per process)."""
    digest = hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def block_keys(
    token_ids: Sequence[int],
    block_tokens: int,
    salt: str | None = None,
    adapter: str | None = None,
    rope_regime: int = 0,
) -> list[int]:
    """Chained keys of the full blocks of `token_ids` (a trailing partial block has none).

    A salt (vLLM's `cache_salt`), a LoRA adapter's identity and a RoPE regime other than 0
    (LongRoPE's long factors) change every key: requests share cached blocks only with requests
    of the same salt, adapter and regime (each changes the KV of every token). Keys are equal in
    every process of the same Python (a remote tier shares chunks across engines by them): they
    hash only ints and tuples of ints, whose hashes PYTHONHASHSEED does not change; strings enter
    through `_stable`."""
    keys = []
    parent = ROOT_KEY if salt is None else hash((_stable("cache_salt", salt),))
    if adapter is not None:
        parent = hash((_stable("lora", adapter), parent))
    if rope_regime:
        parent = hash((_stable("rope_regime", str(rope_regime)), parent))
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash((parent, tuple(token_ids[start : start + block_tokens])))
        keys.append(parent)
    return keys


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

    def shared_as_hits(self, num_shared: int) -> HitSplit:
        """This split with `num_shared` of its misses computed by another request of its batch,
        costed as device hits (what the JCT model is told such tokens cost)."""
        return replace(
            self,
            num_device_hit_tokens=self.num_device_hit_tokens + num_shared,
            num_miss_tokens=self.num_miss_tokens - num_shared,
        )


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
    rope_regime: int = 0  # the RoPE frequencies its KV is computed with (the model's `rope_regime`)

    @classmethod
    def make(
        cls,
        request_id: str,
        token_ids: Sequence[int] | Tensor,
        block_tokens: int,
        salt: str | None = None,
        adapter: str | None = None,
        rope_regime: int = 0,
    ) -> TierRequest:
        """Build a request from its token ids, computing its block keys (salted by `salt`, `adapter`
        and `rope_regime`) once."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        keys = block_keys(ids.tolist(), block_tokens, salt, adapter, rope_regime)
        return cls(request_id, ids, keys, salt, adapter, rope_regime)

    def cut(self, num_tokens: int, block_tokens: int) -> TierRequest:
        """Its first `num_tokens` tokens (a whole number of blocks, or all of them) as a request of its
        own: the same id, keys, salt, adapter and RoPE regime (a piece of it computed alone)."""
        return replace(self, token_ids=self.token_ids[:num_tokens], keys=self.keys[: num_tokens // block_tokens])
