"""The start-up harness: `tiered serve` timed to its first /health 200, written with its commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.server import run_startup_bench


def test_a_start_is_timed_to_health_and_kept_with_its_commit(tiny_dir: Path, tmp_path: Path) -> None:
    overrides = [f"model.path={tiny_dir}", "cache.block_tokens=16", f"scheduler.profile_cache_dir={tmp_path}"]
    run_startup_bench(None, overrides, 1, None, str(tmp_path / "s.json"))
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["bench"] == "startup" and doc["starts"] == 1 and set(doc["seconds"]) == {"tiered"}
    (seconds,) = doc["seconds"]["tiered"]
    assert 0 < seconds == doc["median_seconds"]["tiered"] and doc["base_over_ours"] == []
    assert len(doc["commits"]["tiered"].removesuffix("+dirty")) == 40


def test_no_start_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["startup", "--starts", "0"]) == 2
    assert "--starts must be >= 1, not 0" in capsys.readouterr().err
