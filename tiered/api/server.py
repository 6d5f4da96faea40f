"""The API process: FastAPI + uvicorn in front of the engine process (ZMQ + msgpack).

Tokenization and validation happen here; the engine process only sees token ids. Errors use
OpenAI's envelope {"error": {"message", "type", "param", "code"}}; bad input is a 400, never a
500, and never reaches the engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from transformers import AutoTokenizer

from tiered.api.engine_process import serve_engine
from tiered.api.protocol import Ready, ScoreRequest, ScoreResponse, decode, encode
from tiered.config import Config
from tiered.embedded import resolve_model_path

log = logging.getLogger(__name__)
ENGINE_START_TIMEOUT_S = 900


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _error_body(status: int, message: str, type_: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class EngineClient:
    """Starts the engine process and matches its responses to waiting requests."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.requests = self.ctx.socket(zmq.PUSH)
        self.responses = self.ctx.socket(zmq.PULL)
        req_port = self.requests.bind_to_random_port("tcp://127.0.0.1")
        resp_port = self.responses.bind_to_random_port("tcp://127.0.0.1")
        self.process = multiprocessing.get_context("spawn").Process(
            target=serve_engine,
            args=(config, f"tcp://127.0.0.1:{req_port}", f"tcp://127.0.0.1:{resp_port}"),
            name="tiered-engine",
            daemon=True,
        )
        self.pending: dict[str, asyncio.Future[ScoreResponse]] = {}
        self.ready: Ready | None = None
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process.start()
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while self.ready is None:
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})")
            if await self.responses.poll(1000):
                message = decode(await self.responses.recv())
                if isinstance(message, Ready):
                    self.ready = message
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not become ready in time")
        self._reader = asyncio.create_task(self._read())
        self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """If the engine process dies, every waiting request gets a 503 instead of waiting forever."""
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        log.error("the engine process exited (code %s)", self.process.exitcode)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(APIError(503, "the engine process exited", type_="service_unavailable"))
        self.pending.clear()

    async def _read(self) -> None:
        while True:
            message = decode(await self.responses.recv())
            future = self.pending.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)

    @property
    def alive(self) -> bool:
        return self.ready is not None and self.process.is_alive()

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        future: asyncio.Future[ScoreResponse] = asyncio.get_running_loop().create_future()
        self.pending[req.request_id] = future
        await self.requests.send(encode(req))
        return await future

    def full(self, incoming: int) -> bool:
        return len(self.pending) + incoming > self.config.scheduler.max_waiting

    def stop(self) -> None:
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        self.ctx.destroy(linger=0)


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of other engines are accepted and ignored

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 1
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None


class ScoreBody(BaseModel):
    """vLLM's /generative_scoring and SGLang's /v1/score take the same fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# For a tokenizer without a chat template: role-tagged turns, then the assistant's turn opens.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Metrics:
    """Prometheus counters, named after vLLM's under a `tiered:` prefix."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.device_hit_tokens = 0
        self.host_hit_tokens = 0
        self.queue_seconds = 0.0
        self.e2e_seconds = 0.0
        self.jct_error: float | None = None

    def observe(self, out: ScoreResponse, e2e_seconds: float) -> None:
        self.requests += 1
        self.prompt_tokens += out.num_tokens
        self.device_hit_tokens += out.num_device_hit_tokens
        self.host_hit_tokens += out.num_host_hit_tokens
        self.cached_tokens += out.num_device_hit_tokens + out.num_host_hit_tokens
        self.queue_seconds += out.queued_seconds
        self.e2e_seconds += e2e_seconds
        if out.jct_error is not None:
            self.jct_error = out.jct_error

    def render(self, waiting: int) -> str:
        rows = [
            ("prefix_cache_queries", "counter", "Prompt tokens looked up in the KV tiers.", self.prompt_tokens),
            ("prefix_cache_hits", "counter", "Prompt tokens found in the KV tiers.", self.cached_tokens),
            ("device_hit_tokens", "counter", "Prompt tokens found in the device tier.", self.device_hit_tokens),
            ("host_hit_tokens", "counter", "Prompt tokens loaded from the host tier.", self.host_hit_tokens),
            ("request_success", "counter", "Requests answered.", self.requests),
            ("num_requests_waiting", "gauge", "Requests sent to the engine and not answered yet.", waiting),
            ("jct_prediction_error", "gauge", "Mean absolute percentage error of the JCT model (fraction).",
             self.jct_error if self.jct_error is not None else float("nan")),
        ]  # fmt: skip
        lines = []
        for name, kind, doc, value in rows:
            lines += [f"# HELP tiered:{name} {doc}", f"# TYPE tiered:{name} {kind}", f"tiered:{name} {value}"]
        for name, doc, total in (
            ("request_queue_time_seconds", "Time in the engine's queue.", self.queue_seconds),
            ("e2e_request_latency_seconds", "Time from the API receiving a request to its answer.", self.e2e_seconds),
        ):
            lines += [f"# HELP tiered:{name} {doc}", f"# TYPE tiered:{name} summary",
                      f"tiered:{name}_sum {total}", f"tiered:{name}_count {self.requests}"]  # fmt: skip
        return "\n".join(lines) + "\n"


def build_app(config: Config, api_key: str | None = None, served_model_name: str | None = None) -> FastAPI:
    folder = resolve_model_path(config.model.path, config.model.models_dir)
    config = replace(config, model=replace(config.model, path=str(folder)))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model_name = served_model_name or Path(folder).name
    client = EngineClient(config)
    metrics = Metrics()
    if tokenizer.chat_template is None:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        await client.start()
        log.info("serving %s (max_model_len %d)", model_name, client.ready.max_model_len if client.ready else 0)
        yield
        client.stop()

    app = FastAPI(title="tiered", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(_error_body(exc.status, exc.message, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        body = _error_body(500, f"internal error: {type(exc).__name__}", "internal_server_error", None)
        return JSONResponse(body, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = loc[0] if loc else None  # the request field; deeper parts name union members
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(_error_body(400, message, "invalid_request_error", param), status_code=400)

    @app.middleware("http")
    async def auth(request: Request, call_next):  # noqa: ANN001, ANN202
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization") != f"Bearer {api_key}":
                body = _error_body(401, "Incorrect API key provided.", "invalid_request_error", None)
                return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": "ok" if client.alive else "unavailable"}, status_code=200 if client.alive else 503
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = client.ready.max_model_len if client.ready else config.model.max_model_len
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tiered", "max_model_len": max_len}
        return {"object": "list", "data": [card]}

    def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]

    def _check(ids: list[int], logprob_ids: list[int]) -> None:
        assert client.ready is not None
        limit, vocab = client.ready.max_model_len, client.ready.vocab_size
        if not ids:
            raise APIError(400, "prompt must contain at least one token", "prompt")
        if len(ids) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested {len(ids)} "
                f"tokens in the prompt. Please reduce the length of the prompt.",
                "prompt",
            )
        for t in (*ids, *logprob_ids):
            if not 0 <= t < vocab:
                raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab})", "prompt")

    async def _run(reqs: list[ScoreRequest]) -> list[ScoreResponse]:
        """Send requests together (the scheduler sees them all); refuse them all if the queue is full."""
        if client.full(len(reqs)):
            raise APIError(429, f"the queue is full ({config.scheduler.max_waiting} requests); retry later",
                           type_="rate_limit_exceeded")  # fmt: skip
        start = time.monotonic()
        outs = list(await asyncio.gather(*(client.score(r) for r in reqs)))
        for out in outs:
            if out.error is None:
                metrics.observe(out, time.monotonic() - start)
        return outs

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(len(client.pending)), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> dict[str, Any]:
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is not None and limit != 1:
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"{param} must be 1: this engine serves prefill-only requests (got {limit})", param)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be between 0 and 20 (got {body.top_logprobs})", "top_logprobs")
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        if not client.alive:
            raise APIError(503, "the engine is not serving", type_="service_unavailable")
        try:
            text = tokenizer.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes its own BOS
        except Exception as exc:  # noqa: BLE001 - a malformed message is the client's error
            raise APIError(400, f"messages could not be rendered: {exc}", "messages") from None
        _check(ids, [])
        top = max(1, body.top_logprobs or 0) if body.logprobs else 0
        (out,) = await _run([ScoreRequest(uuid.uuid4().hex, ids, [], top)])
        if out.error:
            raise APIError(400, out.error, "messages")
        text = tokenizer.decode([out.token_id])
        logprobs = None
        if body.logprobs:

            def entry(t: int, lp: float) -> dict[str, Any]:
                tok = str(tokenizer.decode([t]))
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

            chosen = dict(out.top_logprobs).get(out.token_id)
            first = entry(out.token_id, chosen if chosen is not None else float("nan"))
            first["top_logprobs"] = [entry(t, lp) for t, lp in out.top_logprobs[: body.top_logprobs or 0]]
            logprobs = {"content": [first]}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": "length"}  # fmt: skip
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": _usage([out])}  # fmt: skip

    async def _score_items(body: ScoreBody) -> tuple[list[list[float]], list[ScoreResponse]]:
        """One prefill-only request per item, all sent together: the query is their shared prefix."""
        if not client.alive:
            raise APIError(503, "the engine is not serving", type_="service_unavailable")
        if not body.items:
            raise APIError(400, "items must not be empty", "items")
        if not body.label_token_ids:
            raise APIError(400, "label_token_ids must not be empty", "label_token_ids")

        def ids(part: str | list[int], first: bool) -> list[int]:
            return tokenizer.encode(part, add_special_tokens=first) if isinstance(part, str) else list(part)

        prompts = [
            ids(item, True) + ids(body.query, False) if body.item_first else ids(body.query, True) + ids(item, False)
            for item in body.items
        ]
        for p in prompts:
            _check(p, body.label_token_ids)
        reqs = [ScoreRequest(uuid.uuid4().hex, p, list(body.label_token_ids)) for p in prompts]
        outs = await _run(reqs)
        scores = []
        for out in outs:
            if out.error:
                raise APIError(400, out.error, "items")
            lps = dict(out.logprobs)
            values = [math.exp(lps[t]) for t in body.label_token_ids]
            if body.apply_softmax:  # over the label tokens only
                total = sum(values)
                values = [v / total for v in values]
            scores.append(values)
        return scores, list(outs)

    def _usage(outs: list[ScoreResponse]) -> dict[str, Any]:
        prompt_tokens = sum(o.num_tokens for o in outs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(outs),
            "total_tokens": prompt_tokens + len(outs),
            "prompt_tokens_details": {
                "cached_tokens": sum(o.num_device_hit_tokens + o.num_host_hit_tokens for o in outs)
            },
            "tiered": {  # our extension: where the cached tokens came from
                "device_hit_tokens": sum(o.num_device_hit_tokens for o in outs),
                "host_hit_tokens": sum(o.num_host_hit_tokens for o in outs),
            },
        }

    @app.post("/generative_scoring")
    @app.post("/v1/generative-scores")
    async def generative_scoring(body: ScoreBody) -> dict[str, Any]:
        """vLLM's shape: results[i].token_probs maps each label id (a string) to its probability."""
        scores, outs = await _score_items(body)
        results = [
            {"index": i, "token_probs": {str(t): p for t, p in zip(body.label_token_ids, row, strict=True)}}
            for i, row in enumerate(scores)
        ]
        return {"id": f"genscore-{uuid.uuid4().hex}", "object": "generative_score", "created": int(time.time()),
                "model": model_name, "results": results, "usage": _usage(outs)}  # fmt: skip

    @app.post("/v1/score")
    async def sglang_score(body: ScoreBody) -> dict[str, Any]:
        """SGLang's shape: scores[i] lists the label probabilities of item i, in label order."""
        scores, outs = await _score_items(body)
        return {"object": "scoring", "model": model_name, "scores": scores, "usage": _usage(outs)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        if body.max_tokens is not None and body.max_tokens != 1:
            message = f"max_tokens must be 1: this engine serves prefill-only requests (got {body.max_tokens})"
            raise APIError(400, message, "max_tokens")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, f"logprobs must be between 0 and 20 (got {body.logprobs})", "logprobs")
        if not client.alive:
            raise APIError(503, "the engine is not serving", type_="service_unavailable")
        prompts = _prompts(body.prompt)
        wanted = body.logprob_token_ids or []
        for ids in prompts:
            _check(ids, wanted)
        top = 0 if body.logprobs is None else max(1, body.logprobs)  # the chosen token is the top-1
        reqs = [ScoreRequest(uuid.uuid4().hex, ids, wanted, top) for ids in prompts]
        outs = await _run(reqs)
        choices = []
        for i, out in enumerate(outs):
            if out.error:
                raise APIError(400, out.error, "prompt")
            text = tokenizer.decode([out.token_id])
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": "length", "logprobs": None}
            if body.logprobs is not None:
                chosen = dict(out.top_logprobs).get(out.token_id)
                shown = out.top_logprobs[: body.logprobs]
                choice["logprobs"] = {
                    "tokens": [text],
                    "token_logprobs": [chosen],
                    "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in shown}],
                    "text_offset": [0],
                }
            if wanted:
                choice["logprob_token_ids"] = {str(t): lp for t, lp in out.logprobs}
            choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(list(outs)),
        }

    return app
