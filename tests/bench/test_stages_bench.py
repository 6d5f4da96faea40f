"""`python -m benchmarks stages`: its system names, and a run on the tiny model (equal answers, bubbles reported)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.stages import system_overrides
from benchmarks.traces import BenchError


def test_system_names_set_the_pipeline_keys_and_bad_ones_are_named() -> None:
    assert system_overrides("1x2") == ["engine.pipeline_stages=1", "engine.threads=2", "cache.suffix=discard"]
    assert system_overrides("2x1-waves-2+host")[:3] == [
        "engine.pipeline_stages=2",
        "engine.threads_per_stage=1",
        "cache.suffix=offload",
    ]
    assert system_overrides("2x1-fill-drain")[-1] == "engine.pipeline_schedule=fill-drain"
    assert system_overrides("4x2-waves-8") == [
        "engine.pipeline_stages=4",
        "engine.threads_per_stage=2",
        "cache.suffix=discard",
        "engine.pipeline_schedule=waves",
        "engine.pipeline_microbatches=8",
    ]
    assert system_overrides("2x1-waves-4-flight1")[-1] == "engine.pipeline_batches_in_flight=1"
    for bad in ("2x", "waves-2", "2x1-waves", "2x1-fill", "2x1-waves-2-flight", "1x2+offload"):
        with pytest.raises(BenchError, match=re.escape(bad)):
            system_overrides(bad)


def test_two_stages_answer_as_one_process_and_report_their_bubbles(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    code = main(
        [
            "stages",
            "--set",
            f"model.path={tiny_dir}",
            "--set",
            "model.dtype=float32",
            "--set",
            f"attention.profile_cache_dir={tmp_path}",
            "--set",
            f"scheduler.profile_cache_dir={tmp_path}",
            "--set",
            "cache.block_tokens=16",
            "--set",
            "cache.device_tier_bytes=98304",  # 12 blocks: ~1 profile
            "--systems",
            "1x2,2x1-waves-2,2x1-waves-2+host",
            "--users",
            "2",
            "--visits",
            "4",
            "--posts",
            "3",
            "--rounds",
            "4",
            "--profile-tokens",
            "120",
            "--post-tokens",
            "20",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["systems"]}
    assert rows["1x2"]["bubbles"] == [] and len(rows["2x1-waves-2"]["bubbles"]) == 2
    assert all(0.0 <= b < 1.0 for b in rows["2x1-waves-2"]["bubbles"])
    assert rows["2x1-waves-2"]["max_logprob_diff"] < 1e-4
    assert rows["1x2"]["computed_tokens"] == rows["2x1-waves-2"]["computed_tokens"] > 0
    assert rows["2x1-waves-2+host"]["max_logprob_diff"] < 1e-4
    # One visit a round: a user back after the other's visit finds their profile in every stage's host tier.
    assert rows["2x1-waves-2+host"]["host_hit_tokens"] > 0 and rows["2x1-waves-2"]["host_hit_tokens"] == 0
    assert all(e is not None for e in rows["2x1-waves-2"]["stage_jct_errors"])  # each stage's model learnt
    assert len(rows["2x1-waves-2"]["stage_jct_errors"]) == 2 and rows["1x2"]["stage_jct_errors"] == []
