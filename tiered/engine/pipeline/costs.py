"""The JCT model of a pipeline: what a micro-batch costs on each stage.

Design notes: docs/internals.md, section `tiered/engine/pipeline/costs.py`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from tiered.request.tokens import HitSplit
from tiered.scheduler.jct import JCTModel

MAX_WAITING = 256  # micro-batches measured before the prior that join the fit (as the JCT model's window)


class StageModels:
    """One JCT model per pipeline stage, fitted on what each stage measures per micro-batch beside a prior."""

    def __init__(self, layer_shares: Sequence[float]) -> None:
        """`layer_shares[s]`: stage s's fraction of the decoder layers."""
        self.shares = list(layer_shares)
        self.models: list[JCTModel] | None = None  # one per stage, once `use_prior` gave the profile
        self._waiting: deque[tuple[int, list[list[HitSplit]], list[float]]] = deque(maxlen=MAX_WAITING)

    def use_prior(self, base: JCTModel) -> None:
        """Fit every stage's model on `base`'s profile scaled by the stage's share (its loads left
        out: no stage loads during a micro-batch), then on the micro-batches measured so far. A
        model without a profile (given as coefficients: tests, benchmarks) is scaled as it stands
        and never refitted, as the engine's own."""
        grid = [x for x in base.profile if not x.num_host_hit_tokens and not x.num_remote_hit_tokens]
        self.models = []
        for share in self.shares:
            if grid:
                self.models.append(JCTModel.fit([replace(x, seconds=x.seconds * share) for x in grid]))
            else:  # no loads in a micro-batch: c3 and c5 (host and remote loads) left out
                c = [v * share for v in base.coefficients]
                c[3] = c[5] = 0.0
                self.models.append(JCTModel(c))
        for stage, microbatches, seconds in self._waiting:
            self.observe(stage, microbatches, seconds)
        self._waiting.clear()

    def observe(self, stage: int, microbatches: Sequence[Sequence[HitSplit]], seconds: Sequence[float]) -> None:
        """Stage `stage` ran these micro-batches (each its items' splits) in these seconds; one refit."""
        if len(microbatches) != len(seconds):
            raise ValueError(f"stage {stage}: {len(seconds)} seconds for {len(microbatches)} micro-batches")
        if self.models is None:
            self._waiting.append((stage, [list(mb) for mb in microbatches], list(seconds)))
            return
        for i, (splits, s) in enumerate(zip(microbatches, seconds, strict=True)):
            self.models[stage].observe(splits, s, refit=i == len(seconds) - 1)

    def predict(self, stage: int, splits: Sequence[HitSplit]) -> float:
        """Seconds of one micro-batch of these requests on stage `stage` (0 before a prior)."""
        return self.models[stage].predict_batch(splits) if self.models is not None else 0.0

    def job_seconds(self, split: HitSplit) -> float:
        """A request's weight in a cut: what it adds to a micro-batch on its slowest stage (see the
        module docstring)."""
        if self.models is None or not any(m.coefficients[1] or m.coefficients[2] for m in self.models):
            return float(split.num_miss_tokens)  # no prior, or a model that prices no computed token
        return max(m.predict_batch((split,)) - m.predict_batch(()) for m in self.models)

    @property
    def errors(self) -> list[float | None]:
        """Each stage's mean absolute percentage error (a fraction) over its last 100 micro-batches."""
        return [m.error for m in self.models] if self.models is not None else [None] * len(self.shares)
