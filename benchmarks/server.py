"""`python -m benchmarks server`: what the HTTP server adds per request over the in-process engine.

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

import httpx
import torch

from benchmarks.launch import start_server, stop_server
from benchmarks.report import write_report
from tiered.config import Config
from tiered.engine import Engine

log = logging.getLogger(__name__)


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
