"""A short soak of a real `tiered serve`: nothing lost or doubled, no 5xx, blocks back when idle."""

from __future__ import annotations

from pathlib import Path

from benchmarks.soak import SoakOptions, run_soak
from tiered.config import load_config


def test_a_short_soak_answers_every_valid_request_exactly_once(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "cache.block_tokens=16",
            "cache.device_tier_bytes=262144",
            "cache.host.lmcache={max_local_cpu_size: 0.002}",
            "scheduler.profile_tokens=[64,256]",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
        ],
    )
    opts = SoakOptions(
        minutes=0.25,
        concurrency=8,
        invalid_fraction=0.3,
        users=8,
        profile_tokens=300,
        out_dir=tmp_path,
        json_path=str(tmp_path / "soak.json"),
    )
    report = run_soak(cfg, opts)
    assert report["exactly_once"] and report["valid_failures"] == [] and report["server_errors_5xx"] == 0
    assert report["valid_sent"] > 20 and report["invalid_sent"] > 5
    assert all(400 <= int(key.split(":")[1]) < 500 for key in report["invalid_by_status"])
    assert report["probe_answers"] >= 1 and report["probe_max_abs_diff_vs_forward"] < 1e-4
    assert report["idle_pinned_blocks"] == 0 and report["idle_waiting"] == 0 and report["engine_alive"]
