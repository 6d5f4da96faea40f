"""How the output token and its alternatives are written in `logprobs` (vLLM's shapes).

Design notes: docs/internals.md, section `tiered/api/logprobs.py`.
"""

from __future__ import annotations

import json
from typing import Any

from tiered.api.protocol import ScoreResponse

TOKEN_ID_PREFIX = "token_id:"


def space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a fast tokenizer's pre-tokenizer (None: there is
    none, and `decode([id])` keeps a token's leading space, as byte-level BPE does)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    for part in [pre, *pre.get("pretokenizers", [])]:
        if part.get("type") == "Metaspace":
            return str(part.get("replacement", "▁"))
    return None


class TokenTexts:
    """Token ids as logprobs write them, for one tokenizer (its space marker read once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.marker = space_marker(tokenizer)

    def text(self, token_id: int) -> str:
        """`decode([id])`, with the leading spaces the vocabulary piece has and decoding dropped."""
        text = str(self.tokenizer.decode([token_id]))
        if self.marker is None:
            return text
        piece = str(self.tokenizer.convert_ids_to_tokens(token_id) or "")
        markers = len(piece) - len(piece.lstrip(self.marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def names(self, token_ids: list[int], as_token_ids: bool) -> dict[int, str]:
        """Each id's name in a mapping keyed by name: its text, or `token_id:<id>` when asked for
        or when its text is another id's among `token_ids`."""
        texts = {t: self.text(t) for t in token_ids}
        if as_token_ids:
            return {t: f"{TOKEN_ID_PREFIX}{t}" for t in texts}
        owners: dict[str, int] = {}
        for text in texts.values():
            owners[text] = owners.get(text, 0) + 1
        return {t: text if owners[text] == 1 else f"{TOKEN_ID_PREFIX}{t}" for t, text in texts.items()}


def completion_logprobs(texts: TokenTexts, out: ScoreResponse, num: int, as_token_ids: bool) -> dict[str, Any]:
    """A completion choice's `logprobs`: the chosen token and the `num` most likely ones."""
    shown = out.top_logprobs[:num]
    names = texts.names([out.token_id, *(t for t, _ in shown)], as_token_ids)
    chosen = dict(out.top_logprobs).get(out.token_id)
    return {
        "tokens": [names[out.token_id]],
        "token_logprobs": [chosen],
        "top_logprobs": [{names[t]: lp for t, lp in shown}],
        "text_offset": [0],
    }


def chat_logprobs(texts: TokenTexts, out: ScoreResponse, num: int, as_token_ids: bool) -> dict[str, Any]:
    """A chat choice's `logprobs`: one `content` entry, its `num` alternatives listed. `bytes`
    are always the decoded text's UTF-8 bytes, also where `token` is written `token_id:<id>`."""

    def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
        text = texts.text(token_id)
        token = f"{TOKEN_ID_PREFIX}{token_id}" if as_token_ids else text
        return {"token": token, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    first = entry(out.token_id, dict(out.top_logprobs).get(out.token_id))
    first["top_logprobs"] = [entry(t, lp) for t, lp in out.top_logprobs[:num]]
    return {"content": [first]}
