"""Goodput of a `python -m benchmarks mixed` run, from its records: calls answered within their objective.

A call is good when it was answered (no error) within its objective, its latency running from its
arrival to its answer on the client's clock; goodput is good calls per second of the arrival
window (the same window for every system, so at a load every system meets, goodput = offered
rate). The servers' own verdicts (`usage.tiered.deadline_met`, ours) are counted beside it, not
used: they run from the server's arrival. Long calls are also compared one by one with a prompt
of their length alone on the idle server: their slowdown.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

from benchmarks.mixed_trace import LONG, SHORT, MixedCall, MixedParams, MixedTrace
from benchmarks.stats import Record, percentile

# /metrics samples of ours (tolerated absent) on prefills that yield (pieces, yields, deferrals,
# parked KV) and on how soon calls predicted to miss were refused (tiered:shed_delay_seconds).
RUN_METRICS = re.compile(r"^tiered:.*(piece|yield|deferral|park|shed_delay)")
SHED_DELAY = "tiered:shed_delay_seconds"


def shed_within(metrics: dict[str, float], seconds: float) -> tuple[int, int] | None:
    """Of the calls a run refused as predicted to miss, how many within `seconds` (a bucket's bound)
    of the last shed check that found them in time, and how many in all; None: not reported."""
    total = metrics.get(f"{SHED_DELAY}_count")
    if total is None:
        return None
    within = metrics.get(f'{SHED_DELAY}_bucket{{le="{seconds:g}"}}')
    if within is None:
        raise ValueError(f"{SHED_DELAY} has no bucket at {seconds:g} s")
    return int(within), int(total)


@dataclass(slots=True)
class ClassScore:
    kind: str  # "short", "long" or "all"
    num_calls: int
    num_answered: int
    num_good: int  # answered within their objective
    offered_per_s: float  # calls / window
    goodput_per_s: float  # good calls / window
    p50_latency_seconds: float  # of the answered calls (nan: none)
    p99_latency_seconds: float
    num_deadline_met_reported: int | None  # the server's own count (usage.tiered.deadline_met); None: not reported
    num_pieces: int | None  # pieces their prefills ran in (usage.tiered.num_pieces); None: not reported
    mean_latency_seconds: float = float("nan")  # of the answered calls
    # Calls the server refused as over capacity or unable to meet their objective (HTTP 429 / 503),
    # and how long the client waited for that answer (P99; nan: none refused).
    num_refused: int = 0
    p99_refused_seconds: float = float("nan")


@dataclass(slots=True)
class LongCompletion:
    """One long call against a prompt of its length alone on the idle server."""

    call_id: str
    arrival_seconds: float
    latency_seconds: float | None  # None: it failed
    slowdown: float | None  # latency / alone
    good: bool
    num_pieces: int | None


@dataclass(slots=True)
class RunScore:
    system: str
    short_qps: float
    window_seconds: float
    alone_seconds: float  # a long prompt alone on this system's idle server (best of the repeats)
    short: ClassScore
    long: ClassScore
    total: ClassScore
    longs: list[LongCompletion]
    metrics: dict[str, float] = field(default_factory=dict)  # RUN_METRICS samples, after minus before the run

    @property
    def num_errors(self) -> int:
        return self.total.num_calls - self.total.num_answered


def is_good(call: MixedCall, record: Record) -> bool:
    return record.error is None and record.latency_seconds <= call.slo_ms / 1e3


def _reported(values: list[int | None]) -> int | None:
    """The sum of what the server reported; None if it reported none of them."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def score_class(kind: str, calls: list[MixedCall], by_id: dict[str, Record], window_seconds: float) -> ClassScore:
    records = [by_id[c.call.call_id] for c in calls]
    latencies = [r.latency_seconds for r in records if r.error is None]
    good = sum(is_good(c, r) for c, r in zip(calls, records, strict=True))
    met = [None if r.deadline_met is None else int(r.deadline_met) for r in records]
    refused = [r.latency_seconds for r in records if is_refused(r)]
    return ClassScore(
        kind,
        len(calls),
        len(latencies),
        good,
        len(calls) / window_seconds,
        good / window_seconds,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        _reported(met),
        _reported([r.num_pieces for r in records]),
        statistics.fmean(latencies) if latencies else float("nan"),
        len(refused),
        percentile(refused, 0.99),
    )


def is_refused(record: Record) -> bool:
    """The server answered the call with a refusal (429: its objective cannot be met; 400: nor with
    its prefix cached; 503 saying it is over capacity), not a failure (a 503 of an engine that died is one)."""
    error = record.error or ""
    unmeetable = error.startswith("400") and "objective unmeetable" in error
    return error.startswith("429") or unmeetable or (error.startswith("503") and "over capacity" in error)


def score_run(
    system: str, trace: MixedTrace, records: list[Record], alone_seconds: float, metrics: dict[str, float] | None = None
) -> RunScore:
    """Goodput per class and in all, the long calls' slowdowns; `records` one per call of the trace."""
    by_id = {r.request_id: r for r in records}
    w = trace.window_seconds
    longs = []
    for c in trace.of(LONG):
        r = by_id[c.call.call_id]
        latency = r.latency_seconds if r.error is None else None
        slowdown = latency / alone_seconds if latency is not None else None
        longs.append(LongCompletion(c.call.call_id, c.arrival_seconds, latency, slowdown, is_good(c, r), r.num_pieces))
    return RunScore(
        system,
        trace.short_qps,
        w,
        alone_seconds,
        score_class(SHORT, trace.of(SHORT), by_id, w),
        score_class(LONG, trace.of(LONG), by_id, w),
        score_class("all", trace.calls, by_id, w),
        longs,
        dict(metrics or {}),
    )


def _share(c: ClassScore) -> str:
    return f"{100 * c.num_good / c.num_calls:.0f}%" if c.num_calls else "-"


def _slowdowns(s: RunScore) -> str:
    known = [x.slowdown for x in s.longs if x.slowdown is not None]
    return f"{statistics.fmean(known):.2f} / {max(known):.2f}" if known else "-"


def _pieces(s: RunScore) -> str:
    pieces, answered = s.long.num_pieces, s.long.num_answered
    return "-" if pieces is None or not answered else f"{pieces / answered:.1f}"


def print_goodput(scores: list[RunScore], p: MixedParams) -> None:
    """One row per (system, load): goodput per class and in all, short P50 / P99 (of the answered
    calls), long slowdowns, pieces, calls refused (429 / 503) and other errors."""
    print(
        f"goodput: calls/s answered within their objective (short <= {p.short_slo_ms / 1e3:g} s, long <= "
        f"{p.long_slo_ms / 1e3:g} s) per second of arrivals; long slowdown: latency / a {p.long_tokens}-token "
        "prompt alone on the idle server (mean / max); pieces: per answered long call"
    )
    print(
        f"{'system':<24}{'short/s':>8}{'short good/s':>13}{'long good/s':>12}{'all good/s':>11}"
        f"{'short met':>10}{'long met':>9}{'P50 s':>7}{'P99 s':>7}{'alone s':>8}{'slowdown':>13}{'pieces':>7}"
        f"{'refused':>8}{'errors':>7}"
    )
    for s in scores:
        print(
            f"{s.system:<24}{s.short.offered_per_s:>8.3f}{s.short.goodput_per_s:>13.3f}{s.long.goodput_per_s:>12.4f}"
            f"{s.total.goodput_per_s:>11.3f}{_share(s.short):>10}{_share(s.long):>9}"
            f"{s.short.p50_latency_seconds:>7.2f}{s.short.p99_latency_seconds:>7.2f}{s.alone_seconds:>8.2f}"
            f"{_slowdowns(s):>13}{_pieces(s):>7}{s.total.num_refused:>8}{s.num_errors - s.total.num_refused:>7}"
        )
    for s in scores:
        pieces = {name: v for name, v in s.metrics.items() if not name.startswith(SHED_DELAY)}
        if pieces:
            shown = ", ".join(f"{name} {'+' if v >= 0 else ''}{v:g}" for name, v in sorted(pieces.items()))
            print(f"  {s.system} at {s.short_qps:g} short/s, /metrics during the run: {shown}")
        shed = shed_within(s.metrics, 0.05)
        if shed is not None and shed[1]:
            print(
                f"  {s.system} at {s.short_qps:g} short/s: {shed[0]} of {shed[1]} calls refused as predicted to "
                "miss were refused within 50 ms of the last shed check that found them in time"
            )
    for s in scores:
        reported = (s.short.num_deadline_met_reported, s.long.num_deadline_met_reported)
        if None not in reported and reported != (s.short.num_good, s.long.num_good):
            print(
                f"  {s.system} at {s.short_qps:g} short/s: the server says {reported[0]} short and {reported[1]} "
                f"long calls met their deadline (client clock: {s.short.num_good} and "
                f"{s.long.num_good})"
            )
