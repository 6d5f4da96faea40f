"""The C++ kernel (`native`): each ISA path this CPU runs against the fp32 reference, the prefix
read through a block table, its errors, and the fallback when it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_attention import SHAPES, TOLERANCE, _case

from tiered.hybrid.attention import KERNELS, Span, native, reference_
from tiered.hybrid.attention.kernels import windowed
from tiered.native import library as native_library
from tiered.native.build import build, library_path

ROOT = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(
    not native_library.available(), reason="the native kernel's library could not be built here"
)


# The head dims a path takes are multiples of its dot products' unit (others are refused, or `auto` picks another).
HEAD_DIM_STEP = {"avx512bf16": 2, "amx": 32}


def _isa_or_skip(isa: str) -> str:
    if isa not in native_library.cpu_isas():
        pytest.skip(f"this CPU does not run the {isa} path (it runs: {', '.join(native_library.cpu_isas())})")
    return isa


def _error_against_reference(
    isa: str,
    case: tuple[list[Span], int, int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> float:
    """The native kernel's path `isa` on a case of SHAPES' form (the prefix as one pool block): the
    largest difference from the fp32 reference. Checks the path ran and kept q's dtype."""
    spans, num_keys, prefix = case
    q, k, v, pk, pv = _case(spans, num_keys, prefix, heads, kv_heads, head_dim, dtype)
    expected = q.clone().float()
    reference_(expected, k, v, spans, pk, pv)
    got = q.clone()
    one_block = torch.zeros(1, dtype=torch.int64)
    paged = native.PagedPrefix(pk[None], pv[None], one_block, prefix) if pk is not None and pv is not None else None
    assert native.attend_paged_(got, k, v, spans, paged, isa=isa) == isa
    assert got.dtype == dtype
    return (got.float() - expected).abs().max().item()


@needs_native
@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # head dims of whole registers, and ones that are not (the value width padded inside: 80, 48; odd: 33)
    [(4, 4, 64), (16, 4, 64), (8, 1, 128), (8, 2, 80), (4, 4, 48), (4, 2, 33)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_path_equals_the_fp32_reference(
    isa: str, shape: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _isa_or_skip(isa)
    if head_dim % HEAD_DIM_STEP.get(isa, 1):
        pytest.skip(f"the {isa} path's dot products take head dims in multiples of {HEAD_DIM_STEP[isa]} (tested below)")
    assert _error_against_reference(isa, SHAPES[shape], heads, kv_heads, head_dim, dtype) <= TOLERANCE[dtype]


@needs_native
@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefix_is_read_through_a_block_table(isa: str, dtype: torch.dtype) -> None:
    """Blocks scattered in a pool among others' blocks, out of order, the last one partly used:
    the same answer as the prefix gathered into one contiguous tensor."""
    _isa_or_skip(isa)
    spans = [Span(0, 0, 40), Span(40, 40, 25, ((0, 12),))]
    q, k, v, _, _ = _case(spans, 65, 0, 16, 4, 64, dtype)
    g = torch.Generator().manual_seed(7)
    pool_k, pool_v = (torch.randn(9, 16, 4, 64, generator=g).to(dtype) for _ in range(2))
    block_ids = torch.tensor([5, 0, 7, 2])
    prefix_tokens = 3 * 16 + 5
    prefix_k, prefix_v = (pool[block_ids].flatten(0, 1)[:prefix_tokens] for pool in (pool_k, pool_v))
    expected = q.clone().float()
    reference_(expected, k, v, spans, prefix_k, prefix_v)
    got = q.clone()
    native.attend_paged_(got, k, v, spans, native.PagedPrefix(pool_k, pool_v, block_ids, prefix_tokens), isa=isa)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


# Sliding windows over every kind of key: a prefix in scattered pool blocks, visible ranges, own keys;
# windows inside one key tile, across several, and past everything (no key hidden).
WINDOWED = {
    "prefix, visible, own": ([Span(0, 40, 150, ((0, 40),)), Span(150, 190, 60, ((100, 120),))], 250, 3 * 16 + 5),
    "a long own span": ([Span(0, 0, 700)], 700, 0),
    "last rows": ([Span(0, 300, 1, ((0, 300),)), Span(1, 301, 1, ((250, 301),))], 302, 2 * 16),
}


@needs_native
@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("shape", list(WINDOWED))
@pytest.mark.parametrize("window", [1, 5, 64, 100, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_window_hides_the_keys_before_it_as_the_pytorch_call_does(
    isa: str, shape: str, window: int, dtype: torch.dtype, threads: int
) -> None:
    """Each query sees only the keys at positions above its own minus the window, positions running
    from the prefix's first token through the visible ranges to its own keys: the fp32 PyTorch
    windowed call's answer, with the prefix read through a block table."""
    _isa_or_skip(isa)
    spans, num_keys, prefix_tokens = WINDOWED[shape]
    q, k, v, _, _ = _case(spans, num_keys, 0, 8, 2, 64, dtype)
    g = torch.Generator().manual_seed(window)
    pool_k, pool_v = (torch.randn(7, 16, 2, 64, generator=g).to(dtype) for _ in range(2))
    block_ids = torch.tensor([4, 1, 6, 2])[: -(-prefix_tokens // 16)]
    prefix_k, prefix_v = (pool[block_ids].flatten(0, 1)[:prefix_tokens] for pool in (pool_k, pool_v))
    expected = q.clone().float()
    pk, pv = (prefix_k.float(), prefix_v.float()) if prefix_tokens else (None, None)
    windowed(window)(expected, k.float(), v.float(), spans, pk, pv)
    got = q.clone()
    paged = native.PagedPrefix(pool_k, pool_v, block_ids, prefix_tokens) if prefix_tokens else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native.attend_paged_(got, k, v, spans, paged, isa=isa, window=window)
    finally:
        torch.set_num_threads(before)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]
    # the kernel's windowed pair is the same call (contiguous prefix: one block)
    attend_window_, _ = KERNELS["native"].windowed(window)  # type: ignore[misc]
    again = q.clone()
    attend_window_(again, k, v, spans, prefix_k if prefix_tokens else None, prefix_v if prefix_tokens else None)
    assert (again.float() - expected).abs().max().item() <= TOLERANCE[dtype]


# Spans with many query blocks: a task then runs several consecutive blocks over each key tile (the tile made
# ready once for all of them), the causal tiles skipping the blocks before their first key.
GROUPED = {
    # a long chunk whose earlier tokens are visible, and a span after it on the same keys
    "chunk after chunk": ([Span(0, 300, 700, ((0, 300),)), Span(700, 1000, 90, ((0, 1000),))], 1090, 0),
    # a suffix longer than its (made ready) prefix, and a short span on the same prefix
    "suffix past the prefix": ([Span(0, 0, 900), Span(900, 900, 40)], 940, 320),
    # a chunk on a history of more K,V per KV head than a core's cache: its blocks in the fewest tasks
    "chunk on a long history": ([Span(0, 5000, 200, ((0, 5000),))], 5200, 0),
    # a piece and a short span on a prefix too large to be made ready once per call: each task makes the
    # prefix's tiles ready for its blocks
    "piece on a long prefix": ([Span(0, 0, 300), Span(300, 300, 40)], 340, 5000),
}


@needs_native
@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("shape", list(GROUPED))
# group 4 (16 positions a block; 8 on amx), group 3 (21, or 10 on amx: blocks that start inside a key tile),
# group 1 at head dim 128
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (6, 2, 64), (2, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tasks_of_many_query_blocks_equal_the_fp32_reference(
    isa: str, shape: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    _isa_or_skip(isa)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the fewest tasks, so the most blocks a task
    try:
        error = _error_against_reference(isa, GROUPED[shape], heads, kv_heads, head_dim, dtype)
    finally:
        torch.set_num_threads(threads)
    assert error <= TOLERANCE[dtype]


@needs_native
def test_auto_takes_the_best_path_here_and_strided_views_are_read_in_place() -> None:
    spans, num_keys, prefix = SHAPES["shared prefix"]
    q, k, v, pk, pv = _case(spans, num_keys, prefix, 16, 4, 64, torch.float32)
    kv = torch.stack([k, v], 1)  # [N, 2, Hkv, Dh]: k and v as strided views of one tensor
    expected = q.clone()
    reference_(expected, k, v, spans, pk, pv)
    got = q.clone()
    assert (
        native.attend_paged_(
            got,
            kv[:, 0],
            kv[:, 1],
            spans,
            native.PagedPrefix(pk[None], pv[None], torch.zeros(1, dtype=torch.int64), prefix),  # type: ignore[index]
        )
        == native_library.cpu_isas()[0]
    )
    assert (got - expected).abs().max().item() <= TOLERANCE[torch.float32]


@needs_native
def test_bad_inputs_are_errors_that_say_what_is_wrong() -> None:
    q, k, v, _, _ = _case([Span(0, 0, 8)], 8, 0, 4, 2, 64, torch.float32)
    pool = torch.zeros(2, 16, 2, 64)
    with pytest.raises(RuntimeError, match="block id 3 is not in the pool"):
        native.attend_paged_(q, k, v, [Span(0, 0, 8)], native.PagedPrefix(pool, pool, torch.tensor([3]), 10))
    with pytest.raises(RuntimeError, match="do not fit"):
        native.attend_paged_(q, k, v, [Span(0, 0, 8)], native.PagedPrefix(pool, pool, torch.tensor([0]), 17))
    with pytest.raises(RuntimeError, match="reaches past"):
        native.attend_paged_(q, k, v, [Span(0, 4, 8)], None)
    if "avx512bf16" in native_library.cpu_isas():
        odd = _case([Span(0, 0, 8)], 8, 0, 4, 2, 33, torch.bfloat16)
        with pytest.raises(RuntimeError, match="takes head dims that are multiples of 2, got 33"):
            native.attend_paged_(odd[0], odd[1], odd[2], [Span(0, 0, 8)], None, isa="avx512bf16")
        assert native.attend_paged_(odd[0], odd[1], odd[2], [Span(0, 0, 8)], None) == "avx512"
    if "amx" in native_library.cpu_isas():
        q80, k80, v80, _, _ = _case([Span(0, 0, 8)], 8, 0, 4, 2, 80, torch.bfloat16)
        with pytest.raises(RuntimeError, match="takes head dims that are multiples of 32 up to 256, got 80"):
            native.attend_paged_(q80, k80, v80, [Span(0, 0, 8)], None, isa="amx")
        assert native.attend_paged_(q80, k80, v80, [Span(0, 0, 8)], None) == "avx512bf16"
    with pytest.raises(RuntimeError, match="unknown isa"):
        native.attend_paged_(q, k, v, [Span(0, 0, 8)], None, isa="neon")
    missing = [isa for isa in native.ISAS if isa not in native_library.cpu_isas()]
    if missing:
        with pytest.raises(RuntimeError, match=f"cannot run the {missing[0]} path"):
            native.attend_paged_(q, k, v, [Span(0, 0, 8)], None, isa=missing[0])


@needs_native
def test_the_library_is_cached_by_source_torch_and_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    path = library_path()
    assert path.exists() and path.is_relative_to(ROOT / ".cache" / "native")

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert build() == path
    monkeypatch.setenv("CXX", "clang++")
    assert library_path() != path


FALLBACK = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from tiered.hybrid.attention import select
from tiered.native import build
from tiered.config import AttentionConfig, ConfigError
build.default_cache_dir = lambda: Path(sys.argv[1])
build.main()
print("available:", ",".join(select.available("cpu")))
try:
    heads = select.KernelShape(4, 2, 64, __import__("torch").float32, "cpu")
    select.choose_kernel(AttentionConfig("native", sys.argv[1]), heads, 256)
except ConfigError as e:
    print("config error:", e)
"""


def test_without_a_compiler_the_engine_keeps_the_pytorch_kernels(tmp_path: Path) -> None:
    """CXX=/bin/false is the only fault: the build says why, exits 0 (what `make venv` runs), and
    `native` is not among the kernels here; forcing it is a config error."""
    env = {**os.environ, "CXX": "/bin/false"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FALLBACK), str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "WARNING native attention kernel not built: '/bin/false' failed (exit 1)" in out
    assert "the engine uses the PyTorch kernels" in out
    assert "available: flash-head,flash,flash-f32,masked" in out
    assert "config error: config key 'attention.kernel': 'native' does not run on cpu" in out
    assert not list(tmp_path.glob("*/attend.so"))


def test_native_is_registered_beside_the_pytorch_kernels() -> None:
    assert KERNELS["native"].dtypes == (torch.float32, torch.bfloat16)
    assert KERNELS["native"].runs_on("cpu") == native_library.available()
    assert not KERNELS["native"].runs_on("cpu", torch.float16)
