"""The answers of a step: those made from a batch's logits (`Launched`: a batch handed to the
runner), and the failures of requests that expired, whose adapter is unreadable, or whose batch
the runner lost."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from tiered.engine.adapters import Adapters
from tiered.request.plan import Prepared
from tiered.request.score import Result
from tiered.scheduler.step import Decision, Step

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A batch submitted to the runner and not yet collected: its decisions, prepared requests
    (pins held), each request's tokens computed by its lead, the runner's ticket, when its step
    began preparing it (monotonic: its requests' wait ends there) and when it was submitted
    (perf_counter: its compute starts)."""

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


def refused_results(step: Step) -> list[Result]:
    """The failures of the requests a step took out of the queue: past their deadline
    (`scheduler.drop_expired`) or predicted to miss it (`scheduler.late: shed`, with the step's
    Retry-After)."""
    now = time.monotonic()
    expired = [
        Result.failed(
            w.request_id,
            w.request.token_ids.numel(),
            f"deadline exceeded: {1e3 * (now - (w.deadline or now)):.0f} ms past its latency objective while it "
            "waited (scheduler.drop_expired)",
            now - w.arrival,
            expired=True,
        )
        for w in step.expired
    ]
    shed = [
        Result.failed(
            w.request_id,
            w.request.token_ids.numel(),
            f"deadline unreachable: its predicted {w.jct:.2f} s cannot start in time to end within its latency "
            f"objective ({max(0.0, (w.deadline or now) - now):.2f} s left; scheduler.late: shed)",
            now - w.arrival,
            expired=True,
            retry_after=step.retry_after,
            late_since=w.arrival if w.in_time_at is None else w.in_time_at,
        )
        for w in step.shed
    ]
    return expired + shed


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


def unavailable_results(lost: list[Decision], why: str) -> list[Result]:
    """Requests whose batch was lost with the runner: each fails with a 503 naming `why`."""
    return [
        Result.failed(w.request_id, w.request.token_ids.numel(), why, time.monotonic() - w.arrival, unavailable=True)
        for d in lost
        if (w := d.waiting)
    ]
