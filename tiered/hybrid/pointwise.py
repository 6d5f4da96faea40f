"""The decoder layer's row-wise steps: RMSNorm and SiLU-and-multiply.

Each has its PyTorch expression (the reference, and what runs off the CPU or without the native
library) and a fused op of the native library (csrc/pointwise.cpp: one pass over each row, the
same rounding steps). The fused op runs for 2-D CPU rows of float32 or bfloat16 with contiguous
rows; anything else takes the PyTorch expression. `use_fused(False)` turns the fused ops off in
this process (tests compare the two paths).

Design notes: docs/internals.md, section `tiered/hybrid/pointwise.py`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tiered.native.library import library

_FUSED_DTYPES = (torch.float32, torch.bfloat16)
_enabled = [True]


def use_fused(enabled: bool) -> None:
    """Use the native library's fused ops where they apply (True, the default) or never."""
    _enabled[0] = enabled


def _fused(*tensors: Tensor) -> Any | None:
    """The native ops if every tensor suits them, else None."""
    if not _enabled[0]:
        return None
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _FUSED_DTYPES:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # the fused ops have no backward
    if any(t.dtype != first.dtype or t.device != first.device or t.stride(-1) != 1 for t in tensors):
        return None
    return library()


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF Llama's RMSNorm: fp32 statistics, cast back to x's dtype before the weight (so bf16
    rounds as HF's does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm_reference`, fused where it can be."""
    ops = _fused(x, weight) if x.dim() == 2 and weight.dim() == 1 else None
    if ops is None:
        return rms_norm_reference(x, weight, eps)
    return ops.rms_norm(x, weight, eps)  # type: ignore[no-any-return]


def silu_mul_(gate: Tensor, up: Tensor) -> Tensor:
    """gate = silu(gate) * up in place (silu rounded to gate's dtype first, as F.silu_ then mul_)."""
    ops = _fused(gate, up) if gate.dim() == 2 and gate.shape == up.shape else None
    if ops is None:
        return F.silu(gate, inplace=True).mul_(up)
    ops.silu_mul_(gate, up)
    return gate
