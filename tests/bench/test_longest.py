"""The longest-prompt harness on the tiny model: a measured bracket, then our server at that length."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.longest import LongestOptions, run_longest_bench
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG


def test_ours_serves_the_longest_length_that_fits_and_the_next_is_over(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        DEFAULT_CONFIG,
        [
            f"model.path={tiny_dir}",
            "model.dtype=float32",
            "cache.block_tokens=16",
            "scheduler.profile_tokens=[64,256]",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
        ],
    )
    budget = 16 * 2**20
    opts = LongestOptions(
        [budget],
        vllm_python=None,
        resolution=512,
        guess_tokens=(1024, 2048),
        json_path=str(tmp_path / "longest.json"),
        out_dir=tmp_path,
    )
    run_longest_bench(cfg, opts)
    (r,) = json.loads((tmp_path / "longest.json").read_text())["budgets"]
    peaks = {int(n): p for n, p in r["peaks_by_len"].items()}
    assert r["ours_over_tokens"] - r["ours_tokens"] == 512
    assert peaks[r["ours_tokens"]] <= budget < peaks[r["ours_over_tokens"]]
    assert r["ours_tokens"] > 2048
    # The server's own profile run may find its peak a little higher: it starts at most a few steps lower.
    assert r["ours_served_tokens"] == r["ours_tokens"] - 512 * len(r["ours_refused"]) > 0
    assert r["ours"]["tokens"] == r["ours_served_tokens"] - 1 and r["ours"]["seconds"] > 0
    assert r["peer_tokens"] == 0 and r["ours_at_peer_length"] is None
