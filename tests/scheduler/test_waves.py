"""Micro-batches by the work they compute (waves) against GPipe's cut by count."""

from __future__ import annotations

import random

import pytest

from tiered.engine.pipeline.waves import Job, form_by_count, form_waves


def _cost(job: Job) -> float:
    return job.num_computed_tokens + 0.01 * job.num_cached_tokens


@pytest.mark.parametrize("seed", range(25))
def test_no_microbatch_exceeds_the_mean_by_more_than_one_request(seed: int) -> None:
    """LPT's bound: max <= mean + largest job; so within (1 + eps) of the mean whenever no job is
    more than eps of it (the queue allows it)."""
    rng = random.Random(seed)
    jobs = [Job(f"r{i}", rng.choice([150, 170, 2000, 40]), rng.choice([0, 1800])) for i in range(rng.randrange(1, 80))]
    k = rng.randrange(1, 12)
    mbs = form_waves(jobs, k, _cost)
    assert sorted(j.request_id for mb in mbs for j in mb) == sorted(j.request_id for j in jobs)  # each once
    loads = [sum(_cost(j) for j in mb) for mb in mbs]
    mean = sum(map(_cost, jobs)) / k
    assert max(loads) <= mean + max(map(_cost, jobs)) + 1e-9
    eps = max(map(_cost, jobs)) / mean
    assert max(loads) <= (1 + eps) * mean + 1e-9


def test_small_even_jobs_balance_within_a_few_percent_where_a_count_cut_does_not() -> None:
    jobs = [Job(f"r{i}", 2000 if i % 8 == 0 else 150, 0 if i % 8 == 0 else 1800) for i in range(64)]
    jobs += [Job(f"s{i}", 150, 1800) for i in range(200)]
    waves = [sum(_cost(j) for j in mb) for mb in form_waves(jobs, 4, _cost)]
    count = [sum(_cost(j) for j in mb) for mb in form_by_count(jobs, 4)]
    assert max(waves) / (sum(waves) / 4) <= 1.02
    assert max(count) / (sum(count) / 4) > 1.2  # the new users' profiles all fall in the first quarter


def test_a_follower_never_runs_before_the_request_it_reads() -> None:
    lead = Job("v.0", 2000, 0)
    followers = [Job(f"v.{i}", 150, 1800, after="v.0") for i in range(1, 8)]
    others = [Job(f"o{i}", 900, 0) for i in range(6)]
    mbs = form_waves([*others, lead, *followers], 4, _cost)
    where = {j.request_id: m for m, mb in enumerate(mbs) for j in mb}
    assert all(where[f.request_id] >= where["v.0"] for f in followers)
    arrival = [j.request_id for j in [*others, lead, *followers]]
    for mb in mbs:  # within a micro-batch, arrival order
        assert [j.request_id for j in mb] == sorted((j.request_id for j in mb), key=arrival.index)


def test_the_count_cut_is_gpipes_and_bad_sizes_are_refused() -> None:
    jobs = [Job(f"r{i}", 10 * (i + 1), 0) for i in range(10)]
    sizes = [len(mb) for mb in form_by_count(jobs, 4)]
    assert sum(sizes) == 10 and max(sizes) - min(sizes) <= 1 and len(sizes) == 4
    assert [j.request_id for mb in form_by_count(jobs, 4) for j in mb] == [j.request_id for j in jobs]
    assert len(form_by_count(jobs[:2], 4)) == 2 and len(form_waves(jobs[:2], 4, _cost)) == 2
    with pytest.raises(ValueError, match="num_microbatches"):
        form_waves(jobs, 0, _cost)
