"""A decoder's shape as its checkpoint's config.json gives it, and the sizes that follow from it
(KV bytes per token: the one rule the tiers, the memory split and the benchmarks size by)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama-3's frequency-dependent RoPE scaling, as config.json's `rope_scaling` gives it."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    # Mistral/Qwen2 sliding-window attention; inputs longer than this are refused.
    sliding_window: int | None

    @property
    def kv_elems_per_token_per_layer(self) -> int:
        """K and V elements one token adds to one layer."""
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token adds over all layers, stored in `dtype`."""
        return self.num_layers * self.kv_elems_per_token_per_layer * dtype.itemsize
