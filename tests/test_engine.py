"""The in-process engine: results equal a direct forward, bad input is named, the memory split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiered.config import load_config
from tiered.engine import Engine, EngineStartError, ScoreParams
from tiered.hybrid.forward import ForwardInputError, forward


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
    assert sum(r.split.num_device_hit_tokens for r in results) == 4 * 288  # the shared prefix hit 4 times
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
    assert len(engine.scheduler) == 0
    engine.close()


def test_memory_budget_sets_the_device_tier_or_refuses_to_start(tiny_dir: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dir, tmp_path, "engine.memory_budget_bytes=268435456", "cache.suffix=discard"))
    assert 0 < engine.tiers.device_tier.num_blocks * engine.tiers.device_tier.bytes_per_block < 256 * 2**20
    engine.close()
    with pytest.raises(EngineStartError, match=r"max_model_len 2048 does not fit .* bytes over"):
        Engine(_cfg(tiny_dir, tmp_path, "engine.memory_budget_bytes=1000000", "cache.suffix=discard"))
