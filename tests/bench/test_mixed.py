"""`python -m benchmarks mixed`: the seeded mixed trace, goodput scoring on hand-made records, the systems,
refusals before anything starts, and one small run over HTTP on the tiny model."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from benchmarks.cli import main
from benchmarks.goodput import RUN_METRICS, RunScore, print_goodput, score_run, shed_within
from benchmarks.launch import prometheus_totals
from benchmarks.load import Call, read_usage
from benchmarks.mixed import MixedOptions, _capacity_rows, _Runs, run_mixed_bench, sustained_qps
from benchmarks.mixed_trace import LONG, SHORT, MixedCall, MixedParams, MixedTrace, build_trace, calls_for
from benchmarks.servers import write_changed_config
from benchmarks.stats import Record
from benchmarks.systems import MixedSystem, mixed_system
from benchmarks.traces import QUESTION_TOKENS, BenchError, ordinary_token_ids
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG

VOCAB = list(range(10, 500))
SMALL = MixedParams(
    short_slo_ms=1500,
    long_tokens=300,
    long_per_minute=3,
    long_slo_ms=12000,
    minutes=100,
    users=5,
    posts=2,
    profile_tokens=60,
    post_tokens=8,
    alone_repeats=2,
    seed=7,
)


def test_the_trace_is_seeded_and_has_the_asked_mix() -> None:
    t = build_trace(VOCAB, SMALL, 0.5)
    again = build_trace(VOCAB, SMALL, 0.5)
    assert [(c.call, c.arrival_seconds) for c in t.calls] == [(c.call, c.arrival_seconds) for c in again.calls]
    assert t.calls != build_trace(VOCAB, replace(SMALL, seed=8), 0.5).calls
    short, long = t.of(SHORT), t.of(LONG)
    assert t.window_seconds == 6000 and len(short) + len(long) == len(t.calls)
    assert 0.95 * 3000 < len(short) < 1.05 * 3000 and len(long) == 300  # Poisson at 0.5/s; 3/min, one a period
    assert [int(c.arrival_seconds // 20) for c in long] == list(range(300))
    times = [c.arrival_seconds for c in t.calls]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 6000
    assert {c.slo_ms for c in short} == {1500} and {c.slo_ms for c in long} == {12000}
    assert all(len(c.call.prompts) == 2 for c in short) and all(len(c.call.prompts) == 1 for c in long)
    profiles: dict[int, list[int]] = {}
    for c in short:  # each prompt: its user's profile (40-80 tokens) + a post + the question
        for prompt in c.call.prompts:
            assert 40 + 1 + QUESTION_TOKENS <= len(prompt) <= 80 + 20 + QUESTION_TOKENS
            profiles.setdefault(c.user, prompt[:40])
            assert prompt[:40] == profiles[c.user]
    assert {c.user for c in short} == set(range(5)) and sum(c.returning for c in short) == len(short) - 5
    # Long prompts: exactly long_tokens, fresh (no two alike, none starts as a profile does), and
    # alone_repeats more for the idle-server reference.
    prompts = [c.call.prompts[0] for c in long] + t.alone_prompts
    assert len(t.alone_prompts) == 2 and {len(p) for p in prompts} == {300}
    assert len({tuple(p[:8]) for p in prompts}) == len(prompts)
    assert not {tuple(p[:8]) for p in prompts} & {tuple(p[:8]) for p in profiles.values()}
    # Twice the short load: the same long calls at the same times, twice the short calls.
    double = build_trace(VOCAB, SMALL, 1.0)
    assert [(c.call, c.arrival_seconds) for c in double.of(LONG)] == [(c.call, c.arrival_seconds) for c in long]
    assert 1.9 < len(double.of(SHORT)) / len(short) < 2.1


def test_calls_cap_the_trace_and_each_system_gets_its_fields() -> None:
    t = build_trace(VOCAB, replace(SMALL, minutes=None, calls=40), 0.5)
    assert len(t.calls) == 40 and t.window_seconds == t.calls[-1].arrival_seconds
    ours, chunked, prio = (calls_for(t, mixed_system(n)) for n in ("tiered", "vllm-chunk512", "vllm-priority-chunk512"))
    kinds = [c.kind for c in t.calls]
    assert [c.slo_ms for c in ours] == [1500 if k == SHORT else 12000 for k in kinds]
    assert {c.priority for c in ours} == {None} and {(c.slo_ms, c.priority) for c in chunked} == {(None, None)}
    deadlines = [round(1e3 * c.arrival_seconds + c.slo_ms) for c in t.calls]
    assert [c.priority for c in prio] == deadlines and {c.slo_ms for c in prio} == {None}
    # earliest deadline first: a long call sent before a short one may still run after it
    assert any(
        a.kind == LONG and b.kind == SHORT and pa > pb
        for a, b, pa, pb in zip(t.calls, t.calls[1:], deadlines, deadlines[1:], strict=False)
    )


def test_system_names() -> None:
    assert mixed_system("tiered") == MixedSystem("tiered", ("scheduler.pieces=deadline",))
    assert mixed_system("tiered-never") == MixedSystem("tiered-never", ("scheduler.pieces=never",))
    assert mixed_system("tiered-in-order") == MixedSystem(
        "tiered-in-order", ("scheduler.pieces=deadline", "scheduler.late=serve", "scheduler.defer_late=false")
    )
    assert mixed_system("tiered-serve-late") == MixedSystem(
        "tiered-serve-late", ("scheduler.pieces=deadline", "scheduler.late=serve")
    )
    assert mixed_system("tiered-base") == MixedSystem("tiered-base", ("scheduler.pieces=deadline",))
    assert mixed_system("tiered-fixed1024") == MixedSystem(
        "tiered-fixed1024", ("scheduler.pieces=fixed", "scheduler.piece_tokens=1024")
    )
    s = mixed_system("vllm-chunk2048")
    assert s is not None and s.is_vllm and s.vllm_step_tokens == 2048 and s.vllm_args == []
    s = mixed_system("vllm-priority-chunk1024-cap256")
    assert s is not None and s.vllm_args == ["--scheduling-policy", "priority", "--long-prefill-token-threshold", "256"]
    s = mixed_system("vllm-chunk2048-cap512-adaptive")
    assert s is not None and s.vllm_args == [
        "--long-prefill-token-threshold",
        "512",
        "--long-prefill-token-threshold-adaptive",
    ]
    for bad in (
        "vllm",
        "tiered-fixed",
        "tiered-fixed0",
        "vllm-chunk",
        "vllm-priority",
        "tiered-fcfs",
        "vllm-chunk512-adaptive",
        "vllm-chunk512-cap64-partial2",
    ):
        assert mixed_system(bad) is None, bad


def _hand_made() -> tuple[MixedTrace, list[Record]]:
    def call(i: int, kind: str, slo: float) -> MixedCall:
        return MixedCall(Call(f"c{i}", [[1, 2, 3]]), kind, float(i), slo)

    calls = [
        call(0, SHORT, 1000),
        call(1, SHORT, 1000),
        call(2, LONG, 10000),
        call(3, SHORT, 1000),
        call(4, SHORT, 1000),
        call(5, LONG, 10000),
    ]
    records = [
        Record("c0", 3, 0.0, 0.5, None, 0, 0),
        Record("c1", 3, 1.0, 1.0, None, 0, 0),  # exactly at its objective: good
        Record("c2", 3, 2.0, 4.0, None, 0, 0, num_pieces=3, deadline_met=True),
        Record("c3", 3, 3.0, 1.5, None, 0, 0),  # late
        Record("c4", 3, 4.0, 0.1, None, 0, 0, error="503: engine restarted"),  # fast, but failed: not good
        Record("c5", 3, 5.0, 12.0, None, 0, 0, num_pieces=1, deadline_met=False),  # late
    ]
    return MixedTrace(0.4, 10.0, calls, []), records


def test_goodput_and_percentiles_are_exact_on_hand_made_records(capsys: pytest.CaptureFixture[str]) -> None:
    trace, records = _hand_made()
    shed = {"tiered:shed_delay_seconds_count": 4.0, 'tiered:shed_delay_seconds_bucket{le="0.05"}': 3.0}
    metrics = {"tiered:pieces_total": 2.0} | shed
    s = score_run("tiered", trace, list(reversed(records)), alone_seconds=4.0, metrics=metrics)
    short, long, total = s.short, s.long, s.total
    assert (short.num_calls, short.num_answered, short.num_good) == (4, 3, 2)
    assert (short.offered_per_s, short.goodput_per_s) == (0.4, 0.2)
    assert (short.p50_latency_seconds, short.p99_latency_seconds) == (1.0, 1.5)  # of 0.5, 1.0, 1.5
    assert (short.num_deadline_met_reported, short.num_pieces) == (None, None)  # the server said nothing
    assert (long.num_calls, long.num_answered, long.num_good, long.goodput_per_s) == (2, 2, 1, 0.1)
    # nearest rank: the P50 of two values is the lower one
    assert (long.p50_latency_seconds, long.num_deadline_met_reported, long.num_pieces) == (4.0, 1, 4)
    assert (total.num_calls, total.num_answered, total.num_good, total.goodput_per_s) == (6, 5, 3, 0.3)
    assert (total.p50_latency_seconds, total.p99_latency_seconds) == (1.5, 12.0)  # of 0.5, 1.0, 1.5, 4.0, 12.0
    assert [(x.call_id, x.slowdown, x.good, x.num_pieces) for x in s.longs] == [
        ("c2", 1.0, True, 3),
        ("c5", 3.0, False, 1),
    ]
    assert s.num_errors == 1
    print_goodput([s], MixedParams(short_slo_ms=1000, long_slo_ms=10000))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tiered "))
    assert row.split() == [
        "tiered",
        "0.400",
        "0.200",
        "0.1000",
        "0.300",
        "50%",
        "50%",
        "1.00",
        "1.50",
        "4.00",
        "2.00",
        "/",
        "3.00",
        "2.0",
        "0",  # refused: none (an engine that died is a failure, not a refusal)
        "1",
    ]
    assert "tiered:pieces_total +2" in out and "shed_delay_seconds_bucket" not in out
    assert "3 of 4 calls refused as predicted to miss were refused within 50 ms" in out
    failed = [replace(r, error="500: boom", num_pieces=None) for r in records]
    s = score_run("tiered", trace, failed, alone_seconds=4.0)
    assert s.total.num_good == 0 and s.longs[0].slowdown is None and s.long.p50_latency_seconds != 0.0


def test_usage_fields_are_read_where_reported() -> None:
    r = Record("a", 10, 0.0, 0.0, None, 0, 0)
    read_usage({"tiered": {"device_hit_tokens": 5, "host_hit_tokens": 2, "num_pieces": 3, "deadline_met": False}}, r)
    assert (r.device_hit_tokens, r.host_hit_tokens, r.num_pieces, r.deadline_met) == (5, 2, 3, False)
    r = Record("b", 10, 0.0, 0.0, None, 0, 0)
    read_usage({"tiered": {"device_hit_tokens": 1, "host_hit_tokens": 0}}, r)  # a server without the fields
    assert (r.device_hit_tokens, r.num_pieces, r.deadline_met) == (1, None, None)
    r = Record("c", 10, 0.0, 0.0, None, 0, 0)
    read_usage({"prompt_tokens_details": {"cached_tokens": 7}}, r)  # vLLM's
    assert (r.device_hit_tokens, r.host_hit_tokens, r.num_pieces) == (7, 0, None)


def test_bad_systems_and_options_fail_before_anything_starts(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT_CONFIG, ["model.path=/nowhere/model"])  # would fail if anything started

    def run(systems: list[str], qps: list[float], python: str | None = None) -> None:
        run_mixed_bench(cfg, SMALL, MixedOptions(systems, qps, python, None, tmp_path))

    with pytest.raises(BenchError, match=r"unknown system\(s\) nope, vllm-chunk0; known: tiered, tiered-never, "):
        run(["tiered", "nope", "vllm-chunk0"], [1.0])
    with pytest.raises(BenchError, match="--short-qps needs values > 0, got 1,0"):
        run(["tiered"], [1.0, 0.0])
    with pytest.raises(BenchError, match="--vllm-python"):
        run(["tiered", "vllm-chunk512"], [1.0])
    with pytest.raises(BenchError, match="tiered-base serves the checkout at --base-tree"):
        run(["tiered", "tiered-base"], [1.0])
    with pytest.raises(BenchError, match="engine.memory_budget_bytes=0"):
        cfg = load_config(DEFAULT_CONFIG, ["engine.memory_budget_bytes=1000000000"])
        run(["vllm-chunk512"], [1.0], str(tmp_path))
    with pytest.raises(BenchError, match="^--long-tokens must be >= 1; --alone-repeats must be >= 1$"):
        MixedParams(long_tokens=0, alone_repeats=0)
    with pytest.raises(BenchError, match="one of --minutes and --calls"):
        MixedParams(minutes=None)
    assert main(["mixed", "--systems", "tiered,vllm-fast", "--plots", str(tmp_path)]) != 0
    assert main(["mixed", "--long-tokens", "0", "--plots", str(tmp_path)]) != 0
    with pytest.raises(SystemExit):
        main(["mixed", "--minutes", "1", "--calls", "4"])
    assert not list(tmp_path.iterdir())


def test_a_small_mixed_run_over_http(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        DEFAULT_CONFIG,
        [
            f"model.path={tiny_dir}",
            "cache.block_tokens=16",
            "scheduler.profile_tokens=[64,256]",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
        ],
    )
    params = MixedParams(
        short_slo_ms=5000,
        long_tokens=200,
        long_per_minute=40,
        long_slo_ms=20000,
        minutes=0.1,
        users=3,
        profile_tokens=48,
        post_tokens=8,
        alone_repeats=1,
    )
    # tiered-fixed32 is the reference; tiered-never runs beside it, run for run, twice.
    opts = MixedOptions(["tiered-fixed32", "tiered-never"], [2.0], None, str(tmp_path / "m.json"), tmp_path, repeats=2)
    doc = run_mixed_bench(cfg, params, opts)
    saved = json.loads((tmp_path / "m.json").read_text())
    trace = build_trace(ordinary_token_ids(tiny_dir), params, 2.0)
    assert saved["bench"] == "mixed" and saved["params"]["long_tokens"] == 200
    assert saved["traces"] == [
        {
            "short_qps": 2.0,
            "window_seconds": 6.0,
            "short_calls": len(trace.of(SHORT)),
            "long_calls": len(trace.of(LONG)),
        }
    ]
    # in ABBA order: the reference first, then second
    assert [s["system"] for s in saved["scores"]] == [
        "tiered-fixed32",
        "tiered-never",
        "tiered-never",
        "tiered-fixed32",
    ]
    assert set(saved["launch"]) == {"tiered-fixed32", "tiered-never"} and "runs" not in saved
    assert [
        (r["measure"].split()[0], r["ours"]["system"], r["peer"]["system"], r["ratio"]["n"]) for r in saved["headline"]
    ] == [
        ("short", "tiered-fixed32", "tiered-never", 2),
        ("all", "tiered-fixed32", "tiered-never", 2),
        ("mean", "tiered-fixed32", "tiered-never", 2),
        ("P99", "tiered-fixed32", "tiered-never", 2),
    ]
    assert saved["headline"][3]["ratio_is"] == "peer / ours"  # a latency: lower is better
    score = saved["scores"][0]
    assert score["system"] == "tiered-fixed32" and score["alone_seconds"] > 0
    assert score["total"]["num_calls"] == len(trace.calls) == score["total"]["num_answered"]  # all answered
    for kind in ("short", "long", "total"):
        assert 0 <= score[kind]["goodput_per_s"] <= score[kind]["offered_per_s"]
    assert len(score["longs"]) == len(trace.of(LONG)) and all(x["slowdown"] > 0 for x in score["longs"])
    run = doc["runs"][0]
    assert saved["records"] == str(tmp_path / "m.records.json.gz")  # every record kept beside the JSON, compressed
    with gzip.open(tmp_path / "m.records.json.gz", "rt") as f:
        assert json.load(f) == doc["runs"]
    # pairs in ABBA order: the reference first in the first repeat, second in the next
    assert [(d["system"], d["repeat"]) for d in doc["runs"]] == [
        ("tiered-fixed32", 0),
        ("tiered-never", 0),
        ("tiered-never", 1),
        ("tiered-fixed32", 1),
    ]
    assert [(r["request_id"], r["kind"]) for r in run["records"]] == [(c.call.call_id, c.kind) for c in trace.calls]
    assert all(r["num_pieces"] is None or r["num_pieces"] >= 1 for r in run["records"])
    assert (tmp_path / "tiered-fixed32.yaml").read_text().count("piece_tokens: 32") == 1
    assert saved["summaries"][0]["num_requests"] == len(trace.of(SHORT))
    assert (tmp_path / "tiered-never.yaml").exists()
    from benchmarks.plots import plot_goodput

    assert plot_goodput(doc, tmp_path / "plots" / "goodput.png").stat().st_size > 0


def test_capacity_is_the_load_up_to_which_every_load_kept_its_objectives() -> None:
    """`sustained_qps`: 99% of the short calls in time (refused ones missed) and every long prompt,
    at that load and every lower one; the headline row takes it repeat by repeat, ours over the peer."""
    trace, records = _hand_made()
    base = score_run("tiered", trace, records, alone_seconds=4.0)

    def at(qps: float, short_good: int, long_good: int = 2) -> RunScore:
        short = replace(base.short, num_calls=100, num_good=short_good)
        return replace(base, short_qps=qps, short=short, long=replace(base.long, num_calls=2, num_good=long_good))

    assert sustained_qps([at(3, 99), at(1, 100), at(2, 99)]) == 3
    assert sustained_qps([at(1, 100), at(2, 98), at(3, 100)]) == 1  # a load passing above one that failed
    assert sustained_qps([at(1, 100), at(2, 100, long_good=1)]) == 1  # a long prompt late
    assert sustained_qps([at(1, 98)]) == 0
    runs = _Runs()
    for ours, theirs in (((1, 2, 4), (1, 2)), ((1, 2), (1,))):  # loads kept, per repeat
        for q in (1, 2, 4):
            pair = (at(q, 100 if q in theirs else 90), at(q, 100 if q in ours else 90))
            runs.paired.setdefault(("vllm-chunk8", q), []).append(pair)
    (row,) = _capacity_rows("tiered", MixedParams(short_slo_ms=2000, long_slo_ms=60000), runs)
    assert (
        row["measure"].startswith("short calls/s sustained within the objectives") and "loads 1, 2, 4" in row["measure"]
    )
    assert (row["ours"]["min"], row["ours"]["max"], row["peer"]["min"], row["peer"]["max"]) == (2, 4, 1, 2)
    assert row["ratio"]["min"] == 2 and row["ratio"]["max"] == 2


def test_metrics_totals_keep_a_histograms_buckets_apart() -> None:
    """`prometheus_totals` sums a sample over its labels, but a histogram's buckets by their bound:
    `shed_within` reads how many refusals came within a bound, and names a bound it lacks."""
    import http.server
    import threading

    text = (
        b"# TYPE tiered:shed_delay_seconds histogram\n"
        b'tiered:shed_delay_seconds_bucket{le="0.05",model_name="m",route="/a"} 2.0\n'
        b'tiered:shed_delay_seconds_bucket{model_name="m",route="/b",le="0.05"} 1.0\n'
        b'tiered:shed_delay_seconds_bucket{le="+Inf",model_name="m",route="/a"} 3.0\n'
        b'tiered:shed_delay_seconds_count{model_name="m",route="/a"} 3.0\n'
        b'tiered:shed_delay_seconds_count{model_name="m",route="/b"} 1.0\n'
        b'tiered:shed_delay_seconds_created{model_name="m",route="/a"} 1.7e9\n'
        b'tiered:prefill_pieces_total{model_name="m"} 5.0\n'
    )

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name is http.server's
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        totals = prometheus_totals(f"http://127.0.0.1:{server.server_port}", lambda name: bool(RUN_METRICS.match(name)))
    finally:
        server.shutdown()
        server.server_close()
    assert totals == {
        'tiered:shed_delay_seconds_bucket{le="0.05"}': 3.0,
        'tiered:shed_delay_seconds_bucket{le="inf"}': 3.0,
        "tiered:shed_delay_seconds_count": 4.0,
        "tiered:prefill_pieces_total": 5.0,
    }
    assert shed_within(totals, 0.05) == (3, 4) and shed_within({}, 0.05) is None
    with pytest.raises(ValueError, match="no bucket at 0.01 s"):
        shed_within(totals, 0.01)


def test_another_checkout_is_given_only_the_settings_that_differ_from_the_defaults(tmp_path: Path) -> None:
    """`tiered-base` serves an older checkout, which may not know a key added since: its config file
    holds only the values that differ from the defaults, and reads back to the same config."""
    cfg = load_config(None, ["scheduler.pieces=never", "cache.host.lmcache.max_local_cpu_size=4.0"])
    path = write_changed_config(cfg, tmp_path / "base.yaml")
    assert yaml.safe_load(path.read_text()) == {
        "cache": {"host": {"lmcache": {"max_local_cpu_size": 4.0}}},
        "scheduler": {"pieces": "never"},
    }
    assert load_config(path, []) == cfg
