"""One fresh prompt of N tokens through `tiered.Engine` in this process, profiled (cProfile, by
own time): where a lone long prefill spends its time. The config's keys can be overridden.

    .venv/bin/python -m benchmarks.profile_one_prompt 16384 scheduler.pieces=never cache.suffix=discard
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from tiered.config import load_config
from tiered.engine import Engine


def main() -> None:
    n = int(sys.argv[1])
    cfg = load_config("configs/bench-m.yaml", ["attention.kernel=native", *sys.argv[2:]])
    with Engine(cfg) as engine:
        ids = torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(0))
        engine.submit(ids[:64])
        engine.run()  # warm-up
        engine.submit(ids)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        engine.run()
        profile.disable()
        print(f"{n} tokens: {time.perf_counter() - start:.1f} s; torch threads {torch.get_num_threads()}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
