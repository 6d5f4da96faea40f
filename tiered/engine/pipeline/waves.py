"""Micro-batches for pipeline-parallel prefill (WavePP's waves), and the naive cut they replace.

With a model split into S stages, a batch is cut into micro-batches that follow one another
through the stages; a stage idles (a bubble) whenever the micro-batch it waits for is still on
the stage before, which happens when micro-batches carry unequal work. Under prefix reuse two
prompts of the same length can cost 1x and 20x (cached profile or not), so a cut by prompt count
or length leaves stages idle. `form_waves` cuts by the work each request computes after its hits
(the JCT model's terms for computed tokens, attention pairs and the cached prefix it reads):
longest first, each to the lightest micro-batch (LPT), which keeps every micro-batch within the
mean plus one request of it, so within (1 + ε) of the mean whenever no request is more than ε of
it. `form_by_count` is the GPipe-style baseline: equal numbers of requests, in arrival order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Job:
    """A request as the pipeline sees it: tokens it computes and cached tokens it reads."""

    request_id: str
    num_computed_tokens: int
    num_cached_tokens: int
    # The request whose computed tokens this one reads (a batch's follower reads its lead's
    # profile): it must not run in an earlier micro-batch than that one.
    after: str | None = None


def form_waves(jobs: Sequence[Job], num_microbatches: int, cost: Callable[[Job], float]) -> list[list[Job]]:
    """Cut `jobs` into `num_microbatches` micro-batches of even cost (longest processing time
    first: each job to the lightest micro-batch it may join, never one before its `after`'s);
    empty micro-batches are dropped. Within a micro-batch, jobs keep their arrival order."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    order = {job.request_id: i for i, job in enumerate(jobs)}
    by_id = {job.request_id: job for job in jobs}
    loads = [0.0] * num_microbatches
    placed: dict[str, int] = {}
    out: list[list[Job]] = [[] for _ in range(num_microbatches)]

    def place(job: Job) -> None:
        if job.request_id in placed:
            return
        first = 0
        if job.after is not None and job.after in by_id:
            place(by_id[job.after])  # a lead before its followers, whatever their costs
            first = placed[job.after]
        m = min(range(first, num_microbatches), key=lambda i: (loads[i], i))
        placed[job.request_id] = m
        out[m].append(job)
        loads[m] += cost(job)

    for job in sorted(jobs, key=cost, reverse=True):
        place(job)
    return [sorted(mb, key=lambda j: order[j.request_id]) for mb in out if mb]


def form_by_count(jobs: Sequence[Job], num_microbatches: int) -> list[list[Job]]:
    """GPipe's cut: consecutive runs of (nearly) equal numbers of requests, whatever they compute."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    n, k = len(jobs), min(num_microbatches, max(1, len(jobs)))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [list(jobs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
