"""Pieces of the engine's step: a batch handed to the runner (`Launched`) and the answers made
from its logits; requests that fail before a forward (expired, their adapter unreadable)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered.adapters import Adapters
from tiered.offload.device_tier import DeviceTier
from tiered.offload.request import Prepared
from tiered.scheduler.scheduler import Decision, Scheduler
from tiered.score import Result

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A batch submitted to the runner and not yet collected: its decisions, prepared requests
    (pins held), each request's tokens computed by its lead, the runner's ticket, the engine
    step's start (monotonic) and when it was submitted (perf_counter)."""

    batch: list[Decision]
    prepared: list[Prepared]
    shared: list[int]
    ticket: object
    started: float
    sent: float


def batch_results(launched: Launched, logits: Tensor, load: float, compute: float, predicted: float) -> list[Result]:
    """Each request's answer from the batch's last-token logits [B, V]: its chosen token, the
    logprobs it asked for, its hits (those before its first piece, for a request that yielded)
    and its timings (`load` and `compute`: the batch's)."""
    batch, prepared = launched.batch, launched.prepared
    logprobs = torch.log_softmax(logits, dim=-1)
    store = sum(p.store_seconds for p in prepared)
    now = time.monotonic()
    results = []
    for i, (d, p) in enumerate(zip(batch, prepared, strict=True)):
        w = d.waiting
        par = w.params
        top = []
        if par.top_logprobs:
            values, indices = torch.topk(logprobs[i], par.top_logprobs)
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
        results.append(
            Result(
                request_id=p.request.request_id,
                num_tokens=p.request.token_ids.numel(),
                split=p.split if w.first_split is None else w.first_split,
                token_id=par.choose(logits[i]),
                logprobs={t: float(logprobs[i, t]) for t in par.logprob_token_ids},
                top_logprobs=top,
                queued_seconds=launched.started - w.arrival,
                prefetch_wait_seconds=p.prefetch_wait_seconds,
                load_seconds=load,
                compute_seconds=compute,
                predicted_seconds=predicted,
                decision_seconds=d.decision_seconds,
                finished_at=now,
                batch_size=len(batch),
                num_shared_tokens=launched.shared[i],
                store_seconds=store,
                num_pieces=w.num_pieces + 1,
                deadline_met=None if w.deadline is None else now <= w.deadline,
            )
        )
    return results


def expire(scheduler: Scheduler, drop: Callable[[str], object]) -> list[Result]:
    """`scheduler.drop_expired`: fail the waiting requests whose deadline has passed (`drop` takes each out)."""
    now = time.monotonic()
    out = []
    while (first := scheduler.by_deadline(limit=1)) and (deadline := first[0].deadline or now) < now:
        drop((w := first[0]).request_id)
        late = 1e3 * (now - deadline)
        out.append(
            Result.failed(
                w.request_id,
                w.request.token_ids.numel(),
                f"deadline exceeded: {late:.0f} ms past its latency objective while it waited (scheduler.drop_expired)",
                now - w.arrival,
                expired=True,
            )
        )
    return out


def load_adapters(adapters: Adapters | None, batch: list[Decision], started: float) -> list[Result]:
    """Make the batch's adapters resident; fail (only) the requests whose adapter folder can no
    longer be read as it was checked (changed or deleted since)."""
    identities = [a for d in batch if (a := d.waiting.request.adapter) is not None]
    if adapters is None or not identities:
        return []
    bad = adapters.load(identities)
    for why in bad.values():
        log.error("%s: its requests fail", why)
    return [
        Result.failed(w.request_id, w.request.token_ids.numel(), bad[a], started - w.arrival)
        for d in batch
        if (a := (w := d.waiting).request.adapter) in bad
    ]


def give_back(lost: list[Decision], device_tier: DeviceTier, scheduler: Scheduler | None, why: str) -> list[Result]:
    """Requests whose batch was lost (their prepared requests already aborted): each waits again with
    the `scheduler` (as it was: a request that yielded keeps its parked KV), or without one fails
    with a 503 naming `why` (its parked KV released)."""
    if scheduler is not None:
        for d in lost:
            scheduler.requeue(d.waiting)
        return []
    for d in lost:
        device_tier.unpin(d.waiting.parked)
    return [
        Result.failed(w.request_id, w.request.token_ids.numel(), why, time.monotonic() - w.arrival, unavailable=True)
        for d in lost
        if (w := d.waiting)
    ]
