"""Runs a `Step`: prepares its requests in the tiers, hands the batch to the runner, answers it.

A batch is prepared (pins, host loads), planned (`runner.plan_batch`) and submitted; its logits
become results, its KV goes to the tiers by policy, and the JCT model learns its time. With a
pipeline several batches are in the runner at once (`_in_flight`, oldest first): a step sends one
and answers the oldest. A piece of a yielding request runs alone, parks its KV and waits again
(in `StepOutput.requeue`). Out of memory fails a request alone; a batch that runs out of memory
runs again one request at a time. A runner that loses its batches (a pipeline stage died) fails
them with a 503, or with `ForwardRetry` gives them back to wait again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

import torch

from tiered.engine.results import (
    Launched,
    batch_results,
    load_adapters,
    refused_results,
    unavailable_results,
)
from tiered.engine.runner import ForwardRetry, ForwardUnavailable, plan_batch
from tiered.engine.startup import Parts
from tiered.request.plan import Prepared
from tiered.request.score import Result
from tiered.request.tokens import TierRequest
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.step import Decision, PieceStats, Step, StepOutput, Waiting

log = logging.getLogger(__name__)

# Requests between pieces hold at most this share of the device tier (their leading parked blocks)
# when a host tier has the rest, so that short calls meanwhile find their cached prefixes there.
PARK_DEVICE_SHARE = 0.5


def out_of_memory(exc: BaseException) -> bool:
    """cuda raises torch.OutOfMemoryError; the CPU allocator a RuntimeError saying so."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(exc)


class Executor:
    """Runs steps on the parts the engine started with; keeps the batches in the runner."""

    def __init__(self, parts: Parts, jct: JCTModel, stats: PieceStats) -> None:
        self.parts = parts
        self.tiers = parts.tiers
        self.runner = parts.runner
        self.jct = jct
        self.stats = stats
        self._in_flight: deque[Launched] = deque()  # batches in the runner, oldest first
        self._picked: list[Decision] = []  # the step's batch until it is sent to the runner or answered
        self._last_done = 0.0  # perf_counter when the runner's last batch ended
        self._prefetch: TierRequest | None = None  # the step's prefetch, started once its batch is prepared

    @property
    def num_in_flight(self) -> int:
        """Requests in batches the runner has not answered yet."""
        return sum(len(launched.batch) for launched in self._in_flight)

    def release(self, w: Waiting) -> None:
        """A waiting request leaves (cancelled, expired): its hold on parked blocks and its prefetch go."""
        self.tiers.device_tier.unpin(w.parked)
        self.tiers.drop_prefetch(w.request_id)

    def refuse(self, step: Step) -> list[Result]:
        """The failures of the requests the step took out unrun (expired, shed), their holds released."""
        for w in step.expired + step.shed:
            self.release(w)
        return refused_results(step)

    def execute(self, step: Step) -> StepOutput:
        """Run one step (its refused requests answered already: `refuse`); its answers, and the
        requests that wait again."""
        out = StepOutput()
        self._prefetch = step.prefetch
        started = time.monotonic()
        out.results += (failed := load_adapters(self.parts.adapters, step.batch, started))
        gone = {r.request_id for r in failed}
        self._picked = batch = [d for d in step.batch if d.waiting.request_id not in gone]
        try:
            self._run(step, batch, started, out)
        except ForwardUnavailable as exc:  # a pipeline stage died or hung (restarted): its batches fail, 503
            self._unavailable(str(exc), isinstance(exc, ForwardRetry), out)
        finally:
            self._start_prefetch()  # a step that launched nothing
        self._picked = []
        return out

    def _start_prefetch(self) -> None:
        """Start the step's prefetch: after its batch pinned its prefix, so that the prefetch's
        allocations (which evict unpinned blocks) cannot take the blocks the batch is about to read."""
        if self._prefetch is not None:
            self.tiers.prefetch(self._prefetch)
            self._prefetch = None

    def _run(self, step: Step, batch: list[Decision], started: float, out: StepOutput) -> None:
        piece = step.piece_tokens
        if batch and piece is None and self.runner.max_in_flight > 1:
            self._in_flight.append(self._launch(batch, step.waiting_keys, started))  # into the pipe
            self._picked = []  # sent: from here on the pipe holds it
            return self._collect(self.runner.max_in_flight - 1, out)
        if not batch:  # nothing to send: answer the oldest batch in the pipe, if any
            return self._collect(max(0, len(self._in_flight) - 1), out)
        self._collect(0, out)  # a piece parks KV the next pick must see: the pipe empties first
        if piece is not None:
            self._run_piece(batch[0], piece, step, started, out)
        elif len(batch) == 1:
            out.results += self._run_alone(batch[0], step.waiting_keys, started)
        else:
            try:
                out.results += self._run_batch(batch, step.waiting_keys, started)
            except BaseException as exc:
                if not out_of_memory(exc):
                    raise
                self._release_memory()
                log.warning("a batch of %d requests ran out of memory; running them one by one", len(batch))
                out.results += [r for d in batch for r in self._run_alone(d, step.waiting_keys, started)]

    def _collect(self, keep: int, out: StepOutput) -> None:
        """Answer the oldest batches in the runner until `keep` remain."""
        while len(self._in_flight) > keep:
            out.results += self._complete(self._in_flight[0])
            self._in_flight.popleft()

    def _unavailable(self, why: str, retry: bool, out: StepOutput) -> None:
        """The runner lost every batch in it: each request of those and of the batch picked but not
        sent fails with a 503, or with `retry` (ForwardRetry) waits again as it was."""
        lost, self._picked = self._picked, []
        while self._in_flight:
            launched = self._in_flight.popleft()
            for p in launched.prepared:
                self.tiers.abort(p)
            lost += launched.batch
        if retry:
            out.requeue += [d.waiting for d in lost]
            return
        self.tiers.forget_host()  # a pipeline restarted: its stages' host tiers are gone with them
        out.results += unavailable_results(lost, self.tiers.device_tier, why)

    def _run_alone(
        self, decision: Decision, waiting_keys: set[int], started: float, park: bool = False
    ) -> list[Result]:
        """One request in its own forward; out of memory fails it alone (admission should prevent it)."""
        try:
            return self._run_batch([decision], waiting_keys, started, park)
        except BaseException as exc:
            if not out_of_memory(exc):
                raise
            self._release_memory()
            self.tiers.device_tier.unpin(decision.waiting.parked)  # a request that yielded: its hold too
            req = decision.waiting.request
            n = req.token_ids.numel()
            log.error("request %s (%d tokens) ran out of memory: %s", req.request_id, n, str(exc)[:200])
            waited = started - decision.waiting.arrival
            return [Result.failed(req.request_id, n, f"out of memory computing {n} tokens", waited)]

    def _release_memory(self) -> None:
        if self.parts.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _run_batch(
        self, batch: list[Decision], waiting_keys: set[int], started: float, park: bool = False
    ) -> list[Result]:
        """Prepare every request (pins, host loads), one forward over all, then finish each.
        `park`: the batch is a piece of a request that resumes later (its KV stays, see `prepare`)."""
        launched = self._launch(batch, waiting_keys, started, park)
        try:
            return self._complete(launched)
        except BaseException:
            for p in launched.prepared:
                self.tiers.abort(p)
            raise

    def _launch(self, batch: list[Decision], waiting_keys: set[int], started: float, park: bool = False) -> Launched:
        """Prepare the batch's requests, plan it and hand it to the runner. With batches in flight
        at once its retained blocks are indexed now: the next batch, planned before this one ends,
        hits them (every stage computes batches in order, so they are written before they are read)."""
        prepared: list[Prepared] = []
        planned: set[int] = set()  # blocks an earlier request of the batch keeps or stores
        try:
            for d in batch:
                prepared.append(self.tiers.prepare(d.waiting.request, waiting_keys, planned, park))
            self._start_prefetch()
            plans = plan_batch(prepared, self.tiers.block_tokens)
            sent = time.perf_counter()
            ticket = self.runner.submit(prepared, plans)
        except BaseException:
            for p in prepared:
                self.tiers.abort(p)
            raise
        if self.runner.max_in_flight > 1:
            for p in prepared:
                self.tiers.commit(p)
        return Launched(batch, prepared, [p.num_shared for p in plans], ticket, started, sent)

    def _complete(self, launched: Launched) -> list[Result]:
        """Wait for a launched batch's logits, release its blocks, learn its time and answer it.
        Its answers' compute time: from when it was sent; what the JCT model learns: from when it
        was sent or the batch before it ended, whichever is later (with batches in flight, what
        this batch added to the runner's busy time)."""
        logits = self.runner.collect(launched.ticket)
        self.parts.synchronize()
        done = time.perf_counter()
        added = done - max(launched.sent, self._last_done)
        self._last_done = done
        batch, prepared, shared = launched.batch, launched.prepared, launched.shared
        for p in prepared:
            self.tiers.finish(p)
        for d in batch:  # a request that yielded: its own pins cover what it held
            self.tiers.device_tier.unpin(d.waiting.parked)
            d.waiting.parked = []
        # For the cost model, tokens computed by another request cost what a cached prefix does.
        splits = [p.split.shared_as_hits(m) for p, m in zip(prepared, shared, strict=True)]
        load = sum(p.load_seconds for p in prepared)
        predicted = self.jct.observe(splits, load + added)
        return batch_results(launched, logits, load, done - launched.sent, predicted)

    def _run_piece(self, d: Decision, num_tokens: int, step: Step, started: float, out: StepOutput) -> None:
        """Compute the head's next `num_tokens` (block-aligned) and park them; the head waits again
        (`out.requeue`), or fails."""
        w, bt = d.waiting, self.tiers.block_tokens
        req = w.request
        end = w.split.num_hit_tokens + num_tokens
        cut = TierRequest(req.request_id, req.token_ids[:end], req.keys[: end // bt], req.salt, req.adapter)
        piece = replace(d, waiting=replace(w, request=cut, parked=[]))
        failed = self._run_alone(piece, step.waiting_keys, started, park=True)
        if failed and failed[0].error is not None:
            self.tiers.device_tier.unpin(w.parked)
            out.results.append(replace(failed[0], num_tokens=req.token_ids.numel()))
            return
        if w.first_split is None:
            w.first_split = w.split
        w.num_pieces += 1
        dt = self.tiers.device_tier
        held = dt.match(req.keys, req.token_ids.tolist(), count=False, pin=True)
        if self.tiers.host_tier is not None:
            # Not held: cached but evictable, in the host tier (write-through) or sent there when
            # evicted (on-evict); a chunk the host tier lacks (a dropped store) is computed again.
            cap = max(0, int(dt.num_blocks * PARK_DEVICE_SHARE) - step.num_parked_blocks)
            dt.unpin(held[cap:])
            held = held[:cap]
        dt.unpin(w.parked)
        first = w.split.num_hit_tokens // bt  # of this piece's blocks, those held on the device
        on_device = max(0, min(len(held), end // bt) - first)
        self.stats.parked_device_bytes += on_device * dt.bytes_per_block
        if self.tiers.host_tier is not None:
            self.stats.parked_host_bytes += max(0, num_tokens // bt - on_device) * dt.bytes_per_block
        w.parked = held
        out.requeue.append(w)
        self.stats.num_pieces += 1
        log.debug(
            "request %s yielded after piece %d (%d of %d tokens; %d blocks held on the device)",
            req.request_id,
            w.num_pieces,
            end,
            req.token_ids.numel(),
            len(held),
        )
