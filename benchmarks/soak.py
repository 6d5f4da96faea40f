"""`python -m benchmarks soak`: a bounded soak of `tiered serve` with valid and invalid requests mixed.

A server starts with a small device tier and a small host tier (both evict all the time) on the
configured model. `--concurrency` clients send requests for `--minutes`: valid completions
(a user's profile from a pool + a fresh post, with logprobs of two label tokens) and, with
probability `--invalid-fraction`, one of the invalid kinds below. A fixed probe prompt is sent
now and then: its answers must all agree (whether its prefix was a device hit, a host hit or
computed) and match the in-process forward.

Reported and checked:
- every valid request answered exactly once: the client's count of 200s equals both the valid
  requests sent and the server's `vllm:request_success_total` increase (nothing lost, nothing twice);
- every invalid request got a 4xx naming its problem; no 5xx at all;
- RSS of the API and engine processes: after warm-up, after the first fifth of the run (the host
  tier's buffer is touched by then), and at the end; growth over the last four fifths must stay
  under RSS_GROWTH_BOUND;
- device-tier accounting when idle: no pinned blocks, no request waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

from benchmarks.launch import start_server, stop_server
from benchmarks.report import write_report
from benchmarks.traces import ordinary_token_ids
from tiered.api.metrics import parse
from tiered.config import Config, write_config
from tiered.embedded import resolve_model_path

log = logging.getLogger(__name__)

# The RSS of both processes may grow by at most this much after the first fifth of a soak (by then
# LMCache's buffer and the allocator pools are warm): more means something accumulates.
RSS_GROWTH_BOUND = 16 * 2**20

INVALID = {
    "out_of_vocabulary": lambda ids, n: {"prompt": [*ids[:10], 10**7], "max_tokens": 1},
    "too_long": lambda ids, n: {"prompt": ids[:1] * (n + 1), "max_tokens": 1},
    "max_tokens": lambda ids, n: {"prompt": ids[:10], "max_tokens": 16},
    "empty_prompt": lambda ids, n: {"prompt": [], "max_tokens": 1},
    "wrong_type": lambda ids, n: {"prompt": {"text": "x"}, "max_tokens": 1},
    "bad_logit_bias": lambda ids, n: {"prompt": ids[:10], "logit_bias": {"token": 1.0}},
    "not_json": lambda ids, n: None,
}


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids if psutil.pid_exists(p))


def _metrics(http: httpx.Client, url: str) -> dict[str, float]:
    return parse(http.get(f"{url}/metrics", timeout=30).text)


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """What `run_soak` runs beyond the config (the CLI's options, one to one)."""

    minutes: float
    concurrency: int  # clients, each with one request in flight
    invalid_fraction: float  # the chance that a request is one of the INVALID kinds
    users: int  # distinct profiles (shared prefixes)
    profile_tokens: int  # the longest profile; lengths uniform in [1/2, 1] of it
    out_dir: Path  # where the server's config is written
    json_path: str | None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class _Prompts:
    """What the soak's clients build their requests from."""

    profiles: list[list[int]]
    probe: list[int]  # the prompt whose answers must all agree
    labels: list[int]  # the two tokens whose logprobs every valid request asks for
    vocab: list[int]
    max_len: int  # the server's max_model_len (one invalid kind is longer)


def run_soak(cfg: Config, opts: SoakOptions) -> dict[str, Any]:
    """Soak a `tiered serve` of `cfg` for `opts.minutes` (see the module docstring); the JSON document."""
    minutes, concurrency, invalid_fraction = opts.minutes, opts.concurrency, opts.invalid_fraction
    users, profile_tokens = opts.users, opts.profile_tokens
    logging.getLogger("httpx").setLevel(logging.WARNING)
    folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    cfg = replace(cfg, model=replace(cfg.model, path=str(folder)))
    vocab = ordinary_token_ids(folder)
    rng = random.Random(opts.seed)
    profiles = [rng.choices(vocab, k=rng.randint(profile_tokens // 2, profile_tokens)) for _ in range(users)]
    probe = profiles[0] + rng.choices(vocab, k=40)
    labels = vocab[:2]
    path = write_config(cfg, opts.out_dir / "soak.yaml")
    proc, url = start_server(["--config", str(path)])
    http = httpx.Client(timeout=600)
    try:
        (engine_proc,) = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        pids = [proc.pid, engine_proc.pid]
        max_len = http.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        for p in profiles[:4]:  # warm-up
            http.post(f"{url}/v1/completions", json={"prompt": p + [vocab[5]], "max_tokens": 1}).raise_for_status()
        before = _metrics(http, url)
        rss = {"warm": _rss(pids)}
        prompts = _Prompts(profiles, probe, labels, vocab, max_len)
        stats = asyncio.run(_drive(url, opts, prompts, rng, pids, rss))
        time.sleep(2.0)
        idle = http.post(
            f"{url}/v1/completions", json={"prompt": probe, "max_tokens": 1, "logprob_token_ids": labels}
        ).json()
        stats["probe_logprobs"].append(idle["choices"][0]["logprob_token_ids"])
        stats["ok"] += 1
        after = _metrics(http, url)
        rss["end"] = _rss(pids)
        engine_alive = engine_proc.is_running()
    finally:
        http.close()
        stop_server(proc)

    from tiered.hybrid.forward import forward
    from tiered.hybrid.loader import load_model
    from tiered.hybrid.precision import config_precision

    compute = config_precision(cfg).compute
    ref = torch.log_softmax(forward(load_model(folder, compute), torch.tensor(probe)), dim=-1)
    probe_diff = max(abs(lp[str(t)] - float(ref[t])) for lp in stats["probe_logprobs"] for t in labels)
    answered = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    report = {
        "minutes": minutes,
        "concurrency": concurrency,
        "invalid_fraction": invalid_fraction,
        "users": users,
        "profile_tokens": profile_tokens,
        "valid_sent": stats["valid_sent"],
        "ok_200": stats["ok"],
        "server_answered": answered,
        "invalid_sent": stats["invalid_sent"],
        "invalid_by_status": stats["invalid"],
        "valid_failures": stats["valid_failures"],
        "server_errors_5xx": stats["5xx"],
        "probe_answers": len(stats["probe_logprobs"]),
        "probe_max_abs_diff_vs_forward": probe_diff,
        "rss_bytes": rss,
        "rss_samples": stats["rss_samples"],
        "idle_pinned_blocks": after["tiered:device_tier_pinned_blocks"],
        "idle_waiting": after["vllm:num_requests_waiting"],
        "engine_restarts": after["tiered:engine_restarts_total"],
        "host_tier_failures": after["tiered:host_tier_failures_total"],
        "engine_alive": engine_alive,
        "latency_p50_seconds": statistics.median(stats["latency"]) if stats["latency"] else None,
    }
    report["exactly_once"] = stats["ok"] == stats["valid_sent"] + 1 == answered
    growth = rss["end"] - rss.get("fifth", rss["warm"])
    report["rss_growth_bytes"] = growth
    report["rss_growth_bound_bytes"] = RSS_GROWTH_BOUND
    report["rss_ok"] = growth < RSS_GROWTH_BOUND
    print(
        f"soak: {minutes:g} min, concurrency {concurrency}: {stats['valid_sent'] + 1} valid requests, "
        f"{stats['ok']} answered 200, server counted {answered:.0f} -> exactly once: {report['exactly_once']}"
    )
    print(
        f"invalid requests: {stats['invalid_sent']} sent, statuses {json.dumps(stats['invalid'])}; "
        f"5xx: {stats['5xx']}; valid requests failed: {len(stats['valid_failures'])}"
    )
    print(f"probe: {len(stats['probe_logprobs'])} answers, max |logprob - in-process forward| {probe_diff:.2e}")
    print(
        f"RSS (API + engine): warm {rss['warm'] / 2**20:.0f} MiB, after 1/5 {rss.get('fifth', 0) / 2**20:.0f} MiB, "
        f"end {rss['end'] / 2**20:.0f} MiB (growth over the last 4/5: {growth / 2**20:+.1f} MiB)"
    )
    print(
        f"idle: pinned blocks {after['tiered:device_tier_pinned_blocks']:.0f}, "
        f"waiting {after['vllm:num_requests_waiting']:.0f}; "
        f"engine restarts {after['tiered:engine_restarts_total']:.0f}"
    )
    return write_report(opts.json_path, "soak", cfg.device, report)


async def _drive(
    url: str, opts: SoakOptions, prompts: _Prompts, rng: random.Random, pids: list[int], rss: dict[str, int]
) -> dict[str, Any]:
    """`opts.concurrency` clients for `opts.minutes`, sampling RSS into `rss`: what they sent and got back."""
    minutes, concurrency, invalid_fraction = opts.minutes, opts.concurrency, opts.invalid_fraction
    stats: dict[str, Any] = {
        "valid_sent": 0,
        "ok": 0,
        "invalid_sent": 0,
        "invalid": {},
        "valid_failures": [],
        "5xx": 0,
        "probe_logprobs": [],
        "latency": [],
        "rss_samples": [],
    }
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + 60 * minutes
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while loop.time() < end:
                if rng.random() < invalid_fraction:
                    kind = rng.choice(sorted(INVALID))
                    body = INVALID[kind](rng.choice(prompts.profiles), prompts.max_len)
                    stats["invalid_sent"] += 1
                    if body is None:
                        r = await client.post(
                            f"{url}/v1/completions",
                            content=b"\xff{not json",
                            headers={"content-type": "application/json"},
                        )
                    else:
                        r = await client.post(f"{url}/v1/completions", json=body)
                    key = f"{kind}:{r.status_code}"
                    stats["invalid"][key] = stats["invalid"].get(key, 0) + 1
                    stats["5xx"] += r.status_code >= 500
                    continue
                is_probe = rng.random() < 0.05
                prompt = (
                    prompts.probe
                    if is_probe
                    else rng.choice(prompts.profiles) + rng.choices(prompts.vocab, k=rng.randint(20, 60))
                )
                stats["valid_sent"] += 1
                sent = loop.time()
                body = {"prompt": prompt, "max_tokens": 1, "logprob_token_ids": prompts.labels}
                r = await client.post(f"{url}/v1/completions", json=body)
                stats["5xx"] += r.status_code >= 500
                if r.status_code == 200:
                    stats["ok"] += 1
                    stats["latency"].append(loop.time() - sent)
                    if is_probe:
                        stats["probe_logprobs"].append(r.json()["choices"][0]["logprob_token_ids"])
                else:
                    stats["valid_failures"].append(f"{r.status_code}: {r.text[:200]}")

        async def sampler() -> None:
            while loop.time() < end:
                await asyncio.sleep(5)
                # (seconds, API + engine, API alone, engine alone): which process grows
                stats["rss_samples"].append((round(loop.time() - start, 1), _rss(pids), _rss(pids[:1]), _rss(pids[1:])))
                if "fifth" not in rss and loop.time() - start >= 12 * minutes:
                    rss["fifth"] = _rss(pids)

        await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    return stats
