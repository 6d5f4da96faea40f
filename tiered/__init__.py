"""tiered: a prefill-only LLM inference engine with a tiered prefix KV cache."""

__version__ = "0.1.0"
