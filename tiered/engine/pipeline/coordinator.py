"""The coordinator's side of the pipeline: start the stage processes and size their pools, send
each batch through them, and restart them when one dies (the package docstring tells the design)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from tiered.config import Config, ConfigError, HostTierConfig
from tiered.config.options import resolve_device
from tiered.engine.adapters import Adapters
from tiered.engine.pipeline.costs import StageModels
from tiered.engine.pipeline.host import LOAD, StagedHost, stage_host_config, staged_host
from tiered.engine.pipeline.split import cut_microbatches, microbatch_plans, plan_split, stage_layers
from tiered.engine.pipeline.stage import (
    AllocatePool,
    Forward,
    HostCheck,
    HostHeld,
    StageDone,
    StageFailed,
    StageLoaded,
    StageReady,
    StageSpec,
    StageStats,
    StatsRequest,
    run_stage,
)
from tiered.engine.runner import ForwardRetry, ForwardUnavailable, ItemPlan
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.loader import DTYPES, read_args
from tiered.hybrid.precision import Precision
from tiered.offload.device_tier import DeviceTier
from tiered.request.plan import Prepared
from tiered.request.tokens import HitSplit

log = logging.getLogger(__name__)

_StartMessage = TypeVar("_StartMessage", StageLoaded, StageReady)

START_TIMEOUT_S = 600.0  # a stage imports torch and loads its layers
STOP_TIMEOUT_S = 10.0


class PipelineStartError(RuntimeError):
    """A stage process could not start (its own log names the reason), or its layers do not fit
    engine.memory_budget_bytes."""


def _stage_device(device: str, stage: int) -> str:
    """cpu for every stage; on CUDA one device per stage, from the configured one on."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + stage}"


def pool_blocks(
    specs: Sequence[StageSpec], loaded: Sequence[StageLoaded], budget_bytes: int, device_tier_bytes: int
) -> int:
    """The blocks of every stage's pool (the same on all: a block id names the same tokens on every
    stage). With `budget_bytes` (engine.memory_budget_bytes, each stage's): the fewest any stage
    has room for, (budget - its weights and profile peak) // its bytes per block; a stage whose
    peak reaches the budget fails the start (PipelineStartError naming it). Without: the pools
    share `device_tier_bytes` (cache.device_tier_bytes) by their layers' bytes per block."""
    if not budget_bytes:
        return device_tier_bytes // sum(st.bytes_per_block for st in loaded)
    over = [
        f"stage {sp.stage} (layers {sp.layers.start}-{sp.layers.stop - 1}): weights {st.weights_bytes} bytes, with "
        f"one {sp.profile_tokens}-token forward {st.peak_bytes} bytes at the peak, {st.peak_bytes - budget_bytes} "
        "bytes over"
        for sp, st in zip(specs, loaded, strict=True)
        if st.peak_bytes >= budget_bytes
    ]
    if over:
        raise PipelineStartError(
            f"model.max_model_len {specs[0].profile_tokens} does not fit engine.memory_budget_bytes {budget_bytes} "
            f"(each stage's) on {'; '.join(over)}; lower max_model_len, raise the budget or add stages"
        )
    room = [(budget_bytes - st.peak_bytes) // st.bytes_per_block for st in loaded]
    for sp, st, blocks in zip(specs, loaded, room, strict=True):
        log.info(
            "stage %d (layers %d-%d): weights %.1f MiB, profile run of %d tokens peak %.1f MiB of a %.1f MiB "
            "budget -> room for %d blocks of %.1f KiB",
            sp.stage,
            sp.layers.start,
            sp.layers.stop - 1,
            st.weights_bytes / 2**20,
            sp.profile_tokens,
            st.peak_bytes / 2**20,
            budget_bytes / 2**20,
            blocks,
            st.bytes_per_block / 2**10,
        )
    return min(room)


@dataclass(frozen=True, slots=True)
class _Ticket:
    """A batch in the pipe: its micro-batches (indices into the batch, and their items' splits
    for the stage models) and the host chunks it had every stage load (key -> device block id)."""

    cut: list[list[int]]
    loads: list[tuple[int, int]]  # (key, block id): a key twice when the prefetch thread loaded it too
    splits: list[list[HitSplit]]


@dataclass(frozen=True, slots=True)
class PipePlan:
    """How the pipe runs: micro-batches per batch, the memory budget (0: none) and the device tier's
    bytes its stages' pools share, batches in the pipe at once, and how long a stage may take."""

    num_microbatches: int
    budget_bytes: int
    device_tier_bytes: int
    max_in_flight: int = 1
    timeout_s: float = 600.0


class PipelineRunner:
    """Runs planned batches through S stage processes (`runner.Runner`). Not thread-safe: the
    engine's loop is its one caller.

    The first start decides the pools' size (`pool_blocks`) from what the stages report once
    loaded (`loaded`), and builds `device_tier`: the coordinator's index of the blocks every
    stage's pool holds (`DeviceTier(hold_kv=False)`, for the engine's tiers). A restart keeps the
    size and forgets the index's contents; `ready` says what each stage's pool holds."""

    def __init__(
        self,
        specs: list[StageSpec],
        args: ModelArgs,
        plan: PipePlan,
        adapters: Adapters | None = None,
        host: StagedHost | None = None,
    ) -> None:
        """`host`: the index of the stages' host tiers (tiered/engine/pipeline/host.py), None: no host tier."""
        self._specs, self.num_microbatches, self.host = specs, plan.num_microbatches, host
        budget_bytes, device_tier_bytes = plan.budget_bytes, plan.device_tier_bytes
        self._tickets: deque[_Ticket] = deque()
        self.adapters = adapters  # the engine's: which folder an adapter identity names
        self.max_in_flight, self.timeout_s = plan.max_in_flight, plan.timeout_s
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self.num_restarts = 0
        self.num_retries = 0  # times the pipe's batches were computed again: a stage lacked a host chunk
        self.forward_seconds = 0.0  # wall time with a batch in the pipe, since the pipeline (re)started
        self._in_flight, self._busy_since = 0, 0.0
        # What a micro-batch costs on each stage (the engine gives it its JCT profile: `use_prior`).
        self.stage_models = StageModels([len(sp.layers) / args.num_layers for sp in specs])
        started = time.monotonic()
        self.loaded = self._spawn(started)
        try:
            num_blocks = pool_blocks(specs, self.loaded, budget_bytes, device_tier_bytes)
        except PipelineStartError:
            self._stop()
            raise
        # The index holds no K,V (the stages do): it lives in this process's memory, on no device.
        self.device_tier = DeviceTier(
            args, specs[0].block_tokens, 0, DTYPES[specs[0].kv_dtype], "cpu", num_blocks=num_blocks, hold_kv=False
        )
        self._allocate(num_blocks, started)
        self._specs = [replace(sp, profile_tokens=0) for sp in specs]  # a restart keeps the pools' size

    @property
    def pids(self) -> list[int]:
        """The stage processes' ids, stage 0 first."""
        return [p.pid for p in self._procs if p.pid is not None]

    def _start(self) -> None:
        """Start the stages again (after one failed), with pools of the size decided at first."""
        started = time.monotonic()
        self._spawn(started)
        self._allocate(self.device_tier.num_blocks, started)

    def _spawn(self, started: float) -> list[StageLoaded]:
        """Start the stage processes; each loads (and with `profile_tokens` measures) its layers."""
        ctx = mp.get_context("spawn")  # a fresh interpreter per stage: no state forked from the engine
        self._inbox: list[list[object]] = [[] for _ in self._specs]
        # A file rendezvous: no port to find free (and race for); each start gets a fresh one.
        self._rendezvous = Path(tempfile.mkdtemp(prefix="tiered-pipeline-"))
        init = f"file://{self._rendezvous / 'store'}"
        for spec in self._specs:
            parent, child = ctx.Pipe()
            spec = replace(spec, init_method=init)
            proc = ctx.Process(target=run_stage, args=(spec, child), name=f"tiered-stage-{spec.stage}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        return [self._receive_start(s, StageLoaded, started) for s in range(len(self._conns))]

    def _allocate(self, num_blocks: int, started: float) -> None:
        """Every stage allocates its pool of `num_blocks` blocks."""
        for conn in self._conns:
            conn.send(AllocatePool(num_blocks))
        self.ready = [self._receive_start(s, StageReady, started) for s in range(len(self._conns))]
        log.info(
            "pipeline: %d stages (layers %s) ready in %.1f s, %d threads each, pools of %d blocks (%s MiB)",
            len(self._specs),
            ", ".join(f"{sp.layers.start}-{sp.layers.stop - 1}" for sp in self._specs),
            time.monotonic() - started,
            self._specs[0].threads,
            num_blocks,
            ", ".join(f"{r.pool_bytes / 2**20:.1f}" for r in self.ready),
        )

    def _receive_start(self, stage: int, expected: type[_StartMessage], started: float) -> _StartMessage:
        """Stage `stage`'s next start-up message; anything else stops the pipeline (PipelineStartError)."""
        message = self._receive(stage, deadline=started + START_TIMEOUT_S)
        if not isinstance(message, expected):
            self._stop(kill=True)
            why = (
                f"stage {message.stage}: {message.error}"
                if isinstance(message, StageFailed)
                else (f"stage {stage} not ready in {START_TIMEOUT_S:.0f} s" if message is None else message)
            )
            raise PipelineStartError(f"the pipeline did not start: {why} (its log says more)")
        return message

    def _receive(self, stage: int, deadline: float | None = None) -> object:
        """Stage `stage`'s next message; a stage that fails or dies first: a StageFailed naming it;
        None past `deadline`. Other stages' messages wait in their inbox (stages start in any order)."""
        if self._inbox[stage]:
            return self._inbox[stage].pop(0)
        watch: list[Connection | int] = [*self._conns, *(p.sentinel for p in self._procs)]
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(watch, timeout)
            if not ready:
                return None
            for s, conn in enumerate(self._conns):
                if conn in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        watch.remove(conn)  # its process ended: its sentinel says so
                        continue
                    if s == stage or isinstance(message, StageFailed):
                        return message
                    self._inbox[s].append(message)
            for s, proc in enumerate(self._procs):
                if proc.sentinel in ready:
                    proc.join(STOP_TIMEOUT_S)
                    return StageFailed(s, f"its process (pid {proc.pid}) exited with code {proc.exitcode}")

    def submit(self, prepared: Sequence[Prepared], plans: Sequence[ItemPlan]) -> object:
        """Send the batch into the pipe (cut into micro-batches); its ticket for `collect`."""
        m = self.num_microbatches
        cut = cut_microbatches(plans, m, self.stage_models.job_seconds) if m > 1 else [list(range(len(plans)))]
        adapters = {a: self.adapters.spec_of(a) for plan in plans if (a := plan.adapter) is not None and self.adapters}
        ops = self.host.take_ops() if self.host is not None else None
        message = Forward(microbatch_plans(plans, cut), adapters, ops)
        if not self._in_flight:
            self._busy_since = time.perf_counter()
        try:
            for conn in self._conns:
                conn.send(message)  # a stage's reader thread takes it at once, even mid-forward
        except OSError as exc:
            self._fail(f"sending the batch failed ({exc})")
        self._in_flight += 1
        loads = [(key, block) for kind, key, block in ops.before if kind == LOAD] if ops is not None else []
        splits = [[plan_split(plans[i]) for i in indices] for indices in cut]
        self._tickets.append(ticket := _Ticket(cut, loads, splits))
        return ticket

    def collect(self, ticket: object) -> Tensor:
        """The logits [B, V] (fp32, batch order) of the oldest batch submitted. ForwardUnavailable if a
        stage failed or gave no answer in `timeout_s` (the pipeline was restarted, every batch in the
        pipe lost and the device tier forgotten); ForwardRetry if a stage lacked a host chunk it was
        told to load (every batch in the pipe is dropped, to be computed again without it)."""
        assert self._in_flight and ticket is self._tickets[0]
        out, missed = self._done()
        if missed:
            self._retry(missed)
        assert out is not None
        order = torch.tensor([i for indices in self._tickets.popleft().cut for i in indices])
        logits = torch.empty_like(out)
        logits[order] = out
        return logits

    def _done(self) -> tuple[Tensor | None, list[int]]:
        """The oldest batch's logits and the host chunks a stage lacked for it: every stage reports
        its seconds per micro-batch (the stage models learn them) and what its host tier could not
        load or store (gone from the index, dropped everywhere)."""
        deadline = time.monotonic() + self.timeout_s
        logits, missed, dropped, seconds = None, list[int](), list[int](), []
        for s in range(len(self._conns)):
            out = self._receive(s, deadline)
            if out is None:
                self._fail(f"no answer in {self.timeout_s:g} s (engine.pipeline_timeout_s): a stage is stuck")
            if not isinstance(out, StageDone):
                self._fail(str(out.error) if isinstance(out, StageFailed) else str(out))
            assert isinstance(out, StageDone)
            seconds.append(out.seconds)
            logits = out.logits if out.logits is not None else logits
            missed, dropped = missed + out.missed, dropped + out.dropped
        self._in_flight -= 1
        if not self._in_flight:
            self.forward_seconds += time.perf_counter() - self._busy_since
        for s, stage_seconds in enumerate(seconds):  # after every stage's answer was read
            self.stage_models.observe(s, self._tickets[0].splits, stage_seconds)
        if self.host is not None and (missed or dropped):
            self.host.lost(missed + dropped)
        return logits, missed

    def _retry(self, missed: list[int]) -> None:
        """A stage lacked host chunks the batch loaded: the device blocks they went into hold them on
        some stages only, and every later batch in the pipe may have read them. Those blocks leave
        the device tier's index, the later batches are drained, and the engine computes them all
        again (ForwardRetry)."""
        lost, num_missed = len(self._tickets), len(missed)
        self.num_retries += 1
        while True:
            ticket = self._tickets.popleft()
            gone = set(missed)
            self.device_tier.uncache([block for key, block in ticket.loads if key in gone])
            if not self._in_flight:
                break
            missed = self._done()[1]
            num_missed += len(missed)
        log.warning(
            "a stage's host tier lacked %d chunks it was told to load: %d batches computed again, the "
            "chunks forgotten on every stage",
            num_missed,
            lost,
        )
        raise ForwardRetry(f"a stage's host tier lacked chunks it was told to load; {lost} batches computed again")

    def check_host(self, evict: dict[int, list[int]] | None = None) -> list[HostHeld]:
        """Each stage's host tier against the index: the index's keys it lacks, and how many chunks it
        holds beyond them. `evict`: stage -> chunks it takes out of its LMCache first (a fault, for tests)."""
        if self._in_flight:
            raise RuntimeError(f"{self._in_flight} batches in the pipe: collect them before checking the host tier")
        keys = self.host.keys if self.host is not None else []
        for s, conn in enumerate(self._conns):
            conn.send(HostCheck(keys, (evict or {}).get(s, [])))
        out = [self._receive(s) for s in range(len(self._conns))]
        if not all(isinstance(held, HostHeld) for held in out):
            self._fail(f"a stage did not report its host tier: {out}")
        return out  # type: ignore[return-value]

    def forward(self, prepared: Sequence[Prepared], plans: Sequence[ItemPlan]) -> Tensor:
        """One batch through the pipe and back: `submit`, then `collect` its logits."""
        return self.collect(self.submit(prepared, plans))

    def stats(self) -> list[StageStats]:
        """Each stage's busy seconds since the pipeline (re)started: 1 - busy / forward_seconds is
        its bubble fraction (time in a forward it spent waiting for its inputs or its successor)."""
        if self._in_flight:
            raise RuntimeError(f"{self._in_flight} batches in the pipe: collect them before asking for statistics")
        for conn in self._conns:
            conn.send(StatsRequest())
        out = [self._receive(s) for s in range(len(self._conns))]
        if not all(isinstance(st, StageStats) for st in out):
            self._fail(f"a stage did not report its statistics: {out}")
        return out  # type: ignore[return-value]

    def _fail(self, why: str) -> None:
        log.error(
            "pipeline failed: %s; restarting it (%d batches in the pipe lost, its device-tier blocks forgotten)",
            why,
            self._in_flight,
        )
        self._stop(kill=True)
        self.device_tier.forget()
        if self.host is not None:
            self.host.forget()
        self._tickets.clear()
        self.forward_seconds, self._in_flight = 0.0, 0
        self._start()
        self.num_restarts += 1
        raise ForwardUnavailable(f"a pipeline stage failed ({why}); the pipeline was restarted: retry the request")

    def _stop(self, kill: bool = False) -> None:
        for conn in self._conns:
            try:
                if not kill:
                    conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            if kill and proc.is_alive():
                proc.kill()
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def close(self) -> None:
        """Stop the stage processes (killed if batches are still in the pipe)."""
        self._stop(kill=self._in_flight > 0)  # batches nobody will collect: do not wait for them


def start_pipeline(
    config: Config,
    model_dir: Path,
    precision: Precision,
    attention: str,
    adapters: Adapters | None = None,
    model_name: str = "",
) -> PipelineRunner:
    """The engine's pipeline of `engine.pipeline_stages` stage processes, its pools sized
    (ConfigError: more stages than layers; PipelineStartError: a stage failed or does not fit
    engine.memory_budget_bytes, each stage's budget). `model_name`: the host tier's keys name it."""
    args, device = read_args(model_dir), resolve_device(config.device)
    e = config.engine
    stages, num_layers = e.pipeline_stages, args.num_layers
    if stages > num_layers:
        raise ConfigError(
            f"config key 'engine.pipeline_stages': must be <= the model's {num_layers} layers, got {stages}"
        )
    threads = e.threads_per_stage or max(1, len(os.sched_getaffinity(0)) // stages)
    profile_tokens = config.model.max_model_len if e.memory_budget_bytes else 0
    host = staged_host(config, args, precision.kv, model_name)
    bt = config.cache.block_tokens

    fill_drain = e.pipeline_schedule == "fill-drain"
    microbatches = 1 if fill_drain else (e.pipeline_microbatches or stages)
    in_flight = 1 if fill_drain else (e.pipeline_batches_in_flight or stages + 1)
    batch_chunks = (config.scheduler.max_batch_tokens or config.model.max_model_len) // bt + 1

    def stage_host(layers: range) -> HostTierConfig | None:
        stage_chunk = bt * replace(args, num_layers=len(layers)).kv_bytes_per_token(DTYPES[precision.kv])
        return (
            stage_host_config(config.cache.host, host.capacity_chunks, stage_chunk, batch_chunks * in_flight)
            if host
            else None
        )

    specs = [
        StageSpec(
            s,
            stages,
            layers,
            str(model_dir),
            precision.compute,
            precision.kv,
            _stage_device(device, s),
            attention,
            bt,
            profile_tokens,
            e.profile_max_tokens,
            threads,
            "",
            config.forward.mode,
            config.forward.chunk_tokens,
            config.lora.max_loras,
            stage_host(layers),
            model_name,
            e.block_cache_bytes,
        )
        for s, layers in enumerate(stage_layers(num_layers, stages))
    ]
    plan = PipePlan(
        microbatches, e.memory_budget_bytes, config.cache.device_tier_bytes, in_flight, e.pipeline_timeout_s
    )
    return PipelineRunner(specs, args, plan, adapters, host)
