"""Scoring: N items against one query, one call, in vLLM's and SGLang's shapes; reranking
(Jina's and Cohere's shape, as vLLM serves it) and vLLM's pair scores, each pair one prompt."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from tiered.api.errors import APIError
from tiered.api.routes import ServingDep
from tiered.api.schemas import PairScoreBody, RerankBody, ScoreBody
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
@router.post("/score")
async def score(body: ScoreBody | PairScoreBody, request: Request, s: ServingDep) -> dict[str, Any]:
    """Two shapes by their fields. SGLang's (`query`, `items`, `label_token_ids`): scores[i] lists
    the label probabilities of item i, in label order. vLLM's (`text_1`, `text_2`): data[i].score,
    the pair's relevance (`server.score_tokens`)."""
    if isinstance(body, ScoreBody):
        scores, outs = await s.score_items(body, request)
        return {"object": "scoring", "model": s.model_id(body.model), "scores": scores, "usage": usage(outs)}
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not firsts or not seconds:
        raise APIError(400, "text_1 and text_2 must not be empty", "text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)  # one against many
    if len(firsts) != len(seconds):
        raise APIError(
            400, f"text_1 ({len(firsts)}) and text_2 ({len(seconds)}) must be as long, or text_1 one text", "text_2"
        )
    values, outs = await s.score_pairs(list(zip(firsts, seconds, strict=True)), body, request, "text_2")
    return {
        "id": response_id("score", request),
        "object": "list",
        "created": int(time.time()),
        "model": s.model_id(body.model),
        "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
        "usage": usage(outs),
    }


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankBody, request: Request, s: ServingDep) -> dict[str, Any]:
    """Jina's and Cohere's shape: results sorted by relevance_score (highest first), the best
    `top_n`, each with its document's `index` (and the document unless return_documents is false)."""
    if not body.documents:
        raise APIError(400, "documents must not be empty", "documents")
    if body.top_n is not None and body.top_n < 0:
        raise APIError(400, f"top_n must be >= 0, got {body.top_n}", "top_n")
    texts = []
    for i, doc in enumerate(body.documents):
        text = doc if isinstance(doc, str) else doc.get("text") if isinstance(doc, dict) else None
        if not isinstance(text, str):
            raise APIError(400, f"documents[{i}] must be a string or an object with a string 'text'", "documents")
        texts.append(text)
    values, outs = await s.score_pairs([(body.query, t) for t in texts], body, request, "documents")
    order = sorted(range(len(values)), key=lambda i: -values[i])[: body.top_n or None]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {
        "id": response_id("rerank", request),
        "model": s.model_id(body.model),
        "results": results,
        "usage": {**usage(outs), "total_tokens": sum(o.num_tokens for o in outs)},
    }
