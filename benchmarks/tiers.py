"""`python -m benchmarks tiers`: what the host tier is worth.

1. Load against recompute: the cost per token of bringing a prefix back from the host tier
   (LMCache retrieval into device blocks) against computing it again, at a few lengths. The
   ratio is what the scheduler's JCT model weighs host hits with. With --disk, the same prefix
   read back from LMCache's local disk alone (taken out of the tier's memory first), after the
   OS's page cache was dropped where this process may drop it (else from the page cache: said so).
2. A prefix-revisiting sequence: U users, each request = the user's profile + a fresh post,
   users visited round-robin for R rounds, with a device tier that holds only a fraction of the
   profiles. Run with suffix `offload` and with `discard` (PrefillOnly), taking turns
   (--sequence-repeats each), same trace, same process: end-to-end time and hit tokens per tier.

Every request goes through `tiered.Engine` (submit, step, its result), one at a time.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal

import torch

from benchmarks.load import kv_bytes_per_token
from benchmarks.report import headline_row, new_json_path, print_headline, write_report
from benchmarks.stats import abba
from tiered.config import CacheConfig, Config, HostTierConfig, SuffixPolicy
from tiered.engine import Engine
from tiered.hybrid.loader import read_args
from tiered.hybrid.precision import config_precision
from tiered.offload.host_base import HostTierStats
from tiered.request.score import Result
from tiered.scheduler.jct import JCTModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadVsCompute:
    num_tokens: int
    load_seconds: float
    compute_seconds: float
    load_seconds_per_token: float
    compute_seconds_per_token: float
    compute_over_load: float
    disk_load_seconds: float = float("nan")  # with --disk: the prefix read from the local disk alone
    compute_over_disk_load: float = float("nan")
    disk_cold: bool = False  # the page cache was dropped before each disk load (else: files in RAM)


@dataclass(slots=True)
class HostStages:
    """One prefix of `num_tokens` through the host tier, stage by stage (best of the repeats for
    loads, one store), against `copy_` of the same bytes into memory touched before."""

    num_tokens: int
    num_bytes: int
    copy_seconds: float
    load_lookup_seconds: float
    load_get_seconds: float
    load_copy_seconds: float
    store_allocate_seconds: float
    store_copy_seconds: float
    store_put_seconds: float
    store_thread_cpu_seconds: float
    forward_offload_seconds: float  # forward of num_tokens through the tiers, storing every chunk
    forward_discard_seconds: float  # the same forward, storing nothing (median of the repeats)

    @property
    def load_seconds(self) -> float:
        return self.load_lookup_seconds + self.load_get_seconds + self.load_copy_seconds

    @property
    def load_fraction_of_copy(self) -> float:
        return self.copy_seconds / self.load_seconds


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


def _engine(cfg: Config, cache: CacheConfig) -> Engine:
    """An engine over `cache`, its JCT model left unprofiled: the benchmark submits one request
    at a time, so no order is decided and the start-up grid would only cost time."""
    return Engine(replace(cfg, cache=cache), jct_model=JCTModel([0.0]))


def _run_one(engine: Engine, ids: torch.Tensor) -> tuple[Result, float]:
    """One request through the engine (submit, step); its result and its wall seconds."""
    start = time.perf_counter()
    engine.submit(ids)
    (result,) = engine.run()
    if result.error:
        raise RuntimeError(f"the benchmark's request failed: {result.error}")
    return result, time.perf_counter() - start


def _copy_seconds(num_bytes: int, repeats: int) -> float:
    """`copy_` of `num_bytes` between buffers touched before but not in the CPU's caches (as a
    load finds LMCache's memory): a fresh destination would add page faults, a hot one would
    run at cache speed."""
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    flush = torch.zeros(256 * 2**20 // 2, dtype=torch.bfloat16)  # larger than any L3 cache here
    best = float("inf")
    for _ in range(max(repeats, 3)):
        flush.add_(1)
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _drop_page_cache() -> bool:
    """Drop the OS's page cache (clean pages: files written earlier are then read from the device);
    False where this process may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def _disk_load_seconds(engine: Engine, ids: torch.Tensor, n: int, repeats: int) -> tuple[float, bool]:
    """Best-of-`repeats` load seconds of `ids`' prefix from the host tier's disk alone, and whether
    the page cache was dropped before each."""
    host = engine.tiers.host_tier
    assert host is not None
    keys = engine.tiers.new_request("disk", ids).keys
    best, cold = float("inf"), True
    for _ in range(repeats):
        assert host.evict_from_memory(keys) == n // engine.tiers.block_tokens, "the disk lacks the prefix"
        engine.tiers.device_tier.clear()
        cold = _drop_page_cache() and cold
        result, _ = _run_one(engine, ids)
        assert result.split.num_disk_hit_tokens == n, result.split
        best = min(best, result.load_seconds)
    return best, cold


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def load_vs_compute(cfg: Config, lengths: list[int], repeats: int) -> tuple[list[LoadVsCompute], list[HostStages]]:
    """Per length n: what storing costs a forward (fresh prompts through an engine whose tiers store
    every chunk and one whose tiers store nothing), then the cost of loading an n-token prefix
    back from the host tier against computing it (the storing-nothing engine's forward)."""
    out, stages = [], []
    cache = cfg.cache
    kv_per_token = kv_bytes_per_token(cfg)
    for n in lengths:
        size = (n + cache.block_tokens) * kv_per_token * 2
        sized = replace(cache, device_tier_bytes=size, retention="none")
        suffixes: tuple[SuffixPolicy, ...] = ("offload", "discard")
        engines = {s: _engine(cfg, replace(sized, suffix=s)) for s in suffixes}
        vocab = engines["offload"].model.args.vocab_size
        # LMCache fills its buffer as it starts (about 1 s for 4 GB): the first prompt only warms.
        timed: dict[str, list[float]] = {s: [] for s in suffixes}
        computed: list[float] = []
        for i in range(repeats + 1):
            fresh = torch.randint(0, vocab, (n + 1,), generator=torch.Generator().manual_seed(n + 1 + i))
            for suffix, engine in engines.items():
                result, seconds = _run_one(engine, fresh)
                engine.tiers.flush()
                if i > 0:
                    timed[suffix].append(seconds)
                    if suffix == "discard":
                        computed.append(result.compute_seconds)
        engine = engines["offload"]
        host = engine.tiers.host_tier
        assert host is not None
        ids = torch.randint(0, vocab, (n + 1,), generator=torch.Generator().manual_seed(n))
        before = host.stats()
        _run_one(engine, ids)
        engine.tiers.flush()
        stored = _delta(before, host.stats())
        best_load, best = float("inf"), (0.0, 0.0, 0.0)
        for _ in range(repeats):
            engine.tiers.device_tier.clear()
            before = host.stats()
            result, _ = _run_one(engine, ids)
            assert result.split.num_host_hit_tokens == n, result.split
            if result.load_seconds < best_load:
                best_load = result.load_seconds
                d = _delta(before, host.stats())
                best = (d.load_lookup_seconds, d.load_get_seconds, d.load_copy_seconds)
        disk_load, cold = _disk_load_seconds(engine, ids, n, repeats) if host.has_disk else (float("nan"), False)
        for e in engines.values():
            e.close()
        best_compute = min(computed) * n / (n + 1)
        num_bytes = n * kv_per_token
        stage = HostStages(
            n,
            num_bytes,
            _copy_seconds(num_bytes, repeats),
            *best,
            stored.store_allocate_seconds,
            stored.store_copy_seconds,
            stored.store_put_seconds,
            stored.store_thread_cpu_seconds,
            _median(timed["offload"]),
            _median(timed["discard"]),
        )
        stages.append(stage)
        r = LoadVsCompute(
            n,
            best_load,
            best_compute,
            best_load / n,
            best_compute / n,
            best_compute / best_load,
            disk_load,
            best_compute / disk_load,
            cold,
        )
        log.info(
            "%6d tokens: load %.1f ms (%.2f us/token), compute %.0f ms (%.1f us/token): compute/load %.1fx%s",
            n,
            1e3 * r.load_seconds,
            1e6 * r.load_seconds_per_token,
            1e3 * r.compute_seconds,
            1e6 * r.compute_seconds_per_token,
            r.compute_over_load,
            f"; from disk {1e3 * disk_load:.1f} ms ({'page cache dropped' if cold else 'page cache'}): "
            f"compute/disk load {r.compute_over_disk_load:.1f}x"
            if host.has_disk
            else "",
        )
        out.append(r)
    return out, stages


def _delta(before: HostTierStats, after: HostTierStats) -> HostTierStats:
    """The counters' growth between two snapshots."""
    return HostTierStats(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(HostTierStats)})


def print_stages(stages: list[HostStages]) -> None:
    gib = 2**30
    print(f"\n{'tokens':>7} {'MiB':>6} {'stage':<34} {'ms':>8} {'GiB/s':>7} {'copy_ / stage':>13}")
    for st in stages:
        rows = [
            ("copy_ of the same bytes (baseline)", st.copy_seconds),
            ("load: which backend holds the keys", st.load_lookup_seconds),
            ("load: LMCache batched_get", st.load_get_seconds),
            ("load: copies into device blocks", st.load_copy_seconds),
            ("load: total", st.load_seconds),
            ("store: LMCache allocate (fwd thread)", st.store_allocate_seconds),
            ("store: sink copies (fwd thread)", st.store_copy_seconds),
            ("store: LMCache put (store thread)", st.store_put_seconds),
            ("store: store thread CPU", st.store_thread_cpu_seconds),
        ]
        for name, sec in rows:
            bw = st.num_bytes / sec / gib if sec > 0 else float("inf")
            frac = st.copy_seconds / sec if sec > 0 else float("inf")
            print(
                f"{st.num_tokens:>7} {st.num_bytes / 2**20:>6.0f} {name:<34} {1e3 * sec:>8.2f} {bw:>7.1f} {frac:>12.0%}"
            )
        print(
            f"{st.num_tokens:>7} forward storing every chunk {st.forward_offload_seconds:.3f} s, storing nothing "
            f"{st.forward_discard_seconds:.3f} s: x{st.forward_offload_seconds / st.forward_discard_seconds:.3f}"
        )


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


def run_sequence(cfg: Config, trace: list[torch.Tensor], suffix: SuffixPolicy) -> SequenceRun:
    """The trace through one engine, one request per step, as a user's visits arrive."""
    engine = _engine(cfg, replace(cfg.cache, suffix=suffix))
    times: list[float] = []
    dev = host = miss = 0
    start = time.perf_counter()
    for ids in trace:
        result, seconds = _run_one(engine, ids)
        times.append(seconds)
        dev += result.split.num_device_hit_tokens
        host += result.split.num_host_hit_tokens
        miss += result.split.num_miss_tokens
    engine.tiers.flush()
    seconds = time.perf_counter() - start
    run = SequenceRun(suffix, seconds, len(trace), dev, host, miss, engine.tiers.device_tier.num_blocks, times)
    engine.close()
    log.info(
        "suffix %-7s: %.2f s for %d requests; hit tokens device %d, host %d, computed %d",
        suffix,
        seconds,
        len(trace),
        dev,
        host,
        miss,
    )
    return run


def bench_config(
    model_dir: str, dtype: str, device: str, block_tokens: int, max_model_len: int, disk: str | None = None
) -> Config:
    """The engine this benchmark runs: `block_tokens` blocks, every block kept (`retention: all`),
    a 4 GB LMCache CPU tier (and, with `disk`, a 16 GB local disk tier in that directory); the
    device tier is sized per part."""
    cfg = Config(device=device)
    lmcache: dict[str, object] = {"max_local_cpu_size": 4.0}
    if disk:
        lmcache |= {"local_disk": disk, "max_local_disk_size": 16.0}
    cache = CacheConfig(block_tokens=block_tokens, retention="all", host=HostTierConfig(lmcache=lmcache))
    model = replace(cfg.model, path=model_dir, dtype=dtype, max_model_len=max_model_len)  # type: ignore[arg-type]
    return replace(cfg, model=model, cache=cache)


@dataclass(frozen=True, slots=True)
class TiersOptions:
    """What `run_tiers_bench` runs beyond the config (the CLI's options, one to one)."""

    lengths: list[int]  # prefix lengths of part 1 (load against recompute)
    users: int  # part 2: distinct profiles
    profile_tokens: int
    post_tokens: int  # the fresh suffix of each request
    rounds: int  # visits per user
    device_fraction: float  # the device tier, as a share of all profiles' KV
    repeats: int  # timed repeats of part 1; the best is kept
    json_path: str | None
    sequence_repeats: int = 1  # runs of part 2 per suffix policy, taking turns


def run_tiers_bench(cfg: Config, opts: TiersOptions) -> dict[str, object]:
    """Load against recompute, then the revisit sequence with offload and discard (see the module docstring)."""
    users, profile_tokens, post_tokens, rounds = opts.users, opts.profile_tokens, opts.post_tokens, opts.rounds
    device_fraction, sequence_repeats = opts.device_fraction, opts.sequence_repeats
    costs, stages = load_vs_compute(cfg, opts.lengths, opts.repeats)
    device_bytes = int(device_fraction * users * profile_tokens * kv_bytes_per_token(cfg))
    sized = replace(cfg, cache=replace(cfg.cache, device_tier_bytes=device_bytes))
    vocab = read_args(cfg.model.path).vocab_size
    trace = revisit_trace(vocab, users, profile_tokens, post_tokens, rounds, seed=0)
    # offload, discard; discard, offload; ... (ABBA): drift in the machine's speed hits both alike
    suffixes: list[Literal["offload", "discard"]] = ["offload", "discard"]
    runs = [run_sequence(sized, trace, s) for rep in range(sequence_repeats) for s in abba(suffixes, rep)]
    offload = [r.seconds for r in runs if r.suffix == "offload"]
    discard = [r.seconds for r in runs if r.suffix == "discard"]
    headline = [
        headline_row(
            f"revisit sequence ({users} users x {rounds} visits, {profile_tokens}-token profiles, device tier "
            f"{device_fraction:.0%} of them), one request at a time: seconds, host tier (offload) vs PrefillOnly's "
            "discard",
            "s",
            ("offload", offload),
            ("discard", discard),
            higher_is_better=False,
        )
    ]
    speedup = headline[0]["ratio"]["median"]
    print(f"{'tokens':>7} {'load ms':>8} {'compute ms':>10} {'compute/load':>12} {'disk ms':>8} {'compute/disk':>12}")
    for c in costs:
        ms_load, ms_compute, ms_disk = 1e3 * c.load_seconds, 1e3 * c.compute_seconds, 1e3 * c.disk_load_seconds
        print(
            f"{c.num_tokens:>7} {ms_load:>8.1f} {ms_compute:>10.0f} {c.compute_over_load:>11.1f}x {ms_disk:>8.1f} "
            f"{c.compute_over_disk_load:>11.1f}x"
        )
    print_stages(stages)
    print(
        f"\nrevisit trace: {users} users x {rounds} rounds, profile {profile_tokens} + post {post_tokens} tokens, "
        f"device tier {device_fraction:.0%} of the profiles ({runs[0].device_tier_blocks} blocks)"
    )
    print(f"{'suffix':<8} {'seconds':>8} {'device hit':>10} {'host hit':>9} {'computed':>9}")
    for r in runs:
        hits = f"{r.num_device_hit_tokens:>10} {r.num_host_hit_tokens:>9} {r.num_miss_tokens:>9}"
        print(f"{r.suffix:<8} {r.seconds:>8.2f} {hits}")
    print(f"end to end, discard takes {speedup:.2f}x the time of offload (median of {sequence_repeats} paired runs)")
    print_headline(headline)
    return write_report(
        new_json_path(opts.json_path) if opts.json_path else None,
        "tiers",
        cfg.device,
        {
            "model": {"path": cfg.model.path, "dtype": config_precision(cfg).compute},
            "block_tokens": cfg.cache.block_tokens,
            "load_vs_compute": [asdict(c) for c in costs],
            "host_stages": [
                {**asdict(st), "load_seconds": st.load_seconds, "load_fraction_of_copy": st.load_fraction_of_copy}
                for st in stages
            ],
            "trace": {
                "users": users,
                "profile_tokens": profile_tokens,
                "post_tokens": post_tokens,
                "rounds": rounds,
                "device_fraction": device_fraction,
                "device_tier_bytes": device_bytes,
            },
            "runs": [asdict(r) for r in runs],
            "offload_speedup_over_discard": speedup,
            "sequence_repeats": sequence_repeats,
            "headline": headline,
        },
    )
