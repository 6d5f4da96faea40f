"""`tiered serve --replicas N` on Ray Serve (tiered.cluster.deploy), two replicas of the tiny model
sharing one Redis tier: answers through the ingress equal the in-process forward, a user stays on
one replica, a replica killed mid-load loses no request, its replacement finds the users' KV in
Redis, and shutdown completes.

Ray binds the machine's network address and probes a public one, so these tests run only in a
network namespace with loopback alone, as `make test` runs the suite (scripts/loopback)."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("ray.serve", reason="Ray Serve (the ray extra) is not installed")
if [name for _, name in socket.if_nameindex()] != ["lo"]:
    pytest.skip(
        "Ray needs a network namespace with loopback only here: run `make test` (scripts/loopback)",
        allow_module_level=True,
    )

from ray import serve  # noqa: E402

from benchmarks.launch import free_port  # noqa: E402
from tiered.api.metrics import parse  # noqa: E402
from tiered.cluster import deploy  # noqa: E402
from tiered.config import load_config  # noqa: E402
from tiered.hybrid.forward import forward  # noqa: E402
from tiered.hybrid.loader import load_model  # noqa: E402

USERS = 12
PROFILE = 160  # tokens: 10 blocks of 16


def _profile(user: int) -> list[int]:
    return [(user * 131 + t * 7) % 1290 + 3 for t in range(PROFILE)]


def _call(url: str, user: int, post: int, n: int = 4) -> httpx.Response:
    prompts = [[*_profile(user), 40 + post + i, 41] for i in range(n)]
    body = {"prompt": prompts, "max_tokens": 1, "logprob_token_ids": [11, 12]}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"x-user-id": f"u{user}"}, timeout=120)


def _replicas() -> dict[str, dict[str, Any]]:
    """The running engine replicas' info, by replica id (a handle call lands on any replica)."""
    handle = serve.get_deployment_handle("EngineReplica", app_name=deploy.APP_NAME)
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(40):
        info = handle.info.remote().result(timeout_s=30)
        seen[info["replica"]] = info
        if len(seen) == 2:
            break
    return seen


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    jct = tmp_path_factory.mktemp("jct-ray")
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "cache.block_tokens=16",
            f"scheduler.profile_cache_dir={jct}",
            "scheduler.profile_tokens=[64,256]",
            f"cache.host.lmcache={{remote_url: '{redis_url}'}}",
            "cluster.replicas=2",
            "cluster.health_check_period_s=1",
        ],
    )
    url = deploy.deploy(cfg, port=free_port())
    try:
        yield url
    finally:
        deploy.shutdown()


def test_the_ingress_answers_like_tiered_serve(cluster: str, tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    prompts = [[0, *range(10, 10 + n)] for n in (5, 50, 300)]
    r = httpx.post(
        f"{cluster}/v1/completions",
        json={"prompt": prompts, "max_tokens": 1, "logprob_token_ids": [11, 12]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-tiered-replica"] in _replicas()
    for choice in r.json()["choices"]:
        ref = torch.log_softmax(forward(model, torch.tensor(prompts[choice["index"]])), dim=-1)
        got = choice["logprob_token_ids"]
        assert abs(got["11"] - float(ref[11])) < 1e-4 and abs(got["12"] - float(ref[12])) < 1e-4
    bad = httpx.post(f"{cluster}/v1/completions", json={"prompt": [0, 10**6], "max_tokens": 1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert httpx.get(f"{cluster}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 15  # the replicas report their statistics every second
    while "tiered:jct_prediction_error" not in (m := parse(httpx.get(f"{cluster}/metrics", timeout=10).text)):
        assert time.monotonic() < deadline, "no engine statistics reached the ingress's /metrics"
        time.sleep(0.5)
    assert m["vllm:request_success_total"] >= 3 and m["tiered:engine_restarts_total"] == 0
    assert m["tiered:replicas"] == 2


def test_each_user_stays_on_one_replica(cluster: str) -> None:
    homes: dict[int, set[str]] = {}
    for post in range(3):
        for user in range(USERS):
            r = _call(cluster, user, post)
            assert r.status_code == 200, r.text
            homes.setdefault(user, set()).add(r.headers["x-tiered-replica"])
            if post:  # the profile's blocks are in that replica's own tiers, not fetched from Redis
                usage = r.json()["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * PROFILE, usage
                assert usage["tiered"]["remote_hit_tokens"] == 0, usage
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) == 2  # and users are spread over both


def test_a_replica_killed_mid_load_loses_no_request_and_its_successor_finds_the_kv_in_redis(cluster: str) -> None:
    before = _replicas()
    homes = {u: _call(cluster, u, 10).headers["x-tiered-replica"] for u in range(USERS)}
    victim = next(iter(before))
    calls = [(u, 20 + k) for k in range(10) for u in range(USERS)]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_call, cluster, u, post) for u, post in calls]
        while sum(f.done() for f in futures) < 4:  # the load is flowing through both replicas
            time.sleep(0.01)
        os.kill(before[victim]["pid"], signal.SIGKILL)
        killed = sum(not f.done() for f in futures)
        answers = [f.result() for f in futures]
    assert killed > 16  # the kill came mid-load: calls were waiting or running on both replicas
    # Each call answered once: 200, or a clear 503 when its retry failed too.
    assert all(a.status_code in (200, 503) for a in answers), [a.text for a in answers if a.status_code >= 300]
    ok = [a for a in answers if a.status_code == 200]
    assert len(ok) >= len(calls) - 2, [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["error"]["type"] == "service_unavailable" for a in answers if a.status_code == 503)
    # Its engine process does not outlive it.
    deadline = time.monotonic() + 30
    while _alive(before[victim]["engine_pid"]):
        assert time.monotonic() < deadline, "the killed replica's engine process is still running"
        time.sleep(0.5)
    # Ray replaces it; users whose ring position the new replica owns find their profile in Redis.
    deadline = time.monotonic() + 120
    while len(now := _replicas()) < 2 or set(now) == set(before):
        assert time.monotonic() < deadline, "Ray did not replace the killed replica"
        time.sleep(1)
    (successor,) = set(now) - set(before)
    moved = [u for u in range(USERS) if homes[u] == victim]
    served = {}
    for user in range(USERS):
        r = _call(cluster, user, 30, n=1)
        assert r.status_code == 200, r.text
        served[user] = (r.headers["x-tiered-replica"], r.json()["usage"])
    on_successor = [u for u, (rep, _) in served.items() if rep == successor]
    assert on_successor, served  # with 12 users, the new replica owns some
    for user in on_successor:
        usage = served[user][1]
        assert usage["tiered"]["remote_hit_tokens"] == PROFILE, (user, user in moved, usage)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def test_a_replicas_engine_process_that_dies_is_restarted_inside_it(cluster: str) -> None:
    replicas = _replicas()
    rid, info = next(iter(replicas.items()))
    os.kill(info["engine_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while parse(httpx.get(f"{cluster}/metrics", timeout=10).text).get("tiered:engine_restarts_total", 0) < 1:
        assert time.monotonic() < deadline, "the engine restart did not reach the ingress's /metrics"
        time.sleep(0.5)
    assert rid in _replicas()  # the same replica (its health check held), with a new engine process
    for user in range(USERS):
        r = _call(cluster, user, 40, n=1)
        assert r.status_code == 200, r.text


def test_shutdown_completes_and_stops_the_engines(cluster: str) -> None:
    engines = [info["engine_pid"] for info in _replicas().values()]
    start = time.monotonic()
    deploy.shutdown()
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in engines):
        assert time.monotonic() < deadline, "an engine process outlived shutdown"
        time.sleep(0.5)


def test_tiered_serve_replicas_from_the_command_line(tiny_dir: Path, tmp_path: Path) -> None:
    from benchmarks.launch import start_server

    proc, url = start_server(
        [
            str(tiny_dir),
            "--replicas",
            "2",
            "--set",
            "cache.block_tokens=16",
            "--set",
            f"scheduler.profile_cache_dir={tmp_path}",
            "--set",
            "scheduler.profile_tokens=[64]",
        ],
        timeout_s=240,
    )
    try:
        seen = {_call(url, u, 0, n=1).headers["x-tiered-replica"] for u in range(USERS)}
        assert len(seen) == 2  # two replicas answered
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C takes the replicas and Ray down
        assert proc.wait(90) == 0, proc.log_tail()
    assert "engine replica(s) serve at" in proc.log_tail(200000)
