"""The Llama-family decoder (Llama incl. Llama-3 RoPE scaling, Qwen2, Qwen3, Mistral, Phi-3, Gemma 3), top to bottom.

The module tree (named as in HF checkpoints so a state dict loads as is; its shape is `args.py`'s
`ModelArgs`), then the per-chunk steps a decoder layer is made of: norm, RoPE, the q/k/v projection, the MLP. Every
step takes a slice of tokens and writes into buffers the caller preallocated; `forward.py`
decides how many tokens a slice holds and where attention runs. Nothing here knows about
chunking policy or KV tiers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiered.hybrid.args import ModelArgs
from tiered.hybrid.attention import KERNELS, default_kernel
from tiered.hybrid.lora import LoraSlice
from tiered.hybrid.pointwise import rms_norm, silu_mul_


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in fp32 as HF does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalize x over its last dim in fp32, cast back to x's dtype, then scale (`pointwise.rms_norm`)."""
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """A layer's q/k/v/o projections, and Qwen3's per-head q/k norms (attention itself runs in
    `forward.py`'s kernels)."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None


class MLP(nn.Module):
    """A layer's gated MLP projections: gate, up and down."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)


class DecoderLayer(nn.Module):
    """One decoder layer's modules: input norm, attention projections, post-attention norm, MLP."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        # Gemma 3: post_attention_layernorm normalizes attention's output; these the MLP's in and out
        self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps) if a.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps) if a.sandwich_norms else None
        self.query_scale, self.mlp_act = a.query_scale, a.mlp_act


class Decoder(nn.Module):
    """The embedding, the decoder layers and the final norm (HF's `model.` submodule)."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        # An uninitialised table, as every weight is loaded after: Embedding's own init (normal_)
        # on the meta device, where the loader builds the model, would import torch._dynamo.
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model; parameter names match HF checkpoints (`model.layers.0.mlp.up_proj...`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        register_rope(self)
        self.attention = "masked"  # the attention kernel's name (`use_attention`); the loader sets the device's default

    inv_freq: Tensor
    inv_freq_local: Tensor
    inv_freq_long: Tensor

    @property
    def layers(self) -> list[DecoderLayer]:
        """The decoder layers, in order."""
        return list(self.model.layers)  # type: ignore[arg-type]

    def layer_inv_freq(self, layer: int) -> Tensor:
        """RoPE's inverse frequencies of layer `layer` (Gemma 3's sliding layers have their own base)."""
        local = self.args.local_rope_theta is not None and layer in self.args.window_layers
        return self.inv_freq_local if local else self.inv_freq

    def rope(
        self, layer: int, positions: Tensor, dtype: torch.dtype, long: Tensor | bool | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos, sin of layer `layer` at `positions` [n] (each [n, 1, head_dim]); `long`: the rows
        computed in LongRoPE's long regime, [n] bool, or True for all (None, False: none)."""
        scale = self.args.longrope.attention_factor if self.args.longrope is not None else 1.0
        if long is True:
            return rope_cos_sin(self.inv_freq_long, positions, dtype, scale)
        cos, sin = rope_cos_sin(self.layer_inv_freq(layer), positions, dtype, scale)
        if not isinstance(long, Tensor) or not bool(long.any()):
            return cos, sin
        long_cos, long_sin = rope_cos_sin(self.inv_freq_long, positions, dtype, scale)
        rows = long.to(cos.device)[:, None, None]
        return torch.where(rows, long_cos, cos), torch.where(rows, long_sin, sin)

    def embed(self, token_ids: Tensor) -> Tensor:
        """Token ids [n] -> the residual stream's rows [n, D] (Gemma: times sqrt(hidden), in the weights' dtype)."""
        x = self.model.embed_tokens(token_ids)
        if self.args.embed_scale is not None:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        return x

    def last_token_logits(self, hidden_last: Tensor) -> Tensor:
        """[B, D] hidden states of each request's last token -> [B, V] fp32 logits (soft-capped
        where the config says so)."""
        logits = self.lm_head(self.model.norm(hidden_last)).float()
        cap = self.args.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ---- RoPE ----------------------------------------------------------------------------------


def register_rope(model: CausalLM, device: str | torch.device | None = None) -> None:
    """(Re)compute the model's RoPE buffers (on `device`; None: its weights' device): its own
    frequencies, its sliding layers', and LongRoPE's long ones (its own where it has no LongRoPE).
    They are computed on the CPU and moved: computed on the meta device, where the loader builds
    the model, their arithmetic would import torch._dynamo and slow every start-up."""
    a = model.args
    device = model.lm_head.weight.device if device is None else device
    buffers = {
        "inv_freq": rope_inv_freq(a),
        "inv_freq_local": rope_inv_freq(a, local=True),
        "inv_freq_long": rope_inv_freq(a, long=True),
    }
    for name, value in buffers.items():
        model.register_buffer(name, value.to(device), persistent=False)


def rope_inv_freq(a: ModelArgs, local: bool = False, long: bool = False) -> Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 frequency-dependent, linear or LongRoPE
    scaling when set (LongRoPE: its short factors, or with `long` its long ones); `local`: those of
    the sliding layers where they have their own base (Gemma 3), unscaled. On the CPU."""
    exponents = torch.arange(0, a.head_dim, 2, dtype=torch.int64, device="cpu").float() / a.head_dim
    if local and a.local_rope_theta is not None:
        return 1.0 / (a.local_rope_theta**exponents)
    inv_freq = 1.0 / (a.rope_theta**exponents)
    if a.longrope is not None:
        factors = a.longrope.long_factor if long else a.longrope.short_factor
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if a.rope_linear_factor != 1.0:
        return inv_freq / a.rope_linear_factor
    s = a.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos, sin for the given positions [n] (each request of a batch has its own): each [n, 1,
    head_dim], times `scale` (LongRoPE's attention factor) before rounding to `dtype`."""
    freqs = torch.outer(positions.to(device=inv_freq.device, dtype=torch.float32), inv_freq)  # [n, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [n, 1, Dh]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate x [n, heads, Dh] in place: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    x.mul_(cos).add_(rotated)


# ---- per-chunk steps of a decoder layer -----------------------------------------------------


def _linear_into(out: Tensor, x: Tensor, proj: nn.Linear) -> Tensor:
    """out[n, out_features] = proj(x), written into a preallocated buffer."""
    if proj.bias is None:
        return torch.mm(x, proj.weight.t(), out=out)
    return torch.addmm(proj.bias, x, proj.weight.t(), out=out)


def _linear_accumulate_(acc: Tensor, x: Tensor, proj: nn.Linear) -> None:
    """acc += proj(x), in place (the residual add)."""
    acc.addmm_(x, proj.weight.t())
    if proj.bias is not None:
        acc.add_(proj.bias)


def _norm_heads_(x: Tensor, norm: RMSNorm) -> None:
    """x [n, heads, Dh] = norm(x) over each head's Dh values, in place."""
    rows = x.view(-1, x.shape[-1])
    rows.copy_(norm(rows))


def kv_step(
    layer: DecoderLayer,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    out: tuple[Tensor, Tensor],
    lora: LoraSlice | None = None,
) -> None:
    """Norm, k/v projections (plus each row's adapter, if any) and RoPE (`rope`: cos, sin) of keys
    for a slice of tokens x [n, D] into `out`: k, v [n, Hkv, Dh]."""
    (cos, sin), (k_out, v_out) = rope, out
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    n = x.shape[0]
    k, v = _linear_into(k_out.view(n, -1), h, attn.k_proj), _linear_into(v_out.view(n, -1), h, attn.v_proj)
    if lora is not None:
        lora.add_(k, h, "k_proj")
        lora.add_(v, h, "v_proj")
    if attn.k_norm is not None:  # per head: rows of head_dim
        _norm_heads_(k_out, attn.k_norm)
    apply_rope_(k_out, cos, sin)


def q_step(
    layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, lora: LoraSlice | None = None
) -> None:
    """Norm, q projection and RoPE for a slice of tokens x [n, D] into q [n, H, Dh].

    Separate from `kv_step` so the queries of a chunk are made only when its attention runs:
    queries of all tokens never exist at once (the norm runs twice; it is cheap)."""
    h = layer.input_layernorm(x)
    attn = layer.self_attn
    q = _linear_into(q_out.view(x.shape[0], -1), h, attn.q_proj)
    if lora is not None:
        lora.add_(q, h, "q_proj")
    if attn.q_norm is not None:
        _norm_heads_(q_out, attn.q_norm)
    apply_rope_(q_out, cos, sin)
    if layer.query_scale != 1.0:  # Gemma's query_pre_attn_scalar, folded into the queries
        q_out.mul_(layer.query_scale)


def o_proj_step_(layer: DecoderLayer, x: Tensor, attn_out: Tensor, lora: LoraSlice | None = None) -> None:
    """x[n, D] += o_proj(attention output [n, H*Dh]) (Gemma: its post-attention norm of that)."""
    if layer.pre_feedforward_layernorm is not None:
        out = _linear_into(x.new_empty(x.shape), attn_out, layer.self_attn.o_proj)
        if lora is not None:
            lora.add_(out, attn_out, "o_proj")
        x.add_(layer.post_attention_layernorm(out))
        return
    _linear_accumulate_(x, attn_out, layer.self_attn.o_proj)
    if lora is not None:
        lora.add_(x, attn_out, "o_proj")


def mlp_step_(layer: DecoderLayer, x: Tensor, gate_buf: Tensor, up_buf: Tensor, lora: LoraSlice | None = None) -> None:
    """x[n, D] += down(silu(gate(norm x)) * up(norm x)); gate/up buffers are [>= n, F] scratch.
    Gemma: GeGLU (tanh GELU), its own input norm, and the output normed before the add."""
    mlp = layer.mlp
    n = x.shape[0]
    sandwich = layer.pre_feedforward_layernorm is not None
    h = (layer.pre_feedforward_layernorm or layer.post_attention_layernorm)(x)
    gate = _linear_into(gate_buf[:n], h, mlp.gate_proj)
    up = _linear_into(up_buf[:n], h, mlp.up_proj)
    if lora is not None:
        lora.add_(gate, h, "gate_proj")
        lora.add_(up, h, "up_proj")
    if layer.mlp_act == "silu":
        silu_mul_(gate, up)
    else:
        gate.copy_(F.gelu(gate, approximate="tanh").mul_(up))
    if sandwich:
        out = _linear_into(x.new_empty(x.shape), gate, mlp.down_proj)
        if lora is not None:
            lora.add_(out, gate, "down_proj")
        x.add_(layer.post_feedforward_layernorm(out))  # type: ignore[misc]
        return
    _linear_accumulate_(x, gate, mlp.down_proj)
    if lora is not None:
        lora.add_(x, gate, "down_proj")


def use_attention(model: CausalLM, kernel: str | None = None) -> None:
    """Compute `model`'s attention with the kernel named `kernel` (tiered/hybrid/attention); None:
    the default for the model's device."""
    name = kernel or default_kernel(str(model.inv_freq.device))
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel '{name}' (known: {', '.join(KERNELS)})")
    model.attention = name
