"""Runs a `Step`: loads its host hits, hands its prepared batch to the runner and answers it.

The scheduler has allocated and pinned every request's blocks (`Step.prepared`); the executor
has the tiers' worker side run the host loads the scheduler planned into them (`KVWorker.load`:
a chunk that cannot be read gives the whole step back to wait again), plans the batch
(`runner.plan_batch`), submits it and turns its logits into results. It never pins, looks up or
frees a block: what the forward's end means for the KV (retained blocks
indexed, pins released, chunks stored, a piece's KV parked) and the JCT model's observation go
back in the `StepOutput`, which the scheduler applies. With a pipeline several batches are in the
runner at once (`_in_flight`, oldest first): a step sends one and answers the oldest. A piece of a
yielding request runs alone and its head waits again (`StepOutput.piece_head`). Out of memory
fails a request alone; a batch that runs out of memory runs again one request at a time. A
runner that loses its batches (a pipeline stage died) fails them with a 503, or with
`ForwardRetry` gives them back to wait again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

import torch

from tiered.engine.results import Launched, batch_results, load_adapters, unavailable_results
from tiered.engine.runner import ForwardRetry, ForwardUnavailable, plan_batch
from tiered.engine.startup import Parts
from tiered.request.plan import Prepared
from tiered.request.score import Result
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.step import Decision, Step, StepOutput

log = logging.getLogger(__name__)

Pair = tuple[Decision, Prepared]


def out_of_memory(exc: BaseException) -> bool:
    """cuda raises torch.OutOfMemoryError; the CPU allocator a RuntimeError saying so."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(exc)


class Executor:
    """Runs steps on the parts the engine started with; keeps the batches in the runner."""

    def __init__(self, parts: Parts, jct: JCTModel) -> None:
        self.parts = parts
        self.block_tokens = parts.tiers.block_tokens
        self.runner = parts.runner
        self.worker = parts.tiers.worker
        self.jct = jct  # read only: each answer's predicted seconds
        self._in_flight: deque[Launched] = deque()  # batches in the runner, oldest first
        self._picked: list[Pair] = []  # the step's batch until it is sent to the runner or answered
        self._last_done = 0.0  # perf_counter when the runner's last batch ended

    @property
    def num_in_flight(self) -> int:
        """Requests in batches the runner has not answered yet."""
        return sum(len(launched.batch) for launched in self._in_flight)

    def execute(self, step: Step, out: StepOutput) -> None:
        """Run one step (its refused requests answered already) into `out`: its answers, and what
        the scheduler applies afterwards. Whatever it raises, `out` names every prepared request of
        the step that did not finish as aborted."""
        try:
            lost = self.worker.load(step.prepared)  # every request of the step may read these blocks
        except BaseException:
            out.aborted += step.prepared
            raise
        if lost:
            log.warning(
                "%d host-tier chunks could not be read: the step's %d requests wait again and compute them",
                sum(len(load.block_ids) - (load.filled or 0) for load in lost),
                len(step.batch),
            )
            out.aborted += step.prepared
            out.requeue += [d.waiting for d in step.batch]
            return
        out.results += (failed := load_adapters(self.parts.adapters, step.batch, step.started))
        gone = {r.request_id for r in failed}
        pairs = list(zip(step.batch, step.prepared, strict=True))
        for d, p in pairs:
            if d.waiting.request_id in gone:
                out.aborted.append(p)
                out.released.append(d.waiting)
        self._picked = [(d, p) for d, p in pairs if d.waiting.request_id not in gone]
        try:
            self._run(step, out)
        except ForwardUnavailable as exc:  # a pipeline stage died or hung (restarted): its batches fail, 503
            self._unavailable(str(exc), isinstance(exc, ForwardRetry), out)
        except BaseException:
            ended = {id(p) for p in out.finished + out.aborted}
            out.aborted += [p for _, p in self._picked if id(p) not in ended]
            raise
        finally:
            self._picked = []

    def _run(self, step: Step, out: StepOutput) -> None:
        pairs = self._picked
        if pairs and step.piece_tokens is None and self.runner.max_in_flight > 1:
            self._in_flight.append(self._launch(pairs, step.started))  # into the pipe
            self._picked = []  # sent: from here on the pipe holds it
            return self._collect(self.runner.max_in_flight - 1, out)
        if not pairs:  # nothing to send: answer the oldest batch in the pipe, if any
            return self._collect(max(0, len(self._in_flight) - 1), out)
        self._collect(0, out)  # a piece parks KV the next pick must see: the pipe empties first
        if step.piece_tokens is not None:
            self._run_piece(pairs[0], step.started, out)
        elif len(pairs) == 1:
            out.results += self._run_alone(pairs[0], step.started, out)
        else:
            try:
                out.results += self._complete(self._launch(pairs, step.started), out)
            except BaseException as exc:
                if not out_of_memory(exc):
                    raise
                self._release_memory()
                log.warning("a batch of %d requests ran out of memory; running them one by one", len(pairs))
                # Each prepared request runs as planned for the batch: a follower computes the tokens
                # its lead would have computed for it, and keeps and stores the blocks after them.
                out.results += [r for pair in pairs for r in self._run_alone(pair, step.started, out)]

    def _collect(self, keep: int, out: StepOutput) -> None:
        """Answer the oldest batches in the runner until `keep` remain."""
        while len(self._in_flight) > keep:
            out.results += self._complete(self._in_flight[0], out)
            self._in_flight.popleft()

    def _unavailable(self, why: str, retry: bool, out: StepOutput) -> None:
        """The runner lost every batch in it: each request of those and of the batch picked but not
        sent fails with a 503, or with `retry` (ForwardRetry) waits again as it was."""
        lost = [d for d, _ in self._picked]
        out.aborted += [p for _, p in self._picked]
        self._picked = []
        while self._in_flight:
            launched = self._in_flight.popleft()
            out.aborted += launched.prepared
            lost += launched.batch
        if retry:
            out.requeue += [d.waiting for d in lost]
            return
        out.host_lost = True  # a pipeline restarted: its stages' host tiers are gone with them
        out.released += [d.waiting for d in lost]
        out.results += unavailable_results(lost, why)

    def _run_alone(self, pair: Pair, started: float, out: StepOutput) -> list[Result]:
        """One request in its own forward; out of memory fails it alone (admission should prevent it)."""
        d, p = pair
        try:
            return self._complete(self._launch([pair], started), out)
        except BaseException as exc:
            if not out_of_memory(exc):
                raise
            self._release_memory()
            out.aborted.append(p)
            out.released.append(d.waiting)  # a request that yielded: its hold too
            req = d.waiting.request
            n = req.token_ids.numel()
            log.error("request %s (%d tokens) ran out of memory: %s", req.request_id, n, str(exc)[:200])
            waited = started - d.waiting.arrival
            return [Result.failed(req.request_id, n, f"out of memory computing {n} tokens", waited)]

    def _release_memory(self) -> None:
        if self.parts.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _launch(self, pairs: list[Pair], started: float) -> Launched:
        """Plan the batch and hand it to the runner (`started`: when its step began preparing it)."""
        batch, prepared = [d for d, _ in pairs], [p for _, p in pairs]
        plans = plan_batch(prepared, self.block_tokens)
        sent = time.perf_counter()
        ticket = self.runner.submit(prepared, plans)
        return Launched(batch, prepared, [p.num_shared for p in plans], ticket, started, sent)

    def _complete(self, launched: Launched, out: StepOutput) -> list[Result]:
        """Wait for a launched batch's logits and answer it; its prepared requests finish and its
        time goes to the JCT model (both applied by the scheduler). Its answers' compute time: from
        when it was sent; what the JCT model learns: from when it was sent or the batch before it
        ended, whichever is later (with batches in flight, what this batch added to the runner's
        busy time)."""
        logits = self.runner.collect(launched.ticket)
        self.parts.synchronize()
        done = time.perf_counter()
        added = done - max(launched.sent, self._last_done)
        self._last_done = done
        batch, prepared, shared = launched.batch, launched.prepared, launched.shared
        out.finished += prepared
        out.released += [d.waiting for d in batch]  # a request that yielded: its own pins cover what it held
        # For the cost model, tokens computed by another request cost what a cached prefix does.
        splits = [p.split.shared_as_hits(m) for p, m in zip(prepared, shared, strict=True)]
        load = sum(p.load_seconds for p in prepared)
        predicted = self.jct.predict_batch(splits)
        out.observed.append((splits, load + added))
        return batch_results(launched, logits, load, done - launched.sent, predicted)

    def _run_piece(self, pair: Pair, started: float, out: StepOutput) -> None:
        """Compute the head's next piece (its prepared request ends there) with its KV parked; the
        head then waits again (`out.piece_head`), or fails."""
        d, p = pair
        w = d.waiting
        piece = replace(d, waiting=replace(w, request=p.request, parked=[]))  # its holds stay with `w`
        failed = self._run_alone((piece, p), started, out)
        if failed and failed[0].error is not None:
            out.released.append(w)
            out.results.append(replace(failed[0], num_tokens=w.request.token_ids.numel()))
            return
        out.piece_head = w
