"""Project-made LoRA adapters in PEFT's format, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered.embedded import make_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Two adapters of different ranks and target modules, one with rsLoRA scaling.
ADAPTERS = {
    "small": {"rank": 4, "alpha": 8.0, "targets": ("q_proj", "v_proj"), "seed": 1},
    "wide": {"rank": 8, "alpha": 16.0, "targets": ALL, "use_rslora": True, "seed": 2},
}


@pytest.fixture(scope="session")
def adapter_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(model, adapter) -> folder, for the tiny Llama and the tiny Qwen2 (q/k/v biases, tied embeddings)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        (model, name): make_adapter(model_dirs[model], root / f"{model}-{name}", **spec)  # type: ignore[arg-type]
        for model in ("tiny", "tiny-qwen2")
        for name, spec in ADAPTERS.items()
    }
