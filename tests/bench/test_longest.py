"""The longest-prompt harness on the tiny model: a measured bracket, then our server at that length;
longer with the residual stream on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.longest import BudgetResult, LongestOptions, find_peer, run_longest_bench, serve_ours
from benchmarks.memory_group import MemoryGroup
from benchmarks.mil import ForwardSetup, probe_peak
from benchmarks.traces import BenchError, ordinary_token_ids
from tiered.config import Config, load_config
from tiered.config.options import DEFAULT_CONFIG
from tiered.hybrid.loader import DTYPES, read_args
from tiered.hybrid.spill import Spill


def _cfg(tiny_dir: Path, tmp_path: Path, *extra: str) -> Config:
    return load_config(
        DEFAULT_CONFIG,
        [
            f"model.path={tiny_dir}",
            "model.dtype=float32",
            "cache.block_tokens=16",
            "scheduler.profile_tokens=[64,256]",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
            *extra,
        ],
    )


def _run(tiny_dir: Path, tmp_path: Path, *extra: str, answer_max_tokens: int = 0, budget: int = 0) -> dict:
    cfg = _cfg(tiny_dir, tmp_path, *extra)
    opts = LongestOptions(
        [budget or SEARCH_BUDGET],
        vllm_python=None,
        resolution=512,
        guess_tokens=(1024, 2048),
        json_path=str(tmp_path / "longest.json"),
        out_dir=tmp_path,
        answer_max_tokens=answer_max_tokens,
    )
    run_longest_bench(cfg, opts)
    doc = json.loads((tmp_path / "longest.json").read_text())
    assert doc["complete"] is True
    (r,) = doc["budgets"]
    return r  # type: ignore[no-any-return]


BUDGET = 16 * 2**20
# The searches' budget: under it the tiny model's longest prompt spilled is well past its longest in
# memory, and both are short enough for the probes' forwards to stay quick.
SEARCH_BUDGET = 10 * 2**20


def _check_bracket_and_served(r: dict) -> None:
    peaks = {int(n): p for n, p in r["peaks_by_len"].items()}
    assert r["ours_over_tokens"] - r["ours_tokens"] == 512
    assert peaks[r["ours_tokens"]] <= SEARCH_BUDGET < peaks[r["ours_over_tokens"]]
    assert r["ours_tokens"] > 2048
    # The server's own profile run may find its peak a little higher: it starts at most a few steps lower.
    assert r["ours_served_tokens"] == r["ours_tokens"] - 512 * len(r["ours_refused"]) > 0
    assert r["ours"]["tokens"] == r["ours_served_tokens"] - 1 and r["ours"]["seconds"] > 0
    assert r["peer_tokens"] == 0 and r["ours_at_peer_length"] is None


def test_ours_serves_the_longest_length_that_fits_and_longer_with_a_spill_dir(tiny_dir: Path, tmp_path: Path) -> None:
    in_memory = _run(tiny_dir, tmp_path / "memory")
    _check_bracket_and_served(in_memory)
    spill = [f"forward.spill_dir={tmp_path / 'spill'}", "forward.spill_min_tokens=1024"]
    spilled = _run(tiny_dir, tmp_path / "spilled", *spill)
    _check_bracket_and_served(spilled)
    # Per token the residual stream (hidden size x 4 bytes) leaves the measured peak, in the probes
    # and in the server's start-up profile run alike.
    assert spilled["ours_served_tokens"] > in_memory["ours_served_tokens"]


def test_a_run_stopped_while_serving_keeps_what_it_measured(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget's answers can take hours: the JSON is written after each step, so an operator's
    interrupt during our server's answer (raised here where `serve_ours` would run) leaves the
    probes' bracket on disk, marked incomplete."""

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("benchmarks.longest.serve_ours", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_dir, tmp_path)
    doc = json.loads((tmp_path / "longest.json").read_text())
    (r,) = doc["budgets"]
    assert doc["complete"] is False
    peaks = {int(n): p for n, p in r["peaks_by_len"].items()}
    assert peaks[r["ours_tokens"]] <= SEARCH_BUDGET < peaks[r["ours_over_tokens"]]
    assert r["ours_served_tokens"] == 0 and r["ours"] is None


def test_past_answer_max_tokens_ours_is_read_off_the_profiles_line_and_fits(tiny_dir: Path, tmp_path: Path) -> None:
    """Without probing each length: the lengths the server's profile measures, the line's reach
    under the budget, the server started there and not asked to answer; a forward of that length,
    measured afterwards, fits the budget."""
    spill_dir = tmp_path / "spill"
    # engine.profile_max_tokens at its default: the line through 16 K and 32 K tokens, whose peaks
    # differ by far more than a probe's noise (through 1 K and 2 K the slope can read near zero).
    line = [f"forward.spill_dir={spill_dir}", "forward.spill_min_tokens=4096"]
    r = _run(tiny_dir, tmp_path / "line", *line, "forward.chunk_tokens=256", answer_max_tokens=4096, budget=BUDGET)
    assert r["ours_from_line"] and {int(n) for n in r["peaks_by_len"]} == {4095, 16384, 32768}
    assert r["ours_tokens"] % 512 == 0 and r["ours_over_tokens"] == 0
    assert r["ours_served_tokens"] == r["ours_tokens"] - 512 * len(r["ours_refused"]) > 4096
    assert r["ours"] is None  # longer than --answer-max-tokens: started, not answered
    setup = ForwardSetup(str(tiny_dir), "float32", "cpu", 256, Spill(str(spill_dir), 4096))
    # Within 2% of the budget: two probes' noise moves the line's slope (the engine's own start-up
    # check reads lengths off the same line); a slope read near zero lands far over.
    assert probe_peak(setup, "hybrid", r["ours_served_tokens"]) <= 1.02 * BUDGET


def test_a_budget_whose_kv_holds_more_than_the_models_positions_is_named_before_vllm_starts(
    tiny_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(DEFAULT_CONFIG, [f"model.path={tiny_dir}", "model.dtype=float32"])
    args = read_args(tiny_dir)
    budget = 2 * args.max_position_embeddings * args.kv_bytes_per_token(DTYPES["float32"])
    opts = LongestOptions([budget], vllm_python=str(tmp_path / "no-python"), out_dir=tmp_path)
    with pytest.raises(BenchError, match=f"past the model's max_position_embeddings {args.max_position_embeddings}"):
        find_peer(cfg, BudgetResult(budget, 0), opts, [])


@pytest.mark.parametrize("timed", [True, False])
def test_ours_answers_the_peers_length_unless_told_lengths_alone(tiny_dir: Path, tmp_path: Path, timed: bool) -> None:
    """Our server at our longest length answers a prompt of the peer's length too (its time against
    the peer's), --repeats times; with --no-time-at-peer-length it answers only its own."""
    result = BudgetResult(BUDGET, 0, ours_tokens=2048, peer_tokens=1024)
    opts = LongestOptions([BUDGET], None, resolution=512, out_dir=tmp_path, repeats=2, time_at_peer_length=timed)
    serve_ours(_cfg(tiny_dir, tmp_path), result, opts, ordinary_token_ids(tiny_dir))
    assert result.ours_served_tokens == 2048 and result.ours is not None and result.ours.tokens == 2047
    if timed:
        assert result.ours_at_peer_length is not None and result.ours_at_peer_length.tokens == 1023
        assert len(result.ours_at_peer_length.runs) == 2
    else:
        assert result.ours_at_peer_length is None


def _limit_or_skip(tmp_path: Path) -> None:
    group = MemoryGroup("test-longest-rights", 1 << 30, [])
    if group.path is None:
        pytest.skip("no rights to make a memory cgroup here")
    group.close()


def test_ours_answers_inside_a_memory_cgroup_whose_use_is_recorded(tiny_dir: Path, tmp_path: Path) -> None:
    """With --memory-limit our server's processes run in a cgroup of that limit: the answer counts as
    served, and the peak (start-up included) and the spill file's page cache are recorded."""
    _limit_or_skip(tmp_path)
    spill = tmp_path / "spill"
    cfg = _cfg(tiny_dir, tmp_path, f"forward.spill_dir={spill}", "forward.spill_min_tokens=1024")
    result = BudgetResult(BUDGET, 0, ours_tokens=2048)
    opts = LongestOptions([BUDGET], None, resolution=512, out_dir=tmp_path, memory_limit_bytes=4 << 30)
    serve_ours(cfg, result, opts, ordinary_token_ids(tiny_dir))
    assert result.ours is not None and result.ours_answered_tokens == 2048
    use = result.ours_memory
    assert use is not None and use.limit_bytes == 4 << 30 and use.method.startswith("cgroup")
    # the API and engine processes' Python and torch, at least, and no kill
    assert 100 * 2**20 < use.peak_bytes < 4 << 30 and use.oom_kills == 0
    assert use.disk_written_bytes > 0  # the residual stream went to the spill file


def test_a_server_killed_at_the_limit_has_not_served_its_length(tiny_dir: Path, tmp_path: Path) -> None:
    _limit_or_skip(tmp_path)
    result = BudgetResult(BUDGET, 0, ours_tokens=2048)
    opts = LongestOptions([BUDGET], None, resolution=512, out_dir=tmp_path, memory_limit_bytes=96 << 20)
    with pytest.raises(BenchError, match="killed a process at the memory cgroup's limit of 100663296 bytes"):
        serve_ours(_cfg(tiny_dir, tmp_path), result, opts, ordinary_token_ids(tiny_dir))
    assert result.ours is None and result.ours_answered_tokens == 0 and result.ours_refused == []


def test_ours_can_be_held_to_a_multiple_of_the_peers_length(tiny_dir: Path, tmp_path: Path) -> None:
    result = BudgetResult(BUDGET, 0, ours_tokens=8192, peer_tokens=1100)
    opts = LongestOptions([BUDGET], None, resolution=512, out_dir=tmp_path, ours_max_tokens=2.0)
    opts.time_at_peer_length = False
    serve_ours(_cfg(tiny_dir, tmp_path), result, opts, ordinary_token_ids(tiny_dir))
    # 2 x 1,100 in whole steps of 512: started and answered there, not at the 8,192 that fit
    assert result.ours_served_tokens == 2048 and result.ours is not None and result.ours.tokens == 2047
