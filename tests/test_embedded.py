import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tiered.embedded import SHAPES, make_model, resolve_model_path


def test_same_name_gives_identical_bytes(tmp_path: Path, tiny_dir: Path) -> None:
    again = make_model("tiny", tmp_path / "tiny")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_tokenizer_loads_in_transformers_and_round_trips(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    config = json.loads((tiny_dir / "config.json").read_text())
    assert len(tok) <= config["vocab_size"]
    text = "Will the user like this post? Answer: Yes"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == config["bos_token_id"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok.encode(" Yes", add_special_tokens=False)) == 1  # a label is one token
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|bos|><|user|>hi<|eos|><|assistant|>"


def test_bench_shape_is_larger_than_tiny() -> None:
    assert (
        SHAPES["bench"].hidden_size * SHAPES["bench"].num_layers
        > 4 * SHAPES["tiny"].hidden_size * SHAPES["tiny"].num_layers
    )


def test_embedded_path_is_made_once(tmp_path: Path) -> None:
    folder = resolve_model_path("embedded:tiny", tmp_path)
    assert (folder / "config.json").exists()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("embedded:tiny", tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model_path(str(folder), tmp_path / "other") == folder
    with pytest.raises(ValueError, match="unknown embedded model 'huge'"):
        resolve_model_path("embedded:huge", tmp_path)
