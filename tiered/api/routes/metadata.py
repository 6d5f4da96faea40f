"""What a client asks about the server: health, models, version, metrics, and the tokenizer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from tiered import __version__
from tiered.api.errors import APIError
from tiered.api.metrics import CONTENT_TYPE
from tiered.api.routes import ServingDep
from tiered.api.schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.get("/health")
async def health(s: ServingDep) -> JSONResponse:
    """200 while the engine serves, 503 otherwise (starting, restarting, or gone)."""
    alive = s.client.alive
    return JSONResponse({"status": "ok" if alive else "unavailable"}, status_code=200 if alive else 503)


@router.get("/v1/models")
async def models(s: ServingDep) -> dict[str, Any]:
    """One card per served name of the base model, then one per LoRA adapter (vLLM's cards: `root`
    the folder, `parent` the first served name); the folder-name alias is accepted, not listed."""
    ready = s.client.ready
    precision = ready.precision if ready else {}
    card = {
        "id": s.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "tiered",
        "root": s.config.model.path,
        "parent": None,
        "max_model_len": s.max_model_len,
        # ours: the precision the engine resolved (model.dtype: auto picks it per machine)
        "dtype": precision.get("compute"),
        "kv_cache_dtype": precision.get("kv"),
        "checkpoint_dtype": precision.get("checkpoint"),
        "dtype_reason": precision.get("reason"),
    }
    bases = [{**card, "id": name} for name in s.served_names]
    adapters = [{**card, "id": name, "root": path, "parent": s.model_name} for name, path in s.client.adapters.items()]
    return {"object": "list", "data": [*bases, *adapters]}


@router.get("/version")
async def version() -> dict[str, str]:
    """The server's version (`tiered.__version__`)."""
    return {"version": __version__}


@router.get("/metrics")
async def metrics(s: ServingDep) -> Response:
    """The Prometheus metrics, in the text exposition format."""
    return Response(s.metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: ServingDep) -> dict[str, Any]:
    """vLLM's shape: count, max_model_len, tokens (and token_strs when asked)."""
    s.adapter(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", "prompt")
    if body.messages is not None:
        ids = s.render(body.messages, bool(body.add_special_tokens), body.add_generation_prompt)
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = s.prompts(body.prompt, special)[0] if body.prompt else []
    strs = s.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: ServingDep) -> dict[str, str]:
    """vLLM's POST /detokenize: token ids (checked against the vocabulary) back to text."""
    s.adapter(body.model)
    s.check_ids(body.tokens, "tokens")
    return {"prompt": str(s.tokenizer.decode(body.tokens))}
