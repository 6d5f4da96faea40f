"""The CUDA path of the same code: run where a GPU is present (skipped elsewhere, marked `gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from through_tiers import forward_with_tiers

from tiered.config import CacheConfig, HostTierConfig
from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import load_model
from tiered.hybrid.memory import PeakShape, measure_forward_peak
from tiered.hybrid.spill import ResidualFile, Spill
from tiered.offload.tiers import KVTiers, TierSetup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_forward_matches_cpu(tiny_dir: Path) -> None:
    cpu, gpu = load_model(tiny_dir, "float32", "cpu"), load_model(tiny_dir, "float32", "cuda")
    ids = torch.randint(0, 1300, (3000,), generator=torch.Generator().manual_seed(0))
    for mode in ("vanilla", "chunked", "hybrid"):
        ref = forward(cpu, ids, mode=mode, chunk_tokens=256)
        got = forward(gpu, ids, mode=mode, chunk_tokens=256).cpu()
        assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item(), mode


def test_cuda_offload_through_pinned_side_stream_gives_the_same_logits(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, "float32", "cuda")
    a = model.args
    cfg = CacheConfig(
        block_tokens=16,
        device_tier_bytes=64 * 16 * a.kv_bytes_per_token(torch.float32),
        retention="none",
        host=HostTierConfig(lmcache={"max_local_cpu_size": 0.05}),
    )
    tiers = KVTiers(cfg, TierSetup(a, torch.float32, "cuda", "test-cuda"))
    try:
        ids = torch.randint(0, 1300, (500,), generator=torch.Generator().manual_seed(1))
        ref, first = forward_with_tiers(model, tiers, tiers.new_request("a", ids))
        assert first.store is not None and first.store.views[0].is_pinned()  # LMCache's pinned host memory
        tiers.flush()
        again, second = forward_with_tiers(model, tiers, tiers.new_request("b", ids))
        assert second.split.num_host_hit_tokens == 496
        assert (again - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    finally:
        tiers.close()


def test_cuda_peak_is_max_allocated(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, "bfloat16", "cuda")
    short = measure_forward_peak(model, PeakShape(1024), "hybrid", 256)
    long = measure_forward_peak(model, PeakShape(8192), "hybrid", 256)
    assert short.method == "cuda max allocated" and short.weights_bytes < short.peak_bytes < long.peak_bytes


def test_cuda_spilled_forward_equals_the_one_in_memory(tiny_dir: Path, tmp_path: Path) -> None:
    """The residual stream through a file and a pinned host buffer: the same logits, bit for bit."""
    model = load_model(tiny_dir, "bfloat16", "cuda")
    ids = torch.randint(0, 1300, (3000,), generator=torch.Generator().manual_seed(2))
    ref = forward_batch(model, [BatchItem(ids)], chunk_tokens=256)
    got = forward_batch(model, [BatchItem(ids)], chunk_tokens=256, spill=Spill(str(tmp_path), 1))
    assert got.device.type == "cuda" and torch.equal(ref, got)
    stream = ResidualFile(str(tmp_path), 8, 4, torch.bfloat16, 8, torch.device("cuda"))
    try:
        rows = torch.randn((8, 4), device="cuda").to(torch.bfloat16)
        stream.write(0, rows)
        back = stream.read(0, 8)
        assert back.device.type == "cuda" and torch.equal(back, rows)
        assert torch.equal(stream.rows(torch.tensor([5, 1])), rows[[5, 1]])
    finally:
        stream.close()
