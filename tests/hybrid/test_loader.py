import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiered.hybrid.forward import ForwardInputError, forward
from tiered.hybrid.loader import ModelLoadError, load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_the_same_weights(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_dir, tmp_path / "sharded")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = torch.arange(1, 200)
    expected = forward(load_model(tiny_dir), ids)
    assert torch.equal(forward(load_model(folder), ids), expected)


def test_dtype_is_applied(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.inv_freq.dtype == torch.float32  # RoPE angles stay fp32, as in HF


def test_tied_embeddings_share_one_tensor(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["tiny-qwen2"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.args.qkv_bias and model.model.layers[0].self_attn.q_proj.bias is not None


def test_unsupported_architecture_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_dir, tmp_path / "gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        load_model(folder)


def test_missing_files_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json does not exist"):
        load_model(tmp_path)
    folder = _copy(tiny_dir, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(folder)


def test_mismatched_weights_are_reported(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_dir, tmp_path / "partial")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing .*layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_sliding_window_longer_input_is_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(model_dirs["tiny-mistral"], tmp_path / "window")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_model(folder)
    forward(model, torch.arange(1, 129))
    with pytest.raises(ForwardInputError, match="sliding window of 128"):
        forward(model, torch.arange(1, 130))


def test_unsupported_rope_scaling_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_dir, tmp_path / "yarn")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_model(folder)
