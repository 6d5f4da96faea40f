"""tiered: a prefill-only LLM inference engine with a tiered prefix KV cache."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `tiered.Engine` without importing torch for `import tiered`.
    if name in ("Engine", "ScoreParams", "Result"):
        from tiered import engine

        return getattr(engine, name)
    raise AttributeError(name)
