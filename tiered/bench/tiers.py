"""`tiered bench tiers`: what the host tier is worth.

1. Load against recompute: the cost per token of bringing a prefix back from the host tier
   (LMCache retrieval into device blocks) against computing it again, at a few lengths. The
   ratio is what the scheduler's JCT model weighs host hits with.
2. A prefix-revisiting sequence: U users, each request = the user's profile + a fresh post,
   users visited round-robin for R rounds, with a device tier that holds only a fraction of the
   profiles. Run once with suffix `offload` and once with `discard` (PrefillOnly), same trace,
   same process: end-to-end time and hit tokens per tier.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, replace

import torch

from tiered.bench.report import write_report
from tiered.config import CacheConfig, HostTierConfig, SuffixPolicy
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import DTYPES, load_model
from tiered.hybrid.model import CausalLM
from tiered.offload.tiers import KVTiers, forward_with_tiers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadVsCompute:
    num_tokens: int
    load_seconds: float
    compute_seconds: float
    load_seconds_per_token: float
    compute_seconds_per_token: float
    compute_over_load: float


@dataclass(slots=True)
class SequenceRun:
    suffix: str
    seconds: float
    num_requests: int
    num_device_hit_tokens: int
    num_host_hit_tokens: int
    num_miss_tokens: int
    device_tier_blocks: int
    request_seconds: list[float]


def _tiers(model: CausalLM, cache: CacheConfig, dtype: str, device: str) -> KVTiers:
    return KVTiers(cache, model.args, DTYPES[dtype], device, f"bench-{uuid.uuid4().hex[:8]}")


def _kv_bytes_per_token(model: CausalLM, dtype: str) -> int:
    a = model.args
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * DTYPES[dtype].itemsize


def load_vs_compute(
    model: CausalLM, cache: CacheConfig, dtype: str, device: str, lengths: list[int], repeats: int
) -> list[LoadVsCompute]:
    out = []
    vocab = model.args.vocab_size
    for n in lengths:
        size = (n + cache.block_tokens) * _kv_bytes_per_token(model, dtype) * 2
        tiers = _tiers(model, replace(cache, device_tier_bytes=size, retention="none", suffix="offload"), dtype, device)
        ids = torch.randint(0, vocab, (n + 1,), generator=torch.Generator().manual_seed(n))
        forward_with_tiers(model, tiers, tiers.new_request("store", ids))
        tiers.flush()
        best_load = best_compute = float("inf")
        for i in range(repeats):
            tiers.device_tier.clear()
            prepared = tiers.prepare(tiers.new_request(f"load{i}", ids))
            assert prepared.split.num_host_hit_tokens == n, prepared.split
            best_load = min(best_load, prepared.load_seconds)
            tiers.abort(prepared)
            start = time.perf_counter()
            forward(model, ids[:n])
            best_compute = min(best_compute, time.perf_counter() - start)
        tiers.close()
        r = LoadVsCompute(n, best_load, best_compute, best_load / n, best_compute / n, best_compute / best_load)
        log.info(
            "%6d tokens: load %.1f ms (%.2f us/token), compute %.0f ms (%.1f us/token): compute/load %.1fx",
            n, 1e3 * r.load_seconds, 1e6 * r.load_seconds_per_token, 1e3 * r.compute_seconds,
            1e6 * r.compute_seconds_per_token, r.compute_over_load,
        )  # fmt: skip
        out.append(r)
    return out


def revisit_trace(
    vocab: int, users: int, profile_tokens: int, post_tokens: int, rounds: int, seed: int
) -> list[torch.Tensor]:
    """Round-robin revisits: request (r, u) = profile of user u + a fresh post."""
    g = torch.Generator().manual_seed(seed)
    profiles = [torch.randint(0, vocab, (profile_tokens,), generator=g) for _ in range(users)]
    return [
        torch.cat([profiles[u], torch.randint(0, vocab, (post_tokens,), generator=g)])
        for _ in range(rounds)
        for u in range(users)
    ]


def run_sequence(
    model: CausalLM, cache: CacheConfig, dtype: str, device: str, trace: list[torch.Tensor], suffix: SuffixPolicy
) -> SequenceRun:
    tiers = _tiers(model, replace(cache, suffix=suffix), dtype, device)
    times: list[float] = []
    dev = host = miss = 0
    start = time.perf_counter()
    for i, ids in enumerate(trace):
        t0 = time.perf_counter()
        _, prepared = forward_with_tiers(model, tiers, tiers.new_request(f"{suffix}-{i}", ids))
        times.append(time.perf_counter() - t0)
        dev += prepared.split.num_device_hit_tokens
        host += prepared.split.num_host_hit_tokens
        miss += prepared.split.num_miss_tokens
    tiers.flush()
    seconds = time.perf_counter() - start
    run = SequenceRun(suffix, seconds, len(trace), dev, host, miss, tiers.device_tier.num_blocks, times)
    tiers.close()
    log.info(
        "suffix %-7s: %.2f s for %d requests; hit tokens device %d, host %d, computed %d",
        suffix, seconds, len(trace), dev, host, miss,
    )  # fmt: skip
    return run


def run_tiers_bench(
    model_dir: str, dtype: str, device: str, block_tokens: int, lengths: list[int], users: int,
    profile_tokens: int, post_tokens: int, rounds: int, device_fraction: float, repeats: int, json_path: str | None,
) -> dict[str, object]:  # fmt: skip
    model = load_model(model_dir, dtype, device)
    forward(model, torch.arange(1, 512))  # warm-up
    cache = CacheConfig(
        block_tokens=block_tokens, retention="all", host=HostTierConfig(lmcache={"max_local_cpu_size": 4.0})
    )
    costs = load_vs_compute(model, cache, dtype, device, lengths, repeats)
    device_bytes = int(device_fraction * users * profile_tokens * _kv_bytes_per_token(model, dtype))
    cache = replace(cache, device_tier_bytes=device_bytes)
    trace = revisit_trace(model.args.vocab_size, users, profile_tokens, post_tokens, rounds, seed=0)
    runs = [run_sequence(model, cache, dtype, device, trace, s) for s in ("offload", "discard")]
    speedup = runs[1].seconds / runs[0].seconds
    print(f"{'tokens':>7} {'load ms':>8} {'compute ms':>10} {'compute/load':>12}")
    for c in costs:
        ms_load, ms_compute = 1e3 * c.load_seconds, 1e3 * c.compute_seconds
        print(f"{c.num_tokens:>7} {ms_load:>8.1f} {ms_compute:>10.0f} {c.compute_over_load:>11.1f}x")
    print(f"\nrevisit trace: {users} users x {rounds} rounds, profile {profile_tokens} + post {post_tokens} tokens, "
          f"device tier {device_fraction:.0%} of the profiles ({runs[0].device_tier_blocks} blocks)")  # fmt: skip
    print(f"{'suffix':<8} {'seconds':>8} {'device hit':>10} {'host hit':>9} {'computed':>9}")
    for r in runs:
        hits = f"{r.num_device_hit_tokens:>10} {r.num_host_hit_tokens:>9} {r.num_miss_tokens:>9}"
        print(f"{r.suffix:<8} {r.seconds:>8.2f} {hits}")
    print(f"end to end, discard takes {speedup:.2f}x the time of offload")
    return write_report(json_path, "tiers", device, {
        "model": {"path": model_dir, "dtype": dtype},
        "block_tokens": block_tokens,
        "load_vs_compute": [asdict(c) for c in costs],
        "trace": {
            "users": users,
            "profile_tokens": profile_tokens,
            "post_tokens": post_tokens,
            "rounds": rounds,
            "device_fraction": device_fraction,
            "device_tier_bytes": device_bytes,
        },  # fmt: skip
        "runs": [asdict(r) for r in runs],
        "offload_speedup_over_discard": speedup,
    })  # fmt: skip
