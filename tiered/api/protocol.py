"""Messages between the API process and the engine process: typed dataclasses as msgpack maps."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack


@dataclass(slots=True)
class ScoreRequest:
    """One prompt to prefill and score: its token ids, choice fields, priority, adapter and latency objective."""

    request_id: str
    token_ids: list[int]
    logprob_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    allowed_token_ids: list[int] = field(default_factory=list)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter to compute with (None: the base model)
    slo_ms: float | None = None  # latency objective, ms from arrival (None: the server's default)
    # When the API received it (wall clock, time.time()): its arrival, and so its deadline, count
    # from there, not from when the engine, busy with a forward, read the message.
    arrival_unix: float | None = None


@dataclass(slots=True)
class AdapterCommand:
    """Load (`path` set) or unload (`path` None) a LoRA adapter; answered by an AdapterReply."""

    request_id: str
    name: str
    path: str | None = None


@dataclass(slots=True)
class AdapterReply:
    """The engine's answer to an AdapterCommand: `error` None on success, else the message and its status."""

    request_id: str
    error: str | None = None
    error_status: int = 400


@dataclass(slots=True)
class Cancel:
    """The client is gone or its time ran out: drop the request if it still waits."""

    request_id: str


@dataclass(slots=True)
class HostCounters:
    """The host tier's counters since the engine started (HostTierStats, as sent to the API)."""

    loaded_bytes: int = 0
    load_seconds: float = 0.0
    stored_bytes: int = 0
    store_seconds: float = 0.0  # on the forward's thread: allocation and the sink's copies
    store_thread_cpu_seconds: float = 0.0
    dropped_chunks: int = 0
    pending_stores: int = 0
    disk_write_failures: int = 0
    store_wait_seconds: float = 0.0


@dataclass(slots=True)
class ScoreResponse:
    """The engine's answer to a ScoreRequest: the chosen token, logprobs, cache hits, timings, or an error."""

    request_id: str
    error: str | None = None  # set when the engine refused or failed the request
    error_status: int = 400  # the HTTP status for `error`: 400 refused input, 500 failed (out of memory)
    token_id: int = 0
    logprobs: list[tuple[int, float]] = field(default_factory=list)  # for logprob_token_ids
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    num_tokens: int = 0
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_remote_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    num_shared_tokens: int = 0  # computed once for this request by another one of its batch
    queued_seconds: float = 0.0
    load_seconds: float = 0.0  # host-tier loads of this request's batch
    store_seconds: float = 0.0  # what host-tier stores cost this request's batch's forward
    compute_seconds: float = 0.0
    num_pieces: int = 1  # forwards its new tokens took (more than one: it yielded to urgent requests)
    deadline_met: bool | None = None  # answered by its deadline (None: no latency objective)
    retry_after_s: float | None = None  # a refused request (429, 503): predicted seconds until the queue clears
    # Why admission control refused it (`Refused.reason`: deadline, unmeetable, wait_cap); None otherwise.
    error_reason: str | None = None
    # A request refused as predicted to miss its deadline: the last moment (Unix time) a shed check
    # found it in time, or its receipt; and the seconds from then until the engine's client (on the
    # engine's host) received the refusal, set there on receipt (tiered:shed_delay_seconds).
    late_since_unix: float | None = None
    shed_delay_s: float | None = None


def cached_tokens(out: ScoreResponse) -> int:
    """A response's prompt tokens that came from a cache tier (vLLM's `cached_tokens`)."""
    return out.num_device_hit_tokens + out.num_host_hit_tokens + out.num_remote_hit_tokens + out.num_disk_hit_tokens


@dataclass(slots=True)
class EngineStats:
    """Engine-wide statistics, sent in their own message at most a few times a second (and when
    the engine's queue empties), not with every response."""

    jct_error: float | None = None  # the JCT model's prediction error (MAPE) so far
    host_failures: int = 0  # host-tier operations that failed so far (each degraded to recomputation)
    host: HostCounters | None = None  # the host tier's transfer counters so far (None: no host tier)
    pinned_blocks: int = 0  # device-tier blocks pinned now (0 when nothing runs)
    engine_cancelled: int = 0  # requests the engine dropped from its queue on a Cancel, so far
    num_waiting: int = 0  # requests in the engine's queue now
    predicted_wait_s: float = 0.0  # the JCT model's predicted seconds of the work in the engine's queue now
    adapters: tuple[int, int] | None = None  # LoRA: (resident, weight loads so far); None: LoRA off
    lmcache_metrics: str = ""  # LMCache's own Prometheus metrics in the engine process, rendered
    pieces: PieceCounters | None = None  # prefills that yielded, so far


@dataclass(slots=True)
class Busy:
    """The engine starts a forward predicted to end at `until_unix` (wall clock, time.time()), or
    (0.0) has ended it: a call arriving meanwhile waits at least until then."""

    until_unix: float = 0.0


@dataclass(slots=True)
class PieceCounters:
    """Prefills that yield (tiered/scheduler/pieces.py), counted since the engine started."""

    yields: int = 0  # pieces after which a request waited again
    deferrals: int = 0  # heads that waited before starting, an urgent request run first
    parked_device_bytes: int = 0  # KV of finished pieces kept on the device for their request
    parked_host_bytes: int = 0  # ... and left to the host tier (not held on the device: no room, or the cap)


@dataclass(slots=True)
class Ready:
    """The engine process is up and serving."""

    max_model_len: int
    vocab_size: int
    # The resolved precision (tiered.hybrid.precision.Precision as a mapping): checkpoint, compute,
    # kv, reason; shown on /v1/models.
    precision: dict[str, str] = field(default_factory=dict)


_TYPES: dict[str, type] = {
    "request": ScoreRequest,
    "response": ScoreResponse,
    "ready": Ready,
    "cancel": Cancel,
    "adapter": AdapterCommand,
    "adapter_reply": AdapterReply,
    "stats": EngineStats,
    "busy": Busy,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


Message = ScoreRequest | ScoreResponse | Ready | Cancel | AdapterCommand | AdapterReply | EngineStats | Busy


def encode(message: Message) -> bytes:
    """A message as a msgpack frame: its type's name and its fields."""
    return msgpack.packb({"type": _NAMES[type(message)], "body": asdict(message)})


def decode(frame: bytes) -> Any:
    """A msgpack frame back as its message dataclass (tuples and nested counters restored)."""
    raw = msgpack.unpackb(frame)
    cls = _TYPES[raw["type"]]
    body = raw["body"]
    if cls is ScoreResponse:
        body["logprobs"] = [tuple(p) for p in body["logprobs"]]
        body["top_logprobs"] = [tuple(p) for p in body["top_logprobs"]]
    elif cls is EngineStats:
        if body.get("host") is not None:
            body["host"] = HostCounters(**body["host"])
        if body.get("adapters") is not None:
            body["adapters"] = tuple(body["adapters"])
        if body.get("pieces") is not None:
            body["pieces"] = PieceCounters(**body["pieces"])
    elif cls is ScoreRequest:
        body["logit_bias"] = [tuple(p) for p in body["logit_bias"]]
    return cls(**body)
