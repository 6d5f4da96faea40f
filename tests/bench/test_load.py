"""Workload traces and the load runner: exact, seeded traces; interpolation; a small real run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.load import LoadOptions, run_load_bench
from benchmarks.stats import Summary, percentile, sustainable_qps, tail_name
from benchmarks.traces import (
    BenchError,
    PostRecommendationOptions,
    RevisitOptions,
    Trace,
    credit_verification,
    post_recommendation,
    revisit,
)
from tiered.config import load_config

VOCAB = list(range(10, 500))


def test_post_recommendation_is_seeded_exact_and_shares_only_within_a_user() -> None:
    opts = PostRecommendationOptions(users=5, posts=3, scale=0.01, seed=1)
    t = post_recommendation(VOCAB, opts)
    assert len(t) == 15 and t.requests == post_recommendation(VOCAB, opts).requests
    assert t.requests != post_recommendation(VOCAB, replace(opts, seed=2)).requests
    by_user: dict[int, list] = {}
    for r in t.requests:
        by_user.setdefault(r.user, []).append(r)
        assert 110 <= r.prefix_tokens <= 170  # 11K..17K x 0.01
        assert set(r.token_ids) <= set(VOCAB)
    for rs in by_user.values():
        assert len({tuple(r.token_ids[: r.prefix_tokens]) for r in rs}) == 1  # one profile per user
    firsts = {tuple(rs[0].token_ids[:16]) for rs in by_user.values()}
    assert len(firsts) == 5  # users share no prefix


def test_revisit_brings_every_user_back_after_all_others() -> None:
    t = revisit(VOCAB, RevisitOptions(users=4, posts=2, rounds=3, scale=0.01))
    assert len(t) == 24
    rounds = [t.requests[i * 8 : (i + 1) * 8] for i in range(3)]
    for batch in rounds:
        assert sorted(r.user for r in batch) == [0, 0, 1, 1, 2, 2, 3, 3]  # each user once per round
    profile = {r.user: r.token_ids[: r.prefix_tokens] for r in rounds[0]}
    assert all(r.token_ids[: r.prefix_tokens] == profile[r.user] for r in rounds[2])


def test_credit_verification_lengths_and_file_round_trip(tmp_path: Path) -> None:
    t = credit_verification(VOCAB, users=6, scale=0.01, seed=3)
    assert all(400 <= len(r.token_ids) <= 600 and r.prefix_tokens == 0 for r in t.requests)
    t.write(tmp_path / "t.json")
    back = Trace.read(tmp_path / "t.json")
    assert back.kind == "credit_verification" and back.params["scale"] == 0.01 and back.requests == t.requests
    with pytest.raises(BenchError, match="does not exist"):
        Trace.read(tmp_path / "missing.json")
    with pytest.raises(BenchError, match="min <= max"):
        credit_verification(VOCAB, users=2, min_tokens=10, max_tokens=5)


def test_sustainable_qps_is_a_measured_load_below_the_first_crossing() -> None:
    points = [(1.0, 0.1), (2.0, 0.2), (4.0, 1.0), (8.0, 0.3)]
    assert sustainable_qps(points, 0.6) == (2.0, True)  # no interpolation towards 4; 8 lies past a miss
    assert sustainable_qps(points, 0.05) == (0.0, True)  # missed even at the lowest load
    assert sustainable_qps(points, 9.0) == (8.0, False)  # met at the top: a lower bound
    assert sustainable_qps([], 1.0) == (0.0, True)


def test_percentiles_are_nearest_rank_and_a_tail_is_named_only_from_100_samples() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 25)], 0.99) == 24.0  # the maximum of 24
    assert percentile([float(i) for i in range(1, 201)], 0.99) == 198.0  # ceil(0.99 x 200) = 198th
    assert (tail_name(24), tail_name(99), tail_name(100)) == ("max of 24", "max of 99", "P99")


def test_a_small_load_run_writes_json_and_plots(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "cache.block_tokens=16",
            "scheduler.profile_tokens=[64,256]",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
        ],
    )
    trace = revisit(VOCAB, RevisitOptions(users=4, posts=2, rounds=2, scale=0.02))
    opts = LoadOptions(
        ["tiered", "prefillonly"], [0.5, 2.0], 0.25, None, None, None, 0, str(tmp_path / "load.json"), tmp_path
    )
    doc = run_load_bench(cfg, trace, opts)
    saved = json.loads((tmp_path / "load.json").read_text())
    assert saved["trace"]["kind"] == "revisit" and len(saved["runs"]) == 4
    for run in saved["runs"]:
        s = Summary(**run["summary"])
        assert s.num_requests == 16 and s.num_errors == 0 and s.p99_latency_seconds >= s.p50_latency_seconds > 0
        assert {r["request_id"] for r in run["records"]} == {r.request_id for r in trace.requests}
    by = {(s["system"], s["multiple"]): s for s in doc["summaries"]}
    assert by[("prefillonly", 0.5)]["host_hit_rate"] == 0  # discard: no host tier
    assert by[("tiered", 0.5)]["host_hit_rate"] > 0  # returning users' profiles come back from LMCache
    from benchmarks.plots import plot_load

    paths = plot_load(tmp_path / "load.json", tmp_path / "plots")
    assert [p.name for p in paths] == ["latency.png", "throughput.png", "cdf.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
