"""A stage process: its layers of the model and their KV pool; forwards what the coordinator sends.

Stage s receives the residual stream of each micro-batch's computed tokens from stage s - 1
(stage 0 embeds the tokens), runs its layers over it and sends it to stage s + 1 without
waiting for the send to complete (the next micro-batch computes meanwhile). Every stage then
tells the coordinator the seconds of each micro-batch (and, with a host tier, what it could not
load or store); the last stage's answer carries the logits of the whole batch. Any exception is
reported to the coordinator and ends the process: the coordinator restarts the pipeline (a stage
that stopped mid-batch leaves the others waiting on it).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import Tensor

from tiered.config import ForwardMode, HostTierConfig, LoraConfig
from tiered.engine.adapters import Adapters
from tiered.engine.pipeline.host import HostOps, StageHost
from tiered.engine.runner import ItemPlan
from tiered.hybrid.forward import BatchItem, KVSink, LayerKV, forward_batch
from tiered.hybrid.loader import DTYPES, load_model
from tiered.hybrid.lora import AdapterError, AdapterSpec
from tiered.hybrid.memory import PeakShape, bound_gemm_caches, profile_peak, use_block_cache, weights_bytes
from tiered.hybrid.model import CausalLM, use_attention
from tiered.logs import setup as setup_logging
from tiered.offload.device_tier import DeviceTier, PrefixKV
from tiered.request.plan import StoreBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageSpec:
    """Everything a stage process needs to start (pickled to it at spawn)."""

    stage: int
    num_stages: int
    layers: range  # of the whole model's decoder layers
    model_dir: str
    compute_dtype: str
    kv_dtype: str
    device: str  # this stage's: cpu, or cuda:N (one device per stage)
    attention: str  # the kernel the coordinator chose
    block_tokens: int
    # With engine.memory_budget_bytes: a profile run of this many tokens (max_model_len) through
    # its layers at start-up, its peak reported in StageLoaded. 0: none.
    profile_tokens: int
    # Past this many tokens the profile's peak is extended from two shorter forwards (engine.profile_max_tokens).
    profile_max_tokens: int
    threads: int
    init_method: str  # torch.distributed rendezvous (file://... on this machine)
    mode: ForwardMode
    chunk_tokens: int
    max_loras: int = 1  # LoRA adapters kept resident (lora.max_loras)
    host: HostTierConfig | None = None  # this stage's LMCache tier (pipeline/host.py), None: no host tier
    model_name: str = ""  # the host tier's chunk keys name this model
    block_cache_bytes: int | None = None  # with profile_tokens: the block cache's cap (engine.block_cache_bytes)

    @property
    def backend(self) -> str:
        """NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.device.startswith("cuda") else "gloo"


@dataclass(frozen=True, slots=True)
class Forward:
    """One batch, cut into micro-batches that follow one another through the stages, and the
    LoRA adapters its requests use (identity -> the checked folder; a stage reads its layers' part)."""

    microbatches: list[list[ItemPlan]]
    adapters: dict[str, AdapterSpec] = field(default_factory=dict)
    host: HostOps | None = None  # what every stage's host tier does with this batch


@dataclass(frozen=True, slots=True)
class StageDone:
    """A stage finished a batch (every stage says so): the seconds of its forward of each
    micro-batch; the last stage's answer (its logits [B, V]); with the host tier, the chunks it
    was told to load and lacked (`missed`) and those it found no memory to store (`dropped`)."""

    stage: int
    logits: Tensor | None = None
    missed: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class HostCheck:
    """Asks a stage which of `keys` (the coordinator's index) its host tier lacks, and how many
    chunks it holds beyond them (`HostHeld`). `evict`: chunks to take out of its LMCache first, as
    LMCache's own eviction would under memory pressure (a fault, for tests)."""

    keys: list[int]
    evict: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class HostHeld:
    """A stage's answer to `HostCheck`: the index's keys its host tier lacks, and how many chunks it holds besides."""

    stage: int
    missing: list[int]
    extra: int


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Asks every stage for its StageStats."""


@dataclass(frozen=True, slots=True)
class StageStats:
    """Seconds a stage spent computing (its layers' forwards, not waiting for its inputs) since it started."""

    stage: int
    busy_seconds: float
    num_microbatches: int


@dataclass(frozen=True, slots=True)
class StageLoaded:
    """A stage's first answer: its layers are loaded; what its memory holds, for the coordinator
    to decide the pools' size (one number of blocks on every stage: the block ids are shared)."""

    stage: int
    weights_bytes: int
    peak_bytes: int  # weights + the profile run's forward peak (0: no profile run)
    bytes_per_block: int  # of its pool: block_tokens x its layers' K,V bytes per token


@dataclass(frozen=True, slots=True)
class AllocatePool:
    """The coordinator's answer to every StageLoaded: the blocks of each stage's pool."""

    num_blocks: int


@dataclass(frozen=True, slots=True)
class StageReady:
    """A stage's pool is allocated: it forwards from now on."""

    stage: int
    pool_bytes: int  # its pool's K,V: num_blocks x its bytes per block


@dataclass(frozen=True, slots=True)
class StageFailed:
    """A stage raised (during start-up or a batch) and is ending: the error, for the coordinator to report."""

    stage: int
    error: str


def load_stage(spec: StageSpec) -> tuple[CausalLM, StageLoaded]:
    """The stage's part of the model, and what it holds: its weights and, with `profile_tokens`,
    the peak of one forward of that many tokens through its layers (the first stage's from token
    ids, a later one's from a residual stream; the last one's ending in logits)."""
    if spec.profile_tokens:  # under a memory budget, before this process's first matmul
        bound_gemm_caches()
    model = load_model(spec.model_dir, spec.compute_dtype, spec.device, spec.layers)
    use_attention(model, spec.attention)
    peak = 0
    if spec.profile_tokens:
        use_block_cache(model, spec.chunk_tokens, spec.block_cache_bytes)
        first, last = spec.stage == 0, spec.stage == spec.num_stages - 1
        peak = profile_peak(
            model,
            spec.profile_tokens,
            spec.mode,
            spec.chunk_tokens,
            cap=spec.profile_max_tokens,
            shape=lambda n: PeakShape(n, first_stage=first, last_stage=last),
        ).peak_bytes
    bytes_per_block = spec.block_tokens * model.args.kv_bytes_per_token(DTYPES[spec.kv_dtype])
    return model, StageLoaded(spec.stage, weights_bytes(model), peak, bytes_per_block)


class Stage:
    """A stage process's layers, KV pool, host tier and adapters: runs each batch the coordinator sends."""

    def __init__(self, spec: StageSpec, model: CausalLM, num_blocks: int) -> None:
        """`model`: the stage's part (`load_stage`); `num_blocks`: its pool's, the coordinator's
        device tier's (the same block ids on every stage)."""
        self.spec, self.model = spec, model
        self.host = (
            StageHost(spec.host, spec.block_tokens, model.args, DTYPES[spec.kv_dtype], spec.stage, spec.model_name)
            if spec.host is not None
            else None
        )
        self._stores: list[StoreBatch] = []  # the micro-batch's stores, submitted after its forward
        self.pool = DeviceTier(
            model.args, spec.block_tokens, 0, DTYPES[spec.kv_dtype], spec.device, num_blocks=num_blocks
        )
        self.first, self.last = spec.stage == 0, spec.stage == spec.num_stages - 1
        self.busy_seconds, self.num_microbatches = 0.0, 0
        self._stash: dict[int, dict[int, LayerKV]] = {}  # lead's index in the batch -> layer -> its first rows
        self._adapters = Adapters(
            LoraConfig(max_loras=spec.max_loras),
            model.args,
            DTYPES[spec.compute_dtype],
            spec.device,
            first_layer=spec.layers.start,
        )
        # Sends to the next stage not yet known complete, with the tensors they read: a stage goes
        # on to the next micro-batch, or the next batch, without waiting for its successor.
        self._sends: list[tuple[Tensor, dist.Work]] = []

    @torch.inference_mode()
    def forward(self, message: Forward) -> StageDone:
        """Every micro-batch through this stage's layers (the host tier's loads before, its drops
        after); what it took, and on the last stage the logits [B, V]."""
        s, a = self.spec, self.model.args
        self._load_adapters(message.adapters)
        if self.host is not None and message.host is not None:
            self.host.before(message.host, self.pool)
        logits, seconds = [], []
        self._sends = [(t, work) for t, work in self._sends if not work.is_completed()]
        for plans in message.microbatches:
            hidden = None
            if not self.first:
                num_tokens = sum(p.num_computed_tokens for p in plans)
                hidden = torch.empty((num_tokens, a.hidden_size), dtype=DTYPES[s.compute_dtype], device=s.device)
                dist.recv(hidden, src=s.stage - 1)
            start = time.perf_counter()
            out = forward_batch(
                self.model,
                self._items(plans),
                mode=s.mode,
                chunk_tokens=s.chunk_tokens,
                hidden=hidden,
                last_stage=self.last,
            )
            if s.device.startswith("cuda"):  # its kernels' time, not their launch's
                torch.cuda.synchronize(s.device)
            seconds.append(time.perf_counter() - start)
            self.busy_seconds += seconds[-1]
            self.num_microbatches += 1
            for store in self._stores:
                self.host.submit(store)  # type: ignore[union-attr]
            self._stores.clear()
            if self.last:
                logits.append(out)
            else:  # keep `out` alive until its send completes
                self._sends.append((out, dist.isend(out, dst=s.stage + 1)))  # type: ignore[arg-type]
        self._stash.clear()
        missed, dropped = self.host.after(message.host or HostOps()) if self.host is not None else ([], [])
        return StageDone(s.stage, torch.cat(logits).cpu() if self.last else None, missed, dropped, seconds)

    def check(self, message: HostCheck) -> HostHeld:
        """Answer a `HostCheck` (without a host tier every key is missing), after its evictions."""
        if self.host is None:
            return HostHeld(self.spec.stage, list(message.keys), 0)
        if message.evict:
            self.host.tier.remove(message.evict)
        return HostHeld(self.spec.stage, *self.host.holds(message.keys))

    def _load_adapters(self, specs: dict[str, AdapterSpec]) -> None:
        """Make the batch's adapters resident (this stage's layers of them), least recent out past
        `max_loras`. The coordinator read each folder just before; one changed since fails the stage."""
        for spec in specs.values():
            self._adapters.know(spec)
        bad = self._adapters.load(specs)
        if bad:
            raise AdapterError("; ".join(bad.values()))

    def _items(self, plans: list[ItemPlan]) -> list[BatchItem]:
        prefixes: dict[tuple[object, ...], Sequence[LayerKV]] = {}
        items = []
        for plan in plans:
            # One prefix object per prefix (a follower and its lead in this micro-batch must share it),
            # and per stash and shared length for followers whose lead ran before.
            key: tuple[object, ...] = (
                plan.prefix_blocks,
                plan.reads_stash,
                plan.num_shared if plan.reads_stash is not None else 0,
            )
            if key not in prefixes and (plan.prefix_blocks or plan.reads_stash is not None):
                pool = PrefixKV(self.pool, list(plan.prefix_blocks), self.model.args.num_layers)
                prefixes[key] = (
                    pool
                    if plan.reads_stash is None
                    else _StashedPrefix(pool, self._stash[plan.reads_stash], plan.num_shared)
                )
            shared = plan.num_shared if plan.lead is not None else 0  # else read from the stash, or none
            adapter = self._adapters.weights(plan.adapter) if plan.adapter is not None else None
            items.append(
                BatchItem(
                    plan.token_ids,
                    prefixes.get(key),
                    self._sink(plan),
                    lead=plan.lead,
                    num_shared=shared,
                    adapter=adapter,
                    rope_regime=plan.rope_regime,
                )
            )
        return items

    def _sink(self, plan: ItemPlan) -> KVSink | None:
        """Writes the request's retained blocks of this stage's layers into the pool; a lead whose
        followers come in later micro-batches also keeps its first rows in the stash; a follower
        that reads the stash gets its shared rows put back in front (its rows count from the prefix)."""
        blocks = list(plan.retained_blocks)
        start = plan.first_retained_row
        end = start + len(blocks) * self.spec.block_tokens
        pool, stash = self.pool, self._stash
        shared = stash[plan.reads_stash] if plan.reads_stash is not None else None
        if plan.stash_key is not None:
            stash[plan.stash_key] = {}
        store = self.host.begin_store(list(plan.stored_keys)) if self.host is not None and plan.stored_keys else None
        rows = plan.stored_rows[: len(store.keys)] if store is not None else ()
        if store is not None:
            self._stores.append(store)
        if not blocks and plan.stash_key is None and store is None:
            return None

        def sink(layer: int, k: Tensor, v: Tensor) -> None:
            if shared is not None:
                sk, sv = shared[layer]
                k, v = torch.cat([sk[: plan.num_shared], k]), torch.cat([sv[: plan.num_shared], v])
            if plan.stash_key is not None:
                stash[plan.stash_key][layer] = (k[: plan.stash_rows].clone(), v[: plan.stash_rows].clone())
            if blocks:
                pool.write_layer(layer, blocks, k[start:end], v[start:end])
            if store is not None:
                store.write_layer(layer, k, v, rows)

        return sink


class _StashedPrefix(Sequence[LayerKV]):
    """A follower's prefix when its lead ran in an earlier micro-batch: the pool's prefix blocks,
    then the first `num_shared` rows the lead stashed."""

    def __init__(self, pool: PrefixKV, stash: dict[int, LayerKV], num_shared: int) -> None:
        self._pool, self._stash, self._num_shared = pool, stash, num_shared

    def __len__(self) -> int:
        return len(self._pool)

    @property
    def num_tokens(self) -> int:
        """Tokens of the prefix: those in the pool and those shared with the batch's lead."""
        return self._pool.num_tokens + self._num_shared

    def __getitem__(self, layer: int) -> LayerKV:  # type: ignore[override]
        sk, sv = self._stash[layer]
        sk, sv = sk[: self._num_shared], sv[: self._num_shared]
        if not self._pool.num_tokens:
            return sk, sv
        pk, pv = self._pool[layer]
        return torch.cat([pk, sk.to(pk.dtype)]), torch.cat([pv, sv.to(pv.dtype)])


def _reader(conn: Connection) -> queue.Queue[object]:
    """The coordinator's messages, read as they come by a thread of their own: the coordinator sends
    the next batch while this stage computes, and a batch's plans can fill the pipe's buffer (a
    blocked send on both ends would deadlock). None when the coordinator says stop or is gone."""
    inbox: queue.Queue[object] = queue.Queue()

    def read() -> None:
        try:
            while (message := conn.recv()) is not None:
                inbox.put(message)
        except (EOFError, OSError):  # the coordinator is gone
            pass
        inbox.put(None)

    threading.Thread(target=read, name="stage-inbox", daemon=True).start()
    return inbox


def run_stage(spec: StageSpec, conn: Connection) -> None:
    """A stage process's main: join the group, load (and measure) its layers and report them, then
    allocate the pool the coordinator sizes and forward until told to stop (None, also an answer
    to StageLoaded: another stage failed or did not fit its budget)."""
    setup_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the coordinator stops us
    torch.set_num_threads(spec.threads)
    try:
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(spec.device)
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.stage, world_size=spec.num_stages)
        model, loaded = load_stage(spec)
        conn.send(loaded)
        if (pool := conn.recv()) is None:
            return
        stage = Stage(spec, model, pool.num_blocks)
        conn.send(StageReady(spec.stage, stage.pool.kv.numel() * stage.pool.kv.element_size()))
        inbox = _reader(conn)
        while (message := inbox.get()) is not None:
            if isinstance(message, StatsRequest):
                conn.send(StageStats(spec.stage, stage.busy_seconds, stage.num_microbatches))
            elif isinstance(message, Forward):
                conn.send(stage.forward(message))
            elif isinstance(message, HostCheck):
                conn.send(stage.check(message))
    except EOFError:  # the coordinator is gone (during start-up; later the reader thread sees it)
        pass
    except BaseException as exc:
        log.error("stage %d failed: %s", spec.stage, traceback.format_exc())
        try:
            conn.send(StageFailed(spec.stage, f"{type(exc).__name__}: {exc}"))
        finally:
            raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
