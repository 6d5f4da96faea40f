"""How token ids are written in logprobs (tiered/api/logprobs.py), on a Metaspace tokenizer made here."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiered.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs, space_marker
from tiered.api.protocol import ScoreResponse


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style: `decode` drops the leading `▁`, so `▁true` and `true` both decode to "true"."""
    tok = Tokenizer(models.WordLevel({"▁true": 0, "true": 1, "▁▁x": 2, "▁false": 3, "[UNK]": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert fast.decode([0]) == fast.decode([1]) == "true"
    return fast


def test_decoding_drops_no_leading_space_of_the_piece(metaspace: Any) -> None:
    texts = TokenTexts(metaspace)
    assert space_marker(metaspace) == "▁"
    assert [texts.text(t) for t in range(4)] == [" true", "true", "  x", " false"]
    assert texts.names([0, 1, 3], as_token_ids=False) == {0: " true", 1: "true", 3: " false"}


def test_a_completion_row_has_one_key_per_id(metaspace: Any) -> None:
    out = ScoreResponse("r", token_id=1, top_logprobs=[(1, -0.5), (0, -1.0), (3, -2.0)])
    lp = completion_logprobs(TokenTexts(metaspace), out, 3, as_token_ids=False)
    assert lp == {
        "tokens": ["true"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"true": -0.5, " true": -1.0, " false": -2.0}],
        "text_offset": [0],
    }
    lp = completion_logprobs(TokenTexts(metaspace), out, 1, as_token_ids=True)
    assert lp["tokens"] == ["token_id:1"] and lp["top_logprobs"] == [{"token_id:1": -0.5}]


class Alike:
    """A tokenizer whose ids 0..4 all decode to the same text and whose pieces carry no marker."""

    def decode(self, ids: list[int]) -> str:
        return "\ufffd"


def test_ids_that_still_decode_alike_are_written_as_ids_and_only_they() -> None:
    texts = TokenTexts(Alike())
    assert texts.marker is None
    assert texts.names([7], as_token_ids=False) == {7: "\ufffd"}  # alone: its text
    out = ScoreResponse("r", token_id=9, top_logprobs=[(3, -0.1), (4, -0.2)])
    lp = completion_logprobs(texts, out, 2, as_token_ids=False)
    # The chosen id (not among the top ones: logit_bias moved it) has no logprob, and its text collides too.
    assert lp["tokens"] == ["token_id:9"] and lp["token_logprobs"] == [None]
    assert lp["top_logprobs"] == [{"token_id:3": -0.1, "token_id:4": -0.2}]


def test_a_chat_entry_lists_every_alternative_with_the_texts_bytes() -> None:
    out = ScoreResponse("r", token_id=3, top_logprobs=[(3, -0.1), (4, -0.2)])
    (entry,) = chat_logprobs(TokenTexts(Alike()), out, 2, as_token_ids=False)["content"]
    fffd = list("\ufffd".encode())
    assert entry == {
        "token": "\ufffd",
        "logprob": -0.1,
        "bytes": fffd,
        "top_logprobs": [
            {"token": "\ufffd", "logprob": -0.1, "bytes": fffd},
            {"token": "\ufffd", "logprob": -0.2, "bytes": fffd},
        ],
    }
    (entry,) = chat_logprobs(TokenTexts(Alike()), out, 1, as_token_ids=True)["content"]
    assert entry["token"] == "token_id:3" and entry["bytes"] == fffd
    assert entry["top_logprobs"] == [{"token": "token_id:3", "logprob": -0.1, "bytes": fffd}]
    moved = ScoreResponse("r", token_id=9, top_logprobs=[(3, -0.1)])  # logit_bias chose an id outside the top
    assert chat_logprobs(TokenTexts(Alike()), moved, 1, as_token_ids=False)["content"][0]["logprob"] is None
