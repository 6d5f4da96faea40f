"""The servers the HTTP benchmarks drive (`bench visits`, `bench mixed`): `tiered serve` with a
config written per system, or `vllm serve`, each warmed up before it is yielded; and the
Prometheus counters of either, summed over their labels."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tiered.api.launch import start_server, stop_server
from tiered.bench.load import WARM_UP, run_http
from tiered.bench.vllm import VLLMServer
from tiered.config import Config, write_config


@contextmanager
def serve_tiered(cfg: Config, system: str, out_dir: Path) -> Iterator[str]:
    """`tiered serve` with `cfg` (written to OUT_DIR/SYSTEM.yaml, its log beside it), served as
    `model`, warmed up; yields its URL and stops it on exit."""
    path = write_config(cfg, out_dir / f"{system}.yaml")
    proc, url = start_server(["--config", str(path), "--served-model-name", "model"],
                             log_path=out_dir / f"{system}.log")  # fmt: skip
    try:
        run_http(url, "model", [WARM_UP], [0.0], cache_salt="warm-up")
        yield url
    finally:
        stop_server(proc)


@contextmanager
def serve_vllm(vllm: VLLMServer, system: str, out_dir: Path) -> Iterator[str]:
    """Start `vllm` (its log at OUT_DIR/SYSTEM.log) and warm it up; yields its URL, stops it on exit."""
    vllm.start(out_dir / f"{system}.log")
    try:
        run_http(vllm.url, "model", [WARM_UP], [0.0], cache_salt="warm-up")
        yield vllm.url
    finally:
        vllm.stop()


def prometheus_totals(url: str, keep: Callable[[str], bool]) -> dict[str, float]:
    """The server's `/metrics` samples whose name `keep` accepts, each summed over its labels
    (`_created` timestamps left out: they are not amounts)."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if keep(name) and not name.endswith("_created"):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
