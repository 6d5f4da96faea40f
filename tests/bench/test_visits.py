"""The visits trace (seeded, exact, Zipf users) and `python -m benchmarks visits`: helpers and a small real run."""

from __future__ import annotations

import gzip
import json
import logging
import subprocess
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import launch as bench_launch
from benchmarks.cli import main
from benchmarks.plots import visit_load_points
from benchmarks.traces import (
    QUESTION_TOKENS,
    BenchError,
    RevisitOptions,
    Trace,
    TraceRequest,
    VisitsTraceOptions,
    revisit,
    visits,
)
from benchmarks.visits import (
    VisitsOptions,
    _Runs,
    _stopped,
    profiles_kv_bytes,
    run_visits_bench,
    split_visits,
    vllm_prefix_cache_tokens,
    working_set_tokens,
)
from benchmarks.vllm import VLLMServer
from tiered.config import Config, load_config
from tiered.config.options import DEFAULT_CONFIG

VOCAB = list(range(10, 500))
SMALL = {"profile_mean": 100, "profile_sd": 20, "profile_min": 80, "profile_max": 120, "post_tokens": 10}


def test_visits_are_seeded_exact_and_draw_returning_users(tmp_path: Path) -> None:
    opts = VisitsTraceOptions(users=6, visits=20, posts=4, **SMALL, seed=3)
    t = visits(VOCAB, opts)
    assert len(t) == 80 and t.requests == visits(VOCAB, opts).requests
    assert t.requests != visits(VOCAB, replace(opts, seed=4)).requests
    assert [r.visit for r in t.requests] == [v for v in range(20) for _ in range(4)]  # a visit's prompts adjoin
    question = t.requests[0].token_ids[-QUESTION_TOKENS:]
    profile: dict[int, list[int]] = {}
    for r in t.requests:
        assert 80 <= r.prefix_tokens <= 120 and r.token_ids[-QUESTION_TOKENS:] == question
        assert profile.setdefault(r.user, r.token_ids[: r.prefix_tokens]) == r.token_ids[: r.prefix_tokens]
        post = r.token_ids[r.prefix_tokens : -QUESTION_TOKENS]
        assert 1 <= len(post) <= 20 and r.request_id == f"v{r.visit}-u{r.user}-p{t.requests.index(r) % 4}"
    assert len({tuple(p[:16]) for p in profile.values()}) == len(profile)  # users share no prefix
    by_visit = Counter(r.user for r in t.requests if r.request_id.endswith("-p0"))
    assert by_visit.most_common(1)[0][1] >= 3 and len(by_visit) < 20  # Zipf: users come back
    steep_opts = VisitsTraceOptions(users=6, visits=200, posts=1, **SMALL, zipf=3.0)
    steep = Counter(r.user for r in visits(VOCAB, steep_opts).requests)
    assert steep[0] > 150  # 1 / zeta-ish mass of user 0 at exponent 3: ~0.84
    t.write(tmp_path / "v.json")
    back = Trace.read(tmp_path / "v.json")
    assert back.kind == "visits" and back.params["zipf"] == 1.1 and back.requests == t.requests
    with pytest.raises(BenchError, match="Zipf exponent"):
        visits(VOCAB, VisitsTraceOptions(zipf=-1))


def test_old_trace_files_read_with_no_visit(tmp_path: Path) -> None:
    revisit(VOCAB, RevisitOptions(users=2, posts=1, rounds=1, scale=0.01)).write(tmp_path / "old.json")
    doc = json.loads((tmp_path / "old.json").read_text())
    for r in doc["requests"]:
        del r["visit"]  # as written before the field existed
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert [r.visit for r in Trace.read(tmp_path / "old.json").requests] == [-1, -1]


def test_split_visits_and_working_set_are_exact() -> None:
    reqs = [
        TraceRequest("a", 0, [1] * 62, 40, 0),
        TraceRequest("b", 0, [1] * 62, 40, 0),
        TraceRequest("c", 1, [2] * 20, 5, 1),
        TraceRequest("d", 0, [1] * 60, 40, 2),
    ]
    trace = Trace("visits", {}, reqs)
    got = split_visits(trace)
    assert [(v.call.call_id, len(v.call.prompts), v.user, v.returning) for v in got] == [
        ("v0-u0", 2, 0, False),
        ("v1-u1", 1, 1, False),
        ("v2-u0", 1, 0, True),
    ]
    # user 0: 2 shared blocks of 16; own blocks ceil(30/16) + ceil(30/16) + ceil(28/16); user 1: ceil(20/16)
    assert working_set_tokens(trace, 16) == 32 + (2 + 2 + 2) * 16 + 2 * 16
    assert profiles_kv_bytes(trace, 2) == (40 + 5) * 2  # each user's profile once
    with pytest.raises(BenchError, match="needs a visits trace"):
        split_visits(revisit(VOCAB, RevisitOptions(users=1, posts=1, rounds=1, scale=0.01)))


def test_vllm_counters_are_summed_over_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    text = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
vllm:prefix_cache_hits_total{engine="0",model_name="model"} 1200.0
vllm:prefix_cache_hits_total{engine="1",model_name="model"} 34.0
vllm:prefix_cache_queries_total{engine="0",model_name="model"} 5000.0
vllm:prefix_cache_queries_created{engine="0",model_name="model"} 1.7e9
"""
    monkeypatch.setattr(bench_launch.httpx, "get", lambda url, timeout: SimpleNamespace(text=text))
    assert vllm_prefix_cache_tokens("http://x") == (5000, 1234, 0)  # no KV connector: nothing loaded through one
    loaded = text + 'vllm:external_prefix_cache_hits_total{engine="0",model_name="model"} 512.0\n'
    monkeypatch.setattr(bench_launch.httpx, "get", lambda url, timeout: SimpleNamespace(text=loaded))
    assert vllm_prefix_cache_tokens("http://x") == (5000, 1234, 512)
    monkeypatch.setattr(bench_launch.httpx, "get", lambda url, timeout: SimpleNamespace(text="up 1\n"))
    with pytest.raises(BenchError, match="prefix_cache_queries_total"):
        vllm_prefix_cache_tokens("http://x")


def _server(proc: subprocess.Popen[bytes], log_path: Path) -> SimpleNamespace:
    """What the bench reads of a started `VLLMServer`: its process, its log, `running` as the class has it."""
    server = SimpleNamespace(proc=proc, log_path=log_path)
    server.running = partial(VLLMServer.running, server)
    return server


def test_a_peer_whose_server_stopped_is_skipped_and_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A peer's server that stopped (killed at the memory limit, crashed) has its remaining runs
    skipped with one warning naming its log; a running one, and ours, run on."""
    stopped = subprocess.Popen(["true"])
    stopped.wait()
    running = subprocess.Popen(["sleep", "30"])
    runs = _Runs()
    try:
        dead = SimpleNamespace(system="vllm", vllm=_server(stopped, tmp_path / "vllm.log"))
        alive = SimpleNamespace(system="vllm-lmcache", vllm=_server(running, tmp_path / "x.log"))
        ours = SimpleNamespace(system="tiered", vllm=None)
        with caplog.at_level(logging.WARNING, logger="benchmarks.visits"):
            assert _stopped(dead, runs) and _stopped(dead, runs)
            assert not _stopped(alive, runs) and not _stopped(ours, runs)
    finally:
        running.kill()
        running.wait()
    said = [r.getMessage() for r in caplog.records]
    assert runs.stopped == {"vllm"} and len(said) == 1 and "vllm.log" in said[0] and "skipped" in said[0]


def test_bad_systems_fail_before_anything_runs(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT_CONFIG)
    trace = visits(VOCAB, VisitsTraceOptions(users=2, visits=2, posts=1, **SMALL))
    with pytest.raises(BenchError, match="unknown system"):
        run_visits_bench(cfg, trace, VisitsOptions(["nope"], [1.0], out_dir=tmp_path))
    with pytest.raises(BenchError, match="--vllm-python"):
        run_visits_bench(cfg, trace, VisitsOptions(["tiered", "vllm"], [1.0], out_dir=tmp_path))
    gone = str(tmp_path / "nope" / "bin" / "python")
    with pytest.raises(BenchError, match=rf"^--vllm-python {gone} does not exist: run `make bench-env`"):
        run_visits_bench(cfg, trace, VisitsOptions(["vllm"], [1.0], vllm_python=gone, out_dir=tmp_path))
    with pytest.raises(BenchError, match="named twice"):
        run_visits_bench(cfg, trace, VisitsOptions(["tiered", "tiered"], out_dir=tmp_path))
    with pytest.raises(BenchError, match="--load-of vllm is not one of --systems"):
        opts = VisitsOptions(["tiered"], [1.0], warm_up_visits=0, load_of="vllm", out_dir=tmp_path)
        run_visits_bench(cfg, trace, opts)
    with pytest.raises(BenchError, match=r"--warm-up-visits in \[0, 2\)"):
        run_visits_bench(cfg, trace, VisitsOptions(["tiered"], warm_up_visits=2, out_dir=tmp_path))
    with pytest.raises(BenchError, match="tiered-base serves the checkout at --base-tree"):
        run_visits_bench(cfg, trace, VisitsOptions(["tiered", "tiered-base"], warm_up_visits=0, out_dir=tmp_path))


def test_the_cli_writes_a_visits_trace(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "v.json"
    args = [
        "trace",
        "visits",
        "--set",
        f"model.path={tiny_dir}",
        "--users",
        "3",
        "--visits",
        "5",
        "--posts",
        "2",
        "--profile-mean",
        "40",
        "--profile-min",
        "30",
        "--profile-max",
        "50",
        "--profile-sd",
        "5",
        "--post-tokens",
        "8",
        "--scale",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    t = Trace.read(out)
    assert t.kind == "visits" and len(t) == 10 and {r.visit for r in t.requests} == set(range(5))


def _small_config(tiny_dir: Path, tmp_path: Path, *overrides: str) -> Config:
    """The tiny model in blocks of 16, a quick start-up profile cached under `tmp_path`."""
    small = [
        "cache.block_tokens=16",
        "scheduler.profile_tokens=[64,256]",
        f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
    ]
    return load_config(DEFAULT_CONFIG, [f"model.path={tiny_dir}", *small, *overrides])


def test_a_small_visits_run_reports_saturation_loads_cache_and_limit(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = _small_config(tiny_dir, tmp_path)
    trace = visits(
        VOCAB,
        VisitsTraceOptions(
            users=3, visits=6, posts=3, profile_mean=48, profile_sd=8, profile_min=40, profile_max=64, post_tokens=8
        ),
    )
    # tiered-lora2: the same calls, user u's with LoRA adapter u mod 2 (made under tmp_path/adapters).
    opts = VisitsOptions(
        ["tiered", "tiered-lora2"],
        [0.5, 2.0],
        concurrency=4,
        repeats=2,
        peer_first=True,
        warm_up_visits=1,
        json_path=str(tmp_path / "v.json"),
        out_dir=tmp_path,
    )
    doc = run_visits_bench(cfg, trace, opts)
    saved = json.loads((tmp_path / "v.json").read_text())
    assert saved["bench"] == "visits" and saved["trace"] == {
        "kind": "visits",
        "params": trace.params,
        "requests": 6,
        "prompts": 18,
        "tokens": trace.num_tokens,
    }
    assert saved["provenance"]["command"] and set(saved["launch"]) == {"tiered", "tiered-lora2"}
    assert all(launch["startup_seconds"] > 0 for launch in saved["launch"].values())
    # every record beside the JSON, compressed, not in the summary; each saturation run's records under its repeat
    assert "runs" not in saved and saved["records"] == str(tmp_path / "v.records.json.gz")
    with gzip.open(tmp_path / "v.records.json.gz", "rt") as f:
        kept = json.load(f)
    assert sorted({r["repeat"] for r in kept["saturation"]["tiered"]}) == [0, 1]
    assert len(kept["saturation"]["tiered"]) == 2 * 6 and len(kept["visits"]) == 6
    sat, sat_lora = saved["saturation"]
    assert [len(saved["saturation_runs"][s]) for s in ("tiered", "tiered-lora2")] == [2, 2]
    assert sat_lora["system"] == "tiered-lora2" and sat_lora["num_errors"] == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["lora0", "lora1"]
    cache, limit = sat["cache"], sat["limit"]
    assert sat["system"] == "tiered" and sat["visits_per_s"] > 0 and sat["num_errors"] == 0
    assert cache["source"] == "usage" and cache["prompt_tokens"] == trace.num_tokens
    parts = ("device_hit_tokens", "host_hit_tokens", "shared_tokens", "computed_tokens")
    assert sum(cache[p] for p in parts) == trace.num_tokens
    assert limit["computed_tokens"] == cache["computed_tokens"] and 0 < limit["achieved_fraction"] < 1
    # The host tier's counters over each run of ours: what it stored (its default write-through).
    assert all(
        r["cache"]["host_counters"]["tiered:host_store_bytes_total"] > 0 for r in saved["saturation_runs"]["tiered"]
    )
    profile_tokens = profiles_kv_bytes(trace, 1)
    assert saved["profiles_bytes"] > 0 and saved["profiles_bytes"] % profile_tokens == 0  # those tokens x KV per token
    png = tmp_path / "working-set.png"
    assert main(["plot-working-set", str(tmp_path / "v.json"), "--out", str(png)]) == 0 and png.stat().st_size > 0
    older = tmp_path / "older.json"  # a visits JSON of before the field: named, not plotted
    older.write_text(json.dumps({k: v for k, v in saved.items() if k != "profiles_bytes"}))
    assert main(["plot-working-set", str(older), "--out", str(tmp_path / "no.png")]) == 2
    # Latency against load: every load run of the JSON, from the records beside it; a JSON without them is named.
    with gzip.open(tmp_path / "v.records.json.gz", "rt") as f:
        load_runs = json.load(f)["runs"]
    points = visit_load_points([(saved, load_runs)], "tiered", "mean_latency_seconds")
    assert sorted(points) == [0.5, 2.0] and all(len(v) == 2 for v in points.values())
    assert sorted(sum(points.values(), [])) == sorted(
        r["summary"]["mean_latency_seconds"] for r in load_runs if r["summary"]["system"] == "tiered"
    )
    png = tmp_path / "loads.png"
    assert main(["plot-visit-loads", str(tmp_path / "v.json"), "--out", str(png)]) == 0 and png.stat().st_size > 0
    assert main(["plot-visit-loads", str(older), "--out", str(tmp_path / "no.png")]) == 2
    rates = sorted(r["visits_per_s"] for r in saved["saturation_runs"]["tiered"])
    assert saved["saturation_visits_per_s"] == pytest.approx(sum(rates) / 2)  # the loads scale the median
    assert len(saved["slo_p99_seconds"]) == 3
    assert [(s["system"], s["multiple"], s["num_requests"], s["num_errors"]) for s in saved["summaries"]] == [
        ("tiered", 0.5, 6, 0),
        ("tiered", 2.0, 6, 0),
        ("tiered-lora2", 0.5, 6, 0),
        ("tiered-lora2", 2.0, 6, 0),
    ]
    assert set(saved["sustainable"]["tiered"]) == {"p99", "mean"}
    # Headline rows: the reference against the other system, two paired runs each; 6 visits: a maximum, not a P99.
    assert [(r["measure"], r["ours"]["system"], r["peer"]["system"], r["ratio"]["n"]) for r in saved["headline"]] == [
        ("visits/s at saturation", "tiered", "tiered-lora2", 2),
        ("computed (uncached) tokens/s at saturation", "tiered", "tiered-lora2", 2),
        ("mean visit latency at 0.5x tiered's saturation", "tiered", "tiered-lora2", 2),
        ("max of 6 visit latency at 0.5x tiered's saturation", "tiered", "tiered-lora2", 2),
        ("mean visit latency at 2x tiered's saturation", "tiered", "tiered-lora2", 2),
        ("max of 6 visit latency at 2x tiered's saturation", "tiered", "tiered-lora2", 2),
    ]
    assert any(v["returning"] for v in doc["visits"])  # Zipf over 3 users: someone comes back
    # peer_first: the other system opens each load's turns, then the two alternate (B A, A B).
    order = [(r["summary"]["system"], r["summary"]["multiple"]) for r in doc["runs"]]
    assert order == [(s, m) for m in (0.5, 2.0) for s in ("tiered-lora2", "tiered", "tiered", "tiered-lora2")]
    assert saved["peer_first"] is True
    # Each user keeps one adapter, so a returning user's visits hit its own cached profile.
    groups = [[r for r in doc["saturation_records"][s] if r["repeat"] == k] for s in opts.systems for k in range(2)]
    for records in (*groups, *(run["records"] for run in doc["runs"])):
        by_id = {r["request_id"]: r for r in records}
        assert set(by_id) == {v["call_id"] for v in doc["visits"]}
        answered: dict[int, float] = {}  # user -> when their first answered visit was answered
        for v in doc["visits"]:
            r = by_id[v["call_id"]]
            hit = r["device_hit_tokens"] + r["host_hit_tokens"]
            if v["returning"]:  # cached, or computed once in the same batch as the user's first visit
                assert hit + r["shared_tokens"] > 0, v
                if answered[v["user"]] <= r["arrival_seconds"]:  # the profile was cached before this visit came
                    assert hit >= v["prompts"] * (v["profile_tokens"] // 16 * 16), v  # all its whole blocks hit
            end = r["arrival_seconds"] + r["latency_seconds"]
            answered[v["user"]] = min(answered.get(v["user"], end), end)
    assert doc["runs"][0]["summary"]["p99_latency_seconds"] >= doc["runs"][0]["summary"]["p50_latency_seconds"] > 0
    from benchmarks.plots import plot_load

    assert [p.name for p in plot_load(doc, tmp_path / "plots")] == ["latency.png", "throughput.png", "cdf.png"]


def test_tiered_base_serves_another_checkout_beside_ours(tiny_dir: Path, tmp_path: Path) -> None:
    """`tiered-base`: the same config served from the checkout at --base-tree (here this one, from
    its own folder), its commit in the launch record and its disk tier in a folder of its own."""
    disk = tmp_path / "disk"
    lmcache = f"{{max_local_cpu_size: 0.05, local_disk: '{disk}', max_local_disk_size: 1}}"
    cfg = _small_config(tiny_dir, tmp_path, f"cache.host.lmcache={lmcache}")
    trace = visits(VOCAB, VisitsTraceOptions(users=2, visits=3, posts=2, **SMALL))
    root = Path(__file__).resolve().parents[2]
    opts = VisitsOptions(["tiered", "tiered-base"], repeats=1, warm_up_visits=0, out_dir=tmp_path, base_tree=root)
    doc = run_visits_bench(cfg, trace, opts)
    assert [s["num_errors"] for s in doc["saturation"]] == [0, 0]
    launch = doc["launch"]["tiered-base"]
    assert launch["cwd"] == str(root) and len(launch["commit"].removesuffix("+dirty")) == 40
    assert "cwd" not in doc["launch"]["tiered"]
    assert str(disk.with_name("disk-base")) in (tmp_path / "tiered-base.yaml").read_text()
    assert str(disk.with_name("disk-base")) not in (tmp_path / "tiered.yaml").read_text()
