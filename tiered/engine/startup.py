"""What an engine runs with, built once at its start (`start`): precision, model, attention kernel,
memory split, adapters, pipeline stages, KV tiers and the runner (then `profile.py` fits the JCT
model on them)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from tiered.config import Config
from tiered.config.options import resolve_device
from tiered.embedded import resolve_model_path
from tiered.engine.adapters import Adapters
from tiered.engine.pipeline import PipelineRunner, PipelineStartError, start_pipeline
from tiered.engine.runner import ForwardRetry, LocalRunner, Runner, plan_batch
from tiered.hybrid.attention.select import KernelShape, choose_kernel
from tiered.hybrid.loader import DTYPES, load_model, model_identity, model_on_meta, read_args
from tiered.hybrid.memory import bound_gemm_caches, profile_peak, use_block_cache
from tiered.hybrid.model import CausalLM, use_attention
from tiered.hybrid.precision import Precision, precision_for
from tiered.hybrid.spill import check_spill, spill_of
from tiered.offload.tiers import KVTiers, TierSetup
from tiered.request.plan import Prepared

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine cannot start with this configuration (the message says by how much)."""


@dataclass(slots=True)
class Parts:
    """The engine's parts: its model (on the meta device with pipeline stages, which hold the
    weights), the chosen attention kernel, the KV tiers and the runner of its forwards."""

    config: Config
    device: str
    model_dir: Path
    precision: Precision
    model: CausalLM
    kernel: str
    model_identity: str
    adapters: Adapters | None
    tiers: KVTiers
    runner: Runner
    pipeline: PipelineRunner | None = None

    @property
    def max_model_len(self) -> int:
        """The longest prompt (`model.max_model_len`)."""
        return self.config.model.max_model_len

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU): timings end here."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def forward(self, prepared: Sequence[Prepared]) -> tuple[Tensor, list[int]]:
        """One forward over prepared requests, planned by `plan_batch` (requests on one prefix read
        it once; a follower's tokens equal to its lead's are computed once) and run by the runner.
        Returns logits [B, V] and each request's tokens computed by its lead. Their host loads run
        first (ForwardRetry if a chunk could not be read: abort them and prepare them again)."""
        if failed := self.tiers.worker.load(prepared):
            raise ForwardRetry(f"{len(failed)} host-tier loads could not read every chunk")
        plans = plan_batch(prepared, self.tiers.block_tokens)
        return self.runner.forward(prepared, plans), [p.num_shared for p in plans]

    def close(self) -> None:
        """Stop the runner (a pipeline's stage processes) and the tiers."""
        self.runner.close()
        self.tiers.close()


def check_positions(max_model_len: int, folder: Path) -> None:
    """Refuse a `model.max_model_len` past the checkpoint's positions (`max_position_embeddings`,
    which an HF config with RoPE scaling already states at its scaled length), as vLLM does: the
    model was never trained there, so a score would mean nothing."""
    positions = read_args(folder).max_position_embeddings
    if max_model_len > positions:
        raise EngineStartError(
            f"model.max_model_len {max_model_len} is past the model's {positions} positions "
            f"(max_position_embeddings in {folder / 'config.json'}): lower model.max_model_len"
        )


def start(config: Config) -> Parts:
    """Build the parts for `config` (EngineStartError: they do not fit or a stage failed)."""
    stages = config.engine.pipeline_stages
    if config.engine.memory_budget_bytes:  # before this process's first matmul
        bound_gemm_caches()
    if config.engine.threads or stages > 1:  # with stages, the cores are theirs
        torch.set_num_threads(config.engine.threads or 1)
    device = resolve_device(config.device)
    check_spill(config.forward)
    folder = resolve_model_path(config.model.path, config.model.models_dir)
    check_positions(config.model.max_model_len, folder)
    precision = precision_for(config.model.dtype, config.cache.kv_dtype, folder, device)
    log.info("precision: %s", precision.describe())
    # With stages the coordinator keeps the model's args and structure, not its weights: the
    # stage processes hold those (the kernel choice needs only the shapes).
    model = load_model(folder, precision.compute, device) if stages == 1 else model_on_meta(folder)
    a, compute = model.args, DTYPES[precision.compute]
    shape = KernelShape(a.num_heads, a.num_kv_heads, a.head_dim, compute, device)
    kernel = choose_kernel(config.attention, shape, config.model.max_model_len)
    use_attention(model, kernel)
    cache = config.cache
    if config.engine.memory_budget_bytes and stages == 1:  # with stages, each stage measures its own
        use_block_cache(model, config.forward.chunk_tokens, config.engine.block_cache_bytes)
        device_bytes = _split_memory(config, model, config.engine.memory_budget_bytes)
        cache = replace(cache, device_tier_bytes=device_bytes)
    identity = model_identity(folder, precision.identity, cache.block_tokens)
    adapters = Adapters(config.lora, a, compute, device) if config.lora.enabled else None
    try:  # the stage processes, their pools sized; one that fails to load or to fit its budget fails the start
        pipeline = start_pipeline(config, folder, precision, kernel, adapters, identity) if stages > 1 else None
    except PipelineStartError as exc:
        raise EngineStartError(str(exc)) from exc
    setup = TierSetup(a, DTYPES[precision.kv], device, f"engine-{uuid.uuid4().hex[:8]}", identity)
    tiers = KVTiers(cache, setup, pipeline.device_tier if pipeline else None, pipeline.host if pipeline else None)
    runner: Runner = pipeline or LocalRunner(model, tiers.worker, adapters, config.forward)
    return Parts(config, device, folder, precision, model, kernel, identity, adapters, tiers, runner, pipeline)


def _split_memory(config: Config, model: CausalLM, budget: int) -> int:
    """Device-tier bytes = budget − weights − peak of a max_model_len forward (profile run; past
    `engine.profile_max_tokens` a hybrid forward's peak is extended from two shorter ones). With
    `forward.spill_dir`, a forward just short of `spill_min_tokens` keeps its residual stream in
    memory and may peak higher than a longer one that spills: the larger of the two counts."""
    f, max_len = config.forward, config.model.max_model_len
    spill = spill_of(f)
    profiled = profile_peak(model, max_len, f.mode, f.chunk_tokens, spill, config.engine.profile_max_tokens)
    worst, peak_bytes = profiled.worst, profiled.peak_bytes
    left = budget - peak_bytes
    log.info(
        "profile run: %s; weights %.1f MiB of a %.1f MiB budget -> device tier %.1f MiB",
        profiled.describe(spill),
        profiled.weights_bytes / 2**20,
        budget / 2**20,
        left / 2**20,
    )
    if left <= 0:
        how = " extended from {} and {} tokens".format(*profiled.extended[worst]) if worst in profiled.extended else ""
        raise EngineStartError(
            f"model.max_model_len {max_len} does not fit engine.memory_budget_bytes {budget}: "
            f"weights + one forward peak at {peak_bytes} bytes, {-left} bytes over (at {worst} tokens{how}); "
            "lower max_model_len or raise the budget"
        )
    return left
