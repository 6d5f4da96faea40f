"""The pipeline simulation: its pipe arithmetic, and the waves it compares."""

from __future__ import annotations

import pytest

from benchmarks.cli import main
from benchmarks.pipeline_sim import StageCosts, Workload, simulate, visits

FLAT = StageCosts(c0=0.0, c1=1e-3, c2=0.0, c4=0.0, hidden_size=8)  # 1 ms per computed token, nothing else


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_fill_and_drain_leaves_the_textbook_bubble_and_continuous_flow_does_not(stages: int) -> None:
    """Equal micro-batches (no reuse, equal prompts): per batch, a stage idles S - 1 of K + S - 1 slots."""
    w = Workload(visits=64, posts=8, profile_tokens=1000, post_tokens=100, cached_users=0, visits_per_batch=2)
    k = 2 * stages
    gpipe = simulate(FLAT, w, stages, k, "count", "gpipe")
    flow = simulate(FLAT, w, stages, k, "count", "waves")
    assert gpipe.bubble_fraction == pytest.approx((stages - 1) / (k + stages - 1), abs=0.03)
    assert flow.bubble_fraction < 0.02 and flow.throughput_per_device > gpipe.throughput_per_device
    assert simulate(FLAT, w, 1, 2, "count", "gpipe").throughput_per_device == pytest.approx(1.0, abs=1e-6)


def test_with_reuse_waves_beat_the_naive_cut_at_eight_stages() -> None:
    w = Workload()
    naive = simulate(FLAT, w, 8, 16, "count", "gpipe")
    waves = simulate(FLAT, w, 8, 16, "waves", "waves")
    assert waves.throughput_per_device >= 1.5 * naive.throughput_per_device and waves.bubble_fraction < 0.15
    assert (
        simulate(FLAT, w, 4, 8, "waves", "gpipe").microbatch_imbalance
        < simulate(FLAT, w, 4, 8, "count", "gpipe").microbatch_imbalance
    )


def test_visits_reuse_profiles_and_are_seeded() -> None:
    w = Workload(visits=50, users=5, cached_users=5)
    vs = visits(w)
    assert vs == visits(w) and all(len(v) == 8 for v in vs)
    returning = [v for v in vs if v[0].num_cached_tokens > 0]
    assert returning and all(j.num_cached_tokens > 0 for v in returning for j in v)
    new = [v for v in vs if v[0].num_cached_tokens == 0]
    assert len(new) == 5 and all(j.after == v[0].request_id for v in new for j in v[1:])


def test_the_command_prints_its_table_and_refuses_bad_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline-sim", "--stages", "1,2", "--visits", "16"]) == 0
    assert "by cost" in capsys.readouterr().out
    assert main(["pipeline-sim", "--costs", "1,2"]) == 2
    assert "--costs" in capsys.readouterr().err
