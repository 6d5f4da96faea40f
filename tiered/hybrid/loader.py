"""Load a Llama-family HF checkpoint folder (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tiered.config import ConfigError
from tiered.hybrid.args import SUPPORTED_ARCHITECTURES, Llama3RopeScaling, ModelArgs
from tiered.hybrid.model import CausalLM, rope_inv_freq, use_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu; a cuda device on a machine without one is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"config key 'device': '{device}' requested but CUDA is not available here")
    return device


class ModelLoadError(RuntimeError):
    """The folder is not a loadable checkpoint of a supported architecture."""


def _rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE theta and scaling from either the classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"RoPE scaling type '{kind}' is not supported (supported: default, llama3)")


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Map an HF config.json onto ModelArgs; refuse architectures we do not implement."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    uses_window = cfg.get("use_sliding_window", not is_qwen2)
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=int(cfg["sliding_window"]) if uses_window and cfg.get("sliding_window") else None,
    )


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in shards]
    else:
        files = [folder / "model.safetensors"]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"weight file(s) missing: {', '.join(missing)} (only safetensors is supported)")
    return files


def read_args(folder: str | Path) -> ModelArgs:
    """The model's shape from an HF checkpoint folder's config.json (ModelLoadError if it has none)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{config_path} does not exist: '{folder}' is not an HF checkpoint folder")
    return args_from_hf_config(json.loads(config_path.read_text()))


# What `model_identity` reads of each weight file beyond its header: this many evenly spaced slices.
IDENTITY_SLICES = 64
IDENTITY_SLICE_BYTES = 64 * 1024


def model_identity(folder: str | Path, dtype: str, block_tokens: int) -> str:
    """A name for this model's KV, equal on every machine that loads the same checkpoint in the
    same dtype and block size (never a random id): the host tier's keys carry it, so engines that
    share a remote store share chunks exactly when their KV is interchangeable.

    It hashes config.json and, of each weight file, its size, its safetensors header (names,
    shapes, dtypes, offsets) and IDENTITY_SLICES slices spread over its data from the first byte
    to the last (a fine-tune changes nearly every byte), rather than every byte: start-up stays
    fast for large checkpoints."""
    import hashlib

    folder = Path(folder)
    h = hashlib.sha256(f"tiered-kv/1 {dtype} {block_tokens}\n".encode())
    h.update((folder / "config.json").read_bytes())
    for path in _weight_files(folder):
        size = path.stat().st_size
        with path.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            h.update(size.to_bytes(8, "little") + f.read(min(header, size)))
            for i in range(IDENTITY_SLICES):
                f.seek(8 + header + i * max(0, size - 8 - header - IDENTITY_SLICE_BYTES) // (IDENTITY_SLICES - 1))
                h.update(f.read(IDENTITY_SLICE_BYTES))
    return f"tiered-{h.hexdigest()[:20]}"


def load_model(
    folder: str | Path, dtype: str = "float32", device: str | torch.device = "cpu", layers: range | None = None
) -> CausalLM:
    """Build the model for `folder` and load its weights in `dtype` on `device`.

    `layers`: a pipeline stage's part (tiered/pipeline): only these decoder layers, renumbered from
    0 (`args.num_layers` is their count), the embedding if the range starts at layer 0 and the
    final norm and LM head if it ends at the last; the parts a stage does not run stay on the
    meta device (no memory). Only the tensors loaded are read from the files."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype '{dtype}' is not supported (supported: {', '.join(DTYPES)})")
    folder = Path(folder)
    args = read_args(folder)
    layers = range(args.num_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == args.num_layers
    if not (0 <= layers.start < layers.stop <= args.num_layers and layers.step == 1):
        raise ModelLoadError(f"layers {layers} are not a range of the model's {args.num_layers} layers")
    args = replace(args, num_layers=len(layers))
    with torch.device("meta"):
        model = CausalLM(args)
    tied = args.tie_word_embeddings
    state = _read_state(folder, device, layers, first, last, tied)
    if tied:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    expected = {k for k in expected if _local_name(k, range(len(layers)), first, last, tied) is not None}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint in '{folder}' does not match {args.architecture}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    target = DTYPES[dtype]
    model.load_state_dict({k: v.to(target) for k, v in state.items()}, strict=False, assign=True)
    if args.tie_word_embeddings and last:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The module was built on the meta device: the RoPE buffer is computed again for real.
    model.register_buffer("inv_freq", rope_inv_freq(args).to(device), persistent=False)
    use_attention(model)
    return model.eval()


def model_on_meta(folder: str | Path) -> CausalLM:
    """The model's modules and args with no weights (every tensor on the meta device): what a
    pipeline's coordinator keeps of the model, its stage processes holding the weights."""
    with torch.device("meta"):
        model = CausalLM(read_args(folder))
    return model.eval()


def _read_state(
    folder: Path, device: str | torch.device, layers: range, first: bool, last: bool, tied: bool
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors a model of `layers` holds (`_local_name`), and only those are read."""
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                local = None if name.endswith("rotary_emb.inv_freq") else _local_name(name, layers, first, last, tied)
                if local is not None:
                    state[local] = f.get_tensor(name)
    return state


def _local_name(name: str, layers: range, first: bool, last: bool, tied: bool) -> str | None:
    """A checkpoint tensor's name in a model of `layers` (decoder layers renumbered from 0), or
    None if that model does not hold it: the embedding belongs to the first stage (and to the
    last of a model whose LM head is the embedding), the final norm and LM head to the last."""
    if name.startswith("model.layers."):
        index, _, rest = name[len("model.layers.") :].partition(".")
        return f"model.layers.{int(index) - layers.start}.{rest}" if int(index) in layers else None
    if name.startswith("model.embed_tokens."):
        return name if first or (last and tied) else None
    return name if last else None
