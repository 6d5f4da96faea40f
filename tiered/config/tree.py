"""The configuration tree: one dataclass per section, its invariants checked as it is built."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal

ForwardMode = Literal["vanilla", "chunked", "hybrid"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
RetentionPolicy = Literal["prefix", "all", "none"]
SuffixPolicy = Literal["offload", "discard"]
WritePolicy = Literal["write-through", "on-evict"]
OnClose = Literal["drain", "drop"]
SchedulerPolicy = Literal["fcfs", "srjf", "calibrated", "lpm", "spf", "hrrn"]


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the key."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError naming `key` unless `ok`: how each section checks its invariants."""
    if not ok:
        raise ConfigError(f"config key '{key}': {message}")


def require_writable_dir(path: str, key: str, what: str) -> None:
    """Make directory `path` if missing and write one file there (removed at once); a path that
    cannot hold `what` (a file, read-only, not creatable) is a ConfigError naming `key`."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(bytes(4096))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"config key '{key}': '{path}' cannot hold {what} ({reason})") from None


@dataclass(slots=True)
class ModelConfig:
    """Which checkpoint to serve and in which precision."""

    # A folder in HF format, or `embedded:NAME` for a project-made model (made on first use).
    path: str = "embedded:tiny"
    # Compute precision. auto: the checkpoint's dtype where the device computes it natively (CUDA;
    # avx512_bf16 / amx_bf16 CPUs for bf16), else fp32. A dtype name forces it (weights cast at load).
    dtype: DType = "auto"
    # Longest input (tokens) the engine accepts; also the length of the start-up profile run.
    max_model_len: int = 8192
    # Where `embedded:NAME` models are written.
    models_dir: str = ".models"

    def __post_init__(self) -> None:
        require(self.max_model_len >= 1, "model.max_model_len", f"must be >= 1, got {self.max_model_len}")
        require(bool(self.path), "model.path", "must not be empty")


@dataclass(slots=True)
class ForwardConfig:
    """How one request's forward pass is computed: hybrid prefilling (ours) or, to compare, a general engine's."""

    # vanilla: whole sequence per op, all layers' KV held to the end (a general engine);
    # chunked: Sarathi-style, the whole model per token chunk, earlier chunks' KV kept;
    # hybrid: token-wise ops chunk by chunk, attention once per layer, one layer's KV alive.
    mode: ForwardMode = "hybrid"
    # Tokens per chunk for the token-wise ops (hybrid) or per model pass (chunked).
    chunk_tokens: int = 1024
    # A directory on a disk where a hybrid forward of at least `spill_min_tokens` tokens keeps its
    # residual stream (every token's hidden state between layers) instead of memory, so a prompt
    # needs about one layer's K,V in memory; each chunk's rows are read and written back once
    # per layer. null: always in memory. One process only (not with engine.pipeline_stages > 1).
    spill_dir: str | None = None
    spill_min_tokens: int = 16384

    def __post_init__(self) -> None:
        require(self.chunk_tokens >= 1, "forward.chunk_tokens", f"must be >= 1, got {self.chunk_tokens}")
        require(self.spill_min_tokens >= 1, "forward.spill_min_tokens", f"must be >= 1, got {self.spill_min_tokens}")


@dataclass(slots=True)
class HostTierConfig:
    """The host tier (LMCache). `lmcache` holds LMCache's own config keys, passed through as is
    (e.g. max_local_cpu_size in GB, local_disk, max_local_disk_size, remote_url); `chunk_size`
    is always `cache.block_tokens` and is set by us. They win over LMCache's own sources
    (LMCACHE_CONFIG_FILE, then LMCACHE_* variables); max_local_cpu_size is 0.25 unless one of
    them sets it."""

    enabled: bool = True
    lmcache: dict[str, Any] = field(default_factory=dict)
    # When a computed chunk that stays on the device goes to the host tier: `write-through` (right
    # after its forward) or `on-evict` (when the device tier evicts it; never, if it is not).
    # Chunks that do not stay on the device are stored after their forward either way.
    write_policy: WritePolicy = "write-through"
    # Most of one core the store thread may use (it sleeps to stay under it); 1.0 = no bound.
    store_cpu_share: float = 0.25
    # Store batches (one per forwarded request) queued for the store thread; beyond, a store is
    # dropped rather than held (its chunks are recomputed if needed again).
    max_pending_stores: int = 64
    # Seconds a store may wait for LMCache memory held by writes on their way to its disk (or by
    # queued stores), before the chunks that found none are dropped; 0: never wait.
    store_wait_s: float = 0.25
    # At shutdown: `drain` puts the queued stores into LMCache first; `drop` frees them.
    on_close: OnClose = "drain"

    def __post_init__(self) -> None:
        require("chunk_size" not in self.lmcache, "cache.host.lmcache.chunk_size", "is set from cache.block_tokens")
        require(
            0 < self.store_cpu_share <= 1,
            "cache.host.store_cpu_share",
            f"must be in (0, 1], got {self.store_cpu_share}",
        )
        require(
            0 <= self.store_wait_s <= 60,
            "cache.host.store_wait_s",
            f"must be in [0, 60] seconds, got {self.store_wait_s}",
        )
        require(
            self.max_pending_stores >= 1,
            "cache.host.max_pending_stores",
            f"must be >= 1, got {self.max_pending_stores}",
        )


@dataclass(slots=True)
class CacheConfig:
    """The KV tiers: the device tier's block pool, what a finished request leaves in it, the host tier (LMCache)."""

    # Tokens per device-tier block; also LMCache's chunk size, so a block is a host chunk.
    block_tokens: int = 256
    # Bytes of the preallocated device-tier pool (K and V of all layers).
    device_tier_bytes: int = 64 * 2**20
    # Which blocks of a finished request stay on the device.
    retention: RetentionPolicy = "prefix"
    # Most tokens one request may leave on the device (prefix and all policies).
    retention_cap_tokens: int = 65536
    # What happens to KV that does not stay on the device.
    suffix: SuffixPolicy = "offload"
    # Precision of the KV both tiers keep. auto: the compute dtype. A narrower one (bfloat16 under
    # fp32 compute: twice the tokens per byte, converted as blocks are stored and read) costs the
    # conversions: set it where the working set outgrows the tiers.
    kv_dtype: DType = "auto"
    host: HostTierConfig = field(default_factory=HostTierConfig)

    def __post_init__(self) -> None:
        require(self.block_tokens >= 1, "cache.block_tokens", f"must be >= 1, got {self.block_tokens}")
        require(self.device_tier_bytes >= 0, "cache.device_tier_bytes", "must be >= 0")
        require(self.retention_cap_tokens >= 0, "cache.retention_cap_tokens", "must be >= 0")
        require(
            self.suffix == "discard" or self.host.enabled,
            "cache.suffix",
            "'offload' needs cache.host.enabled: true",
        )


@dataclass(slots=True)
class SchedulerConfig:
    """Which request runs next, which requests join its batch, and the prefetch of the likely next one's prefix."""

    policy: SchedulerPolicy = "calibrated"
    # λ, dimensionless: seconds of predicted JCT forgiven per second waited (0 = may starve).
    fairness: float = 0.5
    # Load the likely next request's host-resident prefix while the current one computes.
    prefetch: bool = True
    # JCT profile grid: total lengths (tokens) and computed fractions; capped at max_model_len.
    profile_tokens: list[int] = field(default_factory=lambda: [256, 1024, 4096])
    profile_miss_fractions: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.125])
    # Where profiled JCT fits are cached (keyed by model, device and config).
    profile_cache_dir: str = ".cache/jct"
    # Most requests waiting or running at once; the server answers 503 (with Retry-After) beyond it.
    max_waiting: int = 4096
    # Admission control: a call whose predicted wait (the JCT model's predicted time of the waiting
    # requests the policy runs before it, a prefix several of them compute counted once) exceeds
    # this many seconds is answered 503 with Retry-After at once, objective or not. 0: no cap (only
    # `max_waiting` bounds the queue).
    max_predicted_wait_s: float = 0.0
    # Computed (uncached) tokens of one batched forward: requests sharing a prefix run together
    # up to this budget, reading one copy of it. 0: one request per forward (PrefillOnly's way).
    max_batch_tokens: int = 2048
    # Latency objective of a request that names none (`slo_ms`), ms from arrival; None: none.
    default_slo_ms: float | None = None
    # A call whose objective the JCT model predicts it will miss: `shed` answers it at once with a
    # 429 (Retry-After: the predicted wait), when it arrives (its predicted wait plus its own time
    # ends past its deadline) or while it waits (it cannot start before the running step ends and
    # still make it); `serve` runs it late, behind every call that can still be in time
    # (`defer_late`), its wait bounded only by `max_predicted_wait_s` and `max_waiting`. Calls
    # without an objective are never shed.
    late: Literal["shed", "serve"] = "shed"
    # `late: shed` and a call whose own predicted time exceeds its objective, however idle the
    # machine (its prefix not cached): it is refused (reason `unmeetable`) and its prompt computed in
    # the background at the lowest priority, answered to no one, so that a later call over the same
    # prefix finds it cached; its 429's Retry-After is when that is predicted done. At most this many
    # such warm-ups queued or running at once (the oldest queued gives its slot to a new one; with all
    # running, a 429 without Retry-After); 0: none. A call that misses even with its prefix cached
    # gets a 400 naming its objective.
    warm_unmeetable: int = 4
    # A request past its deadline fails with a clear error instead of running late (`late: serve`;
    # `shed` refuses it earlier).
    drop_expired: bool = False
    # A request whose predicted time from now ends past its deadline waits behind every request
    # that can still meet its own (and those without one); it still runs, late. Under overload the
    # calls that can be in time are, instead of every call running a little late in arrival order.
    defer_late: bool = True
    # How a request running alone may yield between block-aligned pieces, its finished KV parked in
    # the tiers: `deadline` (when a waiting request would end past its planned end behind its rest), `fixed` (pieces of
    # `piece_tokens`), `never` (one pass). A yielding request ends within (1 + max_yield_delay) x its time alone.
    pieces: Literal["deadline", "fixed", "never"] = "deadline"
    piece_tokens: int = 4096
    max_yield_delay: float = 0.5

    def __post_init__(self) -> None:
        require(self.fairness >= 0, "scheduler.fairness", f"must be >= 0, got {self.fairness}")
        require(
            self.default_slo_ms is None or 0 < self.default_slo_ms <= 1e9,
            "scheduler.default_slo_ms",
            f"must be in (0, 1e9] ms or null, got {self.default_slo_ms}",
        )
        require(
            self.piece_tokens >= 1 and self.max_yield_delay >= 0,
            "scheduler.piece_tokens",
            "piece_tokens must be >= 1 and max_yield_delay >= 0",
        )
        require(self.max_waiting >= 1, "scheduler.max_waiting", f"must be >= 1, got {self.max_waiting}")
        require(self.late in ("shed", "serve"), "scheduler.late", f"must be 'shed' or 'serve', got {self.late!r}")
        require(
            0 <= self.max_predicted_wait_s <= 1e6,
            "scheduler.max_predicted_wait_s",
            f"must be in [0, 1e6] s (0: no cap), got {self.max_predicted_wait_s}",
        )
        require(
            0 <= self.warm_unmeetable <= 1024,
            "scheduler.warm_unmeetable",
            f"must be in [0, 1024] (0: no warm-up), got {self.warm_unmeetable}",
        )
        require(self.max_batch_tokens >= 0, "scheduler.max_batch_tokens", f"must be >= 0, got {self.max_batch_tokens}")
        require(
            bool(self.profile_tokens) and min(self.profile_tokens) >= 2,
            "scheduler.profile_tokens",
            "must list lengths >= 2",
        )
        require(
            all(0 < f <= 1 for f in self.profile_miss_fractions),
            "scheduler.profile_miss_fractions",
            "must be in (0, 1]",
        )


AttentionKernel = Literal["auto", "flash-head", "flash", "flash-f32", "native", "masked", "varlen", "vllm-cpu"]


@dataclass(slots=True)
class AttentionConfig:
    """Which attention kernel computes (tiered/hybrid/attention)."""

    # auto: the fastest correct kernel on this machine, measured at start-up on the engine's
    # shapes and cached; a name forces one (flash-head, flash: cpu; flash-f32: cpu, computes
    # half-precision inputs in fp32; native: cpu, where its C++ library builds; masked: any;
    # varlen: cuda; vllm-cpu: cpu, where vLLM's library loads, see vllm_library).
    kernel: AttentionKernel = "auto"
    # Where the measured choice is cached (keyed by CPU, torch, threads, dtype, head shapes and the
    # native library's build).
    profile_cache_dir: str = ".cache/attention"
    # Where the vllm-cpu kernel's compiled ops come from: auto (the vllm package this interpreter
    # would import, found without importing it), a site-packages or vllm package folder, a .so
    # file, or none. Only vllm-cpu 0.32.0 is accepted: the ops' schema is private to vLLM and
    # changes between versions. Unloadable: the kernel is unavailable (the reason is logged).
    vllm_library: str = "auto"

    def __post_init__(self) -> None:
        require(bool(self.vllm_library.strip()), "attention.vllm_library", "must be auto, none or a path")


@dataclass(slots=True)
class EngineConfig:
    """Start-up memory split, and the engine process's threads."""

    # Bytes for weights + one forward + the device tier. 0: use cache.device_tier_bytes as is.
    # Otherwise a profile run forwards max_model_len tokens and the device tier gets the rest.
    # With pipeline_stages > 1, each stage's budget: each measures its own layers' weights and
    # forward, and every stage's pool gets the blocks the tightest stage has room for.
    memory_budget_bytes: int = 0
    # The profile run's longest forward. A hybrid max_model_len above it is not run: its peak is
    # extended along the line through two measured lengths (the peak is affine in the length, the
    # residual stream spilled or not), so a start-up with a long max_model_len costs the forwards
    # up to this length, not one of max_model_len. 0: always forward max_model_len tokens.
    profile_max_tokens: int = 32768
    # Under memory_budget_bytes on the CPU: bytes of freed tensors the block cache keeps for reuse
    # (tiered/allocator/block_cache.py: each tensor of 64 KiB or more has its own mapping, and every forward
    # starts with the cache empty, so the profile's peak holds whatever ran before). A larger cap
    # faults fewer pages per chunk and raises the peak by up to itself. null: four
    # [forward.chunk_tokens, intermediate_size] tensors' bytes; 0: off (glibc's allocator).
    block_cache_bytes: int | None = None
    # torch threads of the engine process's forward. 0: torch's default (one per core).
    threads: int = 0
    # Pipeline parallelism (vLLM's --pipeline-parallel-size): the decoder layers split into this
    # many contiguous ranges, one worker process per stage (tiered/pipeline). 1: one process.
    pipeline_stages: int = 1
    # torch threads of each stage process. 0: the machine's cores // pipeline_stages (at least 1).
    threads_per_stage: int = 0
    # How a batch goes through the stages: `waves` (cut into micro-batches of even predicted seconds
    # on the slowest stage, tiered/engine/pipeline/costs.py, that follow one another, stage s on micro-batch
    # i while stage s + 1 is on i - 1) or `fill-drain` (the whole batch through every stage in turn:
    # GPipe's baseline with one micro-batch).
    pipeline_schedule: Literal["waves", "fill-drain"] = "waves"
    # Micro-batches per batch with `waves`. 0: pipeline_stages.
    pipeline_microbatches: int = 0
    # Batches in the pipe at once with `waves`: the engine plans and sends the next batch while
    # the last stages still compute the one before (each stage takes them in order). 0: one per
    # stage plus one waiting at the first; 1: a batch leaves the last stage before the next enters
    # the first. `fill-drain` always uses 1.
    pipeline_batches_in_flight: int = 0
    # Seconds the engine waits for a batch's answer from the pipeline before it declares a stage
    # stuck (a process alive but not answering): the batch fails with a 503 and the pipeline restarts.
    pipeline_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(self.memory_budget_bytes >= 0, "engine.memory_budget_bytes", "must be >= 0")
        require(
            self.block_cache_bytes is None or self.block_cache_bytes >= 0,
            "engine.block_cache_bytes",
            f"must be null or >= 0, got {self.block_cache_bytes}",
        )
        require(
            self.profile_max_tokens == 0 or self.profile_max_tokens >= 2,
            "engine.profile_max_tokens",
            f"must be 0 or >= 2, got {self.profile_max_tokens}",
        )
        require(self.threads >= 0, "engine.threads", f"must be >= 0, got {self.threads}")
        require(self.pipeline_stages >= 1, "engine.pipeline_stages", f"must be >= 1, got {self.pipeline_stages}")
        require(self.threads_per_stage >= 0, "engine.threads_per_stage", f"must be >= 0, got {self.threads_per_stage}")
        require(
            self.pipeline_microbatches >= 0,
            "engine.pipeline_microbatches",
            f"must be >= 0, got {self.pipeline_microbatches}",
        )
        require(
            self.pipeline_batches_in_flight >= 0,
            "engine.pipeline_batches_in_flight",
            f"must be >= 0, got {self.pipeline_batches_in_flight}",
        )
        require(self.pipeline_timeout_s > 0, "engine.pipeline_timeout_s", f"must be > 0, got {self.pipeline_timeout_s}")


@dataclass(slots=True)
class ServerConfig:
    """`tiered serve`: limits the API process enforces before anything reaches the engine."""

    # Seconds from a request's arrival to its answer; past it the request is cancelled (504). 0: none.
    request_timeout_s: float = 600.0
    # Largest request body accepted, bytes (413 beyond).
    max_body_bytes: int = 16 * 2**20
    # Start a new engine process when the engine process dies (requests in flight get 503).
    restart_engine: bool = True
    # GET /metrics is open, as in vLLM; true puts it behind the API key, as the /v1 routes are.
    metrics_require_key: bool = False
    # The rerank routes and vLLM's /v1/score shape: a pair (query, document) is one prompt, the
    # query's tokens then the document's, and its score the probability of the second token
    # against the first at the last position (softmax over the two: vLLM's `classifier_from_token`
    # for a generative reranker such as Qwen3-Reranker: ["no", "yes"]). Each must be one token.
    score_tokens: list[str] = field(default_factory=lambda: ["no", "yes"])

    def __post_init__(self) -> None:
        require(self.request_timeout_s >= 0, "server.request_timeout_s", "must be >= 0")
        require(
            len(self.score_tokens) == 2 and all(isinstance(t, str) and t for t in self.score_tokens),
            "server.score_tokens",
            f"must name two tokens [negative, positive], got {self.score_tokens!r}",
        )
        require(self.max_body_bytes >= 1024, "server.max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters in PEFT's format (vLLM's --enable-lora family), one per request (`model`)."""

    enabled: bool = False
    # Adapters served from the start: name -> PEFT folder (adapter_config.json + adapter_model.safetensors).
    modules: dict[str, str] = field(default_factory=dict)
    # Adapters resident on the device at once (least recently used ones are dropped and read
    # again from their folder when asked for); also the most distinct adapters in one batch.
    max_loras: int = 8
    # Largest rank accepted (vLLM's default, 16); an adapter above it is refused with a message.
    max_lora_rank: int = 16
    # Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM gates them behind
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, which is honoured too).
    allow_runtime_updates: bool = False

    def __post_init__(self) -> None:
        require(self.max_loras >= 1, "lora.max_loras", f"must be >= 1, got {self.max_loras}")
        require(self.max_lora_rank >= 1, "lora.max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")
        require(self.enabled or not self.modules, "lora.modules", "needs lora.enabled: true (--enable-lora)")
        for name, path in self.modules.items():
            require(
                isinstance(name, str) and bool(name) and isinstance(path, str) and bool(path),
                "lora.modules",
                f"must map adapter names to folders, got {name!r}: {path!r}",
            )


@dataclass(slots=True)
class ClusterConfig:
    """`tiered serve --replicas N`: N engine replicas and one ingress on Ray Serve (tiered.cluster)."""

    # Engine replicas (--replicas). 1 with no address: plain `tiered serve`, no Ray.
    replicas: int = 1
    # Ray cluster to join (--ray-address): "auto" (one running on this machine), "ray://HOST:PORT",
    # or null: start a local one.
    address: str | None = None
    # CPUs Ray reserves for each replica; its engine computes with that many torch threads
    # (rounded down, at least 1) unless engine.threads says otherwise.
    cpus_per_replica: float = 1.0
    # GPUs Ray reserves for each replica; null: 1 when device is cuda, else 0.
    gpus_per_replica: float | None = None
    # How the ingress picks a replica: `affinity` (a consistent-hash ring on x-user-id, else on the
    # prompt's first blocks, with a bounded load) or `round_robin`.
    routing: Literal["affinity", "round_robin"] = "affinity"
    # Bounded load (epsilon): a replica whose queued tokens would exceed (1 + epsilon) x its share
    # of all queued tokens is passed over for the next one on the ring.
    load_factor: float = 0.25
    # Tokens at the start of a prompt that pick its replica (whole blocks; x-user-id overrides).
    affinity_tokens: int = 256
    # Ray's health check of each replica: every period, failed after timeout; a failed replica is replaced.
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        require(self.replicas >= 1, "cluster.replicas", f"must be >= 1, got {self.replicas}")
        require(self.cpus_per_replica > 0, "cluster.cpus_per_replica", f"must be > 0, got {self.cpus_per_replica}")
        require(
            self.gpus_per_replica is None or self.gpus_per_replica >= 0,
            "cluster.gpus_per_replica",
            f"must be >= 0, got {self.gpus_per_replica}",
        )
        require(self.load_factor > 0, "cluster.load_factor", f"must be > 0, got {self.load_factor}")
        require(self.affinity_tokens >= 1, "cluster.affinity_tokens", f"must be >= 1, got {self.affinity_tokens}")
        require(
            self.health_check_period_s > 0 and self.health_check_timeout_s > 0,
            "cluster.health_check_period_s",
            "the health check's period and timeout must be > 0",
        )


@dataclass(slots=True)
class Config:
    """The whole engine configuration."""

    # `cpu`, `cuda`, `cuda:N`, or `auto` (cuda when available, else cpu).
    device: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        ok = self.device in ("cpu", "cuda", "auto") or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        require(ok, "device", f"must be cpu, cuda, cuda:N or auto, got '{self.device}'")
        if self.engine.pipeline_stages > 1:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        """What a pipeline of stages does not support yet, refused by name rather than ignored."""
        later = "is not yet supported with engine.pipeline_stages > 1"
        for key in ("remote_url", "local_disk"):  # each stage's LMCache holds its layers' chunks in its memory
            require(
                not self.cache.host.lmcache.get(key),
                f"cache.host.lmcache.{key}",
                f"a shared or disk backend {later} (each stage's host tier is in its own memory)",
            )
        require(self.forward.mode != "chunked", "forward.mode", f"'chunked' {later} (use hybrid or vanilla)")
        require(self.forward.spill_dir is None, "forward.spill_dir", f"a spilled residual stream {later}")
        require(self.cluster.replicas == 1, "cluster.replicas", f"replicas {later}")
