"""`tiered.Engine`: the in-process API. Submit requests, step, get results.

A step has one contract, vLLM v1's: the scheduler decides it (`Scheduler.schedule` returns a
`Step`: the batch with each request's blocks allocated and pinned, a piece of a request that
yields, the prefix it started prefetching, the requests it took out unrun), the executor runs it
(`Executor.execute`: one forward, or a batch sent into a pipeline) into a `StepOutput`, and the
scheduler applies that in one place (`Scheduler.update_from_output`: blocks indexed and freed,
chunks stored, a piece's KV parked, the JCT model's observation, requests that wait again); the
engine returns the results. Start-up (model, precision, kernel, memory split, tiers) is `startup.py`;
the JCT profile, `profile.py`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tiered.config import Config
from tiered.engine.adapters import UnknownAdapterError
from tiered.engine.executor import Executor
from tiered.engine.profile import jct_for
from tiered.engine.results import refused_results
from tiered.engine.startup import EngineStartError, start
from tiered.hybrid.forward import ForwardInputError
from tiered.request.score import DEFAULT_OPTIONS, DEFAULT_PARAMS, RequestOptions, Result, ScoreParams
from tiered.request.validation import InputError, check_priority, check_prompt, check_slo_ms, check_token_ids
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.pieces import PiecePolicy
from tiered.scheduler.scheduler import Scheduler
from tiered.scheduler.step import PieceStats, Step, StepLimits, StepOutput

__all__ = ["Engine", "EngineStartError"]

log = logging.getLogger(__name__)


class Engine:
    """Model + KV tiers + scheduler in one process. One thread drives it (`step`, `run`, adapters);
    `submit`, `cancel` and `shed_unreachable` may also come from one other thread, while a forward runs."""

    def __init__(self, config: Config, jct_model: JCTModel | None = None) -> None:
        self.config = config
        self.parts = parts = start(config)
        self.jct = jct_for(parts, jct_model)
        self.device, self.model, self.tiers, self.adapters = parts.device, parts.model, parts.tiers, parts.adapters
        self.precision, self.model_dir, self.max_model_len = parts.precision, parts.model_dir, parts.max_model_len
        self.model_identity, self.runner = parts.model_identity, parts.runner
        sc = config.scheduler
        limits = StepLimits(
            sc.max_batch_tokens,
            self.max_model_len,
            config.lora.max_loras,
            sc.prefetch,
            sc.drop_expired,
            sc.defer_late,
            sc.late == "shed",
            sc.max_predicted_wait_s,
            sc.warm_unmeetable,
            index_at_launch=parts.runner.max_in_flight > 1,
        )
        self.pieces = PieceStats()
        policy = PiecePolicy(sc, self.tiers.block_tokens, self.jct, self.pieces)
        self.scheduler = Scheduler(sc.policy, sc.fairness, self.tiers, self.jct, limits=limits, pieces=policy)
        self.executor = Executor(parts, self.jct)
        # The queue's state: `step` holds it but while its forward runs, so `submit`, `cancel` and
        # `shed_unreachable` may come from another thread meanwhile (a server's intake).
        self.lock = threading.RLock()
        self.num_cancelled = 0
        log.info(
            "engine ready: %s on %s (%s compute, %s attention), policy %s (λ=%g), prefetch %s, pieces %s; %s",
            self.model_dir.name,
            self.device,
            self.precision.compute,
            parts.kernel,
            sc.policy,
            sc.fairness,
            sc.prefetch,
            sc.pieces,
            self.tiers.describe(),
        )

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self,
        token_ids: Sequence[int] | Tensor,
        params: ScoreParams = DEFAULT_PARAMS,
        request_id: str | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> str:
        """Queue a request; returns its id. This is the engine's edge for a caller in this process:
        bad input raises ForwardInputError naming the value, by the rules the API process applies
        to each call before it sends it (`tiered.request.validation`; it then calls `enqueue`,
        which does not check again); admission control raises Refused (its status 429 or 503, and
        a Retry-After). `params`: what to answer; `options`: how to serve it (priority, cache
        salt, adapter, latency objective, arrival: `RequestOptions`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        vocab = self.model.args.vocab_size
        try:
            check_prompt(ids.tolist(), vocab, self.max_model_len)
            check_token_ids(params.token_ids(), vocab)
            check_slo_ms(options.slo_ms)
            check_priority(options.priority)
        except InputError as exc:
            raise ForwardInputError(str(exc)) from None
        return self.enqueue(ids, params, request_id, options)

    def enqueue(
        self,
        token_ids: Sequence[int] | Tensor,
        params: ScoreParams = DEFAULT_PARAMS,
        request_id: str | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> str:
        """Queue a request whose prompt, answer ids, objective and priority were checked already by
        `tiered.request.validation` (`submit` does; so does the API process, for every call it
        sends). Raises ForwardInputError only for what depends on the engine's state (an adapter
        it does not serve, a request id already waiting) and Refused as `submit` says."""
        adapter, slo_ms = options.adapter, options.slo_ms
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        identity = None
        if adapter is not None:
            if self.adapters is None:
                raise UnknownAdapterError(f"The model `{adapter}` does not exist (LoRA is not enabled).")
            identity = self.adapters.spec(adapter).identity
        slo_ms = self.config.scheduler.default_slo_ms if slo_ms is None else slo_ms
        request_id = request_id or uuid.uuid4().hex
        slo_s = None if slo_ms is None else slo_ms / 1e3
        req = self.tiers.new_request(request_id, ids, options.cache_salt, identity)
        with self.lock:
            if request_id in self.scheduler:
                raise ForwardInputError(f"request id {request_id!r} is already waiting")
            self.scheduler.add(req, options.arrival, options.priority, params, slo_s)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting request (timed out, client gone). False if it is not waiting."""
        with self.lock:
            if self.scheduler.remove(request_id) is None:
                return False
            self.num_cancelled += 1
        return True

    def shed_unreachable(self, busy_seconds: float, overrun: bool = False) -> list[Result]:
        """`scheduler.late: shed`: take out the waiting requests that cannot meet their deadline even
        if they start `busy_seconds` from now, as failures with their Retry-After ([] otherwise).
        For a caller that watches the queue while a forward runs (`busy_seconds`: what is left of it;
        `overrun`: the forward is past its predicted end, so no check here counts as finding a call in time)."""
        if not self.scheduler.limits.shed_late:
            return []
        with self.lock:
            shed = self.scheduler.take_unreachable(busy_seconds, self.scheduler.running_blocks, not overrun)
            retry_after = busy_seconds + self.scheduler.backlog(self.scheduler.running_blocks) if shed else 0.0
        return refused_results(Step(shed=shed, retry_after=retry_after)) if shed else []

    @property
    def num_waiting(self) -> int:
        """Requests queued (not yet in a forward), warm-ups of unmeetable calls' prefixes not counted."""
        return len(self.scheduler) - sum(rid in self.scheduler for rid in self.scheduler.warming)

    @property
    def num_unfinished(self) -> int:
        """Requests not yet answered: queued, or in a batch in the runner (a pipeline holds up to
        `engine.pipeline_batches_in_flight`); `step()` until it is 0 answers them all."""
        return len(self.scheduler) + self.executor.num_in_flight

    def step(
        self,
        answer_refused: Callable[[list[Result]], None] | None = None,
        starting: Callable[[float], None] | None = None,
    ) -> list[Result]:
        """Run the next step (one forward); the results it produced: those of the batch, or, with
        batches in flight (a pipeline), of the oldest one; [] when nothing waits or the step computed
        a piece of a request that yields (it waits again, its finished KV parked). The requests the
        step refused unrun (shed, expired) are among them, or, with `answer_refused`, handed to it
        before the forward starts (a server answers them at once). `starting` is told the forward's
        predicted seconds just before it starts (a server tells its API, which refuses calls that
        cannot wait that long without asking the engine)."""
        with self.lock:
            step = self.scheduler.schedule()
            self.scheduler.running(step)
        output = StepOutput()
        try:
            refused = refused_results(step)
            if answer_refused is not None and refused:
                answer_refused(refused)
                refused = []
            if starting is not None and step.batch:
                starting(step.predicted_seconds)
        except BaseException:
            output.aborted += step.prepared  # nothing ran: the step's blocks go back
            with self.lock:
                self.scheduler.running(None)
                self.scheduler.update_from_output(step, output)
            raise
        try:
            self.executor.execute(step, output)  # without the lock: calls may arrive meanwhile
        finally:
            with self.lock:
                self.scheduler.running(None)
                self.scheduler.update_from_output(step, output)
                warmed = [r for r in output.results if self.scheduler.finish_warm(r.request_id)]
        for r in warmed:  # a warm-up's answer goes to no one: its prefix is cached now
            if r.error is None:
                log.info("warm-up %s done: %d tokens cached for the calls that follow", r.request_id, r.num_tokens)
            else:
                log.warning("warm-up %s failed: %s", r.request_id, r.error)
        done = {r.request_id for r in warmed}
        return refused + [r for r in output.results if r.request_id not in done]

    # ---- adapters --------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str) -> None:
        """Serve a LoRA adapter from a PEFT folder (AdapterError names what is wrong with it)."""
        if self.adapters is None:
            raise ForwardInputError("LoRA is not enabled (lora.enabled / --enable-lora)")
        self.adapters.add(name, path)

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name` (UnknownAdapterError if it is not served); waiting requests still run."""
        if self.adapters is None:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        self.adapters.remove(name)

    def run(self) -> list[Result]:
        """Run until nothing waits; results in completion order."""
        results = []
        while self.num_unfinished:
            results += self.step()
        return results

    def close(self) -> None:
        """Stop the runner and the tiers."""
        self.parts.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
