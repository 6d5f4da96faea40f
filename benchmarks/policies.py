"""`python -m benchmarks policies`: scheduling policies on a post-recommendation burst, JCT error, decision cost.

1. Post recommendation (the paper's workload, scaled): U users x P candidate posts; each request
   is the user's profile (normal length) + one post, interleaved across users (seeded). A burst
   (everything at once) measures the saturation throughput; then requests arrive as a Poisson
   process at a fraction of it. Every policy runs the same trace on the same engine configuration
   (device tier sized to a fraction of the users' profiles, host tier on): hit tokens per tier,
   mean and P99 latency, makespan, and the JCT model's prediction error on the way.
2. Decision time: one `pick` (re-scoring what changed + choosing) at queue depths 10..10,000,
   after a job changed one user's profile blocks in the tiers.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from benchmarks.load import kv_bytes_per_token, run_engine
from benchmarks.report import write_report
from benchmarks.stats import percentile, poisson_arrivals
from benchmarks.traces import PostRecommendationOptions, Trace, ordinary_token_ids, post_recommendation
from tiered.config import Config
from tiered.engine import Engine, Result
from tiered.scheduler.scheduler import Decision

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PolicyRun:
    policy: str
    num_requests: int
    makespan_seconds: float
    mean_latency_seconds: float
    p50_latency_seconds: float
    p99_latency_seconds: float
    num_device_hit_tokens: int
    num_host_hit_tokens: int
    num_miss_tokens: int
    jct_mape: float | None
    # The best any model of (total, computed, host-hit tokens) could do on this run: the mean
    # absolute percentage deviation of each job from the mean of the jobs with its exact split.
    jct_noise_floor: float
    mean_decision_ms: float


def run_policy(cfg: Config, policy: str, trace: Trace, arrivals: list[float]) -> PolicyRun:
    """Submit each request at its arrival time (wall clock) while the engine runs."""
    engine_cfg = _with_policy(cfg, policy)
    results, makespan, jct_error = run_engine(engine_cfg, trace, arrivals, policy)
    lat = [r.latency_seconds for r in results]
    run = PolicyRun(
        policy,
        len(results),
        makespan,
        statistics.fmean(lat),
        percentile(lat, 0.5),
        percentile(lat, 0.99),
        sum(r.split.num_device_hit_tokens for r in results),
        sum(r.split.num_host_hit_tokens for r in results),
        sum(r.split.num_miss_tokens for r in results),
        jct_error,
        _noise_floor(results),
        1e3 * statistics.fmean(r.decision_seconds for r in results),
    )
    log.info(
        "%-10s makespan %.2f s, latency mean %.2f P99 %.2f s, hits device %d host %d, computed %d, JCT error %s",
        policy,
        makespan,
        run.mean_latency_seconds,
        run.p99_latency_seconds,
        run.num_device_hit_tokens,
        run.num_host_hit_tokens,
        run.num_miss_tokens,
        f"{100 * run.jct_mape:.1f}%" if run.jct_mape is not None else "-",
    )
    return run


def _noise_floor(results: list[Result]) -> float:
    groups: dict[tuple[int, int, int], list[float]] = {}
    for r in results:
        key = (r.split.num_tokens, r.split.num_miss_tokens, r.split.num_host_hit_tokens)
        groups.setdefault(key, []).append(r.load_seconds + r.compute_seconds)
    devs = [abs(t - statistics.fmean(ts)) / t for ts in groups.values() if len(ts) > 1 for t in ts]
    return statistics.fmean(devs) if devs else 0.0


def _with_policy(cfg: Config, policy: str) -> Config:
    return replace(cfg, scheduler=replace(cfg.scheduler, policy=policy))  # type: ignore[arg-type]


def decision_times(cfg: Config, depths: list[int], request_tokens: int, picks: int) -> dict[str, dict[int, float]]:
    """Mean ms per pick at each queue depth, right after one user's blocks changed in the device tier;
    and ("pieces") per decision of whether and where a long head yields, every waiting request
    carrying a latency objective."""
    out: dict[str, dict[int, float]] = {}
    for policy in ("calibrated", "hrrn"):
        engine = Engine(_with_policy(cfg, policy))
        tiers, sched = engine.tiers, engine.scheduler
        out[policy] = {}
        g = torch.Generator().manual_seed(0)
        users = 50
        profiles = [
            torch.randint(0, engine.model.args.vocab_size, (request_tokens,), generator=g) for _ in range(users)
        ]
        n_added = 0
        long_head = sched.add(
            tiers.new_request("long", torch.randint(0, engine.model.args.vocab_size, (request_tokens,), generator=g))
        )
        head = Decision(sched.remove("long") or long_head, long_head.jct, 0.0)
        out.setdefault("pieces", {})
        for depth in depths:
            while len(sched) < depth + picks:
                post = torch.randint(0, engine.model.args.vocab_size, (32,), generator=g)
                # Every waiting request has an objective of 1-10 s: the pieces decision scans the urgent.
                sched.add(
                    tiers.new_request(f"d{n_added}", torch.cat([profiles[n_added % users], post])),
                    slo_seconds=1.0 + n_added % 10,
                )
                n_added += 1
            if policy == "calibrated":  # SLOWeave's choice for a long head, as `step` makes it
                start = time.perf_counter()
                for _ in range(picks):
                    head.waiting.yield_until = None  # its bound, set by a yield, would stop it yielding
                    assert sched.pieces is not None
                    sched.pieces.decide(head, sched.by_deadline, sched.clock())
                out["pieces"][depth] = 1e3 * (time.perf_counter() - start) / picks
                log.info("pieces     queue depth %6d: %.3f ms per decision", depth, out["pieces"][depth])
            total = 0.0
            for i in range(picks):
                # A job just ran: one user's profile blocks entered the device tier.
                tiers._changed(tiers.new_request("x", profiles[i % users]).keys)
                start = time.perf_counter()
                decision = sched.pick()
                total += time.perf_counter() - start
                assert decision is not None
            out[policy][depth] = 1e3 * total / picks
            log.info("%-10s queue depth %6d: %.3f ms per decision", policy, depth, out[policy][depth])
        engine.close()
    return out


@dataclass(frozen=True, slots=True)
class PoliciesOptions:
    """What `run_policies_bench` runs beyond the config (the CLI's options, one to one)."""

    policies: list[str]
    users: int
    posts: int  # candidate posts per user
    profile_mean: int  # tokens; profile lengths are clipped to mean +- sd
    profile_sd: int
    post_tokens: int
    device_fraction: float  # the device tier, as a share of all profiles' KV
    depths: list[int]  # queue depths for the decision time
    repeats: int  # runs per policy, interleaved; the tables show each policy's median run
    load: float  # Poisson arrival rate, as a share of the saturation rate (0: the burst only)
    json_path: str | None


def run_policies_bench(cfg: Config, opts: PoliciesOptions) -> dict[str, object]:
    """Each policy on the same post-recommendation trace and arrivals (see the module docstring); the JSON document."""
    policies, users, posts, repeats, load = opts.policies, opts.users, opts.posts, opts.repeats, opts.load
    profile_mean, profile_sd, post_tokens = opts.profile_mean, opts.profile_sd, opts.post_tokens
    device_fraction = opts.device_fraction
    a_engine = Engine(cfg)  # profiles the JCT model once (cached on disk for the runs below)
    vocab = ordinary_token_ids(a_engine.model_dir)
    a_engine.close()
    kv_per_token = kv_bytes_per_token(cfg)
    device_bytes = int(device_fraction * users * profile_mean * kv_per_token)
    cfg = replace(cfg, cache=replace(cfg.cache, device_tier_bytes=device_bytes))
    trace = post_recommendation(
        vocab,
        PostRecommendationOptions(
            users,
            posts,
            profile_mean,
            profile_sd,
            profile_mean - profile_sd,
            profile_mean + profile_sd,
            post_tokens,
            seed=0,
        ),
    )
    # Saturation throughput: everything submitted at once (fcfs: the order does not change the work much).
    burst = run_policy(cfg, "fcfs", trace, poisson_arrivals(len(trace), 0, seed=0))
    saturation_qps = len(trace) / burst.makespan_seconds
    qps = load * saturation_qps
    arrivals = poisson_arrivals(len(trace), qps, seed=1)
    log.info(
        "saturation %.2f requests/s (burst makespan %.2f s); Poisson arrivals at %.2f/s",
        saturation_qps,
        burst.makespan_seconds,
        qps,
    )
    # Policies interleaved per repeat, so a slow spell of the machine hits all of them; the table
    # shows each policy's median run (by mean latency), the JSON keeps every run.
    all_runs = [run_policy(cfg, p, trace, arrivals) for _ in range(repeats) for p in policies]
    runs = [
        sorted((r for r in all_runs if r.policy == p), key=lambda r: r.mean_latency_seconds)[repeats // 2]
        for p in policies
    ]
    decisions = decision_times(cfg, opts.depths, request_tokens=min(4096, cfg.model.max_model_len - 64), picks=20)
    shape = f"profile ~{profile_mean}±{profile_sd} + post {post_tokens} tokens"
    print(f"post recommendation: {users} users x {posts} posts, {shape}, device tier {device_fraction:.0%} of profiles")
    if load > 0:
        print(f"Poisson arrivals at {qps:.2f} requests/s = {load:.0%} of the saturation {saturation_qps:.2f}/s")
    else:
        print(f"all requests at once (a burst); saturation throughput {saturation_qps:.2f} requests/s")
    head = f"{'device hit':>11}{'host hit':>10}{'computed':>10}{'mean s':>8}{'P99 s':>8}{'makespan':>9}"
    head += f"{'JCT err':>8}{'floor':>7}"
    print(f"{'policy':<11}{head}")
    for r in runs:
        err = f"{100 * r.jct_mape:.1f}%" if r.jct_mape is not None else "-"
        hits = f"{r.num_device_hit_tokens:>11}{r.num_host_hit_tokens:>10}{r.num_miss_tokens:>10}"
        times = f"{r.mean_latency_seconds:>8.2f}{r.p99_latency_seconds:>8.2f}{r.makespan_seconds:>9.2f}"
        print(f"{r.policy:<11}{hits}{times}{err:>8}{100 * r.jct_noise_floor:>6.1f}%")
    for p, by in decisions.items():
        print(f"ms per decision, {p}: " + ", ".join(f"depth {d}: {ms:.3f}" for d, ms in by.items()))
    return write_report(
        opts.json_path,
        "policies",
        cfg.device,
        {
            "config": asdict(cfg),
            "trace": {
                "users": users,
                "posts": posts,
                "profile_mean": profile_mean,
                "profile_sd": profile_sd,
                "post_tokens": post_tokens,
                "device_fraction": device_fraction,
                "seed": 0,
            },
            "repeats": repeats,
            "saturation_qps": saturation_qps,
            "qps": qps,
            "burst_run": asdict(burst),
            "median_runs": [asdict(r) for r in runs],
            "runs": [asdict(r) for r in all_runs],
            "decision_ms_by_depth": decisions,
        },
    )
