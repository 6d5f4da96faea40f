"""A 2-stage engine (two stage processes over gloo) against the one-process engine on the tiny
model in fp32: equal answers (batches, followers, device-tier hits), the hit rule across stages,
micro-batches or fill-and-drain, a stage killed mid-service, refused configurations, and
engine.memory_budget_bytes as each stage's budget (the tiny model's 1.42 MB of weights exceed a
1 MiB budget; each stage holds half)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiered.api.engine_process import _response
from tiered.config import ConfigError, load_config
from tiered.engine import Engine, EngineStartError, ScoreParams
from tiered.engine.pipeline import PipelineRunner, PipelineStartError
from tiered.engine.pipeline.coordinator import pool_blocks
from tiered.engine.pipeline.split import stage_layers
from tiered.engine.pipeline.stage import StageLoaded, StageSpec
from tiered.hybrid.memory import weights_bytes
from tiered.request.score import RequestOptions, Result

TOL = 1e-4
PARAMS = ScoreParams(logprob_token_ids=tuple(range(0, 2048, 37)), top_logprobs=5)


def _cfg(tiny_dir: Path, jct_dir: Path, *overrides: str):
    fixed = [
        f"model.path={tiny_dir}",
        "model.dtype=float32",
        "cache.block_tokens=16",
        "model.max_model_len=2048",
        "cache.suffix=discard",
        "cache.retention=all",
        "cache.device_tier_bytes=262144",
        "scheduler.profile_tokens=[64, 256]",
        f"scheduler.profile_cache_dir={jct_dir}",
    ]
    return load_config(None, [*fixed, *overrides])


@pytest.fixture(scope="module")
def engines(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, adapter_dirs: dict[tuple[str, str], Path]
) -> Iterator[tuple[Engine, Engine]]:
    """(one process, two stages), sharing a JCT profile, serving two LoRA adapters; the pipeline is
    started once for the module."""
    jct = tmp_path_factory.mktemp("jct")
    lora = [
        "lora.enabled=true",
        "lora.max_loras=2",
        *(f"lora.modules.{name}={adapter_dirs[('tiny', name)]}" for name in ("small", "wide")),
    ]
    one = Engine(_cfg(tiny_dir, jct, *lora))
    two = Engine(
        _cfg(tiny_dir, jct, *lora, "engine.pipeline_stages=2", "engine.threads_per_stage=1"), jct_model=one.jct
    )
    yield one, two
    two.close()
    one.close()


def _prompts(seed: int, num: int, prefix_tokens: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 1300, (prefix_tokens,), generator=g)
    return [torch.cat([prefix, torch.randint(0, 1300, (20 + 7 * i,), generator=g)]) for i in range(num)]


def _run(engine: Engine, prompts: list[torch.Tensor], adapters: list[str | None] | None = None) -> list[Result]:
    """Results in prompt order, each request answered exactly once."""
    ids = [
        engine.submit(p, PARAMS, options=RequestOptions(adapter=a))
        for p, a in zip(prompts, adapters or [None] * len(prompts), strict=True)
    ]
    results = engine.run()
    assert sorted(r.request_id for r in results) == sorted(ids)
    by_id = {r.request_id: r for r in results}
    return [by_id[i] for i in ids]


def _assert_equal(got: list[Result], ref: list[Result]) -> None:
    for a, b in zip(got, ref, strict=True):
        assert a.error is None and b.error is None
        assert max(abs(a.logprobs[t] - b.logprobs[t]) for t in b.logprobs) < TOL
        assert max(abs(x[1] - y[1]) for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)) < TOL
        assert a.token_id == b.token_id and a.split == b.split and a.num_shared_tokens == b.num_shared_tokens


def test_two_stages_answer_as_one_process_in_batches_and_from_the_device_tier(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    assert isinstance(two.runner, PipelineRunner) and len(two.runner.pids) == 2
    assert two.tiers.device_tier.kv.numel() == 0  # the coordinator keeps the index; the stages the KV
    prompts = _prompts(0, 5)
    first_one, first_two = _run(one, prompts), _run(two, prompts)
    # One forward: the first prompt computes the shared 300 tokens for the four others (followers).
    assert [r.batch_size for r in first_two] == [5] * 5
    assert sorted(r.num_shared_tokens for r in first_two) == [0] + [300] * 4
    _assert_equal(first_two, first_one)
    hits = two.tiers.device_tier.num_hit_tokens
    again_one, again_two = _run(one, prompts), _run(two, prompts)
    assert all(r.split.num_device_hit_tokens >= 288 for r in again_two)  # every prompt hits the cached prefix
    assert two.tiers.device_tier.num_hit_tokens - hits == sum(r.split.num_device_hit_tokens for r in again_two)
    _assert_equal(again_two, again_one)
    assert all(e is not None for e in two.runner.stage_models.errors)  # every stage reported its micro-batches' seconds


def test_fill_and_drain_answers_as_waves(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    assert isinstance(two.runner, PipelineRunner) and two.runner.num_microbatches == 2  # waves: one per stage
    try:
        # 1: engine.pipeline_schedule fill-drain; 3: followers in the lead's micro-batch and in later ones
        for seed, microbatches in ((7, 1), (8, 3)):
            two.runner.num_microbatches = microbatches
            first = _prompts(seed, 6, prefix_tokens=40)
            _assert_equal(_run(two, first), _run(one, first))
            # New posts on the now cached prefix: its 8-token uncached tail is shared with the lead.
            g = torch.Generator().manual_seed(seed)
            again = [torch.cat([p[:40], torch.randint(0, 1300, (25,), generator=g)]) for p in first]
            got, ref = _run(two, again), _run(one, again)
            assert all(r.split.num_device_hit_tokens == 32 for r in ref) and max(r.num_shared_tokens for r in ref) == 8
            _assert_equal(got, ref)
    finally:
        two.runner.num_microbatches = 2


def test_an_evicted_block_is_recomputed_on_every_stage(engines: tuple[Engine, Engine]) -> None:
    """The coordinator evicts; the freed block ids are overwritten on both stages by other prompts;
    the evicted prompts then miss everywhere and are recomputed, never read from a stale pool."""
    one, two = engines
    prompts = _prompts(11, 3)
    _run(two, prompts)
    for engine in engines:
        engine.tiers.device_tier.clear()  # evicts every unpinned block
    _run(two, _prompts(12, 6, prefix_tokens=500))  # reuses the freed ids, on every stage
    ref = _run(one, prompts)
    for engine in engines:
        engine.tiers.device_tier.clear()
    got = _run(two, prompts)
    assert all(r.split.num_device_hit_tokens == 0 for r in got)
    _assert_equal(got, ref)


def test_lora_adapters_answer_as_one_process_in_mixed_batches(engines: tuple[Engine, Engine]) -> None:
    """Requests of two adapters and of the base model on one prefix, in one batch: each stage applies
    its layers' part of each adapter; an adapter's cached prefix is its own (hits again, same answers)."""
    one, two = engines
    prompts = _prompts(51, 6)
    adapters = ["small", None, "wide", "small", "wide", None]
    for _ in range(2):  # computed, then from each adapter's own cached prefix
        got, ref = _run(two, prompts, adapters), _run(one, prompts, adapters)
        _assert_equal(got, ref)
    # An adapter's prefix read back from the stages' pools: its requests run again right after they
    # ran (which of the three prefixes the small device tier kept after the mixed batches depends on
    # the order the scheduler picked; the one just computed is there).
    small = [p for p, a in zip(prompts, adapters, strict=True) if a == "small"]
    _run(two, small, ["small"] * len(small))
    again = _run(two, small, ["small"] * len(small))
    assert all(r.split.num_device_hit_tokens >= 288 for r in again)
    _assert_equal(again, _run(one, small, ["small"] * len(small)))
    base = _run(two, prompts[:1])[0]
    assert abs(base.logprobs[0] - got[0].logprobs[0]) > 1e-3  # "small" changes the answer (not the base model)


def test_refused_configurations_name_the_key(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'engine.pipeline_stages': must be >= 1, got 0"):
        _cfg(tiny_dir, tmp_path, "engine.pipeline_stages=0")
    with pytest.raises(ConfigError, match=r"'cache.host.lmcache.remote_url': a shared or disk backend is not yet"):
        _cfg(
            tiny_dir,
            tmp_path,
            "engine.pipeline_stages=2",
            "cache.suffix=offload",
            "cache.host.lmcache={remote_url: 'redis://127.0.0.1:1'}",
        )
    with pytest.raises(ConfigError, match="'engine.pipeline_stages': must be <= the model's 2 layers, got 3"):
        Engine(_cfg(tiny_dir, tmp_path, "engine.pipeline_stages=3"))


def test_a_killed_stage_fails_its_batch_with_503_and_the_pipeline_restarts(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    runner = two.runner
    assert isinstance(runner, PipelineRunner)
    _run(two, _prompts(21, 2))  # cached on both stages
    assert two.tiers.device_tier.stats().num_used_blocks > 0
    old = runner.pids
    os.kill(old[1], signal.SIGKILL)
    ids = [two.submit(p, PARAMS) for p in _prompts(21, 3)]
    failed = two.run()
    assert sorted(r.request_id for r in failed) == sorted(ids)  # each answered once, with the failure
    assert all(r.error is not None and r.unavailable and "pipeline stage failed" in r.error for r in failed)
    assert {_response(r).error_status for r in failed} == {503}
    assert runner.num_restarts == 1 and set(runner.pids).isdisjoint(old) and len(runner.pids) == 2
    assert two.tiers.device_tier.stats().num_used_blocks == 0  # the pools are gone: nothing hits
    prompts = _prompts(22, 3)
    _assert_equal(_run(two, prompts), _run(one, prompts))  # later requests are served


# Under the whole model's weights (1.42 MB); over a stage's (0.71 MB) + its 128-token forward with
# room for the resident-memory reading's noise (one run of 2**20 read a stage's peak 0.37 MB over its weights).
BUDGET = 1_300_000

# On CPU a forward's peak is read from VmHWM after resetting it; where the kernel does not let a
# process reset it, the reading is an upper bound (the process's whole high-water mark).
needs_exact_peaks = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="the resident high-water mark cannot be reset here"
)


def _budget_cfg(tiny_dir: Path, jct_dir: Path, *overrides: str):
    """128 tokens at most: a forward's peak stays small beside a stage's weights (the kernel is
    named: `auto` measures shapes of 160 tokens and more)."""
    return _cfg(
        tiny_dir,
        jct_dir,
        "model.max_model_len=128",
        "scheduler.profile_tokens=[64, 128]",
        "attention.kernel=flash",
        *overrides,
    )


@needs_exact_peaks
def test_a_model_over_one_budget_serves_on_two_stages_as_one_process(tiny_dir: Path, tmp_path: Path) -> None:
    budget = f"engine.memory_budget_bytes={BUDGET}"
    refused = rf"max_model_len 128 does not fit engine.memory_budget_bytes {BUDGET}: weights \+ one forward peak at"
    with pytest.raises(EngineStartError, match=refused + r" \d+ bytes, \d+ bytes over"):
        Engine(_budget_cfg(tiny_dir, tmp_path, budget))
    with (
        Engine(_budget_cfg(tiny_dir, tmp_path)) as one,
        Engine(
            _budget_cfg(tiny_dir, tmp_path, budget, "engine.pipeline_stages=2", "engine.threads_per_stage=1")
        ) as two,
    ):  # `two` profiles its JCT model through its stages
        runner = two.runner
        assert isinstance(runner, PipelineRunner)
        assert all(p.is_meta for p in two.model.parameters())  # the coordinator holds no weights
        # Each stage measured its own part: together, the whole model's weights.
        assert sum(st.weights_bytes for st in runner.loaded) == weights_bytes(one.model) > BUDGET
        assert all(st.weights_bytes <= st.peak_bytes < BUDGET for st in runner.loaded)  # 0: no profile run
        blocks = min((BUDGET - st.peak_bytes) // st.bytes_per_block for st in runner.loaded)
        assert blocks > 0 and two.tiers.device_tier.num_blocks == blocks
        for st, ready in zip(runner.loaded, runner.ready, strict=True):  # every pool: those blocks, within budget
            assert ready.pool_bytes == blocks * st.bytes_per_block and st.peak_bytes + ready.pool_bytes <= BUDGET
        prompts = _prompts(31, 4, prefix_tokens=60)
        _assert_equal(_run(two, prompts), _run(one, prompts))
        again = _run(two, prompts)
        assert all(r.split.num_device_hit_tokens >= 48 for r in again)  # at least the shared prefix's blocks
        _assert_equal(again, _run(one, prompts))


@needs_exact_peaks
def test_a_budget_too_small_for_the_stages_fails_the_start_naming_them(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = _budget_cfg(
        tiny_dir,
        tmp_path,
        "engine.memory_budget_bytes=600000",
        "engine.pipeline_stages=2",
        "engine.threads_per_stage=1",
    )
    with pytest.raises(EngineStartError) as failed:
        Engine(cfg)
    message = str(failed.value)
    assert message.startswith("model.max_model_len 128 does not fit engine.memory_budget_bytes 600000 (each stage's)")
    for stage in (0, 1):  # each holds over 700000 bytes of weights
        assert re.search(
            rf"stage {stage} \(layers {stage}-{stage}\): weights 7\d{{5}} bytes, with one 128-token "
            r"forward \d+ bytes at the peak, \d+ bytes over",
            message,
        )


def test_pools_get_the_blocks_the_tightest_stage_has_room_for() -> None:
    specs = [
        StageSpec(s, 3, layers, "", "float32", "float32", "cpu", "masked", 16, 128, 0, 1, "", "hybrid", 1024)
        for s, layers in enumerate(stage_layers(5, 3))
    ]  # layers 0-1, 2-3, 4
    loaded = [StageLoaded(0, 500, 600, 20), StageLoaded(1, 300, 450, 20), StageLoaded(2, 550, 700, 10)]
    assert pool_blocks(specs, loaded, 1000, 0) == 20  # rooms of 20, 27 and 30 blocks
    assert pool_blocks(specs, loaded, 0, 1000) == 20  # no budget: 1000 bytes at 50 bytes a block over the stages
    with pytest.raises(PipelineStartError) as failed:
        pool_blocks(specs, loaded, 650, 0)
    assert str(failed.value) == (
        "model.max_model_len 128 does not fit engine.memory_budget_bytes 650 (each stage's) on stage 2 (layers 4-4): "
        "weights 550 bytes, with one 128-token forward 700 bytes at the peak, 50 bytes over; lower max_model_len, "
        "raise the budget or add stages"
    )
