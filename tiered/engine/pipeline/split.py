"""How the model and a batch are split: layers into stages, a batch into micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from tiered.engine.pipeline.waves import Job, form_waves
from tiered.engine.runner import ItemPlan
from tiered.request.tokens import HitSplit


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


def cut_microbatches(
    plans: Sequence[ItemPlan], num_microbatches: int, cost: Callable[[HitSplit], float] | None = None
) -> list[list[int]]:
    """The batch's items per micro-batch (indices, in batch order), of even cost: `cost` of an
    item's split (the pipeline's stage models, tiered/engine/pipeline/costs.py), else its computed tokens.

    Every item is a job of its own, the costliest first to the lightest micro-batch (`form_waves`),
    so no micro-batch exceeds the mean by more than one item; a follower never goes to an earlier
    micro-batch than its lead (it reads K,V its lead computes: in the same forward, or from the
    lead's stash when it comes later, see `microbatch_plans`). Empty micro-batches are dropped."""
    weigh = cost or (lambda split: float(split.num_miss_tokens))
    weights = [weigh(plan_split(plan)) for plan in plans]
    jobs = [
        Job(
            str(i),
            plan.num_computed_tokens,
            plan.num_prefix_tokens + plan.num_shared,
            None if plan.lead is None else str(plan.lead),
        )
        for i, plan in enumerate(plans)
    ]
    waves = form_waves(jobs, num_microbatches, cost=lambda job: weights[int(job.request_id)])
    return [[int(job.request_id) for job in wave] for wave in waves]


def plan_split(plan: ItemPlan) -> HitSplit:
    """A planned item as the JCT model counts it: the tokens it computes after the K,V it reads
    (its cached prefix and, for a follower, the tokens its lead computes for both)."""
    return HitSplit(plan.num_prefix_tokens + plan.num_shared, 0, plan.num_computed_tokens)


def microbatch_plans(plans: Sequence[ItemPlan], cut: list[list[int]]) -> list[list[ItemPlan]]:
    """Each micro-batch's plans. A follower whose lead is in the same micro-batch follows it there
    (its lead renumbered within the micro-batch); one whose lead ran in an earlier micro-batch
    reads the shared tokens' K,V from the lead's stash (keyed by the lead's index in the batch),
    which the lead keeps for the longest such follower."""
    where = {i: m for m, indices in enumerate(cut) for i in indices}
    stash_rows: dict[int, int] = {}
    for i, plan in enumerate(plans):
        if plan.lead is not None and where[plan.lead] < where[i]:
            stash_rows[plan.lead] = max(stash_rows.get(plan.lead, 0), plan.num_shared)
    out = []
    for indices in cut:
        position = {i: n for n, i in enumerate(indices)}
        mb = []
        for i in indices:
            plan = plans[i]
            if i in stash_rows:
                plan = replace(plan, stash_key=i, stash_rows=stash_rows[i])
            if plan.lead is not None:
                lead = plan.lead
                plan = (
                    replace(plan, lead=position[lead])
                    if lead in position
                    else replace(plan, lead=None, reads_stash=lead)
                )
            mb.append(plan)
        out.append(mb)
    return out
