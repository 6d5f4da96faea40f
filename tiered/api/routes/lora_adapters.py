"""vLLM's runtime LoRA routes, mounted only when runtime updates are allowed (as in vLLM)."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import Response

from tiered.api.errors import APIError
from tiered.api.routes import ServingDep
from tiered.api.schemas import LoadLoraRequest, UnloadLoraRequest
from tiered.config import Config

router = APIRouter()


def allowed(config: Config) -> bool:
    """lora.allow_runtime_updates, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING in the environment."""
    flag = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")
    return config.lora.enabled and (config.lora.allow_runtime_updates or flag)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, s: ServingDep) -> Response:
    """vLLM's POST /v1/load_lora_adapter: load the adapter at `lora_path` in the engine as `lora_name`."""
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if body.lora_name in s.base_names:
        raise APIError(400, f"'{body.lora_name}' is the base model's name", "lora_name")
    s.check_serving()
    reply = await s.client.adapter(body.lora_name, body.lora_path)
    if reply.error is not None:
        type_ = "NotFoundError" if reply.error_status == 404 else "invalid_request_error"
        raise APIError(reply.error_status, reply.error, "lora_path", type_)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, s: ServingDep) -> Response:
    """vLLM's POST /v1/unload_lora_adapter: remove the adapter `lora_name` from the engine."""
    if not body.lora_name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    s.check_serving()
    reply = await s.client.adapter(body.lora_name, None)
    if reply.error is not None:
        raise APIError(reply.error_status, reply.error, "lora_name", "NotFoundError")
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
