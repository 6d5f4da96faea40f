"""`tiered.Engine`: the in-process API. Submit requests, run the loop, get results.

Each step runs one forward over a batch: the scheduler re-scores what changed and picks a head
plus the waiting requests that share its prefix, up to `scheduler.max_batch_tokens` computed
tokens (0: one request per forward, PrefillOnly's way; a long uncached request runs alone, and
may yield between pieces: `pieces.py`). The likely next pick's host-resident prefix
starts loading in the background; each request of the batch waits for its own prefetch (if
any), and one forward computes every request's misses on top of its cached prefix; each
request's KV goes to the tiers by policy. Results carry the hit split per tier and a timing
breakdown (queued, waiting for prefetch, loading, computing: the batch's).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from tiered.adapters import Adapters, UnknownAdapterError
from tiered.batches import Launched, batch_results, expire, give_back, load_adapters
from tiered.config import Config
from tiered.embedded import resolve_model_path
from tiered.hybrid.attention.select import choose_kernel
from tiered.hybrid.forward import ForwardInputError
from tiered.hybrid.loader import DTYPES, load_model, model_identity, model_on_meta, resolve_device
from tiered.hybrid.memory import measure_forward_peak
from tiered.hybrid.model import use_attention
from tiered.hybrid.precision import precision_for
from tiered.offload.request import Prepared
from tiered.offload.tiers import KVTiers
from tiered.pieces import Pieces
from tiered.pipeline import PipelineStartError, start_pipeline
from tiered.profile import profile_jct
from tiered.runner import ForwardRetry, ForwardUnavailable, LocalRunner, Runner, plan_batch
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.scheduler import Decision, Scheduler, Waiting
from tiered.score import DEFAULT_PARAMS, Result, ScoreParams
from tiered.validation import InputError, check_prompt, check_slo_ms, check_token_ids

log = logging.getLogger(__name__)


def _out_of_memory(exc: BaseException) -> bool:
    """cuda raises torch.OutOfMemoryError; the CPU allocator a RuntimeError saying so."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(exc)


class EngineStartError(RuntimeError):
    """The engine cannot start with this configuration (the message says by how much)."""


class Engine:
    """Model + KV tiers + scheduler in one process. Not thread-safe: one caller drives it."""

    def __init__(self, config: Config, jct_model: JCTModel | None = None) -> None:
        self.config = config
        stages = config.engine.pipeline_stages
        if config.engine.threads or stages > 1:  # with stages, the cores are theirs
            torch.set_num_threads(config.engine.threads or 1)
        self.device = device = resolve_device(config.device)
        folder = resolve_model_path(config.model.path, config.model.models_dir)
        self.model_dir = folder
        self.precision = precision_for(config.model.dtype, config.cache.kv_dtype, folder, device)
        log.info("precision: %s", self.precision.describe())
        # With stages the coordinator keeps the model's args and structure, not its weights: the
        # stage processes hold those (the kernel choice needs only the shapes).
        self.model = load_model(folder, self.precision.compute, device) if stages == 1 else model_on_meta(folder)
        self.max_model_len = config.model.max_model_len
        a = self.model.args
        kernel = choose_kernel(
            config.attention.kernel,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            DTYPES[self.precision.compute],
            device,
            config.attention.profile_cache_dir,
            self.max_model_len,
            config.attention.vllm_library,
        )
        use_attention(self.model, kernel)
        cache = config.cache
        if config.engine.memory_budget_bytes and stages == 1:  # with stages, each stage measures its own
            cache = replace(cache, device_tier_bytes=self._split_memory(config.engine.memory_budget_bytes))
        self.model_identity = model_identity(folder, self.precision.identity, cache.block_tokens)
        lora = config.lora
        compute = DTYPES[self.precision.compute]
        self.adapters = Adapters(lora, a, compute, device) if lora.enabled else None
        try:  # the stage processes, their pools sized; one that fails to load or to fit its budget fails the start
            pipeline = (
                start_pipeline(config, folder, a, self.precision, kernel, device, self.adapters, self.model_identity)
                if stages > 1
                else None
            )
        except PipelineStartError as exc:
            raise EngineStartError(str(exc)) from exc
        self.tiers = KVTiers(
            cache,
            a,
            DTYPES[self.precision.kv],
            device,
            f"engine-{uuid.uuid4().hex[:8]}",
            self.model_identity,
            pipeline.device_tier if pipeline else None,
            pipeline.host if pipeline else None,
        )
        self.runner: Runner = pipeline or LocalRunner(self.model, self.tiers, self.adapters, config.forward)
        try:
            self.jct = jct_model or profile_jct(self)  # with stages: through them
            if pipeline:  # its stage models start from the profile
                pipeline.stage_models.use_prior(self.jct)
        except BaseException:
            self.runner.close()  # no engine to close the stages later
            raise
        self.scheduler = Scheduler(config.scheduler.policy, config.scheduler.fairness, self.tiers, self.jct)
        self.pieces = Pieces(self)
        self.num_cancelled = 0
        self._in_flight: deque[Launched] = deque()  # batches in the runner, oldest first
        self._collected: list[Result] = []  # answers not yet returned by step()
        self._picked: list[Decision] = []  # the step's batch until it is sent (or answered, in step)
        self._last_done = 0.0  # perf_counter when the runner's last batch ended
        sc = config.scheduler
        log.info(
            "engine ready: %s on %s (%s compute, %s attention), policy %s (λ=%g), prefetch %s, pieces %s",
            folder.name,
            device,
            self.precision.compute,
            kernel,
            sc.policy,
            sc.fairness,
            sc.prefetch,
            sc.pieces,
        )

    # ---- start-up --------------------------------------------------------------------------

    def _split_memory(self, budget: int) -> int:
        """Device-tier bytes = budget − weights − peak of a max_model_len forward (profile run)."""
        f = self.config.forward
        peak = measure_forward_peak(self.model, self.max_model_len, f.mode, f.chunk_tokens)
        left = budget - peak.peak_bytes
        log.info(
            "profile run: %d tokens peak %.1f MiB (weights %.1f MiB) of a %.1f MiB budget -> device tier %.1f MiB",
            self.max_model_len,
            peak.peak_bytes / 2**20,
            peak.weights_bytes / 2**20,
            budget / 2**20,
            left / 2**20,
        )
        if left <= 0:
            raise EngineStartError(
                f"model.max_model_len {self.max_model_len} does not fit engine.memory_budget_bytes {budget}: "
                f"weights + one forward peak at {peak.peak_bytes} bytes, {-left} bytes over; "
                "lower max_model_len or raise the budget"
            )
        return left

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU): timings end here."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self,
        token_ids: Sequence[int] | Tensor,
        params: ScoreParams = DEFAULT_PARAMS,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        adapter: str | None = None,
        slo_ms: float | None = None,
        arrival: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Bad input raises ForwardInputError naming the value.

        `priority`: lower runs first (vLLM's field); `cache_salt`: cached KV is shared only with
        requests of the same salt (vLLM's field), in both tiers; `adapter`: the name of a LoRA
        adapter to compute with (UnknownAdapterError if it is not served); `slo_ms`: its latency
        objective, ms from its arrival (default `scheduler.default_slo_ms`): its deadline; `arrival`:
        when it arrived (time.monotonic(); default now), for a caller that queued it first."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        vocab = self.model.args.vocab_size
        try:  # the API process already checked; an in-process caller is checked by the same rule here
            check_prompt(ids.tolist(), vocab, self.max_model_len)
            check_token_ids(params.token_ids(), vocab)
            check_slo_ms(slo_ms)
        except InputError as exc:
            raise ForwardInputError(str(exc)) from None
        identity = None
        if adapter is not None:
            if self.adapters is None:
                raise UnknownAdapterError(f"The model `{adapter}` does not exist (LoRA is not enabled).")
            identity = self.adapters.spec(adapter).identity
        slo_ms = self.config.scheduler.default_slo_ms if slo_ms is None else slo_ms
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.scheduler:
            raise ForwardInputError(f"request id {request_id!r} is already waiting")
        slo_s = None if slo_ms is None else slo_ms / 1e3
        req = self.tiers.new_request(request_id, ids, cache_salt, identity)
        w = self.scheduler.add(req, arrival, priority, params, slo_s)
        if slo_s is not None:
            self.pieces.saw(w.arrival, slo_s, w.jct)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting request (timed out, client gone). False if it is not waiting."""
        dropped = self._drop(request_id) is not None
        self.num_cancelled += dropped
        return dropped

    def _drop(self, request_id: str) -> Waiting | None:
        """Take a waiting request out: its hold on parked blocks and its prefetch go with it."""
        w = self.scheduler.remove(request_id)
        if w is not None:
            self.tiers.device_tier.unpin(w.parked)
            self.tiers.drop_prefetch(request_id)
        return w

    @property
    def num_waiting(self) -> int:
        """Requests queued (not yet in a forward)."""
        return len(self.scheduler)

    @property
    def num_unfinished(self) -> int:
        """Requests not yet answered: queued, or in a batch in the runner (a pipeline holds up to
        `engine.pipeline_batches_in_flight`); `step()` until it is 0 answers them all."""
        return len(self.scheduler) + sum(len(launched.batch) for launched in self._in_flight)

    def step(self) -> list[Result]:
        """Run the next batch (one forward); the results it produced: those of the batch, or, with
        batches in flight (a pipeline), of the oldest one; [] when nothing waits or the step computed
        a piece of a request that yields (it waits again, its finished KV parked)."""
        try:
            self._step()
        except ForwardUnavailable as exc:  # a pipeline stage died or hung (restarted): its batches fail, 503
            self._collected += self._unavailable(str(exc), retry=isinstance(exc, ForwardRetry))
        done, self._collected = self._collected, []
        return done

    def _step(self) -> None:
        sc = self.config.scheduler
        if sc.drop_expired:
            self._collected += expire(self.scheduler, self._drop)
        batch = self.scheduler.pick_batch(sc.max_batch_tokens, self.max_model_len, self.config.lora.max_loras)
        piece = self.pieces.decide(batch[0]) if len(batch) == 1 else None
        if piece is not None and piece.take is not None:  # yield before starting: the most urgent first
            self.scheduler.requeue(batch[0].waiting)
            batch = [self.scheduler.take(piece.take)]
            piece = None
        if batch and sc.prefetch:
            nxt = self.scheduler.peek()
            if nxt is not None and nxt.split.num_host_hit_tokens > 0 and not self._batch_makes(batch, nxt):
                self.tiers.prefetch(nxt.request)
        started = time.monotonic()
        self._collected += (failed := load_adapters(self.adapters, batch, started))
        gone = {r.request_id for r in failed}
        self._picked = batch = [d for d in batch if d.waiting.request_id not in gone]
        if batch and piece is None and self.runner.max_in_flight > 1:
            self._in_flight.append(self._launch(batch, started))  # into the pipe, then answer the oldest
            self._picked = []
            return self._collect(self.runner.max_in_flight - 1)
        if not batch:  # nothing to send: answer the oldest batch in the pipe, if any
            return self._collect(max(0, len(self._in_flight) - 1))
        self._collect(0)  # a piece parks KV the next pick must see: the pipe empties first
        if piece is not None and piece.num_tokens is not None:
            self._collected += self.pieces.run(batch[0], piece.num_tokens, started)
        elif len(batch) == 1:
            self._collected += self.run_alone(batch[0], started)
        else:
            try:
                self._collected += self._run_batch(batch, started)
            except BaseException as exc:
                if not _out_of_memory(exc):
                    raise
                self._release_memory()
                log.warning("a batch of %d requests ran out of memory; running them one by one", len(batch))
                self._collected += [r for d in batch for r in self.run_alone(d, started)]
        self._picked = []

    def _collect(self, keep: int) -> None:
        """Answer the oldest batches in the runner until `keep` remain (into `_collected`)."""
        while len(self._in_flight) > keep:
            self._collected += self._complete(self._in_flight[0])
            self._in_flight.popleft()

    def _unavailable(self, why: str, retry: bool = False) -> list[Result]:
        """The runner lost every batch in it (ForwardUnavailable): each request of those and of the
        batch picked but not sent fails with a 503, or with `retry` (ForwardRetry) waits again."""
        lost, self._picked = self._picked, []
        while self._in_flight:
            launched = self._in_flight.popleft()
            for p in launched.prepared:
                self.tiers.abort(p)
            lost += launched.batch
        if not retry:  # a pipeline restarted: its stages' host tiers are gone with them
            self.tiers.forget_host()
        return give_back(lost, self.tiers.device_tier, self.scheduler if retry else None, why)

    def _batch_makes(self, batch: list[Decision], nxt: Waiting) -> bool:
        """The next request's first host-resident block is one this batch loads or computes: it
        will be on the device when the batch ends, so loading it now would load it twice."""
        first_host = nxt.split.num_device_hit_tokens // self.tiers.block_tokens
        key = nxt.request.keys[first_host]
        return any(key in d.waiting.request.keys for d in batch)

    def run_alone(self, decision: Decision, started: float, park: bool = False) -> list[Result]:
        """One request in its own forward; out of memory fails it alone (admission should prevent it)."""
        try:
            return self._run_batch([decision], started, park)
        except BaseException as exc:
            if not _out_of_memory(exc):
                raise
            self._release_memory()
            self.tiers.device_tier.unpin(decision.waiting.parked)  # a request that yielded: its hold too
            req = decision.waiting.request
            n = req.token_ids.numel()
            log.error("request %s (%d tokens) ran out of memory: %s", req.request_id, n, str(exc)[:200])
            waited = started - decision.waiting.arrival
            return [Result.failed(req.request_id, n, f"out of memory computing {n} tokens", waited)]

    def _release_memory(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _run_batch(self, batch: list[Decision], started: float, park: bool = False) -> list[Result]:
        """Prepare every request (pins, host loads), one forward over all, then finish each.
        `park`: the batch is a piece of a request that resumes later (its KV stays, see `prepare`)."""
        launched = self._launch(batch, started, park)
        try:
            return self._complete(launched)
        except BaseException:
            for p in launched.prepared:
                self.tiers.abort(p)
            raise

    def _launch(self, batch: list[Decision], started: float, park: bool = False) -> Launched:
        """Prepare the batch's requests, plan it and hand it to the runner. With batches in flight
        at once its retained blocks are indexed now: the next batch, planned before this one ends,
        hits them (every stage computes batches in order, so they are written before they are read)."""
        prepared: list[Prepared] = []
        planned: set[int] = set()  # blocks an earlier request of the batch keeps or stores
        try:
            for d in batch:
                prepared.append(self.tiers.prepare(d.waiting.request, self.scheduler.waiting_keys(), planned, park))
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
        self.synchronize()
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
        splits = [
            replace(
                p.split,
                num_device_hit_tokens=p.split.num_device_hit_tokens + m,
                num_miss_tokens=p.split.num_miss_tokens - m,
            )
            for p, m in zip(prepared, shared, strict=True)
        ]
        load = sum(p.load_seconds for p in prepared)
        predicted = self.jct.observe(splits, load + added)
        return batch_results(launched, logits, load, done - launched.sent, predicted)

    def forward(self, prepared: Sequence[Prepared]) -> tuple[Tensor, list[int]]:
        """One forward over the prepared requests, planned by `runner.plan_batch` (requests on one
        prefix read it once; a follower's tokens equal to its lead's are computed once) and run by
        the runner (this process, or the pipeline's stages). Returns logits [B, V] and each
        request's tokens computed by its lead."""
        plans = plan_batch(prepared, self.tiers.block_tokens)
        return self.runner.forward(prepared, plans), [p.num_shared for p in plans]

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
        self.runner.close()
        self.tiers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
