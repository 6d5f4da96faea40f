"""The API process: FastAPI + uvicorn in front of the engine process (ZMQ + msgpack).

Tokenization and validation happen here; the engine process only sees token ids. Errors use
OpenAI's envelope {"error": {"message", "type", "param", "code"}}; bad input is a 400, never a
500, and never reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import time
import uuid
from collections.abc import Awaitable, Callable
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
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from tiered import __version__
from tiered.api.engine_process import serve_engine
from tiered.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tiered.api.metrics import Metrics
from tiered.api.protocol import (
    AdapterCommand,
    AdapterReply,
    Cancel,
    EngineStats,
    Ready,
    ScoreRequest,
    ScoreResponse,
    decode,
    encode,
)
from tiered.config import Config
from tiered.embedded import resolve_model_path
from tiered.hybrid.loader import read_args
from tiered.hybrid.lora import AdapterError, read_adapter

log = logging.getLogger(__name__)
ENGINE_START_TIMEOUT_S = 900


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _error_body(status: int, message: str, type_: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class ClientGone(Exception):
    """The HTTP client disconnected while its requests waited."""


class EngineClient:
    """Runs the engine process (restarting it if it dies) and matches its responses to requests."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.requests = self.ctx.socket(zmq.PUSH)
        self.responses = self.ctx.socket(zmq.PULL)
        req_port = self.requests.bind_to_random_port("tcp://127.0.0.1")
        resp_port = self.responses.bind_to_random_port("tcp://127.0.0.1")
        self._addrs = (f"tcp://127.0.0.1:{req_port}", f"tcp://127.0.0.1:{resp_port}")
        self.process: multiprocessing.process.BaseProcess | None = None
        self.pending: dict[str, asyncio.Future[Any]] = {}  # ScoreResponse or AdapterReply
        self.adapters: dict[str, str] = dict(config.lora.modules)  # served LoRA adapters: name -> folder
        self._commands: dict[str, AdapterCommand] = {}  # adapter commands sent, by id, until answered
        self.ready: Ready | None = None
        self.stats: EngineStats | None = None  # the engine's statistics as it last reported them
        self.restarts = 0
        self.cancelled = 0
        self.timed_out = 0
        self._ready_event = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False

    def _spawn(self) -> None:
        self.ready = None
        self._ready_event.clear()
        # A restarted engine serves the adapters loaded at runtime too (those still readable).
        if self.restarts:
            self._drop_unreadable_adapters()
        config = replace(self.config, lora=replace(self.config.lora, modules=dict(self.adapters)))
        self.process = multiprocessing.get_context("spawn").Process(
            target=serve_engine, args=(config, *self._addrs), name="tiered-engine", daemon=True
        )
        self.process.start()

    async def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not self._ready_event.is_set():
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not become ready in time")
            try:
                await asyncio.wait_for(self._ready_event.wait(), 0.5)
            except TimeoutError:
                pass

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read())
        self._spawn()
        await self._wait_ready()
        self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """A dead engine process fails its waiting requests with 503, then is replaced."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            if self.process is None or self.process.is_alive():
                continue
            log.error("the engine process exited (code %s)", self.process.exitcode)
            self.ready = None
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(APIError(503, "the engine process exited", type_="service_unavailable"))
            self.pending.clear()
            if not self.config.server.restart_engine:
                return
            self.restarts += 1
            log.warning("starting a new engine process (restart %d)", self.restarts)
            try:
                self._spawn()
                await self._wait_ready()
                log.info("the engine process serves again")
            except RuntimeError as exc:
                log.error("the new engine process did not start (%s); not serving", exc)
                return

    def _drop_unreadable_adapters(self) -> None:
        """Adapters whose folder fails its check now would stop the new engine from starting."""
        args = read_args(self.config.model.path)
        for name, path in list(self.adapters.items()):
            try:
                read_adapter(name, path, args, self.config.lora.max_lora_rank)
            except AdapterError as exc:
                log.error("not serving adapter '%s' after the restart: %s", name, exc)
                del self.adapters[name]

    async def _read(self) -> None:
        while True:
            message = decode(await self.responses.recv())
            if isinstance(message, Ready):
                self.ready = message
                self._ready_event.set()
                continue
            if isinstance(message, EngineStats):
                self.stats = message
                continue
            if isinstance(message, AdapterReply):  # the engine's state, even if the caller gave up waiting
                command = self._commands.pop(message.request_id, None)
                if command is not None and message.error is None:
                    if command.path is None:
                        self.adapters.pop(command.name, None)
                    else:
                        self.adapters[command.name] = command.path
            future = self.pending.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)

    @property
    def alive(self) -> bool:
        return self.ready is not None and self.process is not None and self.process.is_alive()

    async def run(
        self, reqs: list[ScoreRequest], disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> list[ScoreResponse]:
        """Send requests together and wait for all their answers.

        Past `server.request_timeout_s` (504) or when the client disconnects, the requests that
        have no answer yet are cancelled in the engine (they leave its queue; one already
        computing finishes and its answer is dropped)."""
        loop = asyncio.get_running_loop()
        futures = []
        for r in reqs:
            future: asyncio.Future[ScoreResponse] = loop.create_future()
            self.pending[r.request_id] = future
            futures.append(future)
        gathered = asyncio.gather(*futures)
        try:
            for r in reqs:
                await self.requests.send(encode(r))
            timeout = self.config.server.request_timeout_s
            deadline = time.monotonic() + timeout if timeout else math.inf
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=min(0.25, max(0.0, deadline - time.monotonic())))
                if done:
                    return list(gathered.result())
                if disconnected is not None and await disconnected():
                    self.cancelled += len(reqs)
                    raise ClientGone
                if time.monotonic() >= deadline:
                    self.timed_out += len(reqs)
                    raise APIError(504, f"the request did not finish within server.request_timeout_s={timeout:g} s; "
                                   "it was cancelled", type_="timeout")  # fmt: skip
        except BaseException:
            gathered.cancel()
            if gathered.done() and not gathered.cancelled():
                gathered.exception()  # retrieved: an engine death already answered them
            for r in reqs:
                if self.pending.pop(r.request_id, None) is not None and self.alive:
                    await self.requests.send(encode(Cancel(r.request_id)))
            raise

    async def adapter(self, name: str, path: str | None) -> AdapterReply:
        """Load (`path`) or unload (None) a LoRA adapter in the engine; its reply."""
        command = AdapterCommand(uuid.uuid4().hex, name, path)
        future: asyncio.Future[AdapterReply] = asyncio.get_running_loop().create_future()
        self.pending[command.request_id] = future
        self._commands[command.request_id] = command
        try:
            await self.requests.send(encode(command))
            return await asyncio.wait_for(future, 60)
        except TimeoutError:
            raise APIError(504, f"the engine did not answer the adapter command for '{name}' in 60 s",
                           type_="timeout") from None  # fmt: skip
        finally:
            self.pending.pop(command.request_id, None)

    def full(self, incoming: int) -> bool:
        return len(self.pending) + incoming > self.config.scheduler.max_waiting

    def stop(self) -> None:
        self._stopping = True
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        if self.process is not None and self.process.is_alive():
            self.process.terminate()  # SIGTERM: the engine closes its tiers and exits
            self.process.join(30)
            if self.process.is_alive():
                log.warning("the engine process did not stop in 30 s; killing it")
                self.process.kill()
                self.process.join(5)
        self.ctx.destroy(linger=0)


class EngineFields(BaseModel):
    """Fields every route takes. Fields of other engines are accepted and ignored (extra=allow);
    types are strict (a token id given as the string "5" is a 400, as the schema says)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    priority: int = 0  # vLLM's: lower runs first (always honoured here)
    cache_salt: str | None = None  # vLLM's: cached KV is shared only with the same salt


class ChoiceFields(EngineFields):
    """How the one output token is chosen (vLLM's and OpenAI's fields)."""

    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    logprob_token_ids: list[int] | None = None  # vLLM's: return exactly these ids' logprobs


class CompletionRequest(ChoiceFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 1
    logprobs: int | None = None
    stream: bool | None = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a text prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


class ScoreBody(EngineFields):
    """vLLM's /generative_scoring and SGLang's /v1/score take the same fields."""

    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False


class LoadLoraRequest(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: str


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


class ChatRequest(ChoiceFields):
    messages: list[dict[str, Any]]
    stream: bool | None = False
    add_special_tokens: bool = False  # vLLM's: the chat template writes its own BOS
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# For a tokenizer without a chat template: role-tagged turns, then the assistant's turn opens.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class _Guard:
    """Pure ASGI middleware (cheaper than BaseHTTPMiddleware, and leaves disconnects visible):
    the API key on every route but the open ones (401), the body size limit (413), and the
    client's X-Request-Id echoed on the response (as vLLM does)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, open_paths: tuple[str, ...]) -> None:
        self.app, self.api_key, self.max_body, self.open_paths = app, api_key, max_body_bytes, open_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id")
        if request_id is not None:
            inner_send = send

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
                await inner_send(message)

        if self.api_key and scope["path"] not in self.open_paths:
            if headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode():
                return await _reply(send, 401, "Incorrect API key provided.", "invalid_request_error")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _reply(send, 413, f"the request body is over server.max_body_bytes={self.max_body}",
                                "invalid_request_error")  # fmt: skip
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:  # a chunked body without content-length
                raise APIError(413, f"the request body is over server.max_body_bytes={self.max_body}")
            return message

        return await self.app(scope, counted, send)


async def _reply(send: Any, status: int, message: str, type_: str) -> None:
    body = json.dumps(_error_body(status, message, type_, None)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})  # fmt: skip


def _refuse_stream(stream: bool | None) -> None:
    """Streaming is refused, not faked: an answer is one token, computed in one forward."""
    if stream:
        raise APIError(400, "stream=true is not supported: this engine serves prefill-only requests, whose one "
                       "output token comes in one response; send stream=false", "stream")  # fmt: skip


def _response_id(prefix: str, request: Request) -> str:
    """The response's id: the client's X-Request-Id when it sent one (as vLLM does), else a fresh one."""
    return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"


def build_app(
    config: Config, api_key: str | None = None, served_model_name: str | None = None, chat_template: str | None = None
) -> FastAPI:
    folder = resolve_model_path(config.model.path, config.model.models_dir)
    config = replace(config, model=replace(config.model, path=str(folder)))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model_name = served_model_name or Path(folder).name
    client = EngineClient(config)
    counters = lambda: {"waiting": len(client.pending), "timed_out": client.timed_out,  # noqa: E731
                        "cancelled": client.cancelled, "restarts": client.restarts}  # fmt: skip
    metrics = Metrics(config.model.max_model_len, counters, lambda: client.stats)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif tokenizer.chat_template is None:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        await client.start()
        log.info("serving %s (max_model_len %d)", model_name, client.ready.max_model_len if client.ready else 0)
        yield
        log.info("shutting down: stopping the engine process")
        client.stop()

    app = FastAPI(title="tiered", lifespan=lifespan)
    open_paths = ("/health",) if config.server.metrics_require_key else ("/health", "/metrics")
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=config.server.max_body_bytes, open_paths=open_paths)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(_error_body(exc.status, exc.message, exc.type, exc.param), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown route (404), wrong method (405), a body that is not JSON (400): OpenAI's envelope too.
        body = _error_body(exc.status_code, str(exc.detail), "invalid_request_error", None)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def gone(_: Request, exc: ClientGone) -> JSONResponse:
        return JSONResponse(_error_body(499, "the client disconnected", "cancelled", None), status_code=499)

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

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": "ok" if client.alive else "unavailable"}, status_code=200 if client.alive else 503
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The base model, then each LoRA adapter (vLLM's cards: `root` its folder, `parent` the base)."""
        max_len = client.ready.max_model_len if client.ready else config.model.max_model_len
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tiered", "root": str(folder),
                "parent": None, "max_model_len": max_len}  # fmt: skip
        adapters = [{**card, "id": name, "root": path, "parent": model_name} for name, path in client.adapters.items()]
        return {"object": "list", "data": [card, *adapters]}

    def _adapter(model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for anything else."""
        if model is None or model == model_name:
            return None
        if model in client.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    if config.lora.enabled and (config.lora.allow_runtime_updates or _env_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING")):
        log.warning("runtime LoRA updates are allowed: /v1/load_lora_adapter and /v1/unload_lora_adapter are open")

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoraRequest) -> Response:
            if not body.lora_name or not body.lora_path:
                raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
            if body.lora_name == model_name:
                raise APIError(400, f"'{body.lora_name}' is the base model's name", "lora_name")
            _serving()
            reply = await client.adapter(body.lora_name, body.lora_path)
            if reply.error is not None:
                type_ = "NotFoundError" if reply.error_status == 404 else "invalid_request_error"
                raise APIError(reply.error_status, reply.error, "lora_path", type_)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
            if not body.lora_name:
                raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
            _serving()
            reply = await client.adapter(body.lora_name, None)
            if reply.error is not None:
                raise APIError(reply.error_status, reply.error, "lora_name", "NotFoundError")
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    def _prompts(prompt: str | list[str] | list[int] | list[list[int]], special: bool = True) -> list[list[int]]:
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt, add_special_tokens=special)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return [
            tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
            for p in prompt
        ]

    def _render(messages: list[dict[str, Any]], special: bool, generation_prompt: bool = True) -> list[int]:
        """Chat messages through the chat template, tokenized; a malformed message is the client's 400."""
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            return list(tokenizer.encode(text, add_special_tokens=special))
        except Exception as exc:  # noqa: BLE001 - a malformed message is the client's error
            raise APIError(400, f"messages could not be rendered: {exc}", "messages") from None

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's shape: count, max_model_len, tokens (and token_strs when asked)."""
        _adapter(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            ids = _render(body.messages, bool(body.add_special_tokens), body.add_generation_prompt)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = _prompts(body.prompt, special)[0] if body.prompt else []
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        max_len = client.ready.max_model_len if client.ready else config.model.max_model_len
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        _adapter(body.model)
        vocab = client.ready.vocab_size if client.ready else len(tokenizer)
        for t in body.tokens:
            if not 0 <= t < vocab:
                raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab}) (in tokens)", "tokens")
        return {"prompt": str(tokenizer.decode(body.tokens))}

    def _check_ids(ids: list[int], param: str) -> None:
        assert client.ready is not None
        vocab = client.ready.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise APIError(400, f"token id {t} is outside the vocabulary [0, {vocab}) (in {param})", param)

    def _check_prompt(ids: list[int], param: str) -> None:
        """The API's admission check: nothing too long or out of vocabulary reaches the engine.

        max_model_len is the measured limit when engine.memory_budget_bytes is set (the engine's
        start-up profile run proves a max_model_len forward fits, or refuses to start)."""
        assert client.ready is not None
        limit = client.ready.max_model_len
        if not ids:
            raise APIError(400, f"{param} must contain at least one token", param)
        if len(ids) > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested {len(ids)} "
                f"tokens in the prompt. Please reduce the length of the prompt.",
                param,
            )
        _check_ids(ids, param)

    def _serving() -> None:
        if not client.alive:
            raise APIError(503, "the engine is not serving (starting or restarting); retry shortly",
                           type_="service_unavailable")  # fmt: skip

    def _requests(
        prompts: list[list[int]], body: EngineFields, param: str, wanted: list[int], top: int = 0
    ) -> list[ScoreRequest]:
        """Validate the prompts and the choice fields; one engine request per prompt."""
        adapter = _adapter(body.model)  # an unknown model is a 404 before anything else, as in vLLM
        if body.cache_salt is not None and not body.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string when given", "cache_salt")
        allowed: list[int] = []
        bias: list[tuple[int, float]] = []
        if isinstance(body, ChoiceFields):
            if body.allowed_token_ids is not None:
                if not body.allowed_token_ids:
                    raise APIError(400, "allowed_token_ids must not be empty when given", "allowed_token_ids")
                allowed = list(body.allowed_token_ids)
                _check_ids(allowed, "allowed_token_ids")
            for key, value in (body.logit_bias or {}).items():
                if not key.lstrip("-").isdigit():
                    raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
                if not -100 <= value <= 100 or math.isnan(value):
                    raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
                bias.append((int(key), value))
            _check_ids([t for t, _ in bias], "logit_bias")
        _check_ids(wanted, "logprob_token_ids" if isinstance(body, ChoiceFields) else "label_token_ids")
        for ids in prompts:
            _check_prompt(ids, param)
        return [
            ScoreRequest(uuid.uuid4().hex, ids, wanted, top, allowed, bias, body.priority, body.cache_salt, adapter)
            for ids in prompts
        ]

    async def _run(reqs: list[ScoreRequest], request: Request, param: str) -> list[ScoreResponse]:
        """Send requests together (the scheduler sees them all); refuse them all if the queue is full."""
        if client.full(len(reqs)):
            raise APIError(429, f"the queue is full ({config.scheduler.max_waiting} requests); retry later",
                           type_="rate_limit_exceeded")  # fmt: skip
        start = time.monotonic()
        outs = await client.run(reqs, request.is_disconnected)
        label = reqs[0].lora_name or model_name  # the base model or the adapter (metrics' model_name)
        for out in outs:
            if out.error is None:
                metrics.observe(label, out, time.monotonic() - start)
            elif out.error_status >= 500:
                metrics.failed.labels(label).inc()
        for out in outs:
            if out.error:
                type_ = "server_error" if out.error_status >= 500 else "invalid_request_error"
                raise APIError(out.error_status, out.error, param if out.error_status < 500 else None, type_)
        return outs

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> dict[str, Any]:
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is not None and limit != 1:
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"{param} must be 1: this engine serves prefill-only requests (got {limit})", param)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be between 0 and 20 (got {body.top_logprobs})", "top_logprobs")
        _refuse_stream(body.stream)
        ids = _render(body.messages, body.add_special_tokens)
        _serving()
        top = max(1, body.top_logprobs or 0) if body.logprobs else 0
        (out,) = await _run(_requests([ids], body, "messages", list(body.logprob_token_ids or []), top), request,
                            "messages")  # fmt: skip
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
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": logprobs, "finish_reason": "length"}  # fmt: skip
        if body.logprob_token_ids:
            choice["logprob_token_ids"] = {str(t): lp for t, lp in out.logprobs}
        return {"id": _response_id("chatcmpl", request), "object": "chat.completion", "created": int(time.time()),
                "model": body.model or model_name, "choices": [choice], "usage": _usage([out])}  # fmt: skip

    async def _score_items(body: ScoreBody, request: Request) -> tuple[list[list[float]], list[ScoreResponse]]:
        """One prefill-only request per item, all sent together: the query is their shared prefix."""
        _serving()
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
        outs = await _run(_requests(prompts, body, "items", list(body.label_token_ids)), request, "items")
        scores = []
        for out in outs:
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
                # not cached, but computed once for several prompts of the batch (a shared profile)
                "batch_shared_tokens": sum(o.num_shared_tokens for o in outs),
                # seconds of the forwards that computed these prompts: host-tier loads, what
                # host-tier stores cost them, and the forwards themselves
                "load_seconds": max((o.load_seconds for o in outs), default=0.0),
                "store_seconds": max((o.store_seconds for o in outs), default=0.0),
                "compute_seconds": max((o.compute_seconds for o in outs), default=0.0),
            },
        }

    @app.post("/generative_scoring")
    @app.post("/v1/generative-scores")
    async def generative_scoring(body: ScoreBody, request: Request) -> dict[str, Any]:
        """vLLM's shape: results[i].token_probs maps each label id (a string) to its probability."""
        scores, outs = await _score_items(body, request)
        results = [
            {"index": i, "token_probs": {str(t): p for t, p in zip(body.label_token_ids, row, strict=True)}}
            for i, row in enumerate(scores)
        ]
        return {"id": _response_id("genscore", request), "object": "generative_score", "created": int(time.time()),
                "model": body.model or model_name, "results": results, "usage": _usage(outs)}  # fmt: skip

    @app.post("/v1/score")
    async def sglang_score(body: ScoreBody, request: Request) -> dict[str, Any]:
        """SGLang's shape: scores[i] lists the label probabilities of item i, in label order."""
        scores, outs = await _score_items(body, request)
        model = body.model or model_name
        return {"object": "scoring", "model": model, "scores": scores, "usage": _usage(outs)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any]:
        if body.max_tokens is not None and body.max_tokens != 1:
            message = f"max_tokens must be 1: this engine serves prefill-only requests (got {body.max_tokens})"
            raise APIError(400, message, "max_tokens")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, f"logprobs must be between 0 and 20 (got {body.logprobs})", "logprobs")
        _refuse_stream(body.stream)
        _serving()
        wanted = list(body.logprob_token_ids or [])
        top = 0 if body.logprobs is None else max(1, body.logprobs)  # the chosen token is the top-1
        outs = await _run(_requests(_prompts(body.prompt, body.add_special_tokens), body, "prompt", wanted, top),
                          request, "prompt")  # fmt: skip
        choices = []
        for i, out in enumerate(outs):
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
            "id": _response_id("cmpl", request),
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or model_name,
            "choices": choices,
            "usage": _usage(list(outs)),
        }

    return app
