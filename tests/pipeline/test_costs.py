"""The pipeline's JCT model per stage and micro-batch (tiered/engine/pipeline/costs.py): its prior is the
engine's profile scaled by each stage's share of the layers, it learns each stage's measured
micro-batches, and the micro-batch cut balances what it predicts rather than computed tokens alone."""

from __future__ import annotations

import random

import pytest
import torch

from tiered.engine.pipeline.costs import StageModels
from tiered.engine.pipeline.split import cut_microbatches
from tiered.engine.runner import ItemPlan
from tiered.request.tokens import HitSplit
from tiered.scheduler.jct import JCTModel, JCTSample

TRUE = [0.01, 2e-4, 3e-8, 0.0, 1e-5, 0.0]  # c0..c5 of a made-up machine


def _seconds(c: list[float], samples: list[HitSplit]) -> float:
    return JCTModel(c).predict_batch(samples)


def _profile(c: list[float]) -> JCTModel:
    """A base model fitted on a grid as the engine's start-up profile (plus host loads, which no stage does)."""
    grid = [JCTSample(t, max(1, int(t * f)), 0, 0.0) for t in (64, 512, 2048, 8192) for f in (0.1, 0.5, 1.0)]
    grid += [JCTSample(t, 1, t - 1, 0.5) for t in (512, 2048)]  # host loads: left out of the stages' prior
    grid = [
        JCTSample(
            s.num_tokens,
            s.num_miss_tokens,
            s.num_host_hit_tokens,
            s.seconds or _seconds(c, [HitSplit(s.num_tokens - s.num_miss_tokens, 0, s.num_miss_tokens)]),
        )
        for s in grid
    ]
    return JCTModel.fit(grid)


def test_the_prior_is_the_profile_scaled_by_each_stages_share_of_the_layers() -> None:
    base = _profile(TRUE)
    costs = StageModels([0.75, 0.25])
    assert costs.job_seconds(HitSplit(1000, 0, 40)) == 40  # no prior yet: computed tokens
    costs.use_prior(base)
    for split in (HitSplit(0, 0, 300), HitSplit(4000, 0, 200), HitSplit(100, 0, 6000)):
        whole = _seconds(TRUE, [split])
        assert costs.predict(0, [split]) == pytest.approx(0.75 * whole, rel=1e-3)
        assert costs.predict(1, [split]) == pytest.approx(0.25 * whole, rel=1e-3)
        # A request's weight in a cut: what it adds to a micro-batch on its slowest stage.
        assert costs.job_seconds(split) == pytest.approx(0.75 * (whole - TRUE[0]), rel=1e-3)


def test_each_stage_learns_its_measured_microbatches() -> None:
    """Stage 1 runs twice as slow as its share says (say, it also runs the LM head): once it has
    reported enough micro-batches, its model predicts near that, stage 0's stays where it was."""
    costs = StageModels([0.5, 0.5])
    rng = random.Random(0)
    batches = [
        [HitSplit(rng.choice([0, 1024, 4096]), 0, rng.randint(16, 2048)) for _ in range(rng.randint(1, 4))]
        for _ in range(200)
    ]
    for mb in batches[:20]:  # measured before the engine had its profile: they wait for the prior
        costs.observe(0, [mb], [0.5 * _seconds(TRUE, mb)])
        costs.observe(1, [mb], [1.0 * _seconds(TRUE, mb)])
    assert costs.errors == [None, None]
    costs.use_prior(_profile(TRUE))
    assert all(e is not None for e in costs.errors)
    for mb in batches[20:]:
        costs.observe(0, [mb], [0.5 * _seconds(TRUE, mb)])
        costs.observe(1, [mb], [1.0 * _seconds(TRUE, mb)])
    probe = [HitSplit(2048, 0, 700), HitSplit(0, 0, 300)]
    assert costs.predict(0, probe) == pytest.approx(0.5 * _seconds(TRUE, probe), rel=0.05)
    assert costs.predict(1, probe) > 0.8 * _seconds(TRUE, probe)  # the prior said 0.5x (it stays in the fit)
    assert costs.errors[0] is not None and costs.errors[0] < 0.05


def _plan(computed: int, cached: int) -> ItemPlan:
    return ItemPlan(torch.zeros(computed, dtype=torch.long), (), cached)


def test_the_cut_balances_predicted_seconds_not_computed_tokens() -> None:
    """Equal computed tokens cost more after a long cached prefix (attention pairs, the prefix
    read): cut by the stage models, the micro-batches' predicted seconds are closer than cut by tokens."""
    costs = StageModels([0.5, 0.5])
    costs.use_prior(JCTModel([0.0, 1e-4, 1e-7, 0.0, 5e-5]))
    plans = [_plan(300, 0), _plan(100, 6000), _plan(100, 6000), _plan(100, 0)]

    def heaviest(cut: list[list[int]]) -> float:
        return max(
            costs.predict(0, [HitSplit(plans[i].num_prefix_tokens, 0, plans[i].num_computed_tokens) for i in mb])
            for mb in cut
        )

    by_tokens, by_cost = cut_microbatches(plans, 2), cut_microbatches(plans, 2, costs.job_seconds)
    assert by_tokens == [[0], [1, 2, 3]]  # 300 tokens against 300
    assert sorted(map(sorted, by_cost)) == [[0, 1], [2, 3]]
    assert heaviest(by_cost) < 0.7 * heaviest(by_tokens)
    # A model that prices no computed token (all zero: a benchmark's stand-in) cuts by tokens, not
    # all in one micro-batch.
    flat = StageModels([0.5, 0.5])
    flat.use_prior(JCTModel([0.0]))
    assert cut_microbatches(plans, 2, flat.job_seconds) == by_tokens
