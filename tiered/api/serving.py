"""The serving layer of the API (vLLM's `OpenAIServing`): tokenize, validate once, send to the
engine, read its answers back. The routes (`routes/`) only parse bodies and shape responses.

Validation uses `tiered.request.validation`, the rules the engine itself applies: nothing too long,
empty or out of vocabulary reaches the engine, and the 400 names the field.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import Request

from tiered.api.errors import APIError
from tiered.api.logprobs import TokenTexts
from tiered.api.metrics import Metrics
from tiered.api.protocol import AdapterReply, EngineStats, Ready, ScoreRequest, ScoreResponse, cached_tokens
from tiered.api.schemas import ChoiceFields, EngineFields, ScoreBody
from tiered.config import Config
from tiered.request.validation import InputError, check_priority, check_prompt, check_slo_ms, check_token_ids


class Client(Protocol):
    """What the serving layer needs of the engine (`EngineClient`; a fake one in unit tests)."""

    ready: Ready | None
    adapters: dict[str, str]
    pending: dict[str, Any]
    timed_out: int
    cancelled: int
    busy_until: float  # when the engine's running forward is predicted to end (time.time()); 0.0: none

    @property
    def stats(self) -> EngineStats | None:
        """The engine's statistics as last reported (None before any report)."""
        ...

    @property
    def restarts(self) -> int:
        """Engine processes started after one died."""
        ...

    @property
    def alive(self) -> bool:
        """Whether the engine is up and takes requests."""
        ...

    async def start(self) -> None:
        """Start the engine and wait until it serves."""
        ...

    def stop(self) -> None:
        """Stop the engine."""
        ...

    def full(self, incoming: int) -> bool:
        """Whether `incoming` more requests would overfill the engine's queue."""
        ...

    async def run(self, reqs: list[ScoreRequest], disconnected: Any = None) -> list[ScoreResponse]:
        """Send requests together and return their answers, in order: all of them, or, once one is
        an error, those so far (the others cancelled, as when `disconnected()` turns true)."""
        ...

    async def adapter(self, name: str, path: str | None) -> AdapterReply:
        """Load (`path`) or unload (None) a LoRA adapter; the engine's reply."""
        ...


def refuse_stream(stream: bool | None) -> None:
    """Streaming is refused, not faked: an answer is one token, computed in one forward."""
    if stream:
        raise APIError(
            400,
            "stream=true is not supported: this engine serves prefill-only requests, whose one "
            "output token comes in one response; send stream=false",
            "stream",
        )


def response_id(prefix: str, request: Request) -> str:
    """The response's id: the client's X-Request-Id when it sent one (as vLLM does), else a fresh one."""
    return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"


class Serving:
    """`served_names`: the base model's ids, the first one reported (responses, /v1/models,
    metrics), all accepted; `alias` is accepted too and never reported (the folder's name, so
    clients that sent it before the served name became the model argument keep working).
    `return_tokens_as_token_ids`: the server's default for the request field of that name."""

    def __init__(
        self,
        config: Config,
        tokenizer: Any,
        client: Client,
        metrics: Metrics,
        served_names: Sequence[str],
        *,
        alias: str | None = None,
        return_tokens_as_token_ids: bool = False,
    ) -> None:
        if not served_names:
            raise ValueError("the base model needs at least one served name")
        self.config, self.tokenizer, self.client, self.metrics = config, tokenizer, client, metrics
        self.served_names = tuple(served_names)
        self.model_name = self.served_names[0]
        self.base_names = frozenset((*self.served_names, *([alias] if alias else [])))
        self.token_texts = TokenTexts(tokenizer)
        self.return_tokens_as_token_ids = return_tokens_as_token_ids

    # ---- what the request names --------------------------------------------------------------

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model, by any of its names);
        404 for anything else. A base name wins over an adapter of the same name, as in vLLM."""
        if model is None or model in self.base_names:
            return None
        if model in self.client.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    def model_id(self, model: str | None) -> str:
        """The `model` an answer reports: the adapter's name, else the first served name (vLLM's
        rule: a request that named the base model by another of its names gets the first back)."""
        return self.adapter(model) or self.model_name

    def as_token_ids(self, requested: bool | None) -> bool:
        """A request's `return_tokens_as_token_ids`, else the server's --return-tokens-as-token-ids."""
        return self.return_tokens_as_token_ids if requested is None else requested

    @property
    def max_model_len(self) -> int:
        """The longest prompt the engine takes: as it reported, else the config's until it has."""
        ready = self.client.ready
        return ready.max_model_len if ready else self.config.model.max_model_len

    def check_serving(self) -> None:
        """503 unless the engine serves (it may be starting or restarting)."""
        if not self.client.alive:
            raise APIError(
                503, "the engine is not serving (starting or restarting); retry shortly", type_="service_unavailable"
            )

    # ---- tokenizing ------------------------------------------------------------------------

    def prompts(self, prompt: str | list[str] | list[int] | list[list[int]], special: bool = True) -> list[list[int]]:
        """A completion's `prompt` (a string, strings, ids or lists of ids) as lists of ids."""
        encode = self.tokenizer.encode
        if isinstance(prompt, str):
            return [encode(prompt, add_special_tokens=special)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return [encode(p, add_special_tokens=special) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]

    def render(self, messages: list[dict[str, Any]], special: bool, generation_prompt: bool = True) -> list[int]:
        """Chat messages through the chat template, tokenized; a malformed message is the client's 400."""
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            return list(self.tokenizer.encode(text, add_special_tokens=special))
        except Exception as exc:  # noqa: BLE001 - a malformed message is the client's error
            raise APIError(400, f"messages could not be rendered: {exc}", "messages") from None

    # ---- validating ------------------------------------------------------------------------

    def check_ids(self, ids: list[int], param: str) -> None:
        """400 naming `param` when an id is outside the vocabulary."""
        try:
            check_token_ids(ids, self.vocab_size, param)
        except InputError as exc:
            raise APIError(400, str(exc), param) from None

    @property
    def vocab_size(self) -> int:
        """The vocabulary size the engine reported, else the tokenizer's until it has."""
        ready = self.client.ready
        return ready.vocab_size if ready else len(self.tokenizer)

    def requests(
        self, prompts: list[list[int]], body: EngineFields, param: str, wanted: list[int], top: int = 0
    ) -> list[ScoreRequest]:
        """Validate the prompts and the choice fields; one engine request per prompt."""
        received = time.time()  # the requests' arrival, as the engine will count it
        adapter = self.adapter(body.model)  # an unknown model is a 404 before anything else, as in vLLM
        if body.cache_salt is not None and not body.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string when given", "cache_salt")
        try:
            check_slo_ms(body.slo_ms)
            check_priority(body.priority)
        except InputError as exc:
            raise APIError(400, str(exc), exc.param) from None
        allowed: list[int] = []
        bias: list[tuple[int, float]] = []
        if isinstance(body, ChoiceFields):
            if body.allowed_token_ids is not None:
                if not body.allowed_token_ids:
                    raise APIError(400, "allowed_token_ids must not be empty when given", "allowed_token_ids")
                allowed = list(body.allowed_token_ids)
                self.check_ids(allowed, "allowed_token_ids")
            for key, value in (body.logit_bias or {}).items():
                if not key.lstrip("-").isdigit():
                    raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
                if not -100 <= value <= 100 or math.isnan(value):
                    raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
                bias.append((int(key), value))
            self.check_ids([t for t, _ in bias], "logit_bias")
        self.check_ids(wanted, "logprob_token_ids" if isinstance(body, ChoiceFields) else "label_token_ids")
        for ids in prompts:
            try:
                check_prompt(ids, self.vocab_size, self.max_model_len, param)
            except InputError as exc:
                raise APIError(400, str(exc), param) from None
        return [
            ScoreRequest(
                uuid.uuid4().hex,
                ids,
                wanted,
                top,
                allowed,
                bias,
                body.priority,
                body.cache_salt,
                adapter,
                body.slo_ms,
                received,
            )
            for ids in prompts
        ]

    # ---- running ---------------------------------------------------------------------------

    async def run(self, reqs: list[ScoreRequest], request: Request, param: str) -> list[ScoreResponse]:
        """Send requests together (the scheduler sees them all); refuse them all if the queue is full.
        A call fails as a whole on its first error, at once: its other requests are cancelled."""
        label = reqs[0].lora_name or self.model_name  # the base model or the adapter (metrics' model_name)
        if self.client.full(len(reqs)):
            limit = self.config.scheduler.max_waiting * self.config.cluster.replicas  # per engine, summed
            self.metrics.refused.labels(label, "queue_full").inc(len(reqs))
            stats = self.client.stats
            raise APIError(
                503,
                f"the server is over capacity: its queue is full ({limit} requests: scheduler.max_waiting); "
                "retry later",
                type_="service_unavailable",
                retry_after=stats.predicted_wait_s if stats is not None else 1.0,
            )
        route = request.url.path
        self._refuse_behind_forward(reqs, label, route)
        start = time.monotonic()
        outs = await self.client.run(reqs, request.is_disconnected)
        for out in outs:
            unmeetable = out.error_reason == "unmeetable"  # its own time exceeds its objective (429 or 400)
            if out.error is None:
                self.metrics.observe(label, out, time.monotonic() - start, route)
            elif out.error_status == 429 or unmeetable:  # predicted to miss its deadline (shed), or past it (expired)
                shed = unmeetable or out.retry_after_s is not None
                self.metrics.deadline.labels(label, route, "shed" if shed else "expired").inc()
                self.metrics.refused.labels(label, "unmeetable" if unmeetable else "deadline").inc()
                if out.shed_delay_s is not None:
                    self.metrics.shed_delay.labels(label, route).observe(out.shed_delay_s)
            elif out.error_status == 503 and out.retry_after_s is not None:  # admission control's wait cap
                self.metrics.refused.labels(label, "wait_cap").inc()
            elif out.error_status >= 500:
                self.metrics.failed.labels(label).inc()
        for out in outs:
            if out.error is not None:
                raise APIError(
                    out.error_status,
                    out.error,
                    "slo_ms" if out.error_reason == "unmeetable" else param if out.error_status < 500 else None,
                    _error_type(out),
                    out.retry_after_s,
                )
        return outs

    def _refuse_behind_forward(self, reqs: list[ScoreRequest], label: str, route: str) -> None:
        """`scheduler.late: shed`: refuse the call here (429, as the engine would) when a request of
        it would end past its objective merely by waiting for the forward running now, without a
        round trip to the engine. A lower bound on the wait: the engine's intake checks the rest
        (the queue ahead of it, its own time) as soon as it reads the call."""
        now = time.time()
        remaining = self.client.busy_until - now
        if remaining <= 0 or self.config.scheduler.late != "shed":
            return
        default = self.config.scheduler.default_slo_ms
        for r in reqs:
            slo_ms = r.slo_ms if r.slo_ms is not None else default
            if slo_ms is None:
                continue
            waited = 0.0 if r.arrival_unix is None else max(0.0, now - r.arrival_unix)
            late_by = waited + remaining - slo_ms / 1e3
            if late_by <= 0:
                continue
            self.metrics.deadline.labels(label, route, "shed").inc(len(reqs))
            self.metrics.refused.labels(label, "deadline").inc(len(reqs))
            for q in reqs:  # missed from its receipt on: the forward's predicted end was known then
                waited = 0.0 if q.arrival_unix is None else max(0.0, time.time() - q.arrival_unix)
                self.metrics.shed_delay.labels(label, route).observe(waited)
            stats = self.client.stats
            raise APIError(
                429,
                f"deadline unreachable: the forward running now is predicted to end in {remaining:.2f} s, "
                f"{1e3 * late_by:.0f} ms past the latency objective of {slo_ms:g} ms (scheduler.late: shed)",
                None,
                "deadline_unreachable",
                remaining + (stats.predicted_wait_s if stats is not None else 0.0),
            )

    async def score_items(self, body: ScoreBody, request: Request) -> tuple[list[list[float]], list[ScoreResponse]]:
        """One prefill-only request per item, all sent together: the query is their shared prefix."""
        self.check_serving()
        if not body.items:
            raise APIError(400, "items must not be empty", "items")
        if not body.label_token_ids:
            raise APIError(400, "label_token_ids must not be empty", "label_token_ids")

        def ids(part: str | list[int], first: bool) -> list[int]:
            return self.tokenizer.encode(part, add_special_tokens=first) if isinstance(part, str) else list(part)

        prompts = [
            ids(item, True) + ids(body.query, False) if body.item_first else ids(body.query, True) + ids(item, False)
            for item in body.items
        ]
        return await self.label_probs(prompts, body, request, "items", list(body.label_token_ids), body.apply_softmax)

    async def label_probs(
        self,
        prompts: list[list[int]],
        body: EngineFields,
        request: Request,
        param: str,
        labels: list[int],
        softmax: bool,
    ) -> tuple[list[list[float]], list[ScoreResponse]]:
        """Each prompt's probabilities of the `labels` tokens at its last position (with `softmax`,
        normalized over the labels alone), all prompts sent together."""
        outs = await self.run(self.requests(prompts, body, param, labels), request, param)
        scores = []
        for out in outs:
            lps = dict(out.logprobs)
            if softmax:  # over the label tokens only, shifted by the largest: exact where exp(logprob) underflows
                top = max(lps[t] for t in labels)
                shifted = [math.exp(lps[t] - top) for t in labels]
                total = sum(shifted)
                values = [v / total for v in shifted]
            else:
                values = [math.exp(lps[t]) for t in labels]
            scores.append(values)
        return scores, list(outs)

    def score_token_ids(self) -> list[int]:
        """`server.score_tokens` as token ids [negative, positive]; 400 naming the setting where one
        is not a single token of this tokenizer."""
        words = self.config.server.score_tokens
        ids = [self.tokenizer.encode(w, add_special_tokens=False) for w in words]
        bad = [f"{w!r} is {len(i)} tokens" for w, i in zip(words, ids, strict=True) if len(i) != 1]
        if bad:
            raise APIError(
                400,
                f"this model cannot score pairs with server.score_tokens {words}: {', '.join(bad)} (each must be "
                "one token of its tokenizer; set server.score_tokens)",
                "model",
            )
        return [i[0] for i in ids]

    async def score_pairs(
        self, pairs: list[tuple[str, str]], body: EngineFields, request: Request, param: str
    ) -> tuple[list[float], list[ScoreResponse]]:
        """One prompt per (query, document) pair: the query's tokens (with the tokenizer's BOS),
        then the document's; its score, the positive score token's probability against the
        negative one's (`server.score_tokens`), as vLLM scores a generative reranker."""
        self.check_serving()
        labels = self.score_token_ids()
        encode = self.tokenizer.encode
        prompts = [encode(q, add_special_tokens=True) + encode(d, add_special_tokens=False) for q, d in pairs]
        probs, outs = await self.label_probs(prompts, body, request, param, labels, softmax=True)
        return [row[1] for row in probs], outs


def _error_type(out: ScoreResponse) -> str:
    """OpenAI's error `type` for an engine's failure."""
    if out.error_reason == "unmeetable":  # its own time exceeds its objective, however idle the machine
        return "objective_unmeetable"
    if out.error_status == 429:  # refused at once (predicted to miss), or after its deadline passed
        return "deadline_unreachable" if out.retry_after_s is not None else "deadline_exceeded"
    if out.error_status == 503:
        return "service_unavailable"
    return "server_error" if out.error_status >= 500 else "invalid_request_error"


def usage(outs: list[ScoreResponse]) -> dict[str, Any]:
    """OpenAI's `usage`, with our `tiered` split of where the prompt tokens came from."""
    prompt_tokens = sum(o.num_tokens for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(outs),
        "total_tokens": prompt_tokens + len(outs),
        "prompt_tokens_details": {"cached_tokens": sum(cached_tokens(o) for o in outs)},
        "tiered": {  # our extension: where the cached tokens came from
            "device_hit_tokens": sum(o.num_device_hit_tokens for o in outs),
            "host_hit_tokens": sum(o.num_host_hit_tokens for o in outs),
            "remote_hit_tokens": sum(o.num_remote_hit_tokens for o in outs),  # a shared remote tier's
            "disk_hit_tokens": sum(o.num_disk_hit_tokens for o in outs),  # the host tier's local disk
            # not cached, but computed once for several prompts of the batch (a shared profile)
            "batch_shared_tokens": sum(o.num_shared_tokens for o in outs),
            # seconds of the forwards that computed these prompts: host-tier loads, what host-tier
            # stores cost them, and the forwards themselves
            "load_seconds": max((o.load_seconds for o in outs), default=0.0),
            "store_seconds": max((o.store_seconds for o in outs), default=0.0),
            "compute_seconds": max((o.compute_seconds for o in outs), default=0.0),
            # forwards the prompts' new tokens took (more than one each: a prefill that yielded)
            "num_pieces": sum(o.num_pieces for o in outs),
            # every prompt answered by its deadline (null: no latency objective)
            "deadline_met": None
            if all(o.deadline_met is None for o in outs)
            else all(o.deadline_met is not False for o in outs),
        },
    }
