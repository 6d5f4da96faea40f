"""tiered: a prefill-only LLM inference engine with a tiered prefix KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"  # the one source of the version (pyproject.toml reads it)
__all__ = ["Engine", "RequestOptions", "Result", "ScoreParams", "__version__"]

if TYPE_CHECKING:  # what type checkers see; at run time `import tiered` stays free of torch
    from tiered.engine import Engine
    from tiered.request.score import RequestOptions, Result, ScoreParams


def __getattr__(name: str) -> object:
    # `tiered.Engine` without importing torch for `import tiered`.
    if name in ("Engine", "RequestOptions", "ScoreParams", "Result"):
        import tiered.engine

        return getattr(tiered.engine, name)
    raise AttributeError(name)
