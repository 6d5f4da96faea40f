"""`python -m benchmarks load`: a trace under Poisson load, on our engine and on vLLM, side by side.

1. Saturation: the reference system (the first of --systems that is ours) runs the whole trace
   submitted at once; saturation QPS = requests / makespan.
2. For each system and each multiple m of --multiples, the trace arrives as a Poisson process at
   m x saturation QPS (the same seeded arrival times for every system). Per request: latency
   (arrival to answer), queue time (ours in-process), hit tokens per tier.
3. Summary per run: throughput (requests / (last answer - first arrival)), mean / P50 / P99
   latency, hit rate per tier. Sustainable QPS per system: the highest offered QPS whose P99
   (resp. mean) latency stays under the SLO: a measured load below the first that misses it.

Systems (each one flag value):
- ours in-process: `tiered` (calibrated + offload: the default), `prefillonly` (calibrated +
  discard: PrefillOnly's design), `fcfs` (fcfs + offload), `lpm`, `spf`, `hrrn` (SGLang's
  policies on our engine, offload);
- `tiered-http`: the default config behind `tiered serve`, over loopback HTTP;
- `vllm`, `vllm-nochunk`: `vllm serve` (vLLM's OpenAI server, run by --vllm-python, default: the venv
  `make bench-env` builds) on the same
  model folder and dtype, prefix caching on, chunked prefill on / off, every request
  `max_tokens=1`; compiled (vLLM's default), its KV memory the RAM of our device + host tiers (more
  only if vLLM needs it to hold one longest request, and the output says so).
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch import start_server, stop_server
from benchmarks.report import write_report
from benchmarks.stats import (
    Record,
    Summary,
    median_summary,
    percentile,
    poisson_arrivals,
    summarize,
    sustainable_qps,
)
from benchmarks.systems import ENGINE_SYSTEMS, HTTP_SYSTEMS, SYSTEMS, VLLM_SYSTEMS, check_vllm_python
from benchmarks.traces import BenchError, Trace
from benchmarks.vllm import PeerOptions, VLLMServer, peer_launch
from tiered.config import Config, with_overrides, write_config
from tiered.config.options import resolve_device
from tiered.embedded import resolve_model_path
from tiered.engine import Engine, Result
from tiered.hybrid.precision import config_precision

log = logging.getLogger(__name__)

# ours in-process: config overrides on top of the given config
SLO_FACTORS = (2.5, 5.0, 10.0)


class Progress:
    """One line on stderr per run, redrawn as answers arrive."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.start = label, total, 0, time.monotonic()
        self._enabled = sys.stderr.isatty() or os.environ.get("TIERED_PROGRESS") == "1"

    def step(self) -> None:
        self.done += 1
        if self._enabled:
            width = 30
            filled = int(width * self.done / self.total)
            bar = "#" * filled + "." * (width - filled)
            elapsed = time.monotonic() - self.start
            sys.stderr.write(f"\r{self.label:<28} [{bar}] {self.done}/{self.total} {elapsed:6.1f} s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def run_engine(
    cfg: Config, trace: Trace, arrivals: list[float], label: str = ""
) -> tuple[list[Result], float, float | None]:
    """Submit each request at its arrival time (wall clock) while a fresh engine runs.

    Returns the results in completion order, the makespan (first arrival to last answer) and the
    JCT model's prediction error at the end."""
    engine = Engine(cfg)
    engine.submit(list(range(3, 67)))  # warm-up (first-call costs), then empty tiers: every run starts cold
    engine.run()
    engine.tiers.clear()
    progress = Progress(label, len(trace))
    results = []
    i = 0
    start = time.monotonic()
    try:
        while i < len(trace) or engine.num_unfinished:
            now = time.monotonic() - start
            while i < len(trace) and arrivals[i] <= now:
                r = trace.requests[i]
                engine.submit(r.token_ids, request_id=r.request_id)
                i += 1
            batch = engine.step()
            for result in batch:
                results.append(result)
                progress.step()
            if not batch and i < len(trace):
                time.sleep(max(0.0, arrivals[i] - (time.monotonic() - start)))
        makespan = time.monotonic() - start - arrivals[0]
        jct_error = engine.jct.error
    finally:
        engine.close()
    return results, makespan, jct_error


def _engine_records(results: list[Result], trace: Trace, arrivals: list[float]) -> list[Record]:
    at = {r.request_id: (arrivals[i], len(r.token_ids)) for i, r in enumerate(trace.requests)}
    return [
        Record(
            r.request_id,
            at[r.request_id][1],
            at[r.request_id][0],
            r.latency_seconds,
            r.queued_seconds,
            r.split.num_device_hit_tokens,
            r.split.num_host_hit_tokens,
            r.error,
        )
        for r in results
    ]


@dataclass(slots=True)
class Call:
    """One `POST /v1/completions`: a trace request's prompt, or all the prompts of a visit as one list."""

    call_id: str
    prompts: list[list[int]]
    model: str | None = None  # the `model` field of this call (a LoRA adapter); None: run_http's
    user: str | None = None  # sent as `x-user-id` (a router's affinity key)
    slo_ms: float | None = None  # sent as `slo_ms`: its latency objective, ms from arrival (ours)
    priority: int | None = None  # sent as `priority` (lower runs first; vLLM: with --scheduling-policy priority)


WARM_UP = Call("warm-up", [list(range(3, 67))])  # pays first-call costs before a timed run


def trace_calls(trace: Trace) -> list[Call]:
    """One call per request of the trace."""
    return [Call(r.request_id, [r.token_ids]) for r in trace.requests]


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """How `run_http` sends its calls beyond where and what."""

    label: str = ""  # names the run in the progress log
    concurrency: int | None = None  # calls in flight at most; None: all of them
    cache_salt: str | None = None  # sent as every call's `cache_salt`; None: none sent
    # Seconds a call may take to answer; None: no limit (a long prompt's answer can take over an hour).
    timeout_s: float | None = 3600.0


async def _run_http_async(
    url: str, model: str, calls: list[Call], arrivals: list[float], opts: HttpOptions
) -> list[Record]:
    progress = Progress(opts.label, len(calls))
    # Idle connections close here before the servers' own keep-alive (uvicorn's 5 s, in both ours and
    # vLLM): a request sent on a connection the server is closing fails with a ReadError.
    limits = httpx.Limits(max_connections=len(calls), max_keepalive_connections=len(calls), keepalive_expiry=2.0)
    gate = asyncio.Semaphore(opts.concurrency or len(calls))
    cache_salt = opts.cache_salt
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(i: int) -> Record:
            call = calls[i]
            await asyncio.sleep(max(0.0, start + arrivals[i] - loop.time()))
            async with gate:
                sent = loop.time()
                prompt = call.prompts[0] if len(call.prompts) == 1 else call.prompts
                body = {"model": call.model or model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                fields = {"cache_salt": cache_salt, "slo_ms": call.slo_ms, "priority": call.priority}
                body.update({k: v for k, v in fields.items() if v is not None})
                headers = {"x-user-id": call.user} if call.user is not None else None
                record = Record(call.call_id, sum(len(p) for p in call.prompts), sent - start, 0.0, None, 0, 0)
                try:
                    r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
                    data = r.json()
                    if r.status_code != 200:
                        record.error = f"{r.status_code}: {data.get('error', data)}"
                    else:
                        read_usage(data.get("usage") or {}, record)
                except httpx.HTTPError as exc:
                    record.error = f"{type(exc).__name__}: {exc}"
                record.latency_seconds = loop.time() - sent
            progress.step()
            return record

        return list(await asyncio.gather(*(one(i) for i in range(len(calls)))))


def read_usage(usage: dict[str, Any], record: Record) -> None:
    """A response's `usage` into its record: hits by tier (`usage.tiered` when the server is ours,
    else `cached_tokens`, all counted as device hits) and, where reported, pieces and deadline."""
    split = usage.get("tiered")
    if not split:
        record.device_hit_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return
    record.device_hit_tokens, record.host_hit_tokens = split["device_hit_tokens"], split["host_hit_tokens"]
    record.shared_tokens = split.get("batch_shared_tokens", 0)
    record.remote_hit_tokens = split.get("remote_hit_tokens", 0)
    record.disk_hit_tokens = split.get("disk_hit_tokens", 0)
    record.num_pieces, record.deadline_met = split.get("num_pieces"), split.get("deadline_met")


def run_http(
    url: str, model: str, calls: list[Call], arrivals: list[float], opts: HttpOptions = HttpOptions()
) -> tuple[list[Record], float]:
    """Send each call at its arrival offset (at most `opts.concurrency` in flight); records and makespan.

    A record's latency runs from sending to the whole answer; its hit tokens are the response's
    (`usage.tiered` when the server is ours, else `cached_tokens`, all counted as device hits)."""
    records = asyncio.run(_run_http_async(url, model, calls, arrivals, opts))
    makespan = max(r.arrival_seconds + r.latency_seconds for r in records) - min(arrivals)
    return records, makespan


@dataclass(frozen=True, slots=True)
class _Target:
    """The system a run of `bench load` goes to."""

    system: str
    cfg: Config
    vllm: VLLMServer | None  # the vllm systems' server, started once for all their runs
    out_dir: Path  # ours over HTTP: where its server's config is written


def _one_run(
    target: _Target, trace: Trace, arrivals: list[float], label: str
) -> tuple[list[Record], float, float | None]:
    """One run of the trace at `arrivals`: records, makespan, and the JCT model's error (ours in-process)."""
    system, cfg, vllm = target.system, target.cfg, target.vllm
    if system in ENGINE_SYSTEMS:
        results, makespan, jct_error = run_engine(with_overrides(cfg, ENGINE_SYSTEMS[system]), trace, arrivals, label)
        return _engine_records(results, trace, arrivals), makespan, jct_error
    if vllm is not None:
        vllm.reset()
        return *run_http(vllm.url, "model", trace_calls(trace), arrivals, HttpOptions(label)), None
    # ours over HTTP: a fresh server per run, so every run starts cold
    path = write_config(with_overrides(cfg, HTTP_SYSTEMS[system]), target.out_dir / f"{system}.yaml")
    proc, url = start_server(["--config", str(path), "--served-model-name", "model"])
    try:
        run_http(url, "model", [WARM_UP], [0.0])
        return *run_http(url, "model", trace_calls(trace), arrivals, HttpOptions(label)), None
    finally:
        stop_server(proc)


def kv_bytes_per_token(cfg: Config) -> int:
    from tiered.hybrid.loader import DTYPES, read_args

    a = read_args(resolve_model_path(cfg.model.path, cfg.model.models_dir))
    return a.kv_bytes_per_token(DTYPES[config_precision(cfg).kv])


def device_tokens(trace: Trace, fraction: float) -> int:
    """`fraction` of the trace's distinct prefixes (users' profiles), or of all its tokens if it has none."""
    profiles = {r.user: r.prefix_tokens for r in trace.requests}
    base = sum(profiles.values()) or trace.num_tokens
    return int(fraction * base)


def _logged(s: Summary, repeats: int) -> Summary:
    log.info(
        "%-13s x%-4g %.2f QPS: throughput %.2f/s, latency mean %.2f s P99 %.2f s, hits device %.0f%% host %.0f%%%s%s%s",
        s.system,
        s.multiple,
        s.offered_qps,
        s.throughput_qps,
        s.mean_latency_seconds,
        s.p99_latency_seconds,
        100 * s.device_hit_rate,
        100 * s.host_hit_rate,
        f", JCT error {s.jct_error:.1%}" if s.jct_error is not None else "",
        f", {s.num_errors} errors" if s.num_errors else "",
        f" (medians of {repeats})" if repeats > 1 else "",
    )
    return s


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """What `run_load_bench` runs beyond the config and the trace (the CLI's options, one to one)."""

    systems: list[str]
    multiples: list[float]  # offered loads, as multiples of the saturation throughput
    device_fraction: float  # the device tier (and vLLM's KV memory), as a share of the users' profiles
    vllm_python: str | None
    slo_p99: list[float] | None  # None: 2.5, 5 and 10x the P99 job time in the burst
    slo_mean: list[float] | None  # None: 2.5, 5 and 10x the mean job time in the burst
    seed: int  # seeds the Poisson arrivals
    json_path: str | None
    out_dir: Path  # vLLM logs, our HTTP servers' configs
    repeats: int = 1  # runs per (system, load) on the same arrivals; the tables show medians


def run_load_bench(cfg: Config, trace: Trace, opts: LoadOptions) -> dict[str, Any]:
    """The trace's saturation, then each system at each load (see the module docstring); the JSON document."""
    systems, multiples, device_fraction = opts.systems, opts.multiples, opts.device_fraction
    vllm_python, out_dir, repeats = opts.vllm_python, opts.out_dir, opts.repeats
    logging.getLogger("httpx").setLevel(logging.WARNING)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise BenchError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    if any(s in VLLM_SYSTEMS for s in systems):
        check_vllm_python(vllm_python)
    if trace.max_tokens > cfg.model.max_model_len:
        cfg = replace(cfg, model=replace(cfg.model, max_model_len=trace.max_tokens))
    kv_tokens = device_tokens(trace, device_fraction)
    cfg = replace(cfg, cache=replace(cfg.cache, device_tier_bytes=kv_tokens * kv_bytes_per_token(cfg)))
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
    precision = config_precision(cfg)
    print(trace.describe())
    print(f"precision: {precision.describe()} (vLLM computes in {precision.compute})")
    of = "the users' profiles" if any(r.prefix_tokens for r in trace.requests) else "all the trace's tokens"
    print(
        f"device tier: {kv_tokens} tokens ({device_fraction:.0%} of {of}), "
        f"{cfg.cache.device_tier_bytes / 2**20:.1f} MiB"
    )

    # 1. Saturation, on the reference system (ours, default config), all requests at once.
    reference = next((s for s in systems if s in ENGINE_SYSTEMS), "tiered")
    burst_cfg = with_overrides(cfg, ENGINE_SYSTEMS[reference])
    burst, burst_makespan, _ = run_engine(burst_cfg, trace, [0.0] * len(trace), f"{reference} burst")
    saturation = len(trace) / burst_makespan
    services = [r.load_seconds + r.compute_seconds for r in burst]
    service = statistics.fmean(services)
    # Default SLOs: 2.5x, 5x and 10x what the jobs themselves take when nothing waits (P99 job, mean job).
    slo_p99 = opts.slo_p99 or [f * percentile(services, 0.99) for f in SLO_FACTORS]
    slo_mean = opts.slo_mean or [f * service for f in SLO_FACTORS]
    print(
        f"saturation ({reference}, burst): {saturation:.2f} requests/s (makespan {burst_makespan:.1f} s); "
        f"mean service time {1e3 * service:.0f} ms"
    )

    runs: list[dict[str, Any]] = []
    summaries: list[Summary] = []
    for system in systems:
        vllm: VLLMServer | None = None
        try:
            if system in VLLM_SYSTEMS:
                assert vllm_python is not None
                launch = peer_launch(
                    cfg, vllm_python, trace.max_tokens + 16, peer=PeerOptions(chunked=VLLM_SYSTEMS[system])
                )
                vllm = VLLMServer(launch)
                vllm.start(out_dir / f"{system}.log")
            target = _Target(system, cfg, vllm, out_dir)
            for multiple in multiples:
                qps = multiple * saturation
                arrivals = poisson_arrivals(len(trace), qps, opts.seed)
                repeats_here: list[Summary] = []
                for rep in range(repeats):
                    label = f"{system} x{multiple:g}" + (f" #{rep + 1}" if repeats > 1 else "")
                    records, makespan, jct_error = _one_run(target, trace, arrivals, label)
                    s = replace(summarize(system, multiple, qps, records, makespan), jct_error=jct_error)
                    repeats_here.append(s)
                    runs.append({"summary": asdict(s), "repeat": rep, "records": [asdict(r) for r in records]})
                summaries.append(_logged(median_summary(repeats_here), repeats))
        finally:
            if vllm is not None:
                vllm.stop()

    table = sustainable_table(summaries, systems, slo_p99, slo_mean)
    print_tables(summaries, table, slo_p99, slo_mean)
    doc = write_report(
        opts.json_path,
        "load",
        resolve_device(cfg.device),
        {
            "config": asdict(cfg),
            "trace": {"kind": trace.kind, "params": trace.params, "requests": len(trace), "tokens": trace.num_tokens},
            "systems": systems,
            "multiples": multiples,
            "repeats": repeats,
            "device_fraction": device_fraction,
            "device_tier_tokens": kv_tokens,
            "saturation_qps": saturation,
            "reference": reference,
            "mean_service_seconds": service,
            "slo_p99_seconds": slo_p99,
            "slo_mean_seconds": slo_mean,
            "sustainable": table,
            "summaries": [asdict(s) for s in summaries],
            "runs": runs,
        },
    )
    return doc


def sustainable_table(
    summaries: list[Summary], systems: list[str], slo_p99: list[float], slo_mean: list[float]
) -> dict[str, Any]:
    """Per system, per SLO: the highest offered QPS that meets it (and whether that is exact)."""
    out: dict[str, Any] = {}
    for system in systems:
        mine = [s for s in summaries if s.system == system]
        out[system] = {}
        for key, attr, slos in (("p99", "p99_latency_seconds", slo_p99), ("mean", "mean_latency_seconds", slo_mean)):
            points = [(s.offered_qps, getattr(s, attr)) for s in mine]
            out[system][key] = [
                dict(zip(("slo", "qps", "exact"), (slo, *sustainable_qps(points, slo)), strict=True)) for slo in slos
            ]
    return out


def print_tables(summaries: list[Summary], table: dict[str, Any], slo_p99: list[float], slo_mean: list[float]) -> None:
    """Print one row per (system, load), then the sustainable-QPS tables (the first system is the reference)."""
    print(
        f"{'system':<14}{'x':>5}{'QPS':>7}{'thru':>7}{'mean s':>8}{'P50 s':>8}{'P99 s':>8}{'dev hit':>8}"
        f"{'host hit':>9}{'errors':>7}{'JCT err':>8}"
    )
    for s in summaries:
        jct = f"{100 * s.jct_error:>7.1f}%" if s.jct_error is not None else f"{'-':>8}"
        print(
            f"{s.system:<14}{s.multiple:>5g}{s.offered_qps:>7.2f}{s.throughput_qps:>7.2f}"
            f"{s.mean_latency_seconds:>8.2f}{s.p50_latency_seconds:>8.2f}{s.p99_latency_seconds:>8.2f}"
            f"{100 * s.device_hit_rate:>7.0f}%{100 * s.host_hit_rate:>8.0f}%{s.num_errors:>7}{jct}"
        )
    reference = next(iter(table))
    for key, slos in (("p99", slo_p99), ("mean", slo_mean)):
        print(f"sustainable QPS at {key} latency <= SLO ('>=': met even at the top load; x: {reference} / system)")
        print(f"  {'system':<14}" + "".join(f"{f'<= {slo:.2f} s':>20}" for slo in slos))
        for system, row in table.items():
            cells = []
            for mine, ref in zip(row[key], table[reference][key], strict=True):
                ratio = f" x{ref['qps'] / mine['qps']:.2f}" if mine["qps"] > 0 else " x-"
                cells.append(f"{'' if mine['exact'] else '>='}{mine['qps']:.2f}{ratio if system != reference else ''}")
            print(f"  {system:<14}" + "".join(f"{c:>20}" for c in cells))
