import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiered.hybrid.forward import forward
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


def test_unsupported_rope_scaling_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_dir, tmp_path / "yarn")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_model(folder)


def test_fused_phi3_projections_are_split_row_for_row(model_dirs: dict[str, Path]) -> None:
    """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: the loaded model's
    separate projections are those rows, in that order."""
    model = load_model(model_dirs["tiny-phi3"])
    fused = load_file(str(model_dirs["tiny-phi3"] / "model.safetensors"))
    a, layer = model.args, model.model.layers[1]
    qkv = fused["model.layers.1.self_attn.qkv_proj.weight"]
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    assert torch.equal(layer.self_attn.k_proj.weight, qkv[q : q + kv])
    assert torch.equal(layer.mlp.up_proj.weight, fused["model.layers.1.mlp.gate_up_proj.weight"][a.intermediate_size :])


def test_qwen3_norms_each_heads_queries_and_keys(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["tiny-qwen3"])
    attn = model.model.layers[0].self_attn
    assert model.args.qk_norm and not model.args.qkv_bias and model.args.head_dim == 32
    assert attn.q_norm is not None and attn.k_norm is not None and attn.k_norm.weight.shape == (32,)
    assert load_model(model_dirs["tiny"]).model.layers[0].self_attn.q_norm is None


def _refused(src: Path, dst: Path, match: str, **config: object) -> None:
    """A copy of `src` with `config` changed in its config.json fails to load with `match`."""
    folder = _copy(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_model(folder)


def test_partial_rotary_embeddings_are_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    match = "partial_rotary_factor 0.5 is not supported"
    _refused(model_dirs["tiny-phi3"], tmp_path / "partial-rope", match, partial_rotary_factor=0.5)


def test_gemma3_reads_its_own_config_names(model_dirs: dict[str, Path]) -> None:
    """Gemma 3's config: the sliding layers from `layer_types`, their RoPE base, the query scale
    from `query_pre_attn_scalar`; norms stored as w load as 1 + w."""
    model = load_model(model_dirs["tiny-gemma3"])
    a = model.args
    assert a.window_layers == (0,) and a.sliding_window == 48 and a.local_rope_theta == 10_000.0
    assert a.query_scale == pytest.approx((32 / 24) ** 0.5) and a.embed_scale == pytest.approx(8.0)
    stored = load_file(str(model_dirs["tiny-gemma3"] / "model.safetensors"))["model.norm.weight"]
    assert torch.allclose(model.model.norm.weight, stored + 1.0)
    assert not torch.equal(model.layer_inv_freq(0), model.layer_inv_freq(1))
    assert a.qk_norm and a.attn_logit_softcap is None


def test_gemma2_soft_caps_attention_scores_and_its_caps_change_the_answer(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Gemma 2's config: every other layer slides (the first), one RoPE base, no q/k norms, attention
    scores and logits soft-capped. The caps of the tiny model bite: without the attention cap (the
    same weights) the logits move by far more than the kernels' tolerance."""
    model = load_model(model_dirs["tiny-gemma2"])
    a = model.args
    assert a.window_layers == (0,) and a.sliding_window == 48 and a.local_rope_theta is None and not a.qk_norm
    assert a.attn_logit_softcap == 5.0 and a.final_logit_softcap == 30.0
    assert torch.equal(model.layer_inv_freq(0), model.layer_inv_freq(1))
    uncapped = tmp_path / "uncapped"
    shutil.copytree(model_dirs["tiny-gemma2"], uncapped)
    cfg = json.loads((uncapped / "config.json").read_text())
    (uncapped / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": None}))
    ids = torch.randint(3, 2000, (200,), generator=torch.Generator().manual_seed(0))
    capped, plain = forward(model, ids), forward(load_model(uncapped), ids)
    assert (capped - plain).abs().max() > 0.1


LOAD_SCRIPT = """
import sys
from tiered.hybrid.loader import load_model
import tiered.hybrid.forward
for folder in sys.argv[1:]:
    load_model(folder, "float32", "cpu")
print("torch._dynamo" in sys.modules)
"""


def test_loading_a_model_never_imports_torch_dynamo(model_dirs: dict[str, Path]) -> None:
    """torch._dynamo is slow to import, and every engine and probe process loads a model without
    compiling anything: building the model on the meta device (its init, its RoPE buffers with
    LongRoPE's factors, Llama 3's scaling and Gemma 3's local base) must not pull it in."""
    import subprocess
    import sys

    folders = [str(model_dirs[m]) for m in ("tiny", "tiny-phi3-longrope", "tiny-llama3", "tiny-gemma3")]
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, *folders], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "False"
