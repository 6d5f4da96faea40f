"""A decoder's shape as its checkpoint's config.json gives it, and the sizes that follow from it
(KV bytes per token: the one rule the tiers, the memory split and the benchmarks size by)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Checkpoints that store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (split on load).
FUSED_PROJECTIONS = ("Phi3ForCausalLM",)


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama-3's frequency-dependent RoPE scaling, as config.json's `rope_scaling` gives it."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LongRope:
    """LongRoPE (Phi-3's long-context checkpoints): per-frequency factors that divide RoPE's
    frequencies, `short_factor` for a prompt of at most `original_max_position_embeddings` tokens
    and `long_factor` for a longer one (the whole prompt's length decides, for every position), and
    cos / sin scaled by `attention_factor`."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """A decoder's shape and options, read from its checkpoint's config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Sliding-window attention (Mistral, Qwen2/Qwen3 with use_sliding_window, Phi-3): a query sees
    # only the last `sliding_window` keys up to its own, on the layers in `window_layers`.
    sliding_window: int | None
    # Qwen3: an RMSNorm over each head's queries and keys (its own weight, [head_dim]) before RoPE.
    qk_norm: bool = False
    window_layers: tuple[int, ...] = ()
    # Gemma 2 and 3: RMSNorm scales stored as w (applied as 1 + w), a norm after attention and
    # around the MLP, GeGLU (tanh GELU), embeddings times sqrt(hidden), queries scaled by
    # query_pre_attn_scalar^-0.5, logits soft-capped; Gemma 3: the sliding layers' own RoPE base;
    # Gemma 2: attention scores soft-capped too (cap * tanh(score / cap), before the mask).
    norm_offset: bool = False
    sandwich_norms: bool = False
    mlp_act: str = "silu"
    embed_scale: float | None = None
    query_scale: float = 1.0  # times the kernels' head_dim^-0.5
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    rope_linear_factor: float = 1.0  # linear RoPE scaling of the other layers' positions
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    longrope: LongRope | None = None

    def rope_regime(self, num_tokens: int) -> int:
        """Which RoPE frequencies a prompt of `num_tokens` tokens computes every position with: 0,
        the model's own; 1, LongRoPE's long factors (a prompt past its original length). K,V
        computed in one regime are never reused by a prompt of the other."""
        lr = self.longrope
        return int(lr is not None and num_tokens > lr.original_max_position_embeddings)

    def layer_window(self, layer: int) -> int | None:
        """The window layer `layer` attends within (None: every earlier key)."""
        return self.sliding_window if layer in self.window_layers else None

    @property
    def kv_elems_per_token_per_layer(self) -> int:
        """K and V elements one token adds to one layer."""
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token adds over all layers, stored in `dtype`."""
        return self.num_layers * self.kv_elems_per_token_per_layer * dtype.itemsize
