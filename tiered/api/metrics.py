"""`GET /metrics`: Prometheus metrics through prometheus_client, in vLLM's names where vLLM has one.

Design notes: docs/internals.md, section `tiered/api/metrics.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiered.api.protocol import EngineStats, ScoreResponse, cached_tokens

# vLLM's buckets for request latencies (seconds).
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# Buckets for how long a call predicted to miss its objective waits for its refusal (seconds).
SHED_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("device", "host", "remote", "disk")  # tiered:prefix_cache_hits' tier label
REFUSALS = ("deadline", "unmeetable", "wait_cap", "queue_full")  # tiered:requests_refused's reason label


def buckets_1_2_5(limit: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


class Metrics:
    """One registry per app: several apps in one process (tests) never share a collector."""

    def __init__(
        self,
        max_model_len: int,
        client_counters: Callable[[], dict[str, int]],
        engine_stats: Callable[[], EngineStats | None],
    ) -> None:
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.success = Counter("vllm:request_success", "Requests answered.", [*m, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of answered requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated (one per request).", m, registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the KV tiers.", m, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in either KV tier.", m, registry=r)
        self.tier_hits = Counter(
            "tiered:prefix_cache_hits", "Prompt tokens found, by KV tier.", [*m, "tier"], registry=r
        )
        self.shared = Counter(
            "tiered:batch_shared_tokens",
            "Prompt tokens not cached but computed once for several requests of a batch.",
            m,
            registry=r,
        )
        self.failed = Counter(
            "tiered:request_failure",
            "Requests the engine failed (out of memory, an adapter folder that changed).",
            m,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "From the API receiving a request to its answer.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds", "Time in the engine's queue.", m, buckets=LATENCY_BUCKETS, registry=r
        )
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "Host-tier loads plus the forward of the request's batch.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.deadline = Counter(
            "tiered:deadline",
            "Requests with a latency objective, by route and outcome: met, "
            "missed (answered late), shed (refused at once, predicted to miss: scheduler.late: shed), "
            "expired (refused late, scheduler.drop_expired); goodput is "
            'rate(tiered:deadline_total{outcome="met"}).',
            [*m, "route", "outcome"],
            registry=r,
        )
        self.shed_delay = Histogram(
            "tiered:shed_delay_seconds",
            "Calls refused as predicted to miss their objective (scheduler.late: shed), by route: seconds from "
            "the last shed check that found the call in time (its receipt, if none did) until the engine's client "
            "received its refusal (on the engine's host; the API's own refusals: until the API made it).",
            [*m, "route"],
            buckets=SHED_DELAY_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "tiered:requests_refused",
            "Requests refused before running, by reason: deadline (429: predicted to miss its objective, "
            "or past it), unmeetable (its own predicted time exceeds its objective on an idle machine: 429 while "
            "a warm-up of its prefix can help, scheduler.warm_unmeetable; 400 when nothing can), wait_cap (503: "
            "predicted wait over scheduler.max_predicted_wait_s), queue_full "
            "(503: scheduler.max_waiting unanswered requests).",
            [*m, "reason"],
            registry=r,
        )
        self.pieces = Counter(
            "tiered:prefill_pieces",
            "Forwards answered requests' new tokens took (a request that yielded between pieces counts each piece).",
            m,
            registry=r,
        )
        self.prompt_hist = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request.",
            m,
            buckets=buckets_1_2_5(max_model_len),
            registry=r,
        )
        self.engine_stats = engine_stats
        r.register(_Reported(client_counters, engine_stats))

    def declare(self, model: str) -> None:
        """Every per-request series of `model` at zero, histograms with their buckets: a dashboard or
        an alert reads them from start-up, not only after the first call (as vLLM's do)."""
        for counter in (self.prompt_tokens, self.generation_tokens, self.queries, self.hits, self.shared):
            counter.labels(model)
        for counter in (self.failed, self.pieces):
            counter.labels(model)
        self.success.labels(model, "length")
        for tier in TIERS:
            self.tier_hits.labels(model, tier)
        for reason in REFUSALS:
            self.refused.labels(model, reason)
        for histogram in (self.e2e, self.queue, self.prefill, self.prompt_hist):
            histogram.labels(model)

    def observe(self, model: str, out: ScoreResponse, e2e_seconds: float, route: str = "") -> None:
        """Count one answered request for `model` (and its deadline outcome on `route`) in the per-request metrics."""
        self.success.labels(model, "length").inc()
        if out.deadline_met is not None:
            self.deadline.labels(model, route, "met" if out.deadline_met else "missed").inc()
        self.pieces.labels(model).inc(out.num_pieces)
        self.prompt_tokens.labels(model).inc(out.num_tokens)
        self.generation_tokens.labels(model).inc()
        self.queries.labels(model).inc(out.num_tokens)
        self.hits.labels(model).inc(cached_tokens(out))
        hits = (out.num_device_hit_tokens, out.num_host_hit_tokens, out.num_remote_hit_tokens, out.num_disk_hit_tokens)
        for tier, tokens in zip(TIERS, hits, strict=True):
            self.tier_hits.labels(model, tier).inc(tokens)
        self.shared.labels(model).inc(out.num_shared_tokens)
        self.e2e.labels(model).observe(e2e_seconds)
        self.queue.labels(model).observe(out.queued_seconds)
        self.prefill.labels(model).observe(out.load_seconds + out.compute_seconds)
        self.prompt_hist.labels(model).observe(out.num_tokens)

    def render(self) -> bytes:
        """The exposition text: this registry's metrics, then LMCache's as the engine last reported them."""
        text = generate_latest(self.registry)
        stats = self.engine_stats()
        if stats is not None and stats.lmcache_metrics:
            text += stats.lmcache_metrics.encode()
        return text


class _Reported:
    """Values reported by others, exposed as they were last reported: the engine's statistics
    (from its EngineStats messages) and the API process's own counters."""

    def __init__(
        self, client_counters: Callable[[], dict[str, int]], engine_stats: Callable[[], EngineStats | None]
    ) -> None:
        self.client_counters, self.engine_stats = client_counters, engine_stats

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector hook: the API process's counters, then the engine's last statistics."""
        c = self.client_counters()
        yield _gauge("vllm:num_requests_waiting", "Requests sent to the engine and not answered yet.", c["waiting"])
        yield _counter("tiered:request_timeout", "Requests cancelled past server.request_timeout_s.", c["timed_out"])
        yield _counter(
            "tiered:request_cancelled",
            "Requests cancelled: the client disconnected, or another prompt of its call failed first.",
            c["cancelled"],
        )
        yield _counter("tiered:engine_restarts", "Engine processes started after one died.", c["restarts"])
        if "replicas" in c:
            yield _gauge(
                "tiered:replicas", "Engine replicas the ingress routes to (tiered serve --replicas).", c["replicas"]
            )
        e = self.engine_stats()
        if e is None:
            return
        yield _gauge(
            "tiered:jct_prediction_error",
            "Mean absolute percentage error of the JCT model (fraction).",
            e.jct_error if e.jct_error is not None else float("nan"),
        )
        yield _counter(
            "tiered:host_tier_failures",
            "Host-tier operations that failed and fell back to recomputation (this engine process).",
            e.host_failures,
        )
        yield _counter(
            "tiered:engine_cancelled_requests",
            "Cancelled requests the engine dropped while they waited (this engine process).",
            e.engine_cancelled,
        )
        yield _gauge(
            "tiered:device_tier_pinned_blocks",
            "Device-tier blocks pinned when the engine last reported (0 when nothing runs).",
            e.pinned_blocks,
        )
        yield _gauge(
            "tiered:engine_waiting_requests", "Requests in the engine's queue when it last reported.", e.num_waiting
        )
        yield _gauge(
            "tiered:predicted_wait_seconds",
            "The JCT model's predicted seconds of the work in the engine's queue when it last reported "
            "(what admission control compares with scheduler.max_predicted_wait_s).",
            e.predicted_wait_s,
        )
        if e.host is not None:  # bandwidth = rate(..._bytes_total) / rate(..._seconds_total)
            h = e.host
            for name, doc, value in (
                ("host_load_bytes", "KV bytes loaded from the host tier into device blocks.", h.loaded_bytes),
                (
                    "host_load_seconds",
                    "Seconds spent loading from the host tier (lookup, LMCache get, copies).",
                    h.load_seconds,
                ),
                ("host_store_bytes", "KV bytes put into the host tier.", h.stored_bytes),
                (
                    "host_store_seconds",
                    "Seconds host-tier stores cost the forward (LMCache allocation, the KV sink's copies).",
                    h.store_seconds,
                ),
                (
                    "host_store_thread_cpu_seconds",
                    "CPU seconds of the host tier's store thread.",
                    h.store_thread_cpu_seconds,
                ),
                ("host_store_dropped_chunks", "Chunks not stored (queue full or no LMCache memory).", h.dropped_chunks),
                (
                    "host_store_wait_seconds",
                    "Seconds stores waited for LMCache memory that writes to its disk or queued stores held.",
                    h.store_wait_seconds,
                ),
                (
                    "host_disk_write_failures",
                    "Chunks the host tier's local disk could not take (full, read-only, failing): kept in memory only.",
                    h.disk_write_failures,
                ),
            ):
                yield _counter(f"tiered:{name}", doc, value)
            yield _gauge("tiered:host_store_pending", "Store batches queued for the store thread.", h.pending_stores)
        if e.pieces is not None:
            p = e.pieces
            yield _counter(
                "tiered:prefill_yields",
                "Pieces after which a long prefill waited again, its KV parked, so that urgent requests ran.",
                p.yields,
            )
            yield _counter(
                "tiered:prefill_deferrals",
                "Long prefills that waited before starting, an urgent request run first.",
                p.deferrals,
            )
            parked = CounterMetricFamily(
                "tiered:parked_bytes", "KV bytes of finished pieces parked for their request, by tier.", labels=["tier"]
            )
            parked.add_metric(["device"], p.parked_device_bytes)
            parked.add_metric(["host"], p.parked_host_bytes)
            yield parked
        if e.adapters is not None:
            yield _gauge(
                "tiered:lora_resident_adapters", "LoRA adapters whose weights are on the device.", e.adapters[0]
            )
            yield _counter(
                "tiered:lora_adapter_loads",
                "LoRA adapter weight reads (first use, or after an eviction).",
                e.adapters[1],
            )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def lmcache_metrics() -> str:
    """LMCache's own metrics in this (the engine) process, rendered (empty if it registered none)."""
    from prometheus_client import REGISTRY

    families = [m for m in REGISTRY.collect() if m.name.startswith("lmcache:")]
    if not families:
        return ""

    class _Only:
        def collect(self) -> list[Any]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Only())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def parse(text: str) -> dict[str, float]:
    """Exposition text -> {sample name: sum over its label sets} plus {"name{k=v,...}": value} for
    each labelled sample (tests, the soak, benchmarks)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if sample.labels:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out
