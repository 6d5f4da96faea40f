"""`python -m benchmarks tiers`: its trace, and its two parts run through the engine on the tiny model."""

from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.tiers import bench_config, load_vs_compute, revisit_trace, run_sequence
from tiered.config import Config, HostTierConfig
from tiered.hybrid.loader import read_args


def test_revisit_trace_is_seeded_round_robin_with_exact_lengths() -> None:
    trace = revisit_trace(vocab=100, users=3, profile_tokens=50, post_tokens=7, rounds=2, seed=0)
    assert len(trace) == 6 and all(t.numel() == 57 for t in trace)
    for u in range(3):
        assert torch.equal(trace[u][:50], trace[u + 3][:50])  # the user's profile comes back
        assert not torch.equal(trace[u][50:], trace[u + 3][50:])  # with a fresh post
    assert not torch.equal(trace[0][:50], trace[1][:50])
    again = revisit_trace(vocab=100, users=3, profile_tokens=50, post_tokens=7, rounds=2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(trace, again, strict=True))


def _config(tiny_dir: Path, tmp_path: Path) -> Config:
    cfg = bench_config(str(tiny_dir), "float32", "cpu", block_tokens=16, max_model_len=256)
    host = HostTierConfig(lmcache={"max_local_cpu_size": 0.05})
    attention = replace(cfg.attention, profile_cache_dir=str(tmp_path / "attention"))
    return replace(cfg, cache=replace(cfg.cache, host=host), attention=attention)


def test_the_revisit_sequence_runs_through_the_engine_and_counts_hits_per_tier(tiny_dir: Path, tmp_path: Path) -> None:
    """3 users of 64-token profiles (4 blocks each), a device tier of 4 blocks: offload finds the
    profiles of the second round in the host tier (all but what the device still holds), discard
    computes them again; both see the same tokens."""
    cfg = _config(tiny_dir, tmp_path)
    cfg = replace(
        cfg, cache=replace(cfg.cache, device_tier_bytes=4 * 16 * read_args(tiny_dir).kv_bytes_per_token(torch.float32))
    )
    trace = revisit_trace(vocab=1000, users=3, profile_tokens=64, post_tokens=8, rounds=2, seed=0)
    offload, discard = (run_sequence(cfg, trace, s) for s in ("offload", "discard"))
    total = sum(t.numel() for t in trace)
    for run in (offload, discard):
        assert run.num_requests == 6 and run.device_tier_blocks == 4
        assert run.num_device_hit_tokens + run.num_host_hit_tokens + run.num_miss_tokens == total
    assert discard.num_host_hit_tokens == 0
    assert offload.num_host_hit_tokens + offload.num_device_hit_tokens == 3 * 64  # every profile, once
    assert offload.num_host_hit_tokens >= 2 * 64  # the device tier holds at most one profile
    assert discard.num_miss_tokens > offload.num_miss_tokens


def test_a_prefix_comes_back_from_the_host_tier_whole(tiny_dir: Path, tmp_path: Path) -> None:
    costs, stages = load_vs_compute(_config(tiny_dir, tmp_path), lengths=[64], repeats=1)
    (c,), (st,) = costs, stages
    assert c.num_tokens == st.num_tokens == 64 and c.load_seconds > 0 and c.compute_seconds > 0
    assert st.num_bytes == 64 * read_args(tiny_dir).kv_bytes_per_token(torch.float32)
