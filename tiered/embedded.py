"""Project-made models: seeded Llama-family checkpoints in HF format, with a trained tokenizer.

No model can be downloaded on our machines, so `tiered make-model NAME --out DIR` writes one:
config.json, model.safetensors (seeded random weights, fp32 or bf16 as the shape says) and a byte-level BPE tokenizer
trained on `data/corpus.txt` (tokenizer.json + tokenizer_config.json with a chat template). The
same folder loads in transformers, in vLLM and in our loader. Output is byte-identical for the
same name.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where weights are made: `tiered --help` lists SHAPES without it
    import torch

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "<|eos|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_VOCAB_SIZE = 2048
EMBEDDED_PREFIX = "embedded:"
STAMP = "tiered-embedded.json"  # what the folder was made from


@dataclass(frozen=True, slots=True)
class Shape:
    """A project-made model's shape, seed and stored dtype: what `make_model` writes a checkpoint from."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = TOKENIZER_VOCAB_SIZE
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, object] | None = None
    seed: int = 0
    # The dtype the checkpoint stores (config.json's torch_dtype): real checkpoints ship in bf16.
    dtype: str = "float32"
    head_dim: int | None = None  # None: hidden_size // num_heads (Qwen3's is its own)
    rope_theta: float = 500000.0
    # No weight file: the loader makes the seeded weights where the model runs, in its dtype
    # (a realistic size checked on a GPU without moving gigabytes of weights there).
    generated: bool = False


SHAPES: dict[str, Shape] = {
    # For tests: a forward of thousands of tokens in milliseconds. Head size 32: the smallest
    # vLLM's CPU attention accepts, so the same folder serves the vLLM peer in tests.
    "tiny": Shape("LlamaForCausalLM", 64, 2, 2, 1, 176),
    # For benchmarks: an 8K-token forward takes about a second on 2 CPU cores (bf16).
    "bench": Shape("LlamaForCausalLM", 256, 4, 4, 2, 1024, seed=1, dtype="bfloat16"),
    # For headline figures: a model of realistic proportions (126 M parameters; in bf16 its
    # matmuls are big enough that compute, not Python, sets the pace, as in a real deployment).
    "bench-m": Shape("LlamaForCausalLM", 1024, 8, 16, 4, 4096, seed=5, dtype="bfloat16"),
    # bench-m's weights with 1,048,576 positions: the longest prompts per memory budget pass
    # bench-m's 131,072, and both engines refuse a length past a checkpoint's positions.
    "bench-m-1m": Shape(
        "LlamaForCausalLM", 1024, 8, 16, 4, 4096, max_position_embeddings=1048576, seed=5, dtype="bfloat16"
    ),
    # bench-m's proportions as Qwen3 (q/k norms, tied embeddings): the rerank benchmark, where vLLM
    # serves it as Qwen3-Reranker (a Qwen3ForSequenceClassification read from the LM head).
    "bench-m-qwen3": Shape(
        "Qwen3ForCausalLM", 1024, 8, 16, 4, 4096, tie_word_embeddings=True, seed=13, dtype="bfloat16", head_dim=64
    ),
    # Architecture variants the loader must handle, at tiny size.
    "tiny-qwen2": Shape("Qwen2ForCausalLM", 64, 2, 4, 2, 176, tie_word_embeddings=True, seed=2),
    "tiny-mistral": Shape("MistralForCausalLM", 64, 2, 4, 1, 160, seed=3),
    # Gemma 3's text decoder: a sliding layer (a 48-token window, its own RoPE base) then a global
    # one, sandwich norms, GeGLU, query_pre_attn_scalar != head_dim, logits soft-capped
    "tiny-gemma3": Shape("Gemma3ForCausalLM", 64, 2, 4, 2, 176, tie_word_embeddings=True, seed=11, head_dim=32),
    # Gemma 2's: a sliding layer (48-token window) then a global one, attention scores and logits
    # soft-capped (at 5 and 30, low enough that the caps change the scores of these weights)
    "tiny-gemma2": Shape("Gemma2ForCausalLM", 64, 2, 4, 2, 176, tie_word_embeddings=True, seed=12, head_dim=32),
    # q/k/v and gate/up stored fused, as Phi-3 checkpoints are
    "tiny-phi3": Shape("Phi3ForCausalLM", 64, 2, 4, 2, 176, seed=7),
    # ... with LongRoPE (Phi-3's 128k checkpoints): its short factors up to 64 tokens, its long ones past
    "tiny-phi3-longrope": Shape(
        "Phi3ForCausalLM",
        64,
        2,
        4,
        2,
        176,
        seed=13,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 3.0 * i for i in range(8)],
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k normed per head; heads of 32 over a 64-wide stream (q is 128 wide), as Qwen3's are wider too
    "tiny-qwen3": Shape("Qwen3ForCausalLM", 64, 2, 4, 2, 176, tie_word_embeddings=True, seed=6, head_dim=32),
    # Weights made at load (no file): the loader's generated path at test size, and two real shapes.
    "tiny-generated": Shape("LlamaForCausalLM", 64, 2, 2, 1, 176, seed=8, generated=True),
    "llama-8b-shape": Shape(  # Llama-3.1-8B's config
        "LlamaForCausalLM",
        4096,
        32,
        32,
        8,
        14336,
        vocab_size=128256,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        seed=9,
        dtype="bfloat16",
        generated=True,
    ),
    "qwen3-8b-shape": Shape(  # Qwen3-8B's config
        "Qwen3ForCausalLM",
        4096,
        36,
        32,
        8,
        12288,
        vocab_size=151936,
        max_position_embeddings=40960,
        head_dim=128,
        rope_theta=1000000.0,
        seed=10,
        dtype="bfloat16",
        generated=True,
    ),
    "tiny-llama3": Shape(
        "LlamaForCausalLM",
        64,
        2,
        4,
        2,
        176,
        seed=4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ),
}


def _hf_config(shape: Shape) -> dict[str, object]:
    model_type = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "MistralForCausalLM": "mistral",
        "Phi3ForCausalLM": "phi3",
        "Gemma3ForCausalLM": "gemma3_text",
        "Gemma2ForCausalLM": "gemma2",
    }
    head_dim = _head_dim(shape)
    cfg: dict[str, object] = {
        "architectures": [shape.architecture],
        "model_type": model_type[shape.architecture],
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": shape.dtype,
    }
    if shape.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
    if shape.architecture == "Qwen3ForCausalLM":
        cfg["attention_bias"] = False
    if shape.architecture == "MistralForCausalLM":
        cfg["sliding_window"] = None
    if shape.architecture == "Phi3ForCausalLM" and shape.rope_scaling is not None:
        # Phi-3 names LongRoPE's original length at the config's top level (transformers reads it there)
        cfg["original_max_position_embeddings"] = shape.rope_scaling["original_max_position_embeddings"]
    if shape.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        # A sliding layer (a 48-token window) then a global one; Gemma 3's sliding layers have their
        # own RoPE base, Gemma 2 soft-caps its attention scores (at 5: the tiny weights' scores pass it)
        gemma2 = shape.architecture == "Gemma2ForCausalLM"
        del cfg["hidden_act"]
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=24,
            sliding_window=48,
            layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(shape.num_layers)],
            rope_theta=10_000.0 if gemma2 else 1_000_000.0,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=5.0 if gemma2 else None,
        )
        if not gemma2:
            cfg["rope_local_base_freq"] = 10_000.0
    return cfg


def _head_dim(shape: Shape) -> int:
    return shape.head_dim or shape.hidden_size // shape.num_heads


def _weights(shape: Shape) -> dict[str, torch.Tensor]:
    """Seeded weights scaled so every layer visibly changes the output (std 1/sqrt(fan_in))."""
    import torch

    g = torch.Generator().manual_seed(shape.seed)
    head_dim = _head_dim(shape)
    d, f = shape.hidden_size, shape.intermediate_size

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)

    gemma = shape.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

    def norm(dim: int) -> torch.Tensor:  # Gemma stores w of a scale 1 + w
        return (0.0 if gemma else 1.0) + 0.1 * torch.randn(dim, generator=g)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(shape.vocab_size, d, generator=g)}
    qkv_bias = shape.architecture == "Qwen2ForCausalLM"
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = linear(shape.num_heads * head_dim, d)
        w[p + "self_attn.k_proj.weight"] = linear(shape.num_kv_heads * head_dim, d)
        w[p + "self_attn.v_proj.weight"] = linear(shape.num_kv_heads * head_dim, d)
        if qkv_bias:
            for name, size in (("q", shape.num_heads), ("k", shape.num_kv_heads), ("v", shape.num_kv_heads)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(size * head_dim, generator=g)
        w[p + "self_attn.o_proj.weight"] = linear(d, shape.num_heads * head_dim)
        if shape.architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(d)
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = linear(f, d)
        w[p + "mlp.up_proj.weight"] = linear(f, d)
        w[p + "mlp.down_proj.weight"] = linear(d, f)
    if shape.architecture == "Phi3ForCausalLM":  # Phi-3's files store them fused
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            parts = [w.pop(p + f"self_attn.{x}_proj.weight") for x in ("q", "k", "v")]
            w[p + "self_attn.qkv_proj.weight"] = torch.cat(parts)
            gate, up = w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")
            w[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
    w["model.norm.weight"] = norm(d)
    if not shape.tie_word_embeddings:
        w["lm_head.weight"] = linear(shape.vocab_size, d)
    stored = getattr(torch, shape.dtype)
    return {k: v.to(stored).contiguous() for k, v in w.items()}


def corpus_text() -> str:
    """The bundled text corpus the embedded tokenizer is trained on."""
    return (Path(__file__).parent / "data" / "corpus.txt").read_text()


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def make_model(name: str, out: str | Path) -> Path:
    """Write the embedded model `name` into folder `out` (created); return the folder."""
    if name not in SHAPES:
        raise ValueError(f"unknown embedded model '{name}' (choose from {', '.join(SHAPES)})")
    shape = SHAPES[name]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(out)
    from safetensors.torch import save_file

    if shape.generated:
        from tiered.hybrid.loader import GENERATED_WEIGHTS

        (out / GENERATED_WEIGHTS).write_text(json.dumps({"seed": shape.seed}) + "\n")
    else:
        save_file(_weights(shape), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / STAMP).write_text(json.dumps({"name": name, "shape": asdict(shape)}, indent=2) + "\n")
    # config.json last: its presence marks a complete folder.
    (out / "config.json").write_text(json.dumps(_hf_config(shape), indent=2) + "\n")
    log.info("made embedded model '%s' in %s", name, out)
    return out


def _is_current(folder: Path, name: str) -> bool:
    """The folder was made from today's definition of `name` (shapes change as the project does)."""
    try:
        return json.loads((folder / STAMP).read_text()) == {"name": name, "shape": asdict(SHAPES[name])}
    except (OSError, ValueError):
        return False


def resolve_model_path(path: str, models_dir: str | Path) -> Path:
    """`embedded:NAME` -> models_dir/NAME, made on first use; any other path is returned as is."""
    if not path.startswith(EMBEDDED_PREFIX):
        return Path(path).expanduser()
    name = path[len(EMBEDDED_PREFIX) :]
    if name not in SHAPES:
        raise ValueError(f"unknown embedded model '{name}' (choose from {', '.join(SHAPES)})")
    folder = Path(models_dir) / name
    if not (folder / "config.json").exists() or not _is_current(folder, name):
        # Made beside and renamed into place, so a concurrent reader never sees half a folder.
        tmp = folder.with_name(f".{name}.tmp-{os.getpid()}")
        make_model(name, tmp)
        try:
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def make_adapter(
    model_dir: str | Path,
    out: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Write a seeded LoRA adapter for the checkpoint in `model_dir`, in PEFT's format
    (adapter_config.json + adapter_model.safetensors), into folder `out`; return the folder.

    A and B are both random (PEFT initialises B to zero, which would make a no-op adapter), scaled
    so the adapter moves the logits visibly without swamping the base model."""
    import torch
    from safetensors.torch import save_file

    from tiered.hybrid.loader import read_args
    from tiered.hybrid.lora import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, _shapes

    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown or not targets:
        raise ValueError(f"target modules {unknown or targets} are not among {', '.join(TARGET_MODULES)}")
    args = read_args(model_dir)
    shapes = _shapes(args)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(args.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
            weights[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * (0.5 / rank)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "use_rslora": use_rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out
