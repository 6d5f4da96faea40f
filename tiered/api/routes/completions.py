"""OpenAI's completions and chat completions, prefill-only: `max_tokens` must be 1."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from tiered.api.errors import APIError
from tiered.api.logprobs import chat_logprobs, completion_logprobs
from tiered.api.routes import ServingDep
from tiered.api.schemas import ChatRequest, CompletionRequest
from tiered.api.serving import refuse_stream, response_id, usage

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, s: ServingDep) -> dict[str, Any]:
    """OpenAI's POST /v1/completions: one choice per prompt, its one token (max_tokens must be 1), logprobs."""
    if body.max_tokens is not None and body.max_tokens != 1:
        message = f"max_tokens must be 1: this engine serves prefill-only requests (got {body.max_tokens})"
        raise APIError(400, message, "max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise APIError(400, f"logprobs must be between 0 and 20 (got {body.logprobs})", "logprobs")
    refuse_stream(body.stream)
    s.check_serving()
    wanted = list(body.logprob_token_ids or [])
    top = 0 if body.logprobs is None else max(1, body.logprobs)  # the chosen token is the top-1
    reqs = s.requests(s.prompts(body.prompt, body.add_special_tokens), body, "prompt", wanted, top)
    outs = await s.run(reqs, request, "prompt")
    as_ids = s.as_token_ids(body.return_tokens_as_token_ids)
    choices = []
    for i, out in enumerate(outs):
        text = s.tokenizer.decode([out.token_id])
        choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": "length", "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = completion_logprobs(s.token_texts, out, body.logprobs, as_ids)
        if wanted:
            choice["logprob_token_ids"] = {str(t): lp for t, lp in out.logprobs}
        choices.append(choice)
    return {
        "id": response_id("cmpl", request),
        "object": "text_completion",
        "created": int(time.time()),
        "model": s.model_id(body.model),
        "choices": choices,
        "usage": usage(list(outs)),
    }


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request, s: ServingDep) -> dict[str, Any]:
    """OpenAI's POST /v1/chat/completions: the messages through the chat template, answered with one token."""
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if limit is not None and limit != 1:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{param} must be 1: this engine serves prefill-only requests (got {limit})", param)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be between 0 and 20 (got {body.top_logprobs})", "top_logprobs")
    refuse_stream(body.stream)
    ids = s.render(body.messages, body.add_special_tokens)
    s.check_serving()
    top = max(1, body.top_logprobs or 0) if body.logprobs else 0
    reqs = s.requests([ids], body, "messages", list(body.logprob_token_ids or []), top)
    (out,) = await s.run(reqs, request, "messages")
    text = s.tokenizer.decode([out.token_id])
    logprobs = None
    if body.logprobs:
        as_ids = s.as_token_ids(body.return_tokens_as_token_ids)
        logprobs = chat_logprobs(s.token_texts, out, body.top_logprobs or 0, as_ids)
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": "length",
    }
    if body.logprob_token_ids:
        choice["logprob_token_ids"] = {str(t): lp for t, lp in out.logprobs}
    return {
        "id": response_id("chatcmpl", request),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": s.model_id(body.model),
        "choices": [choice],
        "usage": usage([out]),
    }
