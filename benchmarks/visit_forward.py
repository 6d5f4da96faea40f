"""The visit's forward timed in one process, for comparing two trees of the code side by side.

Best-of-N seconds of (1) the `native` attention alone at the visit's shape (8 x 160 queries on a
shared 1,792-token prefix, bench-m's 16/4 heads of 64, bf16) and (2) the batched forward of those
8 x 160 tokens on bench-m over a cached 1,792-token prefix. It imports only `tiered`, so it runs
against any tree, its path first on PYTHONPATH, the trees taking turns:

    PYTHONPATH=/path/to/tree .venv/bin/python benchmarks/visit_forward.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import tiered
from tiered.embedded import resolve_model_path
from tiered.hybrid.attention import Span
from tiered.hybrid.attention.native import attend_
from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import load_model
from tiered.hybrid.memory import GatheredPrefix
from tiered.hybrid.model import use_attention

REQUESTS, NEW_TOKENS, PREFIX_TOKENS = 8, 160, 1792


def best_of(n: int, fn: Callable[[], object]) -> float:
    """The fastest of `n` timed calls, after one untimed."""
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_seconds() -> tuple[float, float]:
    """Best-of-25 seconds of the attention alone, and its GFLOP/s."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dh, dt = 16, 4, 64, torch.bfloat16
    rows = REQUESTS * NEW_TOKENS
    q, k, v = (torch.randn(rows, h, dh, generator=g).to(dt) for h in (heads, kv_heads, kv_heads))
    pk, pv = (torch.randn(PREFIX_TOKENS, kv_heads, dh, generator=g).to(dt) for _ in "kv")
    spans = [Span(i * NEW_TOKENS, i * NEW_TOKENS, NEW_TOKENS) for i in range(REQUESTS)]
    seconds = best_of(25, lambda: attend_(q.clone(), k, v, spans, pk, pv))
    flops = 4 * heads * dh * rows * (PREFIX_TOKENS + (NEW_TOKENS + 1) / 2)
    return seconds, flops / seconds / 1e9


def forward_seconds() -> float:
    """Best-of-12 seconds of the visit's batched forward on bench-m (bf16, the `native` kernel)."""
    model = load_model(resolve_model_path("embedded:bench-m", ".models"), "bfloat16", "cpu")
    use_attention(model, "native")
    g = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    profile = torch.randint(0, vocab, (PREFIX_TOKENS,), generator=g)
    forward(model, profile, chunk_tokens=1024, kv_sink=lambda i, k, v: kv.append((k.clone(), v.clone())))
    prefix = GatheredPrefix(kv)
    items = [BatchItem(torch.randint(0, vocab, (NEW_TOKENS,), generator=g), prefix) for _ in range(REQUESTS)]
    return best_of(12, lambda: forward_batch(model, items, chunk_tokens=1024))


if __name__ == "__main__":
    attention, gflops = attention_seconds()
    fwd = forward_seconds()
    print(f"{tiered.__file__}: attention {1e3 * attention:.1f} ms ({gflops:.0f} GFLOP/s), forward {fwd:.3f} s")
