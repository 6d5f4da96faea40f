"""The engine: requests in, one step at a time (schedule, execute, apply), results out.

`core.py` holds `Engine` (submit, cancel, step, run); `startup.py` builds what it runs with;
`executor.py` runs a step; `request.py` and `score.py` hold the types a request goes through."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["Engine", "EngineStartError", "Result", "ScoreParams"]

if TYPE_CHECKING:
    from tiered.engine.core import Engine, EngineStartError
    from tiered.engine.score import Result, ScoreParams


def __getattr__(name: str) -> object:
    # Lazy, so that `tiered.engine.request` (imported by the tiers) does not import the engine.
    if name in ("Engine", "EngineStartError"):
        from tiered.engine import core

        return getattr(core, name)
    if name in ("Result", "ScoreParams"):
        from tiered.engine import score

        return getattr(score, name)
    raise AttributeError(name)
