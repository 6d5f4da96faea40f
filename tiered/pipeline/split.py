"""How the model and a batch are split: layers into stages, a batch into micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tiered.runner import ItemPlan
from tiered.scheduler.waves import Job, form_waves


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """`num_stages` contiguous ranges of the layers, as even as possible (earlier stages take the
    extra layer: the last one also runs the final norm and LM head)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} stages for {num_layers} layers: need 1 <= stages <= layers")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def cut_microbatches(plans: Sequence[ItemPlan], num_microbatches: int) -> list[list[int]]:
    """The batch's items per micro-batch (indices, in batch order), of even computed tokens.

    A lead and its followers are one job: a follower reads the K,V its lead computes in the same
    forward. Jobs go to micro-batches longest first, each to the lightest (`form_waves`), so no
    micro-batch exceeds the mean by more than one job; empty ones are dropped."""
    groups: dict[int, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(i if plan.lead is None else plan.lead, []).append(i)
    jobs = [
        Job(str(lead), sum(plans[i].num_computed_tokens for i in members),
            sum(plans[i].num_prefix_tokens for i in members))
        for lead, members in groups.items()
    ]  # fmt: skip
    waves = form_waves(jobs, num_microbatches, cost=lambda job: job.num_computed_tokens)
    return [sorted(i for job in wave for i in groups[int(job.request_id)]) for wave in waves]


def microbatch_plans(plans: Sequence[ItemPlan], indices: list[int]) -> list[ItemPlan]:
    """The plans of one micro-batch, each follower's lead renumbered within it."""
    position = {i: n for n, i in enumerate(indices)}
    return [plans[i] if plans[i].lead is None else replace(plans[i], lead=position[plans[i].lead])  # type: ignore[index]
            for i in indices]  # fmt: skip
