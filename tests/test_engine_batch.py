"""The engine's batches: same answers and same KV in the tiers as one request per forward."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tiered.config import load_config
from tiered.engine import Engine, Result, ScoreParams
from tiered.hybrid.forward import forward
from tiered.native import library as native
from tiered.offload.device_tier import DeviceTier
from tiered.scheduler.step import StepOutput

BT = 16
YES_NO = ScoreParams(logprob_token_ids=(11, 12), top_logprobs=2)


def _engine(tiny_dir: Path, tmp_path: Path, *overrides: str) -> Engine:
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            f"cache.block_tokens={BT}",
            "model.max_model_len=2048",
            "scheduler.profile_tokens=[64, 256]",
            f"scheduler.profile_cache_dir={tmp_path}",
            "scheduler.prefetch=false",
            *overrides,
        ],
    )
    return Engine(cfg)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _visit(engine: Engine, prompts: list[torch.Tensor]) -> dict[str, Result]:
    ids = [engine.submit(p, YES_NO) for p in prompts]
    by_id = {r.request_id: r for r in engine.run()}
    return {i: by_id[i] for i in ids}


def _assert_plain_forward_answers(engine: Engine, prompts: list[torch.Tensor], results: list[Result]) -> None:
    """Each answer's Yes/No logprobs equal a plain forward's of its prompt (fp32, within 1e-4)."""
    for prompt, r in zip(prompts, results, strict=True):
        ref = torch.log_softmax(forward(engine.model, prompt), dim=-1)
        assert max(abs(r.logprobs[t] - float(ref[t])) for t in (11, 12)) < 1e-4


def test_batches_equal_single_runs_with_device_and_host_hits(tiny_dir: Path, tmp_path: Path) -> None:
    u1, u2, u3 = _ids(200, 1), _ids(200, 2), _ids(200, 3)
    post = {i: _ids(10 + i, 10 + i) for i in range(8)}
    mixed = [
        torch.cat([u1, post[0]]),
        torch.cat([u1, post[1]]),
        torch.cat([u1, post[2]]),
        torch.cat([u2, post[3]]),
        torch.cat([u2, post[4]]),
        torch.cat([u3, post[5]]),
        post[6],
    ]
    answers = {}
    for budget in (2048, 0):
        engine = _engine(tiny_dir, tmp_path, "cache.retention=all", f"scheduler.max_batch_tokens={budget}")
        _visit(engine, [torch.cat([u2, post[7]])])
        engine.tiers.flush()
        engine.tiers.device_tier.clear()  # u2's profile now lives in the host tier only
        _visit(engine, [torch.cat([u1, post[7]])])  # u1's on the device
        results = list(_visit(engine, mixed).values())
        assert engine.tiers.device_tier.stats().num_pinned_blocks == 0
        engine.close()
        sizes = [r.batch_size for r in results]
        assert max(sizes) > 1 if budget else set(sizes) == {1}
        u1_posts, u2_posts = results[:3], results[3:5]
        assert all(r.split.num_device_hit_tokens == 192 and r.split.num_host_hit_tokens == 0 for r in u1_posts)
        # The first u2 post loads the profile from the host tier; the second finds it on the device.
        assert sorted(r.split.num_host_hit_tokens for r in u2_posts) == [0, 192]
        assert sorted(r.split.num_device_hit_tokens for r in u2_posts) == [0, 192]
        assert results[5].split.num_miss_tokens == 215 and results[6].split.num_miss_tokens == 16
        answers[budget] = results
    ref_model = _engine(tiny_dir, tmp_path, "cache.suffix=discard")
    for prompt, batched, single in zip(mixed, answers[2048], answers[0], strict=True):
        ref = torch.log_softmax(forward(ref_model.model, prompt), dim=-1)
        for got in (batched, single):
            assert max(abs(got.logprobs[t] - float(ref[t])) for t in (11, 12)) < 1e-4
            assert got.token_id == int(ref.argmax())
            assert [t for t, _ in got.top_logprobs] == torch.topk(ref, 2).indices.tolist()
    ref_model.close()


def _tier_kv(engine: Engine, prompt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K,V of the prompt's cached blocks as the tiers hold them (device first, host on a miss)."""
    prepared = engine.tiers.prepare(engine.tiers.new_request("probe", prompt))
    try:
        assert not engine.tiers.worker.load([prepared])
        kv = engine.tiers.worker.prefix_kv(prepared)
        assert kv is not None and prepared.num_prefix_tokens == (prompt.numel() - 1) // BT * BT
        return [kv[layer] for layer in range(len(kv))]
    finally:
        engine.tiers.abort(prepared)


def test_kv_a_batch_hands_to_the_tiers_equals_single_runs(tiny_dir: Path, tmp_path: Path) -> None:
    profile = _ids(100, 4)
    prompts = [_ids(70, 5), _ids(33, 6), torch.cat([profile, _ids(20, 7)]), torch.cat([profile, _ids(40, 8)])]
    held = {}
    for budget in (2048, 0):
        engine = _engine(tiny_dir, tmp_path, "cache.retention=all", f"scheduler.max_batch_tokens={budget}")
        _visit(engine, prompts)
        engine.tiers.flush()
        device = [_tier_kv(engine, p) for p in prompts]
        engine.tiers.device_tier.clear()
        host = [_tier_kv(engine, p) for p in prompts]  # each loaded back from LMCache
        held[budget] = (device, host)
        engine.close()
    for tier in (0, 1):
        for got, ref in zip(held[2048][tier], held[0][tier], strict=True):
            for (k, v), (rk, rv) in zip(got, ref, strict=True):
                torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)


def test_a_request_over_the_budget_runs_alone(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "scheduler.max_batch_tokens=64")
    long, *short = _visit(engine, [_ids(200, 9), _ids(20, 10), _ids(20, 11), _ids(20, 12)]).values()
    engine.close()
    assert long.batch_size == 1
    assert [r.batch_size for r in short] == [3, 3, 3]


def test_a_visits_prompts_run_in_one_forward_on_their_cached_profile(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_dir, tmp_path)
    profile = _ids(300, 13)
    _visit(engine, [torch.cat([profile, _ids(9, 14)])])  # an earlier visit: the profile went to the host tier
    results = _visit(engine, [torch.cat([profile, _ids(12 + i, 20 + i)]) for i in range(8)]).values()
    engine.close()
    assert [r.batch_size for r in results] == [8] * 8
    # One request loads the profile from the host tier, the seven others find it on the device.
    assert sorted(r.split.num_host_hit_tokens for r in results) == [0] * 7 + [288]
    assert [r.split.num_device_hit_tokens + r.split.num_host_hit_tokens for r in results] == [288] * 8
    # The profile's last 12 tokens fill no block: one request computes them for all eight.
    assert sorted(r.num_shared_tokens for r in results) == [0] + [12] * 7


def test_a_new_users_visit_computes_the_profile_once(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_dir, tmp_path)
    profile = _ids(300, 15)
    prompts = [torch.cat([profile, _ids(12 + i, 30 + i)]) for i in range(6)]
    results = list(_visit(engine, prompts).values())
    engine.tiers.flush()
    stored = len(engine.tiers.host_keys)
    _assert_plain_forward_answers(engine, prompts, results)
    engine.close()
    assert [r.batch_size for r in results] == [6] * 6
    assert sorted(r.num_shared_tokens for r in results) == [0] + [300] * 5
    # The profile's 18 blocks stored once (not once per prompt), plus each prompt's own block 19.
    assert stored == 300 // BT + 6
    assert len({r.compute_seconds for r in results}) == 1  # one forward


def test_no_prefetch_of_a_prefix_the_running_batch_loads(tiny_dir: Path, tmp_path: Path) -> None:
    """One request per forward: the first prompt loads the profile from the host tier; the next
    one, peeked while it runs, shares that profile, so prefetching it would load it twice."""
    engine = _engine(tiny_dir, tmp_path, "scheduler.prefetch=true", "scheduler.max_batch_tokens=0")
    profile = _ids(300, 16)
    _visit(engine, [torch.cat([profile, _ids(9, 17)])])
    engine.tiers.flush()
    engine.tiers.device_tier.clear()  # the profile lives in the host tier only
    loaded_before = engine.tiers.host_tier.stats().num_hit_tokens
    results = list(_visit(engine, [torch.cat([profile, _ids(10 + i, 40 + i)]) for i in range(3)]).values())
    loaded = engine.tiers.host_tier.stats().num_hit_tokens - loaded_before
    engine.close()
    assert loaded == 288  # once
    assert sorted(r.split.num_host_hit_tokens for r in results) == [0, 0, 288]


def test_two_new_users_in_one_batch_each_compute_their_profile_once(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard")
    u1, u2 = _ids(200, 18), _ids(200, 19)
    prompts = [
        torch.cat([u1, _ids(5, 20)]),
        torch.cat([u2, _ids(6, 21)]),
        torch.cat([u2, _ids(7, 22)]),
        torch.cat([u1, _ids(8, 23)]),
    ]
    results = list(_visit(engine, prompts).values())
    _assert_plain_forward_answers(engine, prompts, results)
    engine.close()
    assert [r.batch_size for r in results] == [4] * 4
    assert sorted(r.num_shared_tokens for r in results) == [0, 0, 200, 200]  # each follows its own user


def test_a_batch_takes_only_the_prefixes_the_device_tier_holds_together(tiny_dir: Path, tmp_path: Path) -> None:
    """Two users' profiles (12 blocks each) in the host tier only and a device tier of 16 blocks:
    their visits run as two batches, one per user, each loading its profile once, rather than one
    batch whose second load finds no free block and computes that profile again."""
    probe = _engine(tiny_dir, tmp_path)
    block_bytes = probe.tiers.device_tier.bytes_per_block
    probe.close()
    engine = _engine(tiny_dir, tmp_path, f"cache.device_tier_bytes={16 * block_bytes}")
    u1, u2 = _ids(200, 24), _ids(200, 25)
    for u, seed in ((u1, 26), (u2, 27)):
        _visit(engine, [torch.cat([u, _ids(9, seed)])])
    engine.tiers.flush()
    engine.tiers.device_tier.clear()  # both profiles live in the host tier only
    prompts = [torch.cat([u, _ids(10 + i, 30 + i)]) for i, u in enumerate((u1, u2, u1, u2))]
    results = list(_visit(engine, prompts).values())
    _assert_plain_forward_answers(engine, prompts, results)
    engine.close()
    assert [r.batch_size for r in results] == [2] * 4
    assert sorted(r.split.num_host_hit_tokens for r in results) == [0, 0, 192, 192]
    assert [r.split.num_device_hit_tokens + r.split.num_host_hit_tokens for r in results] == [192] * 4


def test_a_profiles_tail_short_of_a_block_counts_once_in_the_batch_budget(tiny_dir: Path, tmp_path: Path) -> None:
    """A cached profile of 6 blocks (its first visit put them in the tiers) and a 10-token tail, 4
    posts of 12 tokens, a budget of 60 computed tokens: the forward computes the tail once (its
    followers see it), 10 + 4 x 12 = 58 tokens, so all four run in one batch; counted per request
    (22 each) only two would fit."""
    engine = _engine(tiny_dir, tmp_path, "scheduler.max_batch_tokens=60")
    profile = _ids(6 * BT + 10, 50)
    _visit(engine, [profile])
    prompts = [torch.cat([profile, _ids(12, 51 + i)]) for i in range(4)]
    results = list(_visit(engine, prompts).values())
    _assert_plain_forward_answers(engine, prompts, results)
    engine.close()
    assert [r.split.num_device_hit_tokens + r.split.num_host_hit_tokens for r in results] == [6 * BT] * 4
    assert [r.batch_size for r in results] == [4] * 4
    assert sorted(r.num_shared_tokens for r in results) == [0, 10, 10, 10]


def _count_gathers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the device tier's per-layer copies of a cached prefix (`DeviceTier.layer_kv`)."""
    calls: list[int] = []
    gather = DeviceTier.layer_kv

    def counted(tier: DeviceTier, layer: int, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(layer)
        return gather(tier, layer, block_ids)

    monkeypatch.setattr(DeviceTier, "layer_kv", counted)
    return calls


@pytest.mark.skipif(not native.available(), reason="the native kernel's library could not be built here")
@pytest.mark.parametrize(
    ("kernel", "kv_dtype", "reads_in_place"),
    [
        ("native", "auto", True),
        ("flash-head", "auto", True),
        ("masked", "auto", True),
        ("native", "bfloat16", False),
        ("flash-head", "bfloat16", False),
    ],
)
def test_a_cached_prefix_is_read_in_place_where_the_kernel_can(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str, kv_dtype: str, reads_in_place: bool
) -> None:
    """A batch over a cached profile: every kernel reads the prefix from the pool by block id (no
    per-layer copy of it) where the pool keeps KV in the compute dtype; a pool in a narrower dtype is
    gathered and widened. The answers equal a plain forward's (fp32, 1e-4; bf16 KV: 2e-2)."""
    engine = _engine(
        tiny_dir,
        tmp_path,
        "cache.retention=all",
        f"attention.kernel={kernel}",
        f"cache.kv_dtype={kv_dtype}",
        "model.dtype=float32",
    )
    profile = _ids(200, 5)
    _visit(engine, [torch.cat([profile, _ids(12, 6)])])
    prompts = [torch.cat([profile, _ids(10 + i, 20 + i)]) for i in range(3)]
    calls = _count_gathers(monkeypatch)
    results = list(_visit(engine, prompts).values())
    engine.close()
    assert all(r.split.num_device_hit_tokens == 192 for r in results)
    assert (calls == []) == reads_in_place
    tolerance = 1e-4 if kv_dtype == "auto" else 2e-2
    for prompt, r in zip(prompts, results, strict=True):
        ref = torch.log_softmax(forward(engine.model, prompt), dim=-1)
        assert max(abs(r.logprobs[t] - float(ref[t])) for t in (11, 12)) < tolerance


def test_a_step_carries_its_blocks_and_the_scheduler_applies_its_output(tiny_dir: Path, tmp_path: Path) -> None:
    """`schedule()` allocates and pins: the step names each request's cached prefix and the blocks
    its computed tokens fill, by id. The executor runs it without releasing anything; the scheduler's
    `update_from_output` indexes the retained blocks and releases every pin. The request's queueing
    ends where the step began preparing it."""
    engine = _engine(tiny_dir, tmp_path, "cache.retention=all")
    profile = _ids(200, 7)
    _visit(engine, [torch.cat([profile, _ids(12, 8)])])
    dt = engine.tiers.device_tier
    prompt = torch.cat([profile, _ids(40, 9)])  # 240 tokens: 12 cached blocks, 3 more to compute
    engine.submit(prompt, YES_NO)
    step = engine.scheduler.schedule()
    (p,) = step.prepared
    keys = p.request.keys
    assert p.prefix_blocks == dt.match(keys, prompt.tolist(), count=False) and len(p.prefix_blocks) == 12
    assert len(p.retained_blocks) == 3 and p.first_retained_block == 12
    assert dt.stats().num_pinned_blocks == 15
    output = StepOutput()
    engine.executor.execute(step, output)
    assert [r.error for r in output.results] == [None] and output.finished == [p]
    # its wait ends where the step began preparing it: the prepare (a load, here none) is counted apart
    assert output.results[0].queued_seconds == step.started - step.batch[0].waiting.arrival
    assert dt.stats().num_pinned_blocks == 15 and dt.count_cached(keys, 15) == 12  # nothing applied yet
    engine.scheduler.update_from_output(step, output)
    assert dt.stats().num_pinned_blocks == 0 and dt.count_cached(keys, 15) == 15
    engine.close()


def test_a_chunk_looked_up_but_unreadable_gives_the_step_back(tiny_dir: Path, tmp_path: Path) -> None:
    """The scheduler looks a profile's chunks up on the host tier's disk when it picks the batch, the
    worker reads them just before the forward: a file cut short in between (a failing disk) fails
    that read, the step's requests wait again with no forward run, and they are answered right,
    the chunks read before the bad one now device hits, the rest computed, no block left pinned."""
    disk = tmp_path / "disk"
    lmcache = f'cache.host.lmcache={{max_local_cpu_size: 0.05, local_disk: "{disk}", max_local_disk_size: 0.2}}'
    engine = _engine(tiny_dir, tmp_path, "cache.retention=none", lmcache)
    host = engine.tiers.host_tier
    assert host is not None and host.has_disk
    profile = _ids(200, 21)
    _visit(engine, [torch.cat([profile, _ids(5, 22)])])
    keys = engine.tiers.new_request("keys", profile).keys
    assert host.evict_from_memory(keys) == 12  # the profile now lives on the disk only
    backend = host._storage.storage_backends["LocalDiskBackend"]
    path = Path(backend.dict[host._key(keys[4])].path)
    path.write_bytes(path.read_bytes()[:100])
    posts = [torch.cat([profile, _ids(9 + i, 30 + i)]) for i in range(2)]
    forwards = engine.parts.runner.forward
    ran: list[int] = []
    engine.parts.runner.forward = lambda prepared, plans: ran.append(len(prepared)) or forwards(prepared, plans)  # type: ignore[method-assign]
    results = list(_visit(engine, posts).values())
    assert host.stats().num_failures == 1
    assert ran == [2]  # the step that found the bad chunk ran no forward; its retry ran both posts at once
    lead = min(results, key=lambda r: r.split.num_miss_tokens)
    assert (lead.split.num_device_hit_tokens, lead.split.num_host_hit_tokens) == (64, 0)
    assert engine.tiers.device_tier.stats().num_pinned_blocks == 0
    _assert_plain_forward_answers(engine, posts, results)
    engine.close()
