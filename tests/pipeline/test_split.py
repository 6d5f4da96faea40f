"""The pipeline's cuts, in one process: layers into stages, a batch into micro-batches, and a model
run stage by stage (layers loaded per stage, the residual stream handed on) equal to the whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiered.engine.pipeline import cut_microbatches, stage_layers
from tiered.engine.pipeline.split import microbatch_plans
from tiered.engine.runner import ItemPlan
from tiered.hybrid.forward import BatchItem, forward_batch
from tiered.hybrid.loader import load_model


def test_layers_split_into_contiguous_even_ranges() -> None:
    assert stage_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    assert stage_layers(5, 1) == [range(0, 5)]
    with pytest.raises(ValueError, match="3 stages for 2 layers"):
        stage_layers(2, 3)


def _plan(tokens: int, lead: int | None = None, cached: int = 0) -> ItemPlan:
    return ItemPlan(torch.zeros(tokens, dtype=torch.long), (), cached, lead, 5 if lead is not None else 0)


def test_microbatches_are_even_in_computed_tokens_and_never_put_a_follower_before_its_lead() -> None:
    # Computed tokens after hits, not prompt lengths: a 2,000-token prompt with 1,900 cached computes 100.
    plans = [
        _plan(n, cached=c) for n, c in [(100, 1900), (90, 0), (80, 300), (70, 0), (60, 0), (50, 0), (40, 0), (30, 0)]
    ]
    cut = cut_microbatches(plans, 2)
    loads = [sum(plans[i].num_computed_tokens for i in mb) for mb in cut]
    mean = sum(p.num_computed_tokens for p in plans) / 2
    eps = max(p.num_computed_tokens for p in plans) / mean
    assert sorted(i for mb in cut for i in mb) == list(range(8))  # each request once
    assert max(loads) <= (1 + eps) * mean and loads == [260, 260]  # LPT finds the exact split here
    # Followers are jobs of their own, never in an earlier micro-batch than their lead; one in a
    # later one reads the lead's stash (the lead keeps the longest such follower's shared rows).
    plans = [_plan(300), _plan(100, lead=0), _plan(200), _plan(90, lead=0), _plan(100, lead=2)]
    cut = cut_microbatches(plans, 3)
    where = {i: m for m, mb in enumerate(cut) for i in mb}
    assert sorted(where) == list(range(5)) and all(where[p.lead] <= where[i] for i, p in enumerate(plans) if p.lead)
    assert where[0] != where[2] and len(cut) == 3  # the two leads spread, not glued to their followers
    mbs = microbatch_plans(plans, cut)
    for m, indices in enumerate(cut):
        for i, got in zip(indices, mbs[m], strict=True):
            lead = plans[i].lead
            if lead is None:
                assert got.lead is None and got.reads_stash is None
            elif where[lead] == m:  # its lead is here: it follows it by position
                assert got.lead == indices.index(lead) and got.reads_stash is None
            else:
                assert got.lead is None and got.reads_stash == lead and got.num_shared == 5
    stashing = {p.stash_key: p.stash_rows for mb in mbs for p in mb if p.stash_key is not None}
    assert stashing == {
        lead: 5
        for lead in {plans[i].lead for i in where if plans[i].lead is not None and where[plans[i].lead] < where[i]}
    }
    assert cut_microbatches(plans[:1], 4) == [[0]]  # empty micro-batches are dropped


def test_a_model_run_stage_by_stage_equals_the_whole(tiny_dir: Path) -> None:
    whole = load_model(tiny_dir)
    first, last = load_model(tiny_dir, layers=range(0, 1)), load_model(tiny_dir, layers=range(1, 2))
    assert first.args.num_layers == last.args.num_layers == 1
    assert last.model.embed_tokens.weight.is_meta and first.lm_head.weight.is_meta  # parts a stage does not run
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 1300, (40,), generator=g)
    ids = [torch.cat([shared, torch.randint(0, 1300, (5 + i,), generator=g)]) for i in range(3)]
    items = [BatchItem(ids[0]), BatchItem(ids[1][40:], lead=0, num_shared=40), BatchItem(ids[2])]
    hidden = forward_batch(first, items, chunk_tokens=16, last_stage=False)
    assert hidden.shape == (45 + 6 + 47, whole.args.hidden_size)  # the packed computed tokens
    logits = forward_batch(last, items, chunk_tokens=16, hidden=hidden)
    assert (logits - forward_batch(whole, items, chunk_tokens=16)).abs().max() < 1e-5
