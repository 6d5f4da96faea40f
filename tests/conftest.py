"""Shared fixtures: project-made checkpoints, written once per test session."""

from __future__ import annotations

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
