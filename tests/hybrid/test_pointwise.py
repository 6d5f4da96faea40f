"""The fused row-wise ops (RMSNorm, SiLU-and-multiply) against their PyTorch expressions, and
when the model uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiered.hybrid import pointwise
from tiered.native import library as native

needs_native = pytest.mark.skipif(not native.available(), reason="the native library could not be built here")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of a's dtype lie between a and b (same-sign finite values)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


def _rows(n: int, width: int, dtype: torch.dtype, scale: float, seed: int, strided: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(n, width + (24 if strided else 0), generator=g) * scale
    return full[:, :width].to(dtype) if strided else full.to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("n", "width", "strided"), [(300, 1024, False), (7, 1000, True), (1, 17, False), (0, 64, False)]
)
def test_fused_rms_norm_rounds_as_the_pytorch_expression(dtype: torch.dtype, n: int, width: int, strided: bool) -> None:
    """Equal to HF's expression but for the fp32 sum's order: a bf16 output at most 1 ulp off
    (its value rounded the other way), on fewer than 0.1% of elements; fp32 within 1e-6 relative."""
    x = _rows(n, width, dtype, 3.0, 0, strided)
    w = (torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    got = native.library().rms_norm(x, w, 1e-5)
    want = pointwise.rms_norm_reference(x, w, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype
    if n == 0:
        return
    if dtype == torch.bfloat16:
        apart = _ulps_apart(got, want)
        assert apart.max() <= 1 and (apart > 0).float().mean() < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_silu_mul_equals_silu_then_mul(dtype: torch.dtype) -> None:
    """gate = silu(gate) * up in place: bf16 at most 1 ulp off on fewer than 0.1% of elements (the
    exp's last bits), fp32 within 1e-6 relative; edge values (0, +-inf, NaN, exp's overflow and
    underflow) as PyTorch gives them."""
    gate = _rows(64, 4096, dtype, 4.0, 2, strided=True)
    up = _rows(64, 4096, dtype, 1.0, 3, strided=False)
    edges = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 20, -20, 87, -87, 89, -89, 200, -200, float("inf"), -float("inf")])
    gate[0, : len(edges)] = edges.to(dtype)
    gate[1, 0] = float("nan")
    want = F.silu(gate.clone(), inplace=True).mul_(up)
    got = gate.clone()
    native.library().silu_mul_(got, up)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite].isinf(), want[finite].isinf())
    ok = finite & ~want.isinf()
    if dtype == torch.bfloat16:
        apart = _ulps_apart(got[ok], want[ok])
        assert apart.max() <= 1 and (apart > 0).float().mean() < 1e-3
    else:
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-6, atol=0.0)


@needs_native
def test_fused_ops_run_only_where_they_apply() -> None:
    """CPU rows of float32 / bfloat16 take the fused op; float16, a tensor that needs a gradient
    under autograd, or `use_fused(False)` take the PyTorch expression."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    with torch.inference_mode():
        assert pointwise._fused(x, w) is not None
    assert pointwise._fused(x, w) is None  # grad mode and w needs a gradient
    assert pointwise._fused(x.half(), w.detach().half()) is None
    assert pointwise._fused(x, w.detach().float()) is None  # mixed dtypes
    pointwise.use_fused(False)
    try:
        assert pointwise._fused(x, w.detach()) is None
    finally:
        pointwise.use_fused(True)
    assert pointwise._fused(x, w.detach()) is not None
