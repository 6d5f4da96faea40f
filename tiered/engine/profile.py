"""The engine's start-up profile of the JCT model: forwards measured on a grid of lengths and
cached fractions (plus real host-tier loads when there is a host tier), fitted, and cached per
exact setup. It runs on the engine's parts (`Parts.forward`, `synchronize`) and the tiers'
(`prepare`, `finish`, `flush`, `clear`); `scheduler/` keeps the model it fits.

With one process the grid runs the model alone, a cached prefix given as K,V tensors. With
pipeline stages the coordinator holds no weights: the grid runs through the stages
(`Parts.forward`), each cached prefix computed first and kept in the device tier."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import torch
from torch import Tensor

from tiered.engine.runner import ForwardRetry
from tiered.engine.startup import Parts
from tiered.hybrid.attention import native as native_attention
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import DTYPES
from tiered.hybrid.measured import cache_key, load_cached, save_cached
from tiered.request.plan import Prepared
from tiered.scheduler.jct import JCTModel, JCTSample

log = logging.getLogger(__name__)

# Part of the JCT profile's cache key. Bump it when the forward's or the tiers' costs change: a
# profile cached by older code would price jobs (host loads above all) at what they used to cost.
# The torch thread count is part of the key too.
JCT_PROFILE_VERSION = 6


def jct_for(parts: Parts, jct_model: JCTModel | None = None) -> JCTModel:
    """`jct_model`, or the profile of `parts`; a pipeline's stage models start from it. On failure
    the runner stops (no engine is left to stop it)."""
    try:
        jct = jct_model or profile_jct(parts)
        if parts.pipeline is not None:
            parts.pipeline.stage_models.use_prior(jct)
    except BaseException:
        parts.runner.close()
        raise
    return jct


def profile_jct(parts: Parts) -> JCTModel:
    """Fit the JCT model on a measured grid, or reuse the fit cached for this exact setup."""
    sc, f, cache = parts.config.scheduler, parts.config.forward, parts.config.cache
    totals = sorted({min(t, parts.max_model_len) for t in sc.profile_tokens})
    setup = {
        "model": (parts.model_dir / "config.json").read_text(),
        "weights_bytes": (parts.model_dir / "model.safetensors").stat().st_size
        if (parts.model_dir / "model.safetensors").exists()
        else 0,
        "dtype": parts.precision.identity,
        "attention": parts.model.attention,
        # the kernel's costs are what it measures: a rebuilt native library is profiled again
        "native_build": native_attention.build_id() if parts.model.attention == "native" else None,
        "device": parts.device,
        "torch": torch.__version__,
        "mode": f.mode,
        "chunk": f.chunk_tokens,
        "block": cache.block_tokens,
        "totals": totals,
        "fractions": sc.profile_miss_fractions,
        "host": parts.tiers.host_tier is not None,
        "disk": parts.tiers.host_tier is not None and parts.tiers.host_tier.has_disk,
        "cost_paths": JCT_PROFILE_VERSION,
        "threads": torch.get_num_threads(),
    }
    e = parts.config.engine
    if e.pipeline_stages > 1:  # measured through the stages: a fit per pipeline set-up
        setup["pipeline"] = [e.pipeline_stages, e.threads_per_stage, e.pipeline_schedule, e.pipeline_microbatches]
    key = cache_key(setup)
    cached = load_cached(sc.profile_cache_dir, "jct", key)
    try:
        samples = None if cached is None else [JCTSample(**s) for s in cached]
    except TypeError:
        samples = None
    if samples is None:
        start = time.perf_counter()
        samples = _measure_grid(parts, totals, sc.profile_miss_fractions)
        path = save_cached(sc.profile_cache_dir, "jct", key, [asdict(s) for s in samples], setup)
        log.info("JCT profile: %d samples in %.1f s, cached in %s", len(samples), time.perf_counter() - start, path)
    model = JCTModel.fit(samples)
    log.debug("JCT model: %s", ", ".join(f"{c:.3g}" for c in model.coefficients))
    return model


def _measure_grid(parts: Parts, totals: list[int], fractions: list[float]) -> list[JCTSample]:
    if parts.config.engine.pipeline_stages > 1:
        return _measure_through_stages(parts, totals, fractions)
    a = parts.model.args
    bt = parts.tiers.block_tokens
    dtype = DTYPES[parts.precision.kv]  # a prefix as the tiers hold it: the forward converts it
    g = torch.Generator().manual_seed(0)
    f = parts.config.forward
    forward(parts.model, torch.arange(1, 65), mode=f.mode, chunk_tokens=f.chunk_tokens)  # warm-up
    samples = []
    for total in totals:
        ids = torch.randint(0, a.vocab_size, (total,), generator=g)
        for fraction in fractions:
            miss = max(1, int(total * fraction))
            prefix = total - miss
            kv = (
                [
                    (
                        torch.randn(prefix, a.num_kv_heads, a.head_dim, dtype=dtype, device=parts.device),
                        torch.randn(prefix, a.num_kv_heads, a.head_dim, dtype=dtype, device=parts.device),
                    )
                    for _ in range(a.num_layers)
                ]
                if prefix
                else None
            )
            start = time.perf_counter()
            forward(parts.model, ids[prefix:], mode=f.mode, chunk_tokens=f.chunk_tokens, prefix_kv=kv)
            parts.synchronize()
            samples.append(JCTSample(total, miss, 0, time.perf_counter() - start))
    if parts.tiers.host_tier is not None:
        samples += _measure_host_loads(parts, totals, g, bt)
    return samples


def _measure_through_stages(parts: Parts, totals: list[int], fractions: list[float]) -> list[JCTSample]:
    """The grid through `Parts.forward`, for a pipeline. A job's prefix is computed first and
    kept in the device tier (`park`: whatever the retention policy), then the job reads it there
    and computes the rest; a sample records the split the job got (whole blocks of the prefix, as
    many as the tier holds). The tiers end empty, their counters zeroed."""
    tiers = parts.tiers
    g = torch.Generator().manual_seed(0)

    def run(request_id: str, ids: Tensor, park: bool = False) -> tuple[Prepared, float]:
        start = time.perf_counter()
        prepared = _prepared_forward(parts, request_id, ids, park)
        seconds = time.perf_counter() - start
        tiers.finish(prepared)
        return prepared, seconds

    run("profile-warm-up", torch.arange(1, 65))
    samples = []
    for total in totals:
        for fraction in fractions:
            tiers.device_tier.clear()
            ids = torch.randint(0, parts.model.args.vocab_size, (total,), generator=g)
            prefix = total - max(1, int(total * fraction))
            if prefix:
                run(f"profile-prefix-{total}-{fraction}", ids[:prefix], park=True)
            job, seconds = run(f"profile-{total}-{fraction}", ids)
            samples.append(JCTSample(total, job.split.num_miss_tokens, 0, seconds))
    tiers.device_tier.clear()
    tiers.device_tier.reset_stats()
    return samples


def _prepared_forward(parts: Parts, request_id: str, ids: Tensor, park: bool = False) -> Prepared:
    """Prepare one request and run its forward, as the engine's step does: a host chunk that cannot
    be read (ForwardRetry) gives it back and it is prepared again (the chunk is forgotten, so it is
    computed); anything else releases it and is raised. The caller finishes or aborts it."""
    tiers = parts.tiers
    while True:
        prepared = tiers.prepare(tiers.new_request(request_id, ids), park=park)
        try:
            parts.forward([prepared])
            parts.synchronize()
            return prepared
        except ForwardRetry:
            tiers.abort(prepared)
        except BaseException:
            tiers.abort(prepared)
            raise


def _measure_host_loads(parts: Parts, totals: list[int], g: torch.Generator, bt: int) -> list[JCTSample]:
    """Jobs whose prefix all comes from the host tier: real LMCache stores and retrievals; where the
    tier has a local disk, the same prefix again read from the disk alone (taken out of its memory)."""
    tiers = parts.tiers
    samples = []

    def load(request_id: str, ids: Tensor) -> tuple[Prepared, float]:
        tiers.device_tier.clear()
        start = time.perf_counter()
        loaded = _prepared_forward(parts, request_id, ids)
        seconds = time.perf_counter() - start
        tiers.abort(loaded)
        return loaded, seconds

    for total in totals:
        if total <= bt:
            continue
        ids = torch.randint(0, parts.model.args.vocab_size, (total,), generator=g)
        stored = _prepared_forward(parts, f"profile-store-{total}", ids)
        tiers.finish(stored)
        tiers.flush()
        loaded, seconds = load(f"profile-load-{total}", ids)
        split = loaded.split
        samples.append(JCTSample(total, split.num_miss_tokens, split.num_host_hit_tokens, seconds))
        host = tiers.host_tier
        if host is not None and host.has_disk and host.evict_from_memory(stored.request.keys):
            loaded, seconds = load(f"profile-disk-{total}", ids)
            split = loaded.split
            samples.append(
                JCTSample(
                    total,
                    split.num_miss_tokens,
                    split.num_host_hit_tokens,
                    seconds,
                    num_disk_hit_tokens=split.num_disk_hit_tokens,
                )
            )
    tiers.clear()
    if tiers.host_tier is not None:
        tiers.host_tier.reset_stats()
    return samples
