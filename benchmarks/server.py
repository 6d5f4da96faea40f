"""`python -m benchmarks server`: what the HTTP server adds per request over the in-process engine;
`python -m benchmarks startup`: how long `tiered serve` takes to answer its first /health.

Low load: one request at a time, alternating between the two sides. The same config runs
in-process (`Engine.submit` + `run`) and behind `tiered serve` (the openai-style POST
/v1/completions with token ids, over loopback); each side gets its own distinct prompts of
equal length, so neither finds the other's prefix in a cache. Reported: median latency of each,
the difference of the medians, and the median of the paired differences (request i in-process
against request i over HTTP).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import httpx
import torch

from benchmarks.launch import start_server, stop_server
from benchmarks.report import commit_of, write_report
from benchmarks.stats import abba
from tiered.config import Config, load_config
from tiered.config.options import DEFAULT_CONFIG, resolve_device
from tiered.engine import Engine

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent  # this checkout


def run_server_bench(
    cfg: Config, config_path: str | None, overrides: list[str], requests: int, tokens: int, json_path: str | None
) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    engine = Engine(cfg)
    vocab = engine.model.args.vocab_size
    prompts = [torch.randint(1, min(vocab, 1300), (tokens,), generator=g).tolist() for _ in range(2 * requests + 2)]
    args = (["--config", config_path] if config_path else []) + [a for o in overrides for a in ("--set", o)]
    proc, url = start_server(args)
    in_process: list[float] = []
    over_http: list[float] = []
    try:
        http = httpx.Client(timeout=600)
        engine.submit(prompts[-1])  # warm-up, both sides
        engine.run()
        http.post(f"{url}/v1/completions", json={"prompt": prompts[-2], "max_tokens": 1}).raise_for_status()
        # Alternate the two sides, so that drift in the machine's speed hits both alike.
        for i in range(requests):
            start = time.perf_counter()
            engine.submit(prompts[i])
            engine.run()
            in_process.append(time.perf_counter() - start)
            start = time.perf_counter()
            r = http.post(f"{url}/v1/completions", json={"prompt": prompts[requests + i], "max_tokens": 1})
            over_http.append(time.perf_counter() - start)
            r.raise_for_status()
    finally:
        stop_server(proc)
        engine.close()
    med_in, med_http = statistics.median(in_process), statistics.median(over_http)
    print(f"{requests} requests of {tokens} tokens, one at a time")
    print(f"in-process engine: median {1e3 * med_in:.2f} ms")
    print(f"through tiered serve: median {1e3 * med_http:.2f} ms")
    paired = statistics.median(h - i for i, h in zip(in_process, over_http, strict=True))
    print(
        f"server overhead per request: {1e3 * (med_http - med_in):.2f} ms (difference of medians), "
        f"{1e3 * paired:.2f} ms (median of paired differences)"
    )
    return write_report(
        json_path,
        "server",
        cfg.device,
        {
            "requests": requests,
            "tokens": tokens,
            "in_process_seconds": in_process,
            "http_seconds": over_http,
            "median_overhead_seconds": med_http - med_in,
            "median_paired_overhead_seconds": paired,
        },
    )


def run_startup_bench(
    config_path: str | None, overrides: list[str], starts: int, base_tree: Path | None, json_path: str | None
) -> dict[str, object]:
    """`tiered serve` started `starts` times with the same config: the seconds from the command to
    `/health` answering 200 (the engine loaded, its profile run, the app serving), each start a
    fresh pair of processes, stopped before the next. With `base_tree`, that checkout's server
    starts as often, the two taking turns in ABBA order; the ratio of each pair is reported. Each
    checkout first starts once untimed: what a start makes and keeps in the checkout's folders (an
    embedded model, the attention kernels' and JCT profiles' caches) is there for every timed one."""
    args = (["--config", str(Path(config_path).resolve())] if config_path else []) + [
        a for o in overrides for a in ("--set", o)
    ]
    trees: dict[str, Path | None] = {"tiered": None}
    if base_tree is not None:
        trees["tiered-base"] = base_tree.resolve()
    for system, tree in trees.items():
        log.info("%s: an untimed start, to fill its caches", system)
        stop_server(start_server(args, cwd=tree)[0])
    seconds: dict[str, list[float]] = {s: [] for s in trees}  # per system, start by start
    for i in range(starts):
        for system in abba(list(trees), i):
            began = time.perf_counter()
            proc, _ = start_server(args, cwd=trees[system])
            seconds[system].append(time.perf_counter() - began)
            stop_server(proc)
            log.info("%-11s start %d: %.2f s to /health", system, i + 1, seconds[system][-1])
    medians = {s: statistics.median(x) for s, x in seconds.items()}
    print(f"{starts} starts of tiered serve {' '.join(args)}, each to /health 200")
    for system, tree in trees.items():
        print(f"{system:<11} median {medians[system]:.2f} s ({tree or 'this checkout'})")
    ratios = [b / o for o, b in zip(seconds["tiered"], seconds.get("tiered-base", []), strict=False)]
    if ratios:
        each = ", ".join(f"{x:.2f}x" for x in ratios)
        print(f"base / ours, start by start: {each}; median {statistics.median(ratios):.2f}x")
    return write_report(
        json_path,
        "startup",
        resolve_device(load_config(config_path or DEFAULT_CONFIG, overrides).device),
        {
            "starts": starts,
            "args": args,
            "trees": {s: (str(t) if t else None) for s, t in trees.items()},
            "commits": {s: commit_of(t or ROOT) for s, t in trees.items()},
            "seconds": seconds,
            "median_seconds": medians,
            "base_over_ours": ratios,
        },
    )
