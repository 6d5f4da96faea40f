"""`python -m benchmarks attention` runs end to end and reports every kernel on every shape it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import kernels as kernels_module
from benchmarks.cli import main
from tiered.hybrid.attention.select import ShapeClass, available


def test_attention_bench_times_every_kernel_on_every_shape(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes = (ShapeClass("shared", 3, 16, 64), ShapeClass("causal", 1, 96, 0), ShapeClass("too long", 1, 4096, 0))
    monkeypatch.setattr(kernels_module, "ATTENTION_SHAPES", shapes)
    out = tmp_path / "attention.json"
    args = [
        "attention",
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-tokens",
        "256",
        "--json",
        str(out),
        "--vllm-library",
        "none",
        "--prefix",
        "paged,gathered",
        "--block-tokens",
        "16",
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["vllm_cpu_unavailable"] == "disabled (attention.vllm_library: none)"
    assert doc["dtype"] == "float32" and doc["machine"]["threads"] >= 1
    assert doc["prefix_layouts"] == ["paged", "gathered"] and doc["block_tokens"] == 16
    got = {(t["kernel"], t["shape"], t["prefix"]) for t in doc["timings"]}
    here = available("cpu", torch.float32, 32)  # the tiny model's head dim; kernels of other dtypes are left out
    # "too long" skipped
    assert got == {(k, s, p) for k in here for s in ("shared", "causal") for p in ("paged", "gathered")}
    assert all(t["ok"] and t["max_error"] < 1e-4 and t["gflops"] > 0 for t in doc["timings"])
    assert doc["fastest"] in here


def test_a_max_tokens_below_every_shape_is_named(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels_module, "ATTENTION_SHAPES", (ShapeClass("causal", 1, 96, 0),))
    args = ["attention", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens", "64", "--vllm-library", "none"]
    assert main(args) == 2
    assert "--max-tokens 64 leaves no shape class (the shortest has 96 tokens)" in capsys.readouterr().err


def test_a_kernel_that_does_not_run_here_is_named(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "attention",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--kernels",
        "flash,sdpa",
        "--vllm-library",
        "none",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--kernels sdpa: not a kernel that runs here" in err and "flash" in err.split("here")[-1]


def test_a_prefix_layout_that_does_not_exist_is_named(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["attention", "--model", str(tiny_dir), "--device", "cpu", "--prefix", "paged,scattered"]
    assert main(args + ["--vllm-library", "none"]) == 2
    assert "--prefix paged,scattered: each one of contiguous, paged, gathered" in capsys.readouterr().err
