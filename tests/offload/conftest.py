"""Fixtures of the tier tests: the tiny model (fp32) and tiers with LMCache for real, closed after each test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiered.config import CacheConfig, HostTierConfig
from tiered.hybrid.loader import load_model
from tiered.hybrid.model import CausalLM
from tiered.offload.tiers import KVTiers, TierSetup

BT = 16  # tokens per block in these tests (the test modules say it again)
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> CausalLM:
    return load_model(tiny_dir, "float32")


@pytest.fixture
def make_tiers(model: CausalLM) -> Iterator:
    """make(device_blocks, host_options, model_identity, **CacheConfig fields): tiers of
    `device_blocks` blocks of BT tokens, `model_identity` in the host tier's keys; unless `host`
    is given, a 50 MB LMCache CPU tier with `host_options` (HostTierConfig)."""
    made: list[KVTiers] = []

    def make(
        device_blocks: int = 64,
        host_options: dict[str, object] | None = None,
        model_identity: str | None = None,
        **cache: object,
    ) -> KVTiers:
        a = model.args
        block_bytes = BT * a.kv_bytes_per_token(torch.float32)
        host = cache.pop("host", None) or HostTierConfig(lmcache={"max_local_cpu_size": 0.05}, **(host_options or {}))
        cfg = CacheConfig(block_tokens=BT, device_tier_bytes=device_blocks * block_bytes, host=host, **cache)  # type: ignore[arg-type]
        made.append(KVTiers(cfg, TierSetup(a, torch.float32, "cpu", f"test-{next(_ids)}", model_identity)))
        return made[-1]

    yield make
    for t in made:
        t.close()
