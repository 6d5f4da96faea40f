"""Scoring: N items against one query, one call; vLLM's shape and SGLang's."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from tiered.api.routes import ServingDep
from tiered.api.schemas import ScoreBody
from tiered.api.serving import response_id, usage

router = APIRouter()


@router.post("/generative_scoring")
@router.post("/v1/generative-scores")
async def generative_scoring(body: ScoreBody, request: Request, s: ServingDep) -> dict[str, Any]:
    """vLLM's shape: results[i].token_probs maps each label id (a string) to its probability."""
    scores, outs = await s.score_items(body, request)
    results = [
        {"index": i, "token_probs": {str(t): p for t, p in zip(body.label_token_ids, row, strict=True)}}
        for i, row in enumerate(scores)
    ]
    return {
        "id": response_id("genscore", request),
        "object": "generative_score",
        "created": int(time.time()),
        "model": s.model_id(body.model),
        "results": results,
        "usage": usage(outs),
    }


@router.post("/v1/score")
async def sglang_score(body: ScoreBody, request: Request, s: ServingDep) -> dict[str, Any]:
    """SGLang's shape: scores[i] lists the label probabilities of item i, in label order."""
    scores, outs = await s.score_items(body, request)
    return {"object": "scoring", "model": s.model_id(body.model), "scores": scores, "usage": usage(outs)}
