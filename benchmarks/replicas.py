"""Replicas of `tiered serve` sharing one Redis tier, behind vllm-router (issue 14's light path).

Side by side in one run, on the visit workload at saturation (every visit queued at once, at most
`--concurrency` in flight), each run cold (its own cache salt):
- `one`: one replica using both cores, called directly;
- `two-affinity`: two replicas, one core each (taskset, OMP_NUM_THREADS=1), behind vllm-router
  with `--policy consistent_hash` on `x-user-id`;
- `two-roundrobin`: the same two replicas behind `--policy round_robin`.
Every replica has the same Redis as remote tier. Then "moved users": for each of `--moved` users,
one visit on replica 0, then another visit of the same user on replica 1: the share of the
second visit's profile tokens served from Redis.

With `--ray` (issue 14's Ray Serve path, `tiered serve --replicas N`; run it inside a loopback-only
network namespace, `scripts/loopback`), the same measurement on Ray Serve deployments, each
started afresh: `ray-one` (one replica, 2 CPUs), `ray-affinity` (two replicas, one core each:
engine.threads=1 and each engine process pinned to its core; the consistent-hash ring with the
bounded load) and `ray-roundrobin` (the same two, round robin). `--no-redis` runs every system
without the remote tier, so a replica has only its own tiers.

    .venv/bin/python -m benchmarks.replicas --config configs/bench.yaml --users 32 --visits 48
    scripts/loopback .venv/bin/python -m benchmarks.replicas --ray --config configs/bench.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import psutil

from benchmarks.launch import free_port, start_redis, start_router, start_server, stop_server
from benchmarks.load import Call, HttpOptions, run_http
from benchmarks.traces import VisitsTraceOptions, ordinary_token_ids, visits
from benchmarks.visits import split_visits
from tiered.config import Config, load_config, with_overrides, write_config
from tiered.embedded import resolve_model_path


def pin(pid: int, cores: str) -> None:
    """Every thread of the server and of its engine process on `cores`."""
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        subprocess.run(["taskset", "-a", "-cp", cores, str(p.pid)], check=True, stdout=subprocess.DEVNULL)


def measure(url: str, calls: list[Call], salt: str, concurrency: int) -> dict[str, float]:
    records, makespan = run_http(url, "model", calls, [0.0] * len(calls), HttpOptions(salt, concurrency, salt))
    ok = [r for r in records if r.error is None]
    tokens = sum(r.num_tokens for r in ok)
    lat = sorted(r.latency_seconds for r in ok)
    return {
        "visits_per_s": len(ok) / makespan,
        "errors": len(records) - len(ok),
        "makespan_s": makespan,
        "device_share": sum(r.device_hit_tokens for r in ok) / tokens,
        "host_share": sum(r.host_hit_tokens for r in ok) / tokens,
        "remote_share": sum(r.remote_hit_tokens for r in ok) / tokens,
        "shared_share": sum(r.shared_tokens for r in ok) / tokens,
        "p50_s": lat[len(lat) // 2],
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/bench.yaml")
    ap.add_argument("--set", action="append", default=[], help="config overrides, as `tiered --set`")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--visits", type=int, default=48)
    ap.add_argument("--posts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--moved", type=int, default=12)
    ap.add_argument("--ray", action="store_true", help="the Ray Serve deployments instead of vllm-router's")
    ap.add_argument("--no-redis", action="store_true", help="no shared remote tier")
    ap.add_argument("--json", default="benchmarks/out/replicas.json")
    a = ap.parse_args()
    out = Path(a.json).parent
    out.mkdir(parents=True, exist_ok=True)
    redis_proc, redis_url = start_redis(tempfile.mkdtemp(), maxmemory="4gb")
    remote = [] if a.no_redis else [f"cache.host.lmcache.remote_url={redis_url}"]
    cfg = with_overrides(load_config(a.config, a.set), remote)
    folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    trace = visits(ordinary_token_ids(folder), VisitsTraceOptions(a.users, a.visits, a.posts, seed=0))
    vs = split_visits(trace)
    calls = [Call(v.call.call_id, v.call.prompts, user=f"u{v.user}") for v in vs]
    print(trace.describe())
    path = write_config(cfg, out / "replicas.yaml")
    serve = ["--config", str(path), "--served-model-name", "model"]
    results: dict[str, dict[str, float]] = {}
    if a.ray:
        try:
            results = on_ray(cfg, calls, a.concurrency)
        finally:
            redis_proc.terminate()
        report(results, ["ray-one", "ray-affinity", "ray-roundrobin"], a.json, trace.describe())
        return
    try:
        one, url = start_server(serve, log_path=out / "replicas-one.log")
        try:
            results["one"] = measure(url, calls, "one", a.concurrency)
        finally:
            stop_server(one)
        os.environ["OMP_NUM_THREADS"] = "1"
        replicas = [start_server(serve, log_path=out / f"replicas-{i}.log") for i in range(2)]
        try:
            for i, (proc, _) in enumerate(replicas):
                pin(proc.pid, str(i))
            urls = [u for _, u in replicas]
            for policy, name in (("consistent_hash", "two-affinity"), ("round_robin", "two-roundrobin")):
                router, rurl = start_router(urls, policy)
                try:
                    results[name] = measure(rurl, calls, name, a.concurrency)
                finally:
                    router.terminate()
                    router.wait(10)
            results["moved"] = moved(urls, vs, a.moved)
        finally:
            for proc, _ in replicas:
                stop_server(proc)
    finally:
        redis_proc.terminate()
    report(results, ["one", "two-affinity", "two-roundrobin"], a.json, trace.describe())
    m = results["moved"]
    print(
        f"moved users: {m['users']:.0f}, profile tokens served from Redis on the new replica: "
        f"{m['remote_of_profile']:.1%}"
    )


def report(results: dict[str, dict[str, float]], names: list[str], path: str, trace: str) -> None:
    base = results[names[0]]["visits_per_s"]
    for name in names:
        r = results[name]
        print(
            f"{name:15s} {r['visits_per_s']:.3f} visits/s ({r['visits_per_s'] / base:.2f}x one), "
            f"P50 {r['p50_s']:.2f} s P99 {r['p99_s']:.2f} s; tokens from device {r['device_share']:.0%} "
            f"host {r['host_share']:.0%} remote {r['remote_share']:.0%} batch-shared {r['shared_share']:.0%}; "
            f"errors {r['errors']:.0f}"
        )
    Path(path).write_text(json.dumps({"command": " ".join(sys.argv), "trace": trace, **results}, indent=1))


def on_ray(cfg: Config, calls: list[Call], concurrency: int) -> dict[str, dict[str, float]]:
    """Each Ray Serve deployment in turn, each on a fresh local Ray."""
    from ray import serve

    from tiered.cluster import deploy

    results = {}
    systems: tuple[tuple[str, int, Literal["affinity", "round_robin"]], ...] = (
        ("ray-one", 1, "affinity"),
        ("ray-affinity", 2, "affinity"),
        ("ray-roundrobin", 2, "round_robin"),
    )
    for name, replicas, routing in systems:
        c = replace(cfg.cluster, replicas=replicas, cpus_per_replica=2.0 / replicas, routing=routing)
        url = deploy.deploy(replace(cfg, cluster=c), port=free_port(), app_kwargs={"served_model_names": ["model"]})
        try:
            if replicas > 1:
                handle = serve.get_deployment_handle("EngineReplica", app_name=deploy.APP_NAME)
                engines: set[int] = set()
                while len(engines) < replicas:
                    engines.add(handle.info.remote().result(timeout_s=60)["engine_pid"])
                for core, pid in enumerate(sorted(engines)):
                    pin(pid, str(core))
            results[name] = measure(url, calls, name, concurrency)
        finally:
            deploy.shutdown()
    return results


def moved(urls: list[str], vs: list, n: int) -> dict[str, float]:
    """A user's visit on replica 0, then another of its visits on replica 1."""
    by_user: dict[int, list] = {}
    for v in vs:
        by_user.setdefault(v.user, []).append(v)
    pairs = [(u, v[0], v[1]) for u, v in by_user.items() if len(v) >= 2][:n]
    remote = profile = 0
    for u, first, second in pairs:
        run_http(urls[0], "model", [first.call], [0.0], HttpOptions(f"moved u{u} on 0", cache_salt="moved"))
        time.sleep(1.0)  # LMCache's remote puts are asynchronous
        records, _ = run_http(
            urls[1], "model", [second.call], [0.0], HttpOptions(f"moved u{u} on 1", cache_salt="moved")
        )
        remote += records[0].remote_hit_tokens
        profile += second.profile_tokens  # batched: the lead loads the profile once, its followers share it
    return {"users": len(pairs), "remote_of_profile": remote / max(1, profile)}


if __name__ == "__main__":
    main()
