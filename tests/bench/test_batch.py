"""`python -m benchmarks batch` runs end to end on the tiny model and reports what it says it does."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.cli import main
from tiered.hybrid import pointwise
from tiered.native import library as native


def test_batch_bench_writes_both_cases(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "batch.json"
    args = [
        "batch",
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--requests",
        "4",
        "--new-tokens",
        "20",
        "--prefix-tokens",
        "256",
        "--hit-new-tokens",
        "100",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    visit, attn, hit = doc["visit"], doc["attention"], doc["hit_saving"]
    assert (visit["num_requests"], visit["new_tokens"], visit["prefix_tokens"]) == (4, 20, 256)
    assert visit["speedup"] == visit["single_seconds"] / visit["batched_seconds"] > 0
    assert (attn["num_queries"], attn["num_keys"]) == (80, 256) and attn["flops_per_s"] > 0
    assert hit["saving"] == hit["recompute_seconds"] / hit["with_prefix_seconds"] and hit["ideal_saving"] > 1
    fused = doc["pointwise"]
    if native.available():
        assert fused["speedup"] == fused["pytorch_seconds"] / fused["fused_seconds"] > 0
    else:
        assert fused is None
    assert pointwise._fused(torch.ones(2, 2), torch.ones(2)) is not None or not native.available()  # switched back on
