import json
from dataclasses import replace
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


def test_the_long_position_bench_model_differs_from_bench_m_in_its_positions_alone() -> None:
    # Same shape and seed: the same weights, so lengths on it are bench-m's.
    long = SHAPES["bench-m-1m"]
    assert long.max_position_embeddings == 1 << 20 > SHAPES["bench-m"].max_position_embeddings
    assert replace(long, max_position_embeddings=SHAPES["bench-m"].max_position_embeddings) == SHAPES["bench-m"]


def test_embedded_path_is_made_once(tmp_path: Path) -> None:
    folder = resolve_model_path("embedded:tiny", tmp_path)
    assert (folder / "config.json").exists()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("embedded:tiny", tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model_path(str(folder), tmp_path / "other") == folder
    with pytest.raises(ValueError, match="unknown embedded model 'huge'"):
        resolve_model_path("embedded:huge", tmp_path)


def test_a_generated_model_has_no_weight_file_and_the_same_weights_on_every_load(tmp_path: Path) -> None:
    """`generated` shapes: config and tokenizer written, weights made at load, seeded per tensor
    name (a pipeline stage's layers equal the whole model's), in the dtype asked for; the KV
    identity follows from the config and seed."""
    import torch

    from tiered.hybrid.forward import forward
    from tiered.hybrid.loader import GENERATED_WEIGHTS, load_model, model_identity

    folder = make_model("tiny-generated", tmp_path / "gen")
    assert (folder / GENERATED_WEIGHTS).exists() and not list(folder.glob("*.safetensors"))
    a, b = load_model(folder), load_model(folder)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    stage = load_model(folder, layers=range(1, 2))
    assert torch.equal(stage.model.layers[0].mlp.up_proj.weight, a.model.layers[1].mlp.up_proj.weight)
    assert load_model(folder, "bfloat16").model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    logits = forward(a, torch.arange(1, 200), mode="hybrid", chunk_tokens=64)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    again = make_model("tiny-generated", tmp_path / "gen2")
    assert model_identity(folder, "float32", 16) == model_identity(again, "float32", 16)
    assert model_identity(folder, "float32", 16) != model_identity(make_model("tiny", tmp_path / "t"), "float32", 16)


@pytest.mark.parametrize(
    ("name", "billions", "kv_bytes_per_token"),
    [("llama-8b-shape", 8.03, 32 * 2 * 8 * 128 * 2), ("qwen3-8b-shape", 8.19, 36 * 2 * 8 * 128 * 2)],
)
def test_the_8b_shapes_are_the_real_checkpoints_shapes(
    tmp_path: Path, name: str, billions: float, kv_bytes_per_token: int
) -> None:
    """Their configs give Llama-3.1-8B's and Qwen3-8B's parameter counts and KV per token (counted
    on the meta device: nothing is allocated)."""
    import torch

    from tiered.hybrid.loader import model_on_meta, read_args

    folder = make_model(name, tmp_path / name)
    args = read_args(folder)
    assert args.kv_bytes_per_token(torch.bfloat16) == kv_bytes_per_token
    params = sum(p.numel() for p in model_on_meta(folder).parameters())
    assert abs(params / 1e9 - billions) < 0.01, params
