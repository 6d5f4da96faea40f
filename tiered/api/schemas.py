"""Request bodies of the HTTP routes (pydantic: strict types, other engines' fields accepted and
ignored), and the default chat template."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class EngineFields(BaseModel):
    """Fields every route takes. Fields of other engines are accepted and ignored (extra=allow);
    types are strict (a token id given as the string "5" is a 400, as the schema says)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    priority: int = 0  # vLLM's: lower runs first (always honoured here)
    cache_salt: str | None = None  # vLLM's: cached KV is shared only with the same salt
    # Ours: latency objective, ms from arrival (default scheduler.default_slo_ms): a deadline the
    # scheduler plans for (a long prefill may yield to meet it); a call predicted to miss it is
    # refused at once with a 429 (scheduler.late: shed; a 400 if it misses even with its prefix
    # cached), or answered late (late: serve).
    slo_ms: float | None = None


class ChoiceFields(EngineFields):
    """How the one output token is chosen (vLLM's and OpenAI's fields)."""

    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    logprob_token_ids: list[int] | None = None  # vLLM's: return exactly these ids' logprobs
    # vLLM's: write each token in `logprobs` as "token_id:<id>" (None: the server's default)
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(ChoiceFields):
    """OpenAI's body for POST /v1/completions; `max_tokens` must be 1 (prefill-only)."""

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
    """vLLM's body for POST /detokenize: the token ids to turn back into text."""

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


class PairScoreBody(EngineFields):
    """vLLM's /v1/score (and /score): `text_1` against `text_2`, one string or a list each (one
    against many, or pairs in order); each pair is scored as a rerank document is."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankBody(EngineFields):
    """Jina's and Cohere's rerank body, as vLLM serves it on /rerank, /v1/rerank, /v2/rerank."""

    query: str
    documents: list[str] | list[dict[str, Any]]
    top_n: int | None = None  # the best `top_n` (None or 0: every document)
    return_documents: bool = True


class LoadLoraRequest(BaseModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    """vLLM's body for POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: str


class ChatRequest(ChoiceFields):
    """OpenAI's body for POST /v1/chat/completions; `max_tokens` or `max_completion_tokens` must be 1."""

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
