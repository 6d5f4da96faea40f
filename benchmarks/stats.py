"""What a load run measures, summed up: per-request records, a run's summary, sustainable QPS
under a latency SLO, the median of repeated runs; and the seeded Poisson arrivals they replay."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(slots=True)
class Record:
    request_id: str
    num_tokens: int
    arrival_seconds: float  # offset from the run's start
    latency_seconds: float  # arrival to answer
    queued_seconds: float | None  # ours in-process only
    device_hit_tokens: int
    host_hit_tokens: int
    error: str | None = None
    shared_tokens: int = 0  # ours: computed once for several prompts of the batch (not cached)
    remote_hit_tokens: int = 0  # ours: from a remote tier shared by engines
    disk_hit_tokens: int = 0  # ours: from the host tier's local disk
    num_pieces: int | None = None  # ours: pieces its prefill ran in (usage.tiered; None: not reported)
    deadline_met: bool | None = None  # ours: answered within its slo_ms, by the server's clock (None: no objective)


@dataclass(slots=True)
class Summary:
    system: str
    multiple: float
    offered_qps: float
    num_requests: int
    num_errors: int
    throughput_qps: float
    mean_latency_seconds: float
    p50_latency_seconds: float
    p99_latency_seconds: float
    device_hit_rate: float
    host_hit_rate: float
    jct_error: float | None = None  # ours in-process: the JCT model's error (MAPE) at the end of the run


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-quantile: the smallest value with at least q·n values at or below it."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else math.nan


def abba(pair: list[T], rep: int) -> list[T]:
    """The order a pair runs in at repeat `rep`: as given, then reversed, and so on (A B, B A, A B, ...),
    so that neither side always runs first after the wait for quiet."""
    return pair if rep % 2 == 0 else pair[::-1]


# A tail percentile is named as such only from this many samples; below, the figure is the maximum.
MIN_TAIL_SAMPLES = 100


def tail_name(num_samples: int) -> str:
    """What a run's "P99" figure is: P99 from MIN_TAIL_SAMPLES samples on, else their maximum."""
    return "P99" if num_samples >= MIN_TAIL_SAMPLES else f"max of {num_samples}"


def poisson_arrivals(n: int, qps: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process at `qps`; all zero for qps = 0 (a burst)."""
    if qps <= 0:
        return [0.0] * n
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n).exponential_(1.0, generator=g) / qps
    return torch.cumsum(gaps, 0).tolist()


def summarize(system: str, multiple: float, qps: float, records: list[Record], makespan: float) -> Summary:
    ok = [r for r in records if r.error is None]
    lat = [r.latency_seconds for r in ok]
    tokens = sum(r.num_tokens for r in ok) or 1
    return Summary(
        system,
        multiple,
        qps,
        len(records),
        len(records) - len(ok),
        len(ok) / makespan if makespan > 0 else math.nan,
        statistics.fmean(lat) if lat else math.nan,
        percentile(lat, 0.5),
        percentile(lat, 0.99),
        sum(r.device_hit_tokens for r in ok) / tokens,
        sum(r.host_hit_tokens for r in ok) / tokens,
    )


def sustainable_qps(points: list[tuple[float, float]], slo: float) -> tuple[float, bool]:
    """The highest measured offered QPS with latency <= slo, below the first load that misses it; (qps, exact).

    No interpolation: the figure is a load that was run. `exact` is False when even the highest
    load met the SLO (the figure is then a lower bound)."""
    met = 0.0
    for qps, latency in sorted(points):
        if latency > slo:
            return met, True
        met = qps
    return met, not points


def median_summary(runs: list[Summary]) -> Summary:
    """Each figure's median over repeated runs of one (system, load)."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    med = {
        k: statistics.median(getattr(r, k) for r in runs)
        for k in (
            "throughput_qps",
            "mean_latency_seconds",
            "p50_latency_seconds",
            "p99_latency_seconds",
            "device_hit_rate",
            "host_hit_rate",
        )
    }
    errors = [r.jct_error for r in runs if r.jct_error is not None]
    return Summary(
        first.system,
        first.multiple,
        first.offered_qps,
        first.num_requests,
        max(r.num_errors for r in runs),
        **med,
        jct_error=statistics.median(errors) if errors else None,
    )
