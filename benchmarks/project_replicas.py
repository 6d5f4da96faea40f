"""Project N replicas sharing a Redis tier past one machine (issue 14, item 5).

1. `measure`: per-visit costs on this machine, in-process: two engines of `--config` sharing a
   Redis. For each profile length, a new user's visit (the profile computed: `miss`), a second
   visit of that user on the same engine (`local`), and a visit of that user on the other engine,
   which loads the profile from Redis (`remote`). Medians of `--repeats` users, fitted as a + b·P.
2. `project`: the simulation (`benchmarks/cluster_sim.py`, whose docstring is the model) for
   8, 64 and 512 replicas, affinity (the Ray Serve router's ring with the bounded load) against
   round robin: the highest offered QPS within a P99 SLO, and at it the share of visits served
   from each tier, Redis's bandwidth and the busiest replica's load. One plot.
3. `size`: the fewest replicas (affinity) that serve `--qps` within the SLO, and Redis's bandwidth then.

    .venv/bin/python -m benchmarks.project_replicas measure --config configs/bench-m.yaml \
        --json benchmarks/out/costs-bench-m.json
    .venv/bin/python -m benchmarks.project_replicas project --costs benchmarks/out/costs-bench-m.json
    .venv/bin/python -m benchmarks.project_replicas size --costs benchmarks/out/costs-bench-m.json --qps 500
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.cluster_sim import Cluster, Costs, Outcome, SimOptions, Traffic, arrivals, max_qps, profiles, simulate

POSTS, POST_TOKENS = 8, 150


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b·P."""
    xs, ys = [p for p, _ in points], [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def measure(a: argparse.Namespace) -> None:
    from benchmarks.launch import start_redis
    from benchmarks.traces import QUESTION_TOKENS, ordinary_token_ids
    from tiered.config import load_config, with_overrides
    from tiered.embedded import resolve_model_path
    from tiered.engine import Engine
    from tiered.request.score import RequestOptions

    redis, url = start_redis(tempfile.mkdtemp(), maxmemory="8gb")
    cfg = with_overrides(load_config(a.config, a.set), [f"cache.host.lmcache.remote_url={url}"])
    folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    vocab = ordinary_token_ids(folder)
    salt = f"costs-{time.time()}"  # cold: nothing from an earlier run in this Redis's keys

    def tokens(seed: int, n: int) -> list[int]:
        return [vocab[(seed * 7919 + i * 104729) % len(vocab)] for i in range(n)]

    def visit(engine: Engine, profile: list[int], seed: int) -> float:
        question = tokens(1, QUESTION_TOKENS)
        start = time.perf_counter()
        for p in range(POSTS):
            engine.submit(
                profile + tokens(seed * 100 + p, POST_TOKENS) + question, options=RequestOptions(cache_salt=salt)
            )
        engine.run()
        return time.perf_counter() - start

    samples: dict[str, list[tuple[int, float]]] = {"miss": [], "local": [], "remote": []}
    with Engine(cfg) as first, Engine(cfg) as second:
        visit(first, tokens(999, 1800), 1)  # warm-up: allocator, threads
        for size in a.sizes:
            per: dict[str, list[float]] = {"miss": [], "local": [], "remote": []}
            for r in range(a.repeats):
                profile = tokens(size * 31 + r, size)
                per["miss"].append(visit(first, profile, 2))
                per["local"].append(visit(first, profile, 3))
                time.sleep(1.0)  # LMCache's remote puts are asynchronous
                per["remote"].append(visit(second, profile, 4))
            for k, v in per.items():
                samples[k].append((size, statistics.median(v)))
            print(size, {k: round(statistics.median(v), 4) for k, v in per.items()}, flush=True)
        device = first.tiers.device_tier
        kv = device.bytes_per_block // device.block_tokens
        local_bytes = device.num_blocks * device.bytes_per_block
    redis.terminate()
    host_bytes = float(cfg.cache.host.lmcache.get("max_local_cpu_size", 0.25)) * 1e9
    costs = Costs(fit(samples["miss"]), fit(samples["local"]), fit(samples["remote"]), kv)
    out = {
        "config": a.config,
        "set": a.set,
        "cpu": cpu(),
        "samples": samples,
        "costs": asdict(costs),
        "local_tokens": int((local_bytes + host_bytes) // kv),
    }
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def load(path: str) -> tuple[Costs, int, dict]:
    raw = json.loads(Path(path).read_text())
    c = raw["costs"]
    return (
        Costs(tuple(c["miss"]), tuple(c["local"]), tuple(c["remote"]), c["kv_bytes_per_token"]),
        raw["local_tokens"],
        raw,
    )


def bandwidth(a: argparse.Namespace) -> float | None:
    return a.remote_gbps * 1e9 if a.remote_gbps else None


def project(a: argparse.Namespace) -> None:
    costs, local_tokens, raw = load(a.costs)
    local_tokens = a.local_tokens or local_tokens
    rows = []
    for n in a.replicas:
        sizes = profiles(a.users_per_replica * n, seed=a.seed)
        visits = max(a.min_visits, a.visits_per_replica * n)
        for routing in ("affinity", "round_robin"):
            cluster = Cluster(n, local_tokens, a.remote_tokens, bandwidth(a), routing, a.load_factor)
            qps, out = max_qps(cluster, costs, sizes, a.slo, Traffic(a.zipf, visits, a.seed), SimOptions(posts=POSTS))
            rows.append({"replicas": n, "routing": routing, "max_qps": qps, "per_replica": qps / n, **asdict(out)})
            print(
                f"{n:4d} {routing:11s} {qps:9.1f} visits/s within P99 {a.slo:g} s ({qps / n:.2f}/replica); P99 "
                f"{out.p99:.2f} s; visits local {out.local:.0%} remote {out.remote:.0%} computed {out.miss:.0%}; "
                f"Redis read {out.redis_read_bps / 1e9:.2f} GB/s write {out.redis_write_bps / 1e9:.2f} GB/s; "
                f"busiest replica {out.busiest:.0%}",
                flush=True,
            )
    Path(a.json).write_text(
        json.dumps(
            {
                "costs_file": a.costs,
                "cpu": raw["cpu"],
                "args": vars(a) | {"func": None},
                "local_tokens": local_tokens,
                "rows": rows,
            },
            indent=1,
        )
    )
    if a.plot:
        plot(rows, a.plot, a.slo)


def plot(rows: list[dict], path: str, slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for routing, style in (("affinity", "o-"), ("round_robin", "s--")):
        rs = [r for r in rows if r["routing"] == routing]
        left.plot([r["replicas"] for r in rs], [r["per_replica"] for r in rs], style, label=routing)
        right.plot([r["replicas"] for r in rs], [r["redis_read_bps"] / 1e9 for r in rs], style, label=routing)
    for ax, title in ((left, f"visits/s per replica within P99 {slo:g} s"), (right, "Redis reads, GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def size(a: argparse.Namespace) -> None:
    costs, local_tokens, _ = load(a.costs)
    local_tokens = a.local_tokens or local_tokens
    sizes = profiles(a.users, seed=a.seed)
    cluster = Cluster(1, local_tokens, a.remote_tokens, bandwidth(a), "affinity", a.load_factor)

    def run(n: int) -> Outcome:
        visits = arrivals(a.qps, max(a.min_visits, 40 * n), a.users, a.zipf, a.seed)
        return simulate(replace(cluster, replicas=n), costs, sizes, visits)

    n = 1
    while not (out := run(n)).meets(a.slo, a.qps):
        if n >= a.max_replicas:
            print(
                f"{a.qps:g} visits/s of {a.users} users (Zipf {a.zipf}) within P99 {a.slo:g} s: not with up to "
                f"{n} replicas (P99 {out.p99:.1f} s; Redis read {out.redis_read_bps / 1e9:.2f} GB/s, write "
                f"{out.redis_write_bps / 1e9:.2f} GB/s: more than the link carries?)"
            )
            return
        n *= 2
    low, high = n // 2, n  # the fewest between the last failing and this one
    while high - low > max(1, high // 32):
        mid = (low + high) // 2
        if (trial := run(mid)).meets(a.slo, a.qps):
            high, out = mid, trial
        else:
            low = mid
    print(
        f"{a.qps:g} visits/s of {a.users} users (Zipf {a.zipf}) within P99 {a.slo:g} s: {high} replicas; "
        f"P99 {out.p99:.2f} s; visits local {out.local:.0%} remote {out.remote:.0%} computed {out.miss:.0%}; "
        f"Redis read {out.redis_read_bps / 1e9:.2f} GB/s, write {out.redis_write_bps / 1e9:.2f} GB/s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(required=True)
    m = sub.add_parser("measure", help="per-visit costs on this machine (two engines, one Redis)")
    m.add_argument("--config", default="configs/bench-m.yaml")
    m.add_argument("--set", action="append", default=[])
    m.add_argument("--sizes", type=int, nargs="+", default=[1200, 1800, 2400])
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--json", default="benchmarks/out/costs.json")
    m.set_defaults(func=measure)
    for name, func in (("project", project), ("size", size)):
        p = sub.add_parser(name)
        p.add_argument("--costs", required=True, help="the JSON `measure` wrote")
        p.add_argument("--slo", type=float, default=5.0, help="P99 latency bound, seconds")
        p.add_argument("--zipf", type=float, default=1.1)
        p.add_argument("--load-factor", type=float, default=0.25)
        p.add_argument("--local-tokens", type=int, default=0, help="a replica's tiers in tokens (0: from the costs)")
        p.add_argument("--remote-tokens", type=int, default=None, help="Redis's size in tokens (default: unbounded)")
        p.add_argument(
            "--remote-gbps",
            type=float,
            default=0.0,
            help="Redis's bandwidth, GB/s, shared by every replica (0: unlimited)",
        )
        p.add_argument("--min-visits", type=int, default=4000)
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(func=func)
        if name == "project":
            p.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 512])
            p.add_argument("--users-per-replica", type=int, default=256)
            p.add_argument("--visits-per-replica", type=int, default=150)
            p.add_argument("--json", default="benchmarks/out/cluster-sim.json")
            p.add_argument("--plot", default="")
        else:
            p.add_argument("--qps", type=float, required=True)
            p.add_argument("--users", type=int, default=100_000)
            p.add_argument("--max-replicas", type=int, default=4096)
    a = ap.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
