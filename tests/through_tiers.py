"""One request through the tiers without the engine: prepare, load, forward over the misses, finish.

A test helper (the tier tests check the tiers' mechanics request by request); the engine,
`tiered run` and the benchmarks go through `tiered.Engine`. Importable from every test module:
pytest puts `tests/` on the path for its root `conftest.py`."""

from __future__ import annotations

from collections.abc import Collection

from torch import Tensor

from tiered.config import ForwardMode
from tiered.hybrid.forward import forward
from tiered.hybrid.model import CausalLM
from tiered.offload.tiers import KVTiers
from tiered.request.plan import Prepared
from tiered.request.tokens import TierRequest


def forward_with_tiers(
    model: CausalLM,
    tiers: KVTiers,
    req: TierRequest,
    mode: ForwardMode = "hybrid",
    chunk_tokens: int = 1024,
    shared_keys: Collection[int] = (),
) -> tuple[Tensor, Prepared]:
    """Logits of `req` computed over its misses on top of what the tiers hold, and its `Prepared`."""
    prepared = tiers.prepare(req, shared_keys)
    while tiers.worker.load([prepared]):  # a chunk could not be read: forgotten, prepared again (the engine's rule)
        tiers.abort(prepared)
        prepared = tiers.prepare(req, shared_keys)
    try:
        logits = forward(
            model,
            req.token_ids[prepared.num_prefix_tokens :],
            mode=mode,
            chunk_tokens=chunk_tokens,
            prefix_kv=tiers.worker.prefix_kv(prepared),
            kv_sink=tiers.worker.sink(prepared),
        )
    except BaseException:
        tiers.abort(prepared)
        raise
    tiers.finish(prepared)
    return logits, prepared
