"""The host tier with pipeline stages (tiered/engine/pipeline/host.py): each stage keeps its layers' chunks
in its own LMCache, the coordinator keeps the one index. On the tiny model in fp32, against the
one-process engine with its own host tier: prefixes evicted from the device come back from every
stage's host tier with equal answers (write-through and on-evict, batches in the pipe); the
index's evictions happen on every stage (each holds exactly the index's keys); a chunk taken out
of one stage's LMCache behind the index's back (as LMCache's own eviction would) makes the batch
that loads it compute again, recomputing the chunk on every stage, never mixing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_stages import TOL, _cfg, _prompts, _run

from tiered.engine import Engine
from tiered.engine.pipeline import PipelineRunner
from tiered.engine.pipeline.host import StagedHost
from tiered.request.score import Result

HOST = ["cache.suffix=offload", "cache.device_tier_bytes=1048576", "cache.host.lmcache={max_local_cpu_size: 0.001}"]
STAGES = ["engine.pipeline_stages=2", "engine.threads_per_stage=1"]


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    jct = tmp_path_factory.mktemp("jct")
    one = Engine(_cfg(tiny_dir, jct, *HOST))
    two = Engine(_cfg(tiny_dir, jct, *HOST, *STAGES), jct_model=one.jct)
    yield one, two
    two.close()
    one.close()


def _equal_answers(got: list[Result], ref: list[Result]) -> None:
    for a, b in zip(got, ref, strict=True):
        assert a.error is None and b.error is None
        assert max(abs(a.logprobs[t] - b.logprobs[t]) for t in b.logprobs) < TOL
        assert a.token_id == b.token_id


def _consistent(runner: PipelineRunner) -> None:
    """Every stage's LMCache holds exactly the index's chunks."""
    for held in runner.check_host():
        assert held.missing == [] and held.extra == 0, held


def _evict_device(*engines: Engine) -> None:
    for engine in engines:
        engine.tiers.flush()
        engine.tiers.device_tier.clear()  # every unpinned block: what is left is in the host tier


def test_prefixes_come_back_from_every_stages_host_tier_as_in_one_process(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    runner = two.runner
    assert isinstance(runner, PipelineRunner) and isinstance(two.tiers.host_tier, StagedHost)
    prompts = _prompts(61, 5)
    _equal_answers(_run(two, prompts), _run(one, prompts))
    _evict_device(one, two)
    loaded = two.tiers.host_tier.stats().num_hit_tokens
    got, ref = _run(two, prompts), _run(one, prompts)
    # One (the first in the batch) loads the shared prefix from the host tier, the others then find it
    # on the device.
    assert max(r.split.num_host_hit_tokens for r in got) >= 288 and all(r.split.num_hit_tokens >= 288 for r in got)
    assert [r.split for r in got] == [r.split for r in ref]
    assert two.tiers.host_tier.stats().num_hit_tokens - loaded == sum(r.split.num_host_hit_tokens for r in got)
    _equal_answers(got, ref)
    _consistent(runner)


def test_the_index_evicts_on_every_stage(engines: tuple[Engine, Engine]) -> None:
    """Far more prompts than the host tier holds: the index stays at its capacity, each stage's
    LMCache holds the same chunks, and the last prompts still come back equal."""
    one, two = engines
    host = two.tiers.host_tier
    assert isinstance(host, StagedHost) and isinstance(two.runner, PipelineRunner)
    stored = host.stats().num_stored_tokens
    prompts = [p for seed in range(70, 76) for p in _prompts(seed, 2, prefix_tokens=1500)]
    _run(two, prompts)
    assert (host.stats().num_stored_tokens - stored) // 16 > host.capacity_chunks  # more than it holds
    assert len(host.keys) == host.capacity_chunks
    _consistent(two.runner)
    last = prompts[-2:]
    for _ in range(2):  # the first pass makes theirs the chunks used last (batches follow the JCT fit's order)
        _evict_device(one, two)
        got, ref = _run(two, last), _run(one, last)
    # They come back from every stage's host tier (their later chunks not evicted by their first ones'
    # stores when the pair ran early and was computed again: test_a_prefix_computed_again_...).
    assert max(r.split.num_host_hit_tokens for r in got) >= 1500 // 16 * 16
    _equal_answers(got, ref)


def _three_prompts(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1300, (768,), generator=g) for _ in range(3)]  # 48 chunks each; the host holds ~131


@pytest.mark.parametrize("which", ["one process", "two stages"])
def test_a_prefix_used_again_stays_and_the_host_tier_evicts_from_a_prefixs_end(
    engines: tuple[Engine, Engine], which: str
) -> None:
    """Both host tiers are LRU by use, not by store (LMCache's gets leave its order as stored: we
    tell it), and evict a prefix from its end (its first chunk, which every later one needs, last)."""
    engine = engines[0] if which == "one process" else engines[1]
    p, q, r = _three_prompts(96)
    _run(engine, [p])
    _run(engine, [q])
    _evict_device(engine)
    assert _run(engine, [p])[0].split.num_host_hit_tokens >= 47 * 16  # p used again: q is the older one now
    _run(engine, [r])  # 48 more chunks: the host tier evicts ~13, of q, from its end
    _evict_device(engine)
    assert _run(engine, [p])[0].split.num_host_hit_tokens >= 47 * 16
    kept = _run(engine, [q])[0].split.num_host_hit_tokens
    assert 0 < kept < 47 * 16, kept  # its first chunks kept, its last ones gone


@pytest.mark.parametrize("which", ["one process", "two stages"])
def test_a_prefix_computed_again_keeps_its_later_chunks(engines: tuple[Engine, Engine], which: str) -> None:
    """Both host tiers (LMCache's own LRU in one process, the stages' index) evict a prefix from its
    end, and when a prompt's first chunks are gone (lost) while its later ones are held, the prompt
    is computed again and only its first chunks stored, the later ones counted as used: else they
    would be the least recently used, and the next prompt's stores would leave it whole only in part."""
    engine = engines[0] if which == "one process" else engines[1]
    host = engine.tiers.host_tier
    assert host is not None
    p, q, r = _three_prompts(97)
    _run(engine, [p])
    _run(engine, [q])
    first = engine.tiers.new_request("p", p).keys[:10]
    if isinstance(host, StagedHost):  # a chunk the index gives up, as a stage that lost it would report
        host.lost(first)
    else:  # LMCache evicts silently: the next load finds them gone
        host.remove(first)
        host.flush()
    _evict_device(engine)
    assert _run(engine, [p])[0].split.num_host_hit_tokens == 0  # its first chunk missed: computed again
    assert host.missing(engine.tiers.new_request("p", p).keys[:47]) == []  # stored again (10), kept (37)
    _run(engine, [r])  # 48 more chunks: the host tier evicts the least recently used ones
    _evict_device(engine)
    again = _run(engine, [p])[0]
    assert again.split.num_host_hit_tokens >= 47 * 16, again.split  # all of it (the last token is computed)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_chunk_one_stage_lost_is_recomputed_on_every_stage(engines: tuple[Engine, Engine], stage: int) -> None:
    """Three chunks of a cached prefix leave one stage's LMCache behind the index's back. The batch
    that loads them is computed again without them, on every stage. Lost on stage 0, the dropped
    attempt fed stage 1 a wrong residual stream and stage 1 stored wrong chunks after them: those are
    dropped before the retry stores them again, so reloading them later gives right answers."""
    one, two = engines
    runner, host = two.runner, two.tiers.host_tier
    assert isinstance(runner, PipelineRunner) and isinstance(host, StagedHost)
    prompts = _prompts(81 + stage, 4)
    _run(two, prompts)
    _evict_device(two)
    first = two.tiers.new_request("x", prompts[0]).keys[5:8]  # three chunks of the shared prefix
    assert all(k in host.keys for k in first)
    runner.check_host(evict={stage: first})  # gone from one stage's LMCache; the index still lists them
    retries = runner.num_retries
    got, ref = _run(two, prompts), _run(one, prompts)  # every request answered once (_run checks it)
    assert runner.num_retries > retries  # the pipe's batches were computed again
    _equal_answers(got, ref)
    # Computed again: hits stop before the lost chunks (the 5 before them, loaded on every stage by the
    # dropped attempt, are device hits now), every later block is computed on every stage.
    assert all(r.split.num_hit_tokens == 5 * 16 for r in got)
    assert all(k in host.keys for k in first)  # recomputed, stored again (write-through) on both stages
    _consistent(runner)
    _evict_device(two)
    again = _run(two, prompts)  # the whole prefix from every stage's host tier: the stores of the retry
    assert max(r.split.num_host_hit_tokens for r in again) >= 288
    _equal_answers(again, ref)


def test_on_evict_stores_a_block_on_every_stage_when_the_device_evicts_it(tiny_dir: Path, tmp_path: Path) -> None:
    on_evict = "cache.host.write_policy=on-evict"
    with (
        Engine(_cfg(tiny_dir, tmp_path, *HOST, on_evict)) as one,
        Engine(
            _cfg(tiny_dir, tmp_path, *HOST, on_evict, *STAGES, "engine.pipeline_batches_in_flight=3"), jct_model=one.jct
        ) as two,
    ):
        assert isinstance(two.runner, PipelineRunner)
        prompts = _prompts(91, 4)
        _run(two, prompts), _run(one, prompts)
        # With these, more blocks than the device tier's 128: the first prompts' blocks are evicted, and only
        # then stored (retention all + on-evict: nothing is stored after a forward), on every stage.
        evicting = _prompts(92, 6, prefix_tokens=1900)
        _run(two, evicting), _run(one, evicting)
        got, ref = _run(two, prompts), _run(one, prompts)
        assert max(r.split.num_host_hit_tokens for r in got) >= 288 and all(r.split.num_hit_tokens >= 288 for r in got)
        assert [r.split for r in got] == [r.split for r in ref]
        _equal_answers(got, ref)
        _consistent(two.runner)
