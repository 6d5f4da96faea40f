"""`tiered.Engine`: the in-process API. Submit requests, run the loop, get results.

The loop runs one request per forward (prefill is compute-bound; the paper found batching
raised latency without raising throughput). Each step: the scheduler re-scores what changed and
picks; the likely next pick's host-resident prefix starts loading in the background; the picked
request waits for its own prefetch (if any), computes its misses on top of its cached prefix,
and its KV goes to the tiers by policy. Results carry the hit split per tier and a timing
breakdown (queued, waiting for prefetch, loading, computing).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from tiered.config import Config
from tiered.embedded import resolve_model_path
from tiered.hybrid.forward import ForwardInputError, forward
from tiered.hybrid.loader import DTYPES, load_model, resolve_device
from tiered.hybrid.memory import measure_forward_peak
from tiered.offload.tiers import HitSplit, KVTiers, Prepared
from tiered.scheduler.jct import JCTModel, JCTSample, cache_key, load_cached, save_cached
from tiered.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine cannot start with this configuration (the message says by how much)."""


@dataclass(frozen=True, slots=True)
class ScoreParams:
    """What to return of the last token's distribution."""

    logprob_token_ids: tuple[int, ...] = ()  # exactly these ids' logprobs (e.g. Yes / No)
    top_logprobs: int = 0


@dataclass(slots=True)
class Result:
    request_id: str
    num_tokens: int
    split: HitSplit
    token_id: int  # the argmax: the one output token
    logprobs: dict[int, float]  # for params.logprob_token_ids
    top_logprobs: list[tuple[int, float]]
    queued_seconds: float
    prefetch_wait_seconds: float
    load_seconds: float
    compute_seconds: float
    predicted_seconds: float
    decision_seconds: float
    finished_at: float = field(default=0.0)

    @property
    def latency_seconds(self) -> float:
        return self.queued_seconds + self.prefetch_wait_seconds + self.load_seconds + self.compute_seconds


class Engine:
    """Model + KV tiers + scheduler in one process. Not thread-safe: one caller drives it."""

    def __init__(self, config: Config, jct_model: JCTModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.device)
        self.device = device
        folder = resolve_model_path(config.model.path, config.model.models_dir)
        self.model_dir = folder
        self.model = load_model(folder, config.model.dtype, device)
        self.max_model_len = config.model.max_model_len
        cache = config.cache
        if config.engine.memory_budget_bytes:
            cache = replace(cache, device_tier_bytes=self._split_memory(config.engine.memory_budget_bytes))
        self.tiers = KVTiers(
            cache, self.model.args, DTYPES[config.model.dtype], device, f"engine-{uuid.uuid4().hex[:8]}"
        )
        self.jct = jct_model or self._profile_jct()
        self.scheduler = Scheduler(config.scheduler.policy, config.scheduler.fairness, self.tiers, self.jct)
        self._params: dict[int, tuple[ScoreParams, float]] = {}
        log.info(
            "engine ready: %s on %s, policy %s (λ=%g), prefetch %s",
            folder.name, device, config.scheduler.policy, config.scheduler.fairness, config.scheduler.prefetch,
        )  # fmt: skip

    # ---- start-up --------------------------------------------------------------------------

    def _split_memory(self, budget: int) -> int:
        """Device-tier bytes = budget − weights − peak of a max_model_len forward (profile run)."""
        f = self.config.forward
        peak = measure_forward_peak(self.model, self.max_model_len, f.mode, f.chunk_tokens)
        left = budget - peak.peak_bytes
        log.info(
            "profile run: %d tokens peak %.1f MiB (weights %.1f MiB) of a %.1f MiB budget -> device tier %.1f MiB",
            self.max_model_len, peak.peak_bytes / 2**20, peak.weights_bytes / 2**20, budget / 2**20, left / 2**20,
        )  # fmt: skip
        if left <= 0:
            raise EngineStartError(
                f"model.max_model_len {self.max_model_len} does not fit engine.memory_budget_bytes {budget}: "
                f"weights + one forward peak at {peak.peak_bytes} bytes, {-left} bytes over; "
                "lower max_model_len or raise the budget"
            )
        return left

    def _profile_jct(self) -> JCTModel:
        """Fit the JCT model on a measured grid, or reuse the fit cached for this exact setup."""
        sc, f, cache = self.config.scheduler, self.config.forward, self.config.cache
        totals = sorted({min(t, self.max_model_len) for t in sc.profile_tokens})
        parts = {
            "model": (self.model_dir / "config.json").read_text(),
            "weights_bytes": (self.model_dir / "model.safetensors").stat().st_size
            if (self.model_dir / "model.safetensors").exists() else 0,
            "dtype": self.config.model.dtype, "device": self.device, "torch": torch.__version__,
            "mode": f.mode, "chunk": f.chunk_tokens, "block": cache.block_tokens,
            "totals": totals, "fractions": sc.profile_miss_fractions, "host": self.tiers.host_tier is not None,
        }  # fmt: skip
        key = cache_key(parts)
        samples = load_cached(sc.profile_cache_dir, key)
        if samples is None:
            start = time.perf_counter()
            samples = self._measure_jct_grid(totals, sc.profile_miss_fractions)
            path = save_cached(sc.profile_cache_dir, key, samples, parts)
            log.info("JCT profile: %d samples in %.1f s, cached in %s", len(samples), time.perf_counter() - start, path)
        model = JCTModel.fit(samples)
        log.info("JCT model: %s", ", ".join(f"{c:.3g}" for c in model.coefficients))
        return model

    def _measure_jct_grid(self, totals: list[int], fractions: list[float]) -> list[JCTSample]:
        a = self.model.args
        bt = self.tiers.block_tokens
        dtype = DTYPES[self.config.model.dtype]
        g = torch.Generator().manual_seed(0)
        f = self.config.forward
        forward(self.model, torch.arange(1, 65), mode=f.mode, chunk_tokens=f.chunk_tokens)  # warm-up
        samples = []
        for total in totals:
            ids = torch.randint(0, a.vocab_size, (total,), generator=g)
            for fraction in fractions:
                miss = max(1, int(total * fraction))
                prefix = total - miss
                kv = [
                    (torch.randn(prefix, a.num_kv_heads, a.head_dim, dtype=dtype, device=self.device),
                     torch.randn(prefix, a.num_kv_heads, a.head_dim, dtype=dtype, device=self.device))
                    for _ in range(a.num_layers)
                ] if prefix else None  # fmt: skip
                start = time.perf_counter()
                forward(self.model, ids[prefix:], mode=f.mode, chunk_tokens=f.chunk_tokens, prefix_kv=kv)
                self._sync()
                samples.append(JCTSample(total, miss, 0, time.perf_counter() - start))
        if self.tiers.host_tier is not None:
            samples += self._measure_host_loads(totals, g, bt)
        return samples

    def _measure_host_loads(self, totals: list[int], g: torch.Generator, bt: int) -> list[JCTSample]:
        """Jobs whose prefix all comes from the host tier: real LMCache stores and retrievals."""
        samples = []
        for total in totals:
            if total <= bt:
                continue
            ids = torch.randint(0, self.model.args.vocab_size, (total,), generator=g)
            stored = self.tiers.prepare(self.tiers.new_request(f"profile-store-{total}", ids))
            self._compute(stored)
            self.tiers.finish(stored)
            self.tiers.flush()
            self.tiers.device_tier.clear()
            start = time.perf_counter()
            loaded = self.tiers.prepare(self.tiers.new_request(f"profile-load-{total}", ids))
            self._compute(loaded)
            self._sync()
            seconds = time.perf_counter() - start
            self.tiers.abort(loaded)
            split = loaded.split
            samples.append(JCTSample(total, split.num_miss_tokens, split.num_host_hit_tokens, seconds))
        self.tiers.clear()
        return samples

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self, token_ids: Sequence[int] | Tensor, params: ScoreParams = ScoreParams(), request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Bad input raises ForwardInputError naming the value."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        n = ids.numel()
        if n == 0:
            raise ForwardInputError("the prompt is empty: a request needs at least one token")
        if n > self.max_model_len:
            raise ForwardInputError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {n} tokens."
            )
        vocab = self.model.args.vocab_size
        oov = ids[(ids < 0) | (ids >= vocab)].tolist() + [i for i in params.logprob_token_ids if not 0 <= i < vocab]
        if oov:
            raise ForwardInputError(f"token id {oov[0]} is outside the vocabulary [0, {vocab})")
        request_id = request_id or uuid.uuid4().hex
        w = self.scheduler.add(self.tiers.new_request(request_id, ids))
        self._params[w.seq] = (params, w.arrival)
        return request_id

    def step(self) -> Result | None:
        """Run the next request; None when nothing waits."""
        decision = self.scheduler.pick()
        if decision is None:
            return None
        w = decision.waiting
        params, arrival = self._params.pop(w.seq)
        if self.config.scheduler.prefetch:
            nxt = self.scheduler.peek()
            if nxt is not None and nxt.split.num_host_hit_tokens > 0:
                self.tiers.prefetch(nxt.request)
        started = time.monotonic()
        prepared = self.tiers.prepare(w.request, self.scheduler.waiting_keys())
        compute_start = time.perf_counter()
        try:
            logits = self._compute(prepared)
        except BaseException:
            self.tiers.abort(prepared)
            raise
        self._sync()
        compute = time.perf_counter() - compute_start
        self.tiers.finish(prepared)
        predicted = self.jct.observe(prepared.split, prepared.load_seconds + compute)
        logprobs = torch.log_softmax(logits, dim=-1)
        top = []
        if params.top_logprobs:
            values, indices = torch.topk(logprobs, params.top_logprobs)
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
        return Result(
            request_id=w.request.request_id,
            num_tokens=w.request.token_ids.numel(),
            split=prepared.split,
            token_id=int(torch.argmax(logits)),
            logprobs={i: float(logprobs[i]) for i in params.logprob_token_ids},
            top_logprobs=top,
            queued_seconds=started - arrival,
            prefetch_wait_seconds=prepared.prefetch_wait_seconds,
            load_seconds=prepared.load_seconds,
            compute_seconds=compute,
            predicted_seconds=predicted,
            decision_seconds=decision.decision_seconds,
            finished_at=time.monotonic(),
        )

    def _compute(self, prepared: Prepared) -> Tensor:
        f = self.config.forward
        return forward(
            self.model,
            prepared.request.token_ids[prepared.num_prefix_tokens :],
            mode=f.mode,
            chunk_tokens=f.chunk_tokens,
            prefix_kv=self.tiers.prefix_kv(prepared),
            kv_sink=self.tiers.sink(prepared),
        )

    def run(self) -> list[Result]:
        """Run until nothing waits; results in completion order."""
        results = []
        while (r := self.step()) is not None:
            results.append(r)
        return results

    def close(self) -> None:
        self.tiers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
