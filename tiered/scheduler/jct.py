"""Job completion time (JCT) model: predicted seconds of one request from its hit split.

Design notes: docs/internals.md, section `tiered/scheduler/jct.py`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tiered.request.tokens import HitSplit

log = logging.getLogger(__name__)
NUM_FEATURES = 7


def _pairs(num_miss: float, num_tokens: float) -> float:
    """Causal (query, key) pairs of the last `num_miss` of `num_tokens` tokens."""
    return num_miss * (num_tokens - num_miss / 2)


@dataclass(slots=True)
class JCTSample:
    """One measured forward: one request, or a batch with its requests' counts summed."""

    num_tokens: int
    num_miss_tokens: int
    num_host_hit_tokens: int
    seconds: float
    # Σ attention pairs M·(T − M/2) over the forward's requests; -1: one request, computed from its counts.
    num_attention_pairs: float = -1
    num_remote_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0

    @classmethod
    def of(cls, splits: Sequence[HitSplit], seconds: float) -> JCTSample:
        """One forward over requests with these hit splits, their counts and attention pairs summed."""
        return cls(
            sum(s.num_tokens for s in splits),
            sum(s.num_miss_tokens for s in splits),
            sum(s.num_host_hit_tokens for s in splits),
            seconds,
            sum(_pairs(s.num_miss_tokens, s.num_tokens) for s in splits),
            sum(s.num_remote_hit_tokens for s in splits),
            sum(s.num_disk_hit_tokens for s in splits),
        )

    def features(self) -> list[float]:
        """The fit's feature row, as the module docstring's terms: 1, M, pairs, H, T - M, R, D."""
        m = float(self.num_miss_tokens)
        pairs = _pairs(m, self.num_tokens) if self.num_attention_pairs < 0 else float(self.num_attention_pairs)
        cached = float(self.num_tokens - self.num_miss_tokens)
        host, remote, disk = self.num_host_hit_tokens, self.num_remote_hit_tokens, self.num_disk_hit_tokens
        return [1.0, m, pairs, float(host), cached, float(remote), float(disk)]


@dataclass(slots=True)
class JCTModel:
    """Predicted seconds of a forward from its requests' hit splits, refitted online on finished jobs."""

    coefficients: list[float]  # c0..c6 as in the module docstring (missing trailing ones: 0)
    profile: list[JCTSample] = field(default_factory=list)
    _observed: deque[JCTSample] = field(default_factory=lambda: deque(maxlen=256))
    _errors: deque[float] = field(default_factory=lambda: deque(maxlen=100))

    def __post_init__(self) -> None:
        self.coefficients = [*self.coefficients, *[0.0] * (NUM_FEATURES - len(self.coefficients))]

    @classmethod
    def fit(cls, samples: list[JCTSample]) -> JCTModel:
        """A model fitted on `samples`, kept as its profile grid for later refits."""
        return cls(_fit(samples), profile=list(samples))

    def predict(self, split: HitSplit) -> float:
        """Seconds for a job with this hit split run alone (never below zero)."""
        return self.predict_batch((split,))

    def predict_batch(self, splits: Sequence[HitSplit]) -> float:
        """Seconds for one forward over requests with these hit splits (never below zero)."""
        x = JCTSample.of(splits, 0.0).features()
        return max(0.0, sum(c * v for c, v in zip(self.coefficients, x, strict=True)))

    def piece_seconds(self, split: HitSplit, num_tokens: int) -> float:
        """Seconds to compute the next `num_tokens` of a request after its cached prefix (`split`'s
        hits). Monotone in `num_tokens` (pieces are chosen by binary search on it): the per-token
        and attention terms count at least zero, whatever sign the fit gave them."""
        c = self.coefficients
        cached = split.num_hit_tokens
        m = float(num_tokens)
        fixed = c[0] + c[3] * split.num_host_hit_tokens + c[4] * cached + c[5] * split.num_remote_hit_tokens
        fixed += c[6] * split.num_disk_hit_tokens
        return max(0.0, fixed) + max(c[1], 0.0) * m + max(c[2], 0.0) * _pairs(m, cached + m)

    def observe(self, splits: Sequence[HitSplit], seconds: float, refit: bool = True) -> float:
        """Record a finished forward (a batch); returns the prediction it had. Updates the error and
        (unless `refit` is False: several at once, the last one refits) the fit."""
        predicted = self.predict_batch(splits)
        if seconds > 0:
            self._errors.append(abs(predicted - seconds) / seconds)
            self._observed.append(JCTSample.of(splits, seconds))
            if self.profile and refit:  # a model given as coefficients (tests, benchmarks) stays as given
                self.coefficients = _fit(self.profile + list(self._observed))
        return predicted

    @property
    def error(self) -> float | None:
        """Mean absolute percentage error (a fraction) over the last 100 jobs, or None."""
        return sum(self._errors) / len(self._errors) if self._errors else None


def _fit(samples: list[JCTSample]) -> list[float]:
    """Least squares on relative error (long and short jobs weigh alike), coefficients >= 0."""
    x = np.array([s.features() for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / np.maximum(y, 1e-6)
    xw, yw = x * w[:, None], y * w
    # A cost term cannot save time: drop the most negative term and refit until none is.
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while active.any():
        fit, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        coef[:] = 0.0
        coef[active] = fit
        if (fit >= 0).all():
            break
        active[np.flatnonzero(active)[np.argmin(fit)]] = False
    return [float(c) for c in coef]
