"""What runs a batch's forward for the engine: the model in this process (`LocalRunner`), or a
pipeline of stage processes (`tiered.engine.pipeline.PipelineRunner`). The engine plans the batch the
same way for both (`plan_batch`: each request's tokens to compute, its prefix and retained blocks
by id, the lead whose tokens it shares), so the two compute the same forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from tiered.config import ForwardConfig
from tiered.engine.adapters import Adapters
from tiered.hybrid.forward import BatchItem, forward_batch
from tiered.hybrid.model import CausalLM
from tiered.hybrid.spill import spill_of
from tiered.offload.device_tier import PrefixKV
from tiered.offload.worker import KVWorker
from tiered.request.plan import Prepared
from tiered.request.tokens import common_prefix_len


class ForwardUnavailable(RuntimeError):
    """The forward's workers failed (a pipeline stage process died) and were restarted: the batch's
    requests fail with a 503 (the client may retry them); the engine goes on."""


class ForwardRetry(ForwardUnavailable):
    """Every batch in the runner was computed from a host chunk one stage turned out not to hold
    (tiered/engine/pipeline/host.py): their answers are dropped and their requests wait again; the chunk
    is forgotten everywhere, so they recompute it."""


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """One request of a batched forward, by block ids: all a worker needs to compute it.

    `token_ids` are the tokens it computes: after its prefix (`prefix_blocks`, `num_prefix_tokens`
    cached tokens) and, for a follower, after the `num_shared` tokens its `lead` (an earlier item
    of the batch, same prefix and adapter) computes for both. Its computed blocks kept on the
    device go to `retained_blocks`, from row `first_retained_row` of its K,V after the prefix.

    A pipeline may put a follower in a later micro-batch than its lead (tiered/engine/pipeline/split.py):
    the lead then keeps the K,V of its first `stash_rows` computed tokens under `stash_key` (each
    stage, until the batch ends), and the follower (`reads_stash`: that key, `lead` None) reads
    its `num_shared` tokens from there, as the end of its prefix."""

    token_ids: Tensor  # [T]
    prefix_blocks: tuple[int, ...]
    num_prefix_tokens: int
    lead: int | None = None
    num_shared: int = 0
    adapter: str | None = None
    retained_blocks: tuple[int, ...] = ()
    first_retained_row: int = 0
    stash_key: int | None = None
    stash_rows: int = 0
    reads_stash: int | None = None
    # With a pipeline's host tier: chunks this request stores, each from row `stored_rows[i]` (as
    # `first_retained_row` counts) into every stage's LMCache under `stored_keys[i]`.
    stored_keys: tuple[int, ...] = ()
    stored_rows: tuple[int, ...] = ()
    rope_regime: int = 0  # the whole request's (`TierRequest.rope_regime`)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens this item computes (after its prefix and any shared tokens)."""
        return self.token_ids.numel()


def plan_batch(prepared: Sequence[Prepared], block_tokens: int) -> list[ItemPlan]:
    """The batch's plan. Requests with the same prefix blocks share one prefix, read once per
    layer; the first of them leads, and each other one whose next tokens equal the lead's follows
    it: those tokens are computed once (a profile's tail that fills no whole block, or a whole
    profile on a user's first visit)."""
    leads: dict[tuple[tuple[int, ...], str | None, int], list[int]] = {}  # per prefix, adapter and RoPE regime
    plans: list[ItemPlan] = []
    for p in prepared:
        blocks = tuple(p.prefix_blocks)  # block keys include the adapter and regime: one prefix, one of each
        adapter, regime = p.request.adapter, p.request.rope_regime
        new = p.request.token_ids[p.num_prefix_tokens :]
        # Follow the lead that shares the most tokens (two new users' prompts in one batch
        # each follow their own user's first prompt).
        m, lead = max(
            (
                (common_prefix_len(plans[i].token_ids, new, new.numel() - 1), i)
                for i in leads.get((blocks, adapter, regime), ())
            ),
            default=(0, -1),
        )
        retained = tuple(p.retained_blocks), p.first_retained_block * block_tokens - p.num_prefix_tokens
        keys = tuple(p.store.keys) if p.store is not None else ()
        rows = tuple(j * block_tokens - p.num_prefix_tokens for j in p.stored_blocks)
        if m:
            plans.append(
                ItemPlan(
                    new[m:],
                    blocks,
                    p.num_prefix_tokens,
                    lead,
                    m,
                    adapter,
                    *retained,
                    stored_keys=keys,
                    stored_rows=rows,
                    rope_regime=regime,
                )
            )
        else:
            leads.setdefault((blocks, adapter, regime), []).append(len(plans))
            plans.append(
                ItemPlan(
                    new,
                    blocks,
                    p.num_prefix_tokens,
                    None,
                    0,
                    adapter,
                    *retained,
                    stored_keys=keys,
                    stored_rows=rows,
                    rope_regime=regime,
                )
            )
    return plans


class Runner(Protocol):
    """Computes planned batches: each request's last-token logits [B, V] (fp32).

    `submit` starts a batch and returns a ticket, `collect` waits for that batch's logits; tickets
    are collected in the order they were submitted. Up to `max_in_flight` batches may be submitted
    before the first is collected (a pipeline computes the next batch's first stages while the last
    stages finish the one before); the engine plans a batch only from what the batches before it
    will have left in the device tier. `forward` is submit then collect."""

    max_in_flight: int

    def submit(self, prepared: Sequence[Prepared], plans: Sequence[ItemPlan]) -> object:
        """Start computing a planned batch; returns the ticket `collect` takes."""

    def collect(self, ticket: object) -> Tensor:
        """Wait for a submitted batch's last-token logits [B, V] (fp32), in submission order."""

    def forward(self, prepared: Sequence[Prepared], plans: Sequence[ItemPlan]) -> Tensor:
        """Compute a planned batch and return its logits: `submit` then `collect`."""

    def close(self) -> None:
        """Stop the runner and release its workers."""


class LocalRunner:
    """The whole model in this process, its KV read from and written to the tiers' blocks by id
    through their worker side (whose sinks also copy stored chunks into the host tier's memory)."""

    max_in_flight = 1  # the forward runs in submit(), in the engine's thread

    def __init__(self, model: CausalLM, worker: KVWorker, adapters: Adapters | None, config: ForwardConfig) -> None:
        self.model, self.worker, self.adapters, self.config = model, worker, adapters, config

    def submit(self, prepared: Sequence[Prepared], plans: Sequence[ItemPlan]) -> object:
        """Run the forward now, in the engine's thread; the ticket is the logits themselves."""
        return self.forward(prepared, plans)

    def collect(self, ticket: object) -> Tensor:
        """The logits `submit` already computed."""
        assert isinstance(ticket, Tensor)
        return ticket

    def forward(self, prepared: Sequence[Prepared], plans: Sequence[ItemPlan]) -> Tensor:
        """Run the planned batch through the model here, each distinct prefix read from the device tier once."""
        prefixes: dict[tuple[int, ...], PrefixKV | None] = {}
        items = []
        for p, plan in zip(prepared, plans, strict=True):
            if plan.prefix_blocks not in prefixes:
                prefixes[plan.prefix_blocks] = self.worker.prefix_kv(p)
            weights = self.adapters.weights(plan.adapter) if plan.adapter and self.adapters else None
            items.append(
                BatchItem(
                    plan.token_ids,
                    prefixes[plan.prefix_blocks],
                    self.worker.sink(p),
                    lead=plan.lead,
                    num_shared=plan.num_shared,
                    adapter=weights,
                    rope_regime=plan.rope_regime,
                )
            )
        f = self.config
        return forward_batch(self.model, items, mode=f.mode, chunk_tokens=f.chunk_tokens, spill=spill_of(f))

    def close(self) -> None:
        """Nothing to release: the model and tiers belong to the engine."""
        pass
