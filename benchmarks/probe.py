"""One forward in a fresh process, printing its memory peak as JSON (run as a subprocess).

Each probe runs in its own process so one probe's allocator state cannot hide another's peak;
the measurement itself is `tiered.hybrid.memory.measure_forward_peak`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tiered.hybrid.loader import load_model
from tiered.hybrid.memory import PeakShape, measure_forward_peak, use_block_cache
from tiered.hybrid.model import use_attention
from tiered.hybrid.spill import Spill


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run one forward and print its memory peak as JSON.")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", required=True)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, required=True, help="new tokens (per request, with --requests)")
    p.add_argument("--requests", type=int, default=1, help="requests in one batched forward")
    p.add_argument("--prefix-tokens", type=int, default=0, help="one cached prefix all requests share")
    p.add_argument("--attention", help="the attention kernel (default: the model's default on its device)")
    p.add_argument("--spill-dir", help="hybrid: keep a long forward's residual stream in a file in this directory")
    p.add_argument("--spill-min-tokens", type=int, default=1, help="with --spill-dir: from this many tokens on")
    p.add_argument(
        "--block-cache-bytes",
        type=int,
        help="the block cache's cap, as a server under engine.memory_budget_bytes uses it (default: sized from the "
        "model and --chunk-tokens, as engine.block_cache_bytes null; 0: glibc's allocator)",
    )
    a = p.parse_args(argv)
    model = load_model(a.model, a.dtype, a.device)
    use_attention(model, a.attention)
    use_block_cache(model, a.chunk_tokens, a.block_cache_bytes)
    shape = PeakShape(a.tokens, a.requests, a.prefix_tokens)
    spill = Spill(a.spill_dir, a.spill_min_tokens) if a.spill_dir else None
    peak = measure_forward_peak(model, shape, a.mode, a.chunk_tokens, spill)
    json.dump(asdict(peak), sys.stdout)


if __name__ == "__main__":
    main()
