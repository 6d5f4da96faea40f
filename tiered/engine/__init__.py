"""The engine: requests in, one step at a time (schedule, execute, apply), results out.

`core.py` holds `Engine` (submit, cancel, step, run); `startup.py` builds what it runs with;
`executor.py` runs a step. The types a request goes through live below, in `tiered.request`."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["Engine", "EngineStartError", "RequestOptions", "Result", "ScoreParams"]

if TYPE_CHECKING:
    from tiered.engine.core import Engine, EngineStartError
    from tiered.request.score import RequestOptions, Result, ScoreParams


def __getattr__(name: str) -> object:
    # Lazy, so that importing `tiered.request.validation` (the API process) does not load the model code.
    if name in ("Engine", "EngineStartError"):
        from tiered.engine import core

        return getattr(core, name)
    if name in ("RequestOptions", "Result", "ScoreParams"):
        from tiered.request import score

        return getattr(score, name)
    raise AttributeError(name)
