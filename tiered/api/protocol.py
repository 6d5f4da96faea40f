"""Messages between the API process and the engine process: typed dataclasses as msgpack maps."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack


@dataclass(slots=True)
class ScoreRequest:
    request_id: str
    token_ids: list[int]
    logprob_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0


@dataclass(slots=True)
class ScoreResponse:
    request_id: str
    error: str | None = None  # set when the engine refused the request (a 400 for the client)
    token_id: int = 0
    logprobs: list[tuple[int, float]] = field(default_factory=list)  # for logprob_token_ids
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    num_tokens: int = 0
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    queued_seconds: float = 0.0
    compute_seconds: float = 0.0
    jct_error: float | None = None  # the engine's JCT prediction error (MAPE) after this job


@dataclass(slots=True)
class Ready:
    """The engine process is up and serving."""

    max_model_len: int
    vocab_size: int


_TYPES: dict[str, type] = {"request": ScoreRequest, "response": ScoreResponse, "ready": Ready}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def encode(message: ScoreRequest | ScoreResponse | Ready) -> bytes:
    return msgpack.packb({"type": _NAMES[type(message)], "body": asdict(message)})


def decode(frame: bytes) -> Any:
    raw = msgpack.unpackb(frame)
    cls = _TYPES[raw["type"]]
    body = raw["body"]
    if cls is ScoreResponse:
        body["logprobs"] = [tuple(p) for p in body["logprobs"]]
        body["top_logprobs"] = [tuple(p) for p in body["top_logprobs"]]
    return cls(**body)
