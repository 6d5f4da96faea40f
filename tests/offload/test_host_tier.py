"""The host tier's transfers and its store thread, with LMCache for real: bit-exact loads and
stores, a stuck store thread that never blocks a forward, no chunk stored twice, the write
policies, the CPU share, and what happens to the backlog at shutdown."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from through_tiers import forward_with_tiers

from tiered.config import ConfigError, HostTierConfig
from tiered.hybrid.forward import forward
from tiered.hybrid.model import CausalLM
from tiered.offload.tiers import KVTiers

BT = 16  # the block size of conftest's make_tiers
TOL = 1e-5  # fp32 logits, relative to the largest |logit|
_ids = itertools.count()


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: CausalLM, tiers: KVTiers, ids: torch.Tensor):
    return forward_with_tiers(model, tiers, tiers.new_request(f"r{next(_ids)}", ids), chunk_tokens=64)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert (got - ref).abs().max().item() <= TOL * ref.abs().max().item()


class _StuckPut:
    """LMCache's put, held until `release()`: the store thread stays busy with one batch."""

    def __init__(self, tiers: KVTiers, monkeypatch: pytest.MonkeyPatch) -> None:
        storage = tiers.host_tier._storage  # type: ignore[union-attr]
        self._put = storage.batched_put
        self.gate = threading.Event()
        self.entered = threading.Event()
        monkeypatch.setattr(storage, "batched_put", self)

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.entered.set()
        self.gate.wait(30)
        self._put(*args, **kwargs)

    def release(self) -> None:
        self.gate.set()


def test_loaded_blocks_are_bit_equal_to_the_computed_ones(model: CausalLM, make_tiers) -> None:
    tiers = make_tiers(retention="all")
    ids = _tokens(300, 0)  # 18 full blocks
    _, first = _run(model, tiers, ids)
    tiers.flush()
    computed = tiers.device_tier.kv[first.retained_blocks].clone()  # written by the forward's sink
    tiers.device_tier.clear()
    prepared = tiers.prepare(tiers.new_request("load", ids))
    assert prepared.split.num_host_hit_tokens == 288
    # The scheduler side looked the chunks up and gave them blocks; the worker side copies them.
    assert [load.filled for load in prepared.loads] == [None]
    assert prepared.loads[0].block_ids == prepared.prefix_blocks
    assert not tiers.worker.load([prepared])
    assert prepared.loads[0].filled == 18
    assert torch.equal(tiers.device_tier.kv[prepared.prefix_blocks], computed)  # stored, then loaded: same bits
    tiers.abort(prepared)


_THREADS_AFTER_STORING = """
import sys, torch
from tiered.config import load_config
from tiered.engine import Engine
cfg = load_config(None, [f"model.path={sys.argv[1]}", "cache.suffix=offload",
                         f"scheduler.profile_cache_dir={sys.argv[2]}"])
with Engine(cfg) as engine:
    started = torch.get_num_threads()
    engine.submit(list(range(3, 300)))
    engine.run()
    engine.tiers.flush()  # the store thread stored the request's chunks
    print(started, torch.get_num_threads())
"""


def test_the_host_tiers_threads_leave_the_forward_its_threads(tiny_dir: Path, tmp_path: Path) -> None:
    """torch.set_num_threads in a helper thread can set the whole process's: the store thread once
    set 1, and every forward after the first stored request ran on one core (16 K tokens of
    bench-m: 220 s against 114 s). In a fresh process, as the engine's; twice, as the second finds
    its JCT profile cached and runs no forward before its threads start (the case that failed)."""
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", _THREADS_AFTER_STORING, str(tiny_dir), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        started, after = out.stdout.split()[-2:]
        assert after == started, out.stdout


def test_a_stuck_store_thread_never_blocks_a_forward(model: CausalLM, make_tiers, monkeypatch) -> None:
    tiers = make_tiers(host_options={"max_pending_stores": 2})
    stuck = _StuckPut(tiers, monkeypatch)
    first = _tokens(200, 1)
    _run(model, tiers, first)
    assert stuck.entered.wait(10)  # the store thread is inside LMCache's put, and stays there
    for seed in (2, 3, 4):  # two more stores queue, the third finds the queue full and is dropped
        _run(model, tiers, _tokens(100, seed))
    assert tiers.stats().host.num_dropped_chunks == 6 and tiers.stats().host.num_pending_stores == 3
    # A chunk written by a forward but not yet put is already readable: a host hit, no wait.
    logits, prepared = _run(model, tiers, first)
    assert prepared.split.num_host_hit_tokens == 192
    _close(logits, forward(model, first))
    stuck.release()
    tiers.flush()
    stats = tiers.stats().host
    assert stats.num_stores == 3 and stats.num_pending_stores == 0
    assert stats.num_stored_tokens == 192 + 96 + 96


def test_a_chunk_already_in_the_host_tier_is_not_stored_again(model: CausalLM, make_tiers) -> None:
    tiers = make_tiers(device_blocks=0)  # nothing can be loaded to the device: every prompt is recomputed
    profile = _tokens(160, 5)
    for seed in range(3):
        ids = torch.cat([profile, _tokens(40, 10 + seed)])
        logits, prepared = _run(model, tiers, ids)
        tiers.flush()
        assert prepared.split.num_miss_tokens == 200
        _close(logits, forward(model, ids))
    # The profile's 10 chunks once; then only each prompt's own 2 full chunks (200 tokens = 12 blocks).
    assert tiers.stats().host.num_stored_tokens == (12 + 2 + 2) * BT


@pytest.mark.parametrize("policy", ["write-through", "on-evict"])
def test_write_policy_decides_when_retained_blocks_are_stored(model: CausalLM, make_tiers, policy: str) -> None:
    tiers = make_tiers(retention="all", host_options={"write_policy": policy})
    ids = _tokens(300, 6)
    ref = forward(model, ids)
    _run(model, tiers, ids)
    tiers.flush()
    stored_now = tiers.stats().host.num_stored_tokens
    assert stored_now == (288 if policy == "write-through" else 0)
    tiers.device_tier.clear()  # eviction: on-evict stores each block on its way out
    tiers.flush()
    assert tiers.stats().host.num_stored_tokens == 288
    logits, prepared = _run(model, tiers, ids)
    assert prepared.split.num_host_hit_tokens == 288
    _close(logits, ref)


def test_a_prefix_half_evicted_is_found_across_both_tiers(model: CausalLM, make_tiers) -> None:
    tiers = make_tiers(retention="all", host_options={"write_policy": "on-evict"})
    ids = _tokens(300, 7)
    _run(model, tiers, ids)
    # The oldest blocks go first: the prefix's first 3 leave the device (stored on the way), 15 stay.
    taken = tiers.device_tier.allocate(tiers.device_tier.num_blocks - 18 + 3)
    tiers.device_tier.unpin(taken)
    tiers.flush()
    req = tiers.new_request("again", ids)
    est = tiers.estimate(req)
    assert (est.num_device_hit_tokens, est.num_host_hit_tokens) == (15 * BT, 3 * BT)
    logits, prepared = _run(model, tiers, ids)
    assert (prepared.split.num_device_hit_tokens, prepared.split.num_host_hit_tokens) == (15 * BT, 3 * BT)
    _close(logits, forward(model, ids))


def test_the_store_thread_stays_under_its_cpu_share(model: CausalLM, make_tiers, monkeypatch) -> None:
    tiers = make_tiers(host_options={"store_cpu_share": 0.25})
    storage = tiers.host_tier._storage
    put = storage.batched_put

    def busy_put(*args: object, **kwargs: object) -> None:
        end = time.thread_time() + 0.02  # 20 ms of CPU per batch
        while time.thread_time() < end:
            pass
        put(*args, **kwargs)

    monkeypatch.setattr(storage, "batched_put", busy_put)
    start = time.perf_counter()
    for seed in range(4):
        _run(model, tiers, _tokens(100, 20 + seed))
    tiers.flush()
    elapsed = time.perf_counter() - start
    stats = tiers.stats().host
    assert stats.store_thread_cpu_seconds >= 4 * 0.02
    # After each batch the thread sleeps 3x what it used (25% of a core), the last one included.
    assert stats.store_throttle_seconds == pytest.approx(3 * stats.store_thread_cpu_seconds, rel=1e-6)
    assert elapsed >= 3 * 3 * 0.02  # the sleeps after the first three batches happened before the last put


@pytest.mark.parametrize("on_close", ["drain", "drop"])
def test_close_drains_or_drops_the_backlog(model: CausalLM, make_tiers, monkeypatch, on_close: str) -> None:
    tiers = make_tiers(host_options={"on_close": on_close})
    stuck = _StuckPut(tiers, monkeypatch)
    for seed in range(3):  # one batch in the stuck put, two queued behind it
        _run(model, tiers, _tokens(100, 30 + seed))
    assert stuck.entered.wait(10)
    host = tiers.host_tier
    closing = threading.Thread(target=tiers.close)
    closing.start()
    time.sleep(0.2)
    stuck.release()
    closing.join(30)
    assert not closing.is_alive()
    stats = host.stats_
    if on_close == "drain":
        assert (stats.num_stores, stats.num_dropped_chunks) == (3, 0)
    else:
        assert (stats.num_stores, stats.num_dropped_chunks) == (1, 2 * 6)
    assert stats.num_pending_stores == 0


def test_lmcaches_chunk_reuse_record_stays_bounded(model: CausalLM, make_tiers, monkeypatch) -> None:
    """LMCache's LRU policy records every new chunk for a statistic, up to 12.5 M entries (the
    engine's RSS creep in the soak); ours bounds it by the tier's size."""
    from tiered.offload import lmcache_setup

    monkeypatch.setattr(lmcache_setup, "REUSE_RECORD_MIN", 8)
    monkeypatch.setattr(lmcache_setup, "REUSE_RECORD_MAX", 8)  # so the bound is 8 (not 2 x the tier's chunks)
    tiers = make_tiers(device_blocks=0)
    host = tiers.host_tier
    assert host is not None
    record = host._storage.local_cpu_backend.cache_policy.chunk_hash_to_init_timestamp
    sizes = []
    for seed in range(12):
        _run(model, tiers, _tokens(64, 100 + seed))  # 4 new chunks each: 48 in all
        tiers.flush()
        sizes.append(len(record))
    assert tiers.stats().host.num_stored_tokens == 48 * BT
    assert max(sizes) <= 8 and sizes[-1] > 0


def test_host_tier_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="store_cpu_share"):
        HostTierConfig(store_cpu_share=0)
    with pytest.raises(ConfigError, match="max_pending_stores"):
        HostTierConfig(max_pending_stores=0)


def _local_gb(tiers: KVTiers) -> float:
    return float(tiers.host_tier._engine.config.max_local_cpu_size)  # type: ignore[union-attr]


def test_lmcaches_own_config_sources_are_honoured_below_the_yaml(
    make_tiers, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.delenv("LMCACHE_MAX_LOCAL_CPU_SIZE", raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    assert _local_gb(make_tiers(host=HostTierConfig())) == 0.25  # our default
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.03")
    assert _local_gb(make_tiers(host=HostTierConfig())) == 0.03  # LMCache's variable
    assert _local_gb(make_tiers(host=HostTierConfig(lmcache={"max_local_cpu_size": 0.02}))) == 0.02  # the YAML wins
    monkeypatch.delenv("LMCACHE_MAX_LOCAL_CPU_SIZE")
    (tmp_path / "lmcache.yaml").write_text("max_local_cpu_size: 0.04\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(tmp_path / "lmcache.yaml"))
    assert _local_gb(make_tiers(host=HostTierConfig())) == 0.04  # LMCache's file


def test_lmcache_is_quiet_untracked_and_logs_through_our_handlers(make_tiers) -> None:
    import logging
    import os

    make_tiers()
    assert os.environ["LMCACHE_TRACK_USAGE"] == "false"  # set before LMCache's import, unless the user set it
    loggers = [logging.getLogger(n) for n in logging.root.manager.loggerDict if n.startswith("lmcache")]
    assert loggers and all(lg.propagate and not lg.handlers and lg.level >= logging.WARNING for lg in loggers)
