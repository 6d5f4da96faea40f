"""The API process's app factory: it only wires things together (vLLM's `build_app`).

Tokenizer, engine client, metrics and the serving layer are made here and put on
`app.state.serving`; the routes live in `routes/`, one module per family; errors are rendered by
`errors.install_handlers`; the API key (on /v1 routes), body limit and X-Request-Id by
`middleware.Guard`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from transformers import AutoTokenizer

from tiered import __version__
from tiered.api.engine_client import EngineClient, served_config
from tiered.api.errors import install_handlers
from tiered.api.metrics import Metrics
from tiered.api.middleware import Guard
from tiered.api.routes import completions, lora_adapters, metadata, scoring
from tiered.api.schemas import DEFAULT_CHAT_TEMPLATE
from tiered.api.serving import Client, Serving
from tiered.config import Config

log = logging.getLogger(__name__)


def build_app(
    config: Config,
    api_key: str | None = None,
    served_model_names: Sequence[str] | None = None,
    chat_template: str | None = None,
    return_tokens_as_token_ids: bool = False,
    client: Client | None = None,
) -> FastAPI:
    """The app for `config`. `client`: the engine's, made here (an `EngineClient` whose engine
    process starts with the app) unless given: `tiered serve` passes one whose engine process it
    started before importing this module; unit tests pass a fake one.

    `served_model_names`: the base model's ids, the first one reported (default: `model.path` as
    given, vLLM's rule; `tiered serve` passes the model argument before anything resolves it).
    The folder's name is accepted as an alias."""
    served = list(served_model_names or [config.model.path])
    config = served_config(config)
    folder = config.model.path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif tokenizer.chat_template is None:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    engine: Client = client if client is not None else EngineClient(config)

    def counters() -> dict[str, int]:
        c = {
            "waiting": len(engine.pending),
            "timed_out": engine.timed_out,
            "cancelled": engine.cancelled,
            "restarts": engine.restarts,
        }
        replicas = getattr(engine, "num_replicas", None)  # replicas on Ray Serve (tiered.cluster)
        if replicas is not None:
            c["replicas"] = replicas
        return c

    metrics = Metrics(config.model.max_model_len, counters, lambda: engine.stats)
    metrics.declare(served[0])  # the base model's series, as the serving layer labels them

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info("serving %s (max_model_len %d)", ", ".join(served), engine.ready.max_model_len if engine.ready else 0)
        yield
        log.info("shutting down: stopping the engine process")
        engine.stop()

    app = FastAPI(title="tiered", version=__version__, lifespan=lifespan)
    app.state.serving = Serving(
        config,
        tokenizer,
        engine,
        metrics,
        served,
        alias=Path(folder).name,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
    )
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=config.server.max_body_bytes,
        metrics_require_key=config.server.metrics_require_key,
    )
    install_handlers(app)
    for router in (metadata.router, completions.router, scoring.router):
        app.include_router(router)
    if lora_adapters.allowed(config):
        log.warning("runtime LoRA updates are allowed: /v1/load_lora_adapter and /v1/unload_lora_adapter are open")
        app.include_router(lora_adapters.router)
    return app
