"""The in-process engine: results equal a direct forward, bad input is named, the memory split."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import tiered.hybrid.memory as memory
from benchmarks.mil import ForwardSetup, probe_peak
from tiered.config import load_config
from tiered.engine import Engine, EngineStartError, ScoreParams
from tiered.hybrid.forward import ForwardInputError, forward
from tiered.hybrid.loader import read_args
from tiered.hybrid.memory import (
    EXTENSION_MARGIN,
    extend_line,
    extended_reach,
    growth_floor,
    measure_forward_peak,
    profile_lengths,
)
from tiered.hybrid.spill import Spill
from tiered.request.score import RequestOptions


def _cfg(tiny_dir: Path, tmp_path: Path, *overrides: str):
    fixed = [f"model.path={tiny_dir}", "cache.block_tokens=16", "model.max_model_len=2048"]
    profile = ["scheduler.profile_tokens=[64, 256]", f"scheduler.profile_cache_dir={tmp_path}"]
    return load_config(None, [*fixed, *profile, *overrides])


def test_results_match_a_direct_forward_and_the_profile_is_cached(tiny_dir: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dir, tmp_path))
    assert len(list(tmp_path.glob("jct-*.json"))) == 1
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 1300, (300,), generator=g)
    prompts = [torch.cat([prefix, torch.randint(0, 1300, (20 + i,), generator=g)]) for i in range(5)]
    ids = {engine.submit(p, ScoreParams(logprob_token_ids=(11, 12), top_logprobs=3)): p for p in prompts}
    results = engine.run()
    assert {r.request_id for r in results} == set(ids) and len(engine.scheduler) == 0
    # One forward: the first prompt computes the shared 300 tokens for the four others.
    assert [r.batch_size for r in results] == [5] * 5
    assert sorted(r.num_shared_tokens for r in results) == [0, 300, 300, 300, 300]
    for r in results:
        ref = torch.log_softmax(forward(engine.model, ids[r.request_id]), dim=-1)
        assert abs(r.logprobs[11] - ref[11].item()) < 1e-4 and abs(r.logprobs[12] - ref[12].item()) < 1e-4
        assert [t for t, _ in r.top_logprobs] == torch.topk(ref, 3).indices.tolist()
        assert r.token_id == int(ref.argmax())
        assert r.compute_seconds > 0 and r.queued_seconds >= 0
    assert engine.jct.error is not None
    engine.close()
    again = Engine(_cfg(tiny_dir, tmp_path))  # the cached profile is reused
    assert again.jct.profile == engine.jct.profile  # the same measured grid, not a new one
    again.close()


def test_bad_requests_are_refused_by_name(tiny_dir: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dir, tmp_path, "cache.suffix=discard"))
    with pytest.raises(ForwardInputError, match="empty"):
        engine.submit([])
    with pytest.raises(
        ForwardInputError, match=r"^This model's maximum context length is 2048 tokens\. However, you requested 2049"
    ):
        engine.submit([1] * 2049)
    with pytest.raises(ForwardInputError, match="token id 99999 is outside the vocabulary"):
        engine.submit([1, 99999])
    with pytest.raises(ForwardInputError, match="token id 5000"):
        engine.submit([1, 2], ScoreParams(logprob_token_ids=(5000,)))
    with pytest.raises(ForwardInputError, match=r"priority must be an integer in .* got 4611686018427387904"):
        engine.submit([1, 2], options=RequestOptions(priority=2**62))  # the warm-ups' own rank
    assert len(engine.scheduler) == 0
    engine.close()


def test_memory_budget_sets_the_device_tier_or_refuses_to_start(tiny_dir: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dir, tmp_path, "engine.memory_budget_bytes=268435456", "cache.suffix=discard"))
    assert 0 < engine.tiers.device_tier.num_blocks * engine.tiers.device_tier.bytes_per_block < 256 * 2**20
    engine.close()
    with pytest.raises(EngineStartError, match=r"max_model_len 2048 does not fit .* bytes over"):
        Engine(_cfg(tiny_dir, tmp_path, "engine.memory_budget_bytes=1000000", "cache.suffix=discard"))


def test_a_max_model_len_past_the_models_positions_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    positions = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(
        EngineStartError, match=f"max_model_len {positions + 1} is past the model's {positions} positions"
    ):
        Engine(_cfg(tiny_dir, tmp_path, f"model.max_model_len={positions + 1}", "cache.suffix=discard"))
    engine = Engine(_cfg(tiny_dir, tmp_path, f"model.max_model_len={positions}", "cache.suffix=discard"))
    engine.close()


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """The peak of every forward the start-up profile measures, by its tokens."""
    peaks: dict[int, int] = {}

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        peak = measure_forward_peak(*args, **kwargs)
        peaks[peak.num_tokens] = peak.peak_bytes
        return peak

    monkeypatch.setattr(memory, "measure_forward_peak", recorded)
    return peaks


def test_with_a_spill_dir_the_profile_run_also_measures_the_longest_forward_in_memory(
    tiny_dir: Path, tmp_path: Path, measured: dict[int, int]
) -> None:
    """Just short of spill_min_tokens a forward keeps its residual stream in memory and can peak
    above a longer one that spills: the split counts the larger of the two measured peaks."""
    spill = [f"forward.spill_dir={tmp_path / 'spill'}", "forward.spill_min_tokens=1500"]
    budget = ["engine.memory_budget_bytes=268435456", "cache.suffix=discard"]
    engine = Engine(_cfg(tiny_dir, tmp_path, *budget, *spill))
    assert set(measured) == {2048, 1499}
    pool = engine.tiers.device_tier.num_blocks * engine.tiers.device_tier.bytes_per_block
    assert 0 < 268435456 - max(measured.values()) - pool < engine.tiers.device_tier.bytes_per_block
    engine.close()


def test_past_profile_max_tokens_the_profile_runs_two_shorter_forwards(
    tiny_dir: Path, tmp_path: Path, measured: dict[int, int]
) -> None:
    """A long max_model_len is not forwarded at start-up: two lengths up to engine.profile_max_tokens
    are, and the device tier gets what their line leaves at max_model_len."""
    budget = 268435456
    overrides = [f"engine.memory_budget_bytes={budget}", "cache.suffix=discard", "engine.profile_max_tokens=1024"]
    engine = Engine(_cfg(tiny_dir, tmp_path, *overrides, "model.max_model_len=8192"))
    assert set(measured) == {512, 1024}
    floor = growth_floor(engine.parts.model.args, torch.float32)
    extended = extend_line(512, measured[512], 1024, measured[1024], 8192, floor)
    pool = engine.tiers.device_tier.num_blocks * engine.tiers.device_tier.bytes_per_block
    assert 0 <= budget - extended - pool < engine.tiers.device_tier.bytes_per_block
    engine.close()
    with pytest.raises(EngineStartError, match=r"at 8192 tokens extended from 512 and 1024 tokens"):
        Engine(_cfg(tiny_dir, tmp_path, *overrides, "model.max_model_len=8192", "engine.memory_budget_bytes=1000"))


def test_the_extended_peak_is_the_measured_one(tiny_dir: Path, tmp_path: Path) -> None:
    """A hybrid forward's peak is affine in its length within a regime: the line through the two
    lengths a 32 K cap measures meets the peak measured at twice the cap (fresh processes), in
    memory and spilled; with its margin it does not fall under it."""
    for spill in (None, Spill(str(tmp_path), 4096)):
        setup = ForwardSetup(str(tiny_dir), "float32", "cpu", 256, spill)
        lengths = profile_lengths(65536, "hybrid", spill, 32768)
        lo, hi = lengths[:2]
        assert 65536 not in lengths and (lo, hi) == (16384, 32768)
        peak = {n: probe_peak(setup, "hybrid", n) for n in (lo, hi, 65536)}
        extended = extend_line(lo, peak[lo], hi, peak[hi], 65536, growth_floor(read_args(tiny_dir), torch.float32))
        growth = peak[65536] - peak[hi]
        assert growth > 0 and peak[65536] - 2**20 <= extended <= peak[65536] + 0.15 * growth, (spill, peak)


PEAK_AFTER_SCRIPT = """
import sys, torch
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model
from tiered.hybrid.memory import PeakShape, measure_forward_peak
model = load_model(sys.argv[1], "float32", "cpu")
if sys.argv[2] == "after-a-longer-forward":  # its freed scratch stays in the allocator's heap
    forward(model, torch.randint(3, 1000, (30000,)), chunk_tokens=8192)
print(measure_forward_peak(model, PeakShape(12000), "hybrid", 2048).peak_bytes)
"""


def test_a_forwards_peak_is_measured_alike_after_a_longer_one(tiny_dir: Path) -> None:
    """What an earlier, larger forward freed stays in glibc's heap, where the measured forward
    would find it without growing the resident size: the measurement returns the free heap to
    the OS first, so its peak reads about as in a fresh process (a start-up profile measures
    several forwards in one process). glibc's thresholds are fixed high, so every tensor comes
    from the heap in both processes (at its dynamic threshold, the longer forward would move
    where the measured one's large tensors land)."""
    import os
    import subprocess
    import sys

    heap_only = {"MALLOC_MMAP_THRESHOLD_": str(2**28), "MALLOC_TRIM_THRESHOLD_": str(2**28)}

    def peak(history: str) -> int:
        cmd = [sys.executable, "-c", PEAK_AFTER_SCRIPT, str(tiny_dir), history]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **heap_only})
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.split()[-1])

    fresh, after = peak("fresh"), peak("after-a-longer-forward")
    # Not hidden: without the trim `after` reads under a tenth of `fresh`. The bounds are wide
    # because two processes' readings of this small model differ by up to a quarter on a busy host.
    assert 0.5 * fresh <= after <= 2 * fresh, (fresh, after)


def test_the_extended_reach_is_the_longest_length_the_line_keeps_under_a_limit(tiny_dir: Path) -> None:
    lo, peak_lo, hi, peak_hi, limit = 16384, 270 << 20, 32768, 290 << 20, 320 << 20
    n = extended_reach(lo, peak_lo, hi, peak_hi, limit, 0.0)
    assert extend_line(lo, peak_lo, hi, peak_hi, n, 0.0) < limit <= extend_line(lo, peak_lo, hi, peak_hi, n + 1, 0.0)
    assert extended_reach(lo, peak_lo, hi, peak_hi, peak_hi, 0.0) == hi  # nothing past hi fits
    assert extended_reach(lo, peak_hi, hi, peak_hi, limit, 0.0) == sys.maxsize  # a flat line never reaches it
    # Readings that differ by less than one layer's K,V per token (noise at short lengths) do not stretch
    # the reach: the slope is that growth at the least.
    floor = growth_floor(read_args(tiny_dir), torch.float32)
    flat = extended_reach(lo, peak_hi, hi, peak_hi, limit, floor)
    assert flat == hi + int((limit - 1 - peak_hi) // (floor * (1 + EXTENSION_MARGIN)))
    assert extended_reach(lo, peak_lo, hi, peak_hi, limit, floor) == n  # a line steeper than the floor keeps its slope


def test_profile_lengths_stay_in_the_regime_of_max_model_len() -> None:
    assert profile_lengths(2048, "hybrid", None, 32768) == [2048]  # short: measured itself
    assert profile_lengths(100000, "hybrid", None, 32768) == [16384, 32768]
    assert profile_lengths(100000, "chunked", None, 32768) == [100000]  # only hybrid extends
    assert profile_lengths(100000, "hybrid", None, 0) == [100000]
    spill = Spill("/unused", 16384)
    assert profile_lengths(100000, "hybrid", spill, 32768) == [16384, 32768, 16383]
    assert profile_lengths(100000, "hybrid", Spill("/unused", 40000), 32768) == [40000, 56384, 39999]
    assert profile_lengths(50000, "hybrid", Spill("/unused", 40000), 32768) == [50000, 39999]


def test_priority_allowed_tokens_logit_bias_and_cancel(tiny_dir: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dir, tmp_path, "cache.suffix=discard", "scheduler.policy=fcfs"))
    g = torch.Generator().manual_seed(1)
    p = [torch.randint(3, 1300, (40,), generator=g) for _ in range(4)]
    ref = torch.log_softmax(forward(engine.model, p[0]), dim=-1)
    allowed = (int(ref.argsort()[5]), int(ref.argsort()[9]))  # neither is the argmax
    late = engine.submit(
        p[0], ScoreParams(logprob_token_ids=allowed, allowed_token_ids=allowed), options=RequestOptions(priority=1)
    )
    gone = engine.submit(p[1])
    biased = engine.submit(p[2], ScoreParams(logit_bias=((7, 100.0),)))
    urgent = engine.submit(p[3], options=RequestOptions(priority=-1))
    assert engine.cancel(gone) and not engine.cancel(gone) and engine.num_cancelled == 1
    results = engine.run()
    # fcfs within a priority; lower priority values first; the cancelled one never runs.
    assert [r.request_id for r in results] == [urgent, biased, late]
    by_id = {r.request_id: r for r in results}
    assert by_id[late].token_id == max(allowed, key=lambda t: float(ref[t]))
    assert abs(by_id[late].logprobs[allowed[0]] - float(ref[allowed[0]])) < 1e-4  # raw logprobs, as vLLM
    assert by_id[biased].token_id == 7
    assert engine.tiers.device_tier.stats().num_pinned_blocks == 0
    engine.close()


def test_cache_salt_shares_kv_only_within_a_salt(tiny_dir: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dir, tmp_path, "cache.retention=all"))
    ids = torch.randint(3, 1300, (100,), generator=torch.Generator().manual_seed(2))
    splits = []
    for salt in ("a", "b", "a", None):
        engine.submit(ids, options=RequestOptions(cache_salt=salt))
        (r,) = engine.run()
        engine.tiers.flush()
        splits.append(r.split.num_device_hit_tokens + r.split.num_host_hit_tokens)
    assert splits == [0, 0, 96, 0]  # 6 blocks of 16 below the last token
    engine.tiers.device_tier.clear()  # now only the host tier (LMCache, salt in its key) has them
    engine.submit(ids, options=RequestOptions(cache_salt="b"))
    (r,) = engine.run()
    assert r.split.num_host_hit_tokens == 96
    engine.close()


GEMM_CACHE_SCRIPT = """
import sys, torch
from tiered.config import load_config
from tiered.engine import Engine
from tiered.hybrid.memory import _status_bytes
cfg = load_config(None, [f"model.path={sys.argv[1]}", "model.dtype=bfloat16", "cache.suffix=discard",
                         "scheduler.profile_tokens=[64]", f"scheduler.profile_cache_dir={sys.argv[2]}",
                         "engine.memory_budget_bytes=268435456"])
engine = Engine(cfg)
engine.submit(list(range(3, 300)))
engine.run()
before = _status_bytes("VmRSS")
for n in range(300, 540, 3):  # 80 lengths: as many row counts of each projection's matmul
    engine.submit(torch.randint(3, 1300, (n,)))
    (r,) = engine.run()
    assert r.error is None, r.error
print((_status_bytes("VmRSS") - before) // 2**20)
"""


def test_under_a_budget_new_prompt_lengths_do_not_grow_the_resident_size(tiny_dir: Path, tmp_path: Path) -> None:
    """The GEMM library caches a prepared kernel per matmul shape: without a bound, each new
    prompt length leaves a process that prepares bf16 kernels (oneDNN on a bf16 CPU) larger, by
    far more over 80 lengths than this allows; under a memory budget the caches are bounded."""
    import subprocess
    import sys

    cmd = [sys.executable, "-c", GEMM_CACHE_SCRIPT, str(tiny_dir), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    growth_mib = int(out.stdout.split()[-1])
    assert growth_mib < 100, f"{growth_mib} MiB more resident after 80 new lengths under a budget"


OOM_SCRIPT = """
import resource, sys, torch
from tiered.config import load_config
from tiered.engine import Engine
cfg = load_config(None, [f"model.path={sys.argv[1]}", "model.max_model_len=2000000", "cache.suffix=discard",
                         "scheduler.profile_tokens=[64]", f"scheduler.profile_cache_dir={sys.argv[2]}"])
engine = Engine(cfg)
engine.submit(list(range(3, 300)))
engine.run()
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
huge = engine.submit(torch.full((2000000,), 5))  # its activations need GBs: more than the limit allows
small = engine.submit(list(range(3, 300)))
results = {r.request_id: r for r in engine.run()}
assert results[huge].error is not None and "out of memory" in results[huge].error, results[huge].error
assert results[small].error is None and results[small].num_tokens == 297
assert engine.tiers.device_tier.stats().num_pinned_blocks == 0
print("ok")
"""


def test_out_of_memory_fails_only_that_request(tiny_dir: Path, tmp_path: Path) -> None:
    """A real allocation failure: the process's address space is capped below what one request needs."""
    import subprocess
    import sys

    long = shutil.copytree(tiny_dir, tmp_path / "tiny-2m")  # the same weights, 2,000,000 positions
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2_000_000}))
    out = subprocess.run(
        [sys.executable, "-c", OOM_SCRIPT, str(long), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
