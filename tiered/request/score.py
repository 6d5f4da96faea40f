"""What a request asks of its one output token (`ScoreParams`) and what it gets back (`Result`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tiered.request.tokens import HitSplit


@dataclass(frozen=True, slots=True)
class ScoreParams:
    """What to return of the last token's distribution, and how to choose the one output token.

    As in vLLM (its default `raw_logprobs` mode), logprobs are those of the model's own
    distribution; `logit_bias` and `allowed_token_ids` only change which token is chosen."""

    logprob_token_ids: tuple[int, ...] = ()  # exactly these ids' logprobs (e.g. Yes / No)
    top_logprobs: int = 0
    allowed_token_ids: tuple[int, ...] = ()  # the chosen token is one of these (empty: any)
    logit_bias: tuple[tuple[int, float], ...] = ()  # added to the logits before choosing

    def token_ids(self) -> list[int]:
        """Every token id these parameters name (validated against the vocabulary)."""
        return [*self.logprob_token_ids, *self.allowed_token_ids, *(t for t, _ in self.logit_bias)]

    def choose(self, logits: Tensor) -> int:
        """The output token: the argmax of `logits` after `logit_bias`, among `allowed_token_ids` if given."""
        if not self.allowed_token_ids and not self.logit_bias:
            return int(torch.argmax(logits))
        biased = logits.clone()
        for t, b in self.logit_bias:
            biased[t] += b
        if self.allowed_token_ids:
            allowed = torch.tensor(self.allowed_token_ids, dtype=torch.long)
            return int(allowed[torch.argmax(biased[allowed])])
        return int(torch.argmax(biased))


DEFAULT_PARAMS = ScoreParams()  # frozen: one shared default is safe


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How a request is served (vLLM's request fields): `priority` (lower runs first);
    `cache_salt` (cached KV is shared only with requests of the same salt, in both tiers);
    `adapter` (the name of a served LoRA adapter); `slo_ms` (its latency objective, ms from its
    arrival; default `scheduler.default_slo_ms`); `arrival` (time.monotonic(); default now)."""

    priority: int = 0
    cache_salt: str | None = None
    adapter: str | None = None
    slo_ms: float | None = None
    arrival: float | None = None


DEFAULT_OPTIONS = RequestOptions()


@dataclass(slots=True)
class Result:
    """A request's answer: its output token and logprobs, hit split, timings and, if it failed, why."""

    request_id: str
    num_tokens: int
    split: HitSplit
    token_id: int  # the argmax: the one output token
    logprobs: dict[int, float]  # for params.logprob_token_ids
    top_logprobs: list[tuple[int, float]]
    queued_seconds: float
    prefetch_wait_seconds: float
    load_seconds: float
    compute_seconds: float
    predicted_seconds: float
    decision_seconds: float
    finished_at: float = field(default=0.0)
    error: str | None = None  # the request failed in the engine (out of memory); the engine goes on
    batch_size: int = 1  # requests in the forward that computed this one
    # Tokens after the cached prefix that another request of the batch computed for this one
    # (the same tokens: a shared profile tail, or a whole profile nothing had cached yet).
    num_shared_tokens: int = 0
    # Of the forward's time, what storing to the host tier cost it (LMCache allocation, the KV
    # sink's copies), summed over the batch like `load_seconds`.
    store_seconds: float = 0.0
    num_pieces: int = 1  # forwards its new tokens took (more than one: it yielded between pieces)
    deadline_met: bool | None = None  # answered by its deadline (None: it had no latency objective)
    # Failed because its deadline passed while it waited (scheduler.drop_expired), or it was
    # predicted to miss it (scheduler.late: shed): a 429.
    expired: bool = False
    unavailable: bool = False  # failed because a pipeline stage died under its batch (503: retry it)
    retry_after: float | None = None  # a refused request: the predicted seconds until the queue clears
    # A request shed as predicted to miss its deadline: the last moment (monotonic) its prediction
    # had it in time, or its arrival; its refusal's delay is counted from it.
    late_since: float | None = None

    @classmethod
    def failed(
        cls,
        request_id: str,
        num_tokens: int,
        error: str,
        queued_seconds: float,
        expired: bool = False,
        unavailable: bool = False,
        retry_after: float | None = None,
        late_since: float | None = None,
    ) -> Result:
        """A result for a request that failed before computing (`error` says why), with no hits or output."""
        return cls(
            request_id,
            num_tokens,
            HitSplit(0, 0, num_tokens),
            0,
            {},
            [],
            queued_seconds,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            time.monotonic(),
            error,
            expired=expired,
            unavailable=unavailable,
            retry_after=retry_after,
            late_since=late_since,
        )

    @property
    def latency_seconds(self) -> float:
        """Time the request spent in the engine: queued, prefetch wait, load and compute."""
        return self.queued_seconds + self.prefetch_wait_seconds + self.load_seconds + self.compute_seconds
