"""Load a Llama-family HF checkpoint folder (Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma 2 and 3):
config.json + safetensors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tiered.hybrid.args import FUSED_PROJECTIONS, SUPPORTED_ARCHITECTURES, Llama3RopeScaling, LongRope, ModelArgs
from tiered.hybrid.model import CausalLM, register_rope, use_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A folder with this file instead of weight files: its weights are made at load, seeded
# (`tiered make-model llama-8b-shape`), directly on the device in the dtype the model runs in.
GENERATED_WEIGHTS = "tiered-generated-weights.json"


class ModelLoadError(RuntimeError):
    """The folder is not a loadable checkpoint of a supported architecture."""


def _rope(cfg: dict[str, Any]) -> tuple[float, Llama3RopeScaling | LongRope | None]:
    """RoPE theta and scaling from either the classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "longrope":
        return theta, _longrope(cfg, scaling)
    raise ModelLoadError(f"RoPE scaling type '{kind}' is not supported (supported: default, llama3, longrope)")


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any]) -> LongRope:
    """LongRoPE's factors; its original length from the config's top level (Phi-3) or from the
    scaling; its attention factor as given, else sqrt(1 + ln(factor) / ln(original length)) with
    factor = max_position_embeddings / original length unless the scaling names it."""
    original = int(cfg.get("original_max_position_embeddings") or scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or int(cfg.get("max_position_embeddings", original)) / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (tuple(float(x) for x in scaling[key]) for key in ("short_factor", "long_factor"))
    return LongRope(short, long, original, float(attention))


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Map an HF config.json onto ModelArgs; refuse architectures we do not implement."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return _gemma_args(cfg, arch)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    longrope = scaling if isinstance(scaling, LongRope) else None
    is_qwen2 = arch == "Qwen2ForCausalLM"
    is_qwen3 = arch == "Qwen3ForCausalLM"
    uses_window = cfg.get("use_sliding_window", not (is_qwen2 or is_qwen3))
    window = int(cfg["sliding_window"]) if uses_window and cfg.get("sliding_window") else None
    num_layers = int(cfg["num_hidden_layers"])
    window_layers: tuple[int, ...] = ()
    if window is not None:
        types = cfg.get("layer_types")
        if types:  # transformers' own list, where the config has one
            window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        elif is_qwen2 or is_qwen3:  # Qwen's rule: the layers from max_window_layers on
            window_layers = tuple(range(int(cfg.get("max_window_layers", num_layers)), num_layers))
        else:  # Mistral, Phi-3: every layer
            window_layers = tuple(range(num_layers))
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling if isinstance(scaling, Llama3RopeScaling) else None,
        qkv_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=window if window_layers else None,
        qk_norm=is_qwen3,
        window_layers=window_layers,
        longrope=longrope,
    )


def generated_seed(folder: str | Path) -> int | None:
    """The seed of a folder whose weights are made at load (GENERATED_WEIGHTS); None: it has files."""
    path = Path(folder) / GENERATED_WEIGHTS
    return int(json.loads(path.read_text())["seed"]) if path.exists() else None


def _gemma_args(cfg: dict[str, Any], arch: str) -> ModelArgs:
    """Gemma 2's and Gemma 3's text decoders: their configs' names and defaults (transformers').
    Gemma 2: every other layer slides (the first does), one RoPE base, attention scores and
    logits soft-capped (50 and 30 by default). Gemma 3: five of six layers slide, with their own
    RoPE base; q/k normed per head; only the logits may be capped."""
    gemma2 = arch == "Gemma2ForCausalLM"
    name = "Gemma 2" if gemma2 else "Gemma 3"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"hidden_activation '{act}' is not supported for {name} (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention is not supported (a causal decoder only)")
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    heads, head_dim = int(cfg["num_attention_heads"]), int(cfg.get("head_dim") or 256)
    pattern = 2 if gemma2 else int(cfg.get("sliding_window_pattern") or 6)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = cfg.get("rope_parameters") or {}
    local: dict[str, Any] = {}
    if gemma2:
        full = params
    else:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    scaling = {**full, **(cfg.get("rope_scaling") or {})}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelLoadError(f"RoPE scaling type '{kind}' is not supported for {name} (supported: default, linear)")
    window = cfg.get("sliding_window", 4096)
    window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    softcaps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if gemma2 else {}
    attn_cap, final_cap = (cfg.get(k, softcaps.get(k)) for k in ("attn_logit_softcapping", "final_logit_softcapping"))
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 10_000.0 if gemma2 else 1_000_000.0))),
        rope_scaling=None,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192 if gemma2 else 131072)),
        sliding_window=int(window) if window_layers else None,
        qk_norm=not gemma2,
        window_layers=window_layers,
        norm_offset=True,
        sandwich_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=hidden**0.5,
        query_scale=(head_dim / float(cfg.get("query_pre_attn_scalar", 256))) ** 0.5,
        local_rope_theta=None if gemma2 else float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        rope_linear_factor=float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0,
        final_logit_softcap=None if final_cap is None else float(final_cap),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
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
    try:
        return args_from_hf_config(json.loads(config_path.read_text()))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from None


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
    if generated_seed(folder) is not None:  # its weights follow from the seed
        h.update((folder / GENERATED_WEIGHTS).read_bytes())
        return f"tiered-{h.hexdigest()[:20]}"
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
    args = replace(
        args,
        num_layers=len(layers),
        window_layers=tuple(i - layers.start for i in args.window_layers if i in layers),
    )
    with torch.device("meta"):
        model = CausalLM(args)
    tied = args.tie_word_embeddings
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    expected = {k for k in expected if _local_name(k, range(len(layers)), first, last, tied) is not None}
    seed = generated_seed(folder)
    if seed is not None:
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k in expected}
        state = _generate_state(shapes, seed, layers.start, DTYPES[dtype], device)
    else:
        state = _read_state(folder, device, layers, first, last, tied)
    if args.architecture in FUSED_PROJECTIONS and seed is None:
        state = _split_fused(state, args)
    if args.norm_offset:  # Gemma stores each norm's scale as w and applies 1 + w
        state = {k: (v.float() + 1.0 if k.endswith("norm.weight") else v) for k, v in state.items()}
    if tied:
        state.pop("lm_head.weight", None)
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
    register_rope(model, device)  # the module was built on the meta device: the RoPE buffers are made for real
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


def _generate_state(
    shapes: dict[str, tuple[int, ...]], seed: int, first_layer: int, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """Seeded weights for a generated folder, made on `device` in `dtype`: a matrix ~ N(0, 1/fan_in)
    (each layer visibly changes the output), a norm's scale 1 + N(0, 0.01), a bias N(0, 0.01), the
    embedding N(0, 1). Each tensor has its own seed from its name in the whole model, so a
    pipeline stage's layers equal the same layers of the whole model."""
    import zlib

    state = {}
    for name, shape in shapes.items():
        global_name = name
        if name.startswith("model.layers."):
            index, _, rest = name[len("model.layers.") :].partition(".")
            global_name = f"model.layers.{int(index) + first_layer}.{rest}"
        g = torch.Generator(device=device).manual_seed(seed * 2**32 + zlib.crc32(global_name.encode()))
        t = torch.empty(shape, dtype=dtype, device=device).normal_(generator=g)
        if name.endswith("embed_tokens.weight"):
            pass
        elif len(shape) == 2:
            t.mul_(1.0 / shape[1] ** 0.5)
        elif name.endswith("norm.weight"):
            t.mul_(0.1).add_(1.0)
        else:
            t.mul_(0.1)
        state[name] = t
    return state


def _split_fused(state: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    """Phi-3's fused projections as the separate ones the model holds: `qkv_proj` rows are q's, then
    k's, then v's; `gate_up_proj` rows are gate's, then up's (views: no copy)."""
    out = {}
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for name, tensor in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            stem = name[: -len("qkv_proj.weight")]
            for part, rows in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                out[f"{stem}{part}_proj.weight"] = rows
        elif name.endswith("mlp.gate_up_proj.weight"):
            stem = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.split([a.intermediate_size, a.intermediate_size])
            out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = gate, up
        else:
            out[name] = tensor
    return out


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
