"""Every attention kernel against the fp32 reference at the shapes that matter; the per-machine choice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tiered.config import AttentionConfig, ConfigError
from tiered.hybrid.attention import KERNELS, Span, reference_
from tiered.hybrid.attention import select as select_module
from tiered.hybrid.attention.interface import PagedPrefix, prefix_runs, prefix_segments
from tiered.hybrid.attention.kernels import windowed_calls
from tiered.hybrid.attention.select import KernelShape, KernelTiming, ShapeClass, choose_kernel, fastest
from tiered.native import library as native_library

CPU_KERNELS = [name for name, kernel in KERNELS.items() if kernel.runs_on("cpu")]
# Every CPU kernel, including those whose library this interpreter lacks (skipped, with the reason, where absent).
ALL_CPU_KERNELS = [name for name, kernel in KERNELS.items() if "cpu" in kernel.devices]
# Max |out - fp32 reference| (outputs are averages of V rows drawn from N(0, 1)).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture
def cpu_kernel(request: pytest.FixtureRequest, vllm_loaded: str | None) -> str:
    name: str = request.param
    if name == "vllm-cpu" and vllm_loaded is not None:
        pytest.skip(vllm_loaded)
    return name


def _case(
    spans: list[Span], num_keys: int, prefix: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(heads * 1000 + prefix + head_dim)
    num_q = max(p.q_start + p.num for p in spans)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(dtype)

    q, k, v = rand(num_q, heads, head_dim), rand(num_keys, kv_heads, head_dim), rand(num_keys, kv_heads, head_dim)
    pk = rand(prefix, kv_heads, head_dim) if prefix else None
    pv = rand(prefix, kv_heads, head_dim) if prefix else None
    return q, k, v, pk, pv  # type: ignore[return-value]


SHAPES = {
    # many requests on one shared prefix (the visit shape, small)
    "shared prefix": ([Span(i * 24, i * 24, 24) for i in range(6)], 144, 200),
    # one long suffix on a long prefix
    "long suffix": ([Span(0, 0, 300)], 300, 500),
    # no prefix, causal only
    "no prefix": ([Span(0, 0, 333)], 333, 0),
    # a chunk in a request's middle (earlier tokens visible) and a follower (a lead's tokens visible)
    "visible ranges": ([Span(0, 40, 30, ((0, 40),)), Span(30, 90, 20, ((70, 80), (0, 10)))], 110, 64),
    # a lead and three followers that see its first 10 tokens (one visible call for the three)
    "followers": ([Span(0, 0, 25), *(Span(25 + 15 * i, 25 + 15 * i, 15, ((0, 10),)) for i in range(3))], 70, 64),
    # one short span on a prefix: one task per KV head in the native kernel (its prefix read per task)
    "short span": ([Span(0, 0, 10)], 10, 150),
    # the last layer's rows: one query per request, a group's not adjacent to its keys (followers, visible ranges)
    "last rows": (
        [Span(0, 39, 1, ((0, 39),)), Span(1, 99, 1, ((70, 80), (40, 99))), Span(2, 109, 1, ((100, 109),))],
        110,
        64,
    ),
}


@pytest.mark.parametrize("cpu_kernel", ALL_CPU_KERNELS, indirect=True)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (16, 4, 64), (8, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_equals_the_fp32_reference(
    cpu_kernel: str, shape: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    kernel = cpu_kernel
    spans, num_keys, prefix = SHAPES[shape]
    q, k, v, pk, pv = _case(spans, num_keys, prefix, heads, kv_heads, head_dim, dtype)
    expected = q.clone().float()
    reference_(expected, k, v, spans, pk, pv)
    got = q.clone()
    KERNELS[kernel].attend_(got, k, v, spans, pk, pv)
    assert got.dtype == dtype
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


def _pool_case(
    dtype: torch.dtype, block_ids: list[int], prefix_tokens: int, block_tokens: int = 16
) -> tuple[PagedPrefix, torch.Tensor, torch.Tensor]:
    """A prefix in a pool laid out as the device tier's ([blocks, 2, layers, rows, Hkv, Dh], one
    layer's view: strided), scattered among other blocks; and the same prefix gathered."""
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(12, 2, 3, block_tokens, 4, 64, generator=g).to(dtype)
    pool_k, pool_v = pool[:, 0, 1], pool[:, 1, 1]
    ids = torch.tensor(block_ids)
    gathered = [t[ids].flatten(0, 1)[:prefix_tokens] for t in (pool_k, pool_v)]
    return PagedPrefix(pool_k, pool_v, ids, prefix_tokens), gathered[0], gathered[1]


# Block tables: runs of consecutive ids and jumps, out of order, the last block partly used.
BLOCK_TABLES = {
    "one run": ([3, 4, 5, 6], 4 * 16),
    "runs and jumps": ([5, 6, 0, 9, 10, 11, 2], 6 * 16 + 5),
    "one block, part used": ([7], 9),
}


@pytest.mark.parametrize("cpu_kernel", ALL_CPU_KERNELS, indirect=True)
@pytest.mark.parametrize("table", list(BLOCK_TABLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_reads_the_prefix_in_place_through_its_block_table(
    cpu_kernel: str, table: str, dtype: torch.dtype
) -> None:
    """Each kernel's paged call over the device tier's pool gives the reference's answer on the
    gathered prefix: no kernel needs the prefix copied out of the pool first."""
    block_ids, prefix_tokens = BLOCK_TABLES[table]
    paged, pk, pv = _pool_case(dtype, block_ids, prefix_tokens)
    spans = [Span(0, 0, 40), Span(40, 40, 25, ((0, 12),))]
    q, k, v, _, _ = _case(spans, 65, 0, 16, 4, 64, dtype)
    expected = q.clone().float()
    reference_(expected, k, v, spans, pk, pv)
    paged_ = KERNELS[cpu_kernel].attend_paged_
    assert paged_ is not None
    got = q.clone()
    paged_(got, k, v, spans, paged)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("scratch", [1, 1 << 30])
def test_prefix_blocks_are_merged_by_log_sum_exp_in_calls_of_any_size(
    scratch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The part kernels attend a run of blocks as one batched call, or one call a block when the
    scratch bound says so: the same answer either way."""
    from tiered.hybrid.attention import kernels

    monkeypatch.setattr(kernels, "PREFIX_SCRATCH_ELEMENTS", scratch)
    paged, pk, pv = _pool_case(torch.float32, [1, 2, 3, 4, 8, 9], 6 * 16)
    spans = [Span(0, 0, 30)]
    q, k, v, _, _ = _case(spans, 30, 0, 8, 4, 64, torch.float32)
    expected = q.clone()
    reference_(expected, k, v, spans, pk, pv)
    got = q.clone()
    kernels.KERNELS["flash"].attend_paged_(got, k, v, spans, paged)  # type: ignore[misc]
    assert (got - expected).abs().max().item() <= TOLERANCE[torch.float32]


def test_a_block_table_is_read_as_runs_of_consecutive_blocks() -> None:
    paged, _, _ = _pool_case(torch.float32, [5, 6, 0, 9, 10, 11, 2], 6 * 16 + 5)
    runs = prefix_runs(paged)
    assert [r[0].shape[:2] for r in runs] == [(2, 16), (1, 16), (3, 16), (1, 5)]
    assert all(r[0].data_ptr() == paged.pool_k[i].data_ptr() for r, i in zip(runs, [5, 0, 9, 2], strict=True))
    assert sum(seg[0].shape[0] for seg in prefix_segments(paged)) == paged.num_tokens
    with pytest.raises(ValueError, match="cannot hold"):
        prefix_runs(PagedPrefix(paged.pool_k, paged.pool_v, torch.tensor([1]), 17))


@pytest.mark.parametrize("window", [20, 70, None])
def test_the_windowed_call_reads_the_prefix_in_place(window: int | None) -> None:
    paged, pk, pv = _pool_case(torch.float32, [5, 6, 0, 9], 3 * 16 + 5)
    spans = [Span(0, 10, 30, ((0, 10),)), Span(30, 40, 20)]
    q, k, v, _, _ = _case(spans, 60, 0, 8, 4, 64, torch.float32)
    attend_, paged_ = windowed_calls(window)
    expected, got = q.clone(), q.clone()
    attend_(expected, k, v, spans, pk, pv)
    paged_(got, k, v, spans, paged)
    assert (got - expected).abs().max().item() <= TOLERANCE[torch.float32]
    if window is None:
        reference_(q, k, v, spans, pk, pv)
        assert (got - q).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("layout", select_module.PREFIX_LAYOUTS)
def test_kernels_are_timed_with_the_prefix_in_each_layout(layout: str) -> None:
    """The engine's choice times each kernel's paged call on a scattered pool (as the forward calls
    it); `gathered` times the copy out of the pool with the plain call. Every layout is correct."""
    shapes = (ShapeClass("shared", 3, 16, 40),)
    heads = KernelShape(4, 2, 16, torch.float32, "cpu")
    timings = select_module.time_kernels(["masked", "flash"], shapes, heads, prefix_layout=layout, block_tokens=16)
    assert [(t.kernel, t.ok) for t in timings] == [("masked", True), ("flash", True)]
    with pytest.raises(ValueError, match="prefix layout 'scattered'"):
        select_module.time_kernels(["masked"], shapes, heads, prefix_layout="scattered")


def test_a_scattered_pool_holds_the_prefix_in_blocks_no_two_adjacent() -> None:
    g = torch.Generator().manual_seed(3)
    pk, pv = torch.randn(37, 2, 8, generator=g), torch.randn(37, 2, 8, generator=g)
    pool = select_module.scattered_pool(pk, pv, 16)
    ids = pool.block_ids.tolist()
    assert len(ids) == 3 and all(abs(a - b) > 1 for a, b in zip(ids, ids[1:], strict=False))
    assert len(prefix_runs(pool)) == 3
    k, v = select_module.gather(pool)
    assert torch.equal(k, pk) and torch.equal(v, pv)


def test_the_reference_is_softmax_attention_written_out() -> None:
    """The reference itself, against attention spelled out for one query of a follower."""
    spans, num_keys, prefix = SHAPES["visible ranges"]
    q, k, v, pk, pv = _case(spans, num_keys, prefix, 4, 2, 64, torch.float32)
    out = q.clone()
    reference_(out, k, v, spans, pk, pv)
    p = spans[1]
    i = 5  # its 6th own query sees: the prefix, rows 70..80 and 0..10, and its own first 6 keys
    rows = [*range(70, 80), *range(0, 10), *range(p.k_start, p.k_start + i + 1)]
    keys = torch.cat([pk, k[rows]])  # type: ignore[list-item]
    values = torch.cat([pv, v[rows]])  # type: ignore[list-item]
    for h in range(4):
        scores = keys[:, h // 2] @ q[p.q_start + i, h] / 64**0.5
        expected = torch.softmax(scores, 0) @ values[:, h // 2]
        assert torch.allclose(out[p.q_start + i, h], expected, atol=1e-5)


def _timing(kernel: str, shape: str, seconds: float, ok: bool = True) -> KernelTiming:
    return KernelTiming(kernel, shape, seconds, 1.0, 0.0 if ok else 1.0, ok)


@pytest.mark.parametrize("error", [RuntimeError, ValueError, TypeError])
def test_a_kernel_that_raises_while_measured_is_refused(
    error: type[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library kernel failing on this machine (a missing op, an older signature) is measured as
    refused, and the engine's choice falls on one that ran."""

    def broken(*args: object) -> None:
        raise error("not here")

    monkeypatch.setitem(KERNELS, "broken", dataclasses.replace(KERNELS["masked"], name="broken", attend_=broken))
    shapes = (ShapeClass("small", 2, 16, 32),)
    timings = select_module.time_kernels(["broken", "masked"], shapes, KernelShape(4, 2, 16, torch.float32, "cpu"))
    assert [(t.kernel, t.ok) for t in timings] == [("broken", False), ("masked", True)]
    assert fastest(timings) == "masked"


def test_with_a_window_each_kernel_is_timed_on_its_windowed_call_against_the_windowed_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`time_kernels(window=...)`: the calls the forward would take for that window, checked against
    the PyTorch windowed call; a kernel whose windowed call ignores the window is refused there."""
    shapes = (ShapeClass("past the window", 1, 96, 64),)
    heads = KernelShape(4, 2, 16, torch.float32, "cpu")
    names = ["masked", *(["native"] if native_library.available() else [])]
    assert all(t.ok for t in select_module.time_kernels(names, shapes, heads, window=40))
    blind = dataclasses.replace(KERNELS["masked"], name="blind", windowed=lambda w: (KERNELS["masked"].attend_, None))
    monkeypatch.setitem(KERNELS, "blind", blind)
    assert [t.ok for t in select_module.time_kernels(["blind"], shapes, heads, window=40)] == [False]
    assert [t.ok for t in select_module.time_kernels(["blind"], shapes, heads)] == [True]
    # queries at positions 64 .. 159 each see min(p + 1, 40) = 40 keys: 96 x 40 pairs
    assert shapes[0].flops(4, 16, window=40) == 4 * 96 * 40 * 4 * 16
    assert shapes[0].flops(4, 16) == 4 * (96 * 64 + 96 * 97 / 2) * 4 * 16


def test_the_fastest_correct_kernel_wins_with_each_shape_counted_equally() -> None:
    timings = [
        _timing("a", "big", 10.0),
        _timing("a", "small", 0.10),  # 1.0 + 2.0 = 3.0
        _timing("b", "big", 12.0),
        _timing("b", "small", 0.05),  # 1.2 + 1.0 = 2.2: wins
        _timing("c", "big", 1.0),
        _timing("c", "small", 0.01, ok=False),  # fastest, but wrong once
    ]
    assert fastest(timings) == "b"
    with pytest.raises(RuntimeError, match="no attention kernel"):
        fastest([_timing("c", "big", 1.0, ok=False)])


def test_choice_is_measured_once_then_cached_and_a_forced_kernel_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(select_module, "SHAPE_CLASSES", (ShapeClass("tiny", 2, 16, 32),))
    heads = KernelShape(4, 2, 32, torch.float32, "cpu")
    first = choose_kernel(AttentionConfig(profile_cache_dir=str(tmp_path)), heads, 1024)
    assert first in CPU_KERNELS and len(list(tmp_path.glob("attention-*.json"))) == 1

    def must_not_measure(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(select_module, "time_kernels", must_not_measure)
    assert choose_kernel(AttentionConfig(profile_cache_dir=str(tmp_path)), heads, 1024) == first
    assert choose_kernel(AttentionConfig("masked", str(tmp_path)), heads, 1024) == "masked"
    if "native" in CPU_KERNELS:  # another build of the native library is timed again, not trusted from the cache
        monkeypatch.setattr(native_library, "build_id", lambda: "another-build")
        with pytest.raises(AssertionError, match="measured again"):
            choose_kernel(AttentionConfig(profile_cache_dir=str(tmp_path)), heads, 1024)
    with pytest.raises(ConfigError, match="attention.kernel.*varlen.*cpu"):
        choose_kernel(AttentionConfig("varlen", str(tmp_path)), heads, 1024)


def _varlen_on_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int
) -> torch.Tensor:
    """What FlashAttention-2's varlen call computes (causal, bottom-right aligned), written with SDPA:
    a stand-in for the CUDA op so the packing around it is tested here."""
    from torch.nn.attention.bias import causal_lower_right

    out = torch.empty_like(q)
    assert int((cu_q[1:] - cu_q[:-1]).max()) == max_q and int((cu_k[1:] - cu_k[:-1]).max()) == max_k
    for i in range(cu_q.numel() - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        q4, k4, v4 = (t.permute(1, 0, 2)[None].float() for t in (q[qs], k[ks], v[ks]))
        mask = causal_lower_right(q4.shape[2], k4.shape[2])
        o = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
        out[qs] = o[0].transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_varlen_packs_each_piece_as_one_sequence(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered.hybrid.attention import kernels

    monkeypatch.setattr(kernels, "_varlen_attn", _varlen_on_cpu)
    spans, num_keys, prefix = SHAPES[shape]
    q, k, v, pk, pv = _case(spans, num_keys, prefix, 16, 4, 64, torch.bfloat16)
    expected = q.clone().float()
    reference_(expected, k, v, spans, pk, pv)
    got = q.clone()
    kernels.varlen_(got, k, v, spans, pk, pv)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[torch.bfloat16]


def _varlen_with_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):  # type: ignore[no-untyped-def]
    """torch's `varlen_attn` where it takes `window_size` and `enable_gqa` (the CPU stand-in inside)."""
    assert window_size == (-1, 0) and enable_gqa
    return _varlen_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k)


def _varlen_equal_heads(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):  # type: ignore[no-untyped-def]
    """torch's older `varlen_attn`: `is_causal` (bottom-right with FlashAttention-2), equal head counts."""
    assert is_causal and k.shape[1] == v.shape[1] == q.shape[1]
    return _varlen_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k)


@pytest.mark.parametrize("api", [_varlen_with_gqa, _varlen_equal_heads])
def test_varlen_calls_either_signature_of_torchs_varlen_attn(api, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Grouped K,V heads go through both versions of torch's API: as groups where it takes them,
    else each K,V head repeated for its query heads."""
    import torch.nn.attention.varlen as torch_varlen

    from tiered.hybrid.attention import kernels

    monkeypatch.setattr(torch_varlen, "varlen_attn", api)
    spans, num_keys, prefix = SHAPES["followers"]
    q, k, v, pk, pv = _case(spans, num_keys, prefix, 16, 4, 64, torch.bfloat16)
    expected = q.clone().float()
    reference_(expected, k, v, spans, pk, pv)
    got = q.clone()
    kernels.varlen_(got, k, v, spans, pk, pv)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[torch.bfloat16]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", [name for name, k in KERNELS.items() if k.runs_on("cuda", torch.bfloat16)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_kernels_equal_the_fp32_reference(kernel: str, shape: str) -> None:
    spans, num_keys, prefix = SHAPES[shape]
    q, k, v, pk, pv = (
        None if t is None else t.cuda() for t in _case(spans, num_keys, prefix, 16, 4, 128, torch.bfloat16)
    )
    expected = q.clone().float()  # type: ignore[union-attr]
    reference_(expected, k, v, spans, pk, pv)  # type: ignore[arg-type]
    got = q.clone()  # type: ignore[union-attr]
    KERNELS[kernel].attend_(got, k, v, spans, pk, pv)  # type: ignore[arg-type]
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[torch.bfloat16]
