"""The MIL harness: a real probe's peak follows the mode's memory law; bisection lands on the edge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.mil import ForwardSetup, find_mil, forward_flops, probe_peak
from tiered.hybrid.loader import read_args


def test_hybrid_peak_grows_far_slower_than_vanilla(tiny_dir: Path) -> None:
    """Per extra token, vanilla holds the MLP intermediate and all layers' K,V; hybrid neither."""
    slope = {}
    for mode in ("vanilla", "hybrid"):
        setup = ForwardSetup(str(tiny_dir), "float32", "cpu", 512)
        short, long = (probe_peak(setup, mode, n) for n in (4096, 16384))
        slope[mode] = (long - short) / (16384 - 4096)
    a = read_args(tiny_dir)
    # Hybrid's live set per token: residual, q/attention output, one layer's K,V, one group's scratch.
    hybrid_floor = 4 * (2 * a.hidden_size + a.kv_elems_per_token_per_layer + a.num_heads // a.num_kv_heads * a.head_dim)
    assert slope["hybrid"] < 1.5 * hybrid_floor, slope
    assert slope["vanilla"] > 3 * slope["hybrid"], slope


def test_bisection_finds_the_longest_length_that_fits(tiny_dir: Path) -> None:
    budget = 24 * 2**20
    setup = ForwardSetup(str(tiny_dir), "float32", "cpu", 512)
    r = find_mil(setup, "vanilla", budget, start_tokens=1024, resolution=512, max_tokens=65536)
    assert not r.mil_capped and r.mil_tokens >= 1024
    assert r.peak_bytes_by_len[r.mil_tokens] <= budget
    over = [n for n, peak in r.peak_bytes_by_len.items() if peak > budget]
    assert over and min(over) - r.mil_tokens <= 512


def test_flops_count_the_causal_attention_pairs(tiny_dir: Path) -> None:
    a = read_args(tiny_dir)
    # Doubling the length doubles the linear part and about quadruples the attention part.
    f1, f2 = forward_flops(a, 1000), forward_flops(a, 2000)
    assert 2 * f1 < f2 < 4 * f1
    lm_head = 2 * a.hidden_size * a.vocab_size  # last token only
    per_pair = 4 * a.head_dim * a.num_heads * a.num_layers
    linear_per_token = forward_flops(a, 1) - lm_head - per_pair
    assert f1 == pytest.approx(linear_per_token * 1000 + per_pair * 1000 * 1001 / 2 + lm_head, rel=1e-9)


def test_cli_writes_the_documented_json(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mil.json"
    code = main(
        [
            "mil",
            "--model",
            str(tiny_dir),
            "--budget",
            "20MiB",
            "--modes",
            "hybrid",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--lengths",
            "256",
            "--start-tokens",
            "1024",
            "--max-tokens",
            "2048",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    (mode,) = doc["modes"]
    assert set(mode) >= {"mode", "budget_bytes", "mil_tokens", "peak_bytes_by_len"}
    assert mode["mode"] == "hybrid" and mode["budget_bytes"] == 20 * 2**20
    assert mode["mil_tokens"] == 2048 and mode["mil_capped"]
    assert mode["throughput"][0]["num_tokens"] == 256 and mode["throughput"][0]["tokens_per_s"] > 0
    assert "hybrid" in capsys.readouterr().out


def test_cli_names_a_bad_budget(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["mil", "--budget", "lots"])
    assert "'lots' is not a size" in capsys.readouterr().err
