"""The soak's workload straight into an Engine in one process: RSS every 30 s after a 60 s warm-up,
and the size of LMCache's chunk-reuse record (the engine's RSS creep of issue 12).

    .venv/bin/python -m benchmarks.rss_hunt MINUTES notrace|trace [trim]

`trace`: tracemalloc (12 frames) and the allocations that grew most; `trim`: malloc_trim(0) every 30 s."""

import ctypes
import gc
import random
import sys
import time
import tracemalloc

import psutil

from benchmarks.traces import ordinary_token_ids
from tiered.api.engine_process import _response, _stats
from tiered.api.protocol import encode
from tiered.config import load_config, with_overrides
from tiered.embedded import resolve_model_path
from tiered.engine import Engine, ScoreParams

minutes = float(sys.argv[1])
trace = sys.argv[2] == "trace"
trim = len(sys.argv) > 3 and sys.argv[3] == "trim"
cfg = with_overrides(
    load_config(None),
    ["cache.device_tier_bytes=2097152", "cache.block_tokens=64", "cache.host.lmcache={max_local_cpu_size: 0.01}"],
)
folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
vocab = ordinary_token_ids(folder)
rng = random.Random(0)
profiles = [rng.choices(vocab, k=rng.randint(256, 512)) for _ in range(32)]
labels = vocab[:2]
params = ScoreParams(tuple(labels), 0, (), ())
proc = psutil.Process()
libc = ctypes.CDLL("libc.so.6")
with Engine(cfg) as eng:

    def run(seconds):
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            while eng.num_waiting < 64:
                eng.submit(rng.choice(profiles) + rng.choices(vocab, k=rng.randint(20, 60)), params)
            for r in eng.step():
                encode(_response(r))
                n += 1
            encode(_stats(eng))
        return n

    run(60)
    gc.collect()
    base = proc.memory_info().rss
    if trace:
        tracemalloc.start(12)
    s1 = None
    t0 = time.monotonic()
    total = 0
    for i in range(int(minutes * 2)):
        total += run(30)
        if trim:
            libc.malloc_trim(0)
        gc.collect()
        rss = proc.memory_info().rss
        traced = tracemalloc.get_traced_memory()[0] if trace else 0
        host = eng.tiers.host_tier
        assert host is not None, "this hunt needs the host tier"
        record = len(host._storage.local_cpu_backend.cache_policy.chunk_hash_to_init_timestamp)  # type: ignore[attr-defined]
        print(
            f"{time.monotonic() - t0:6.0f}s n={total} rss {(rss - base) / 2**20:+7.1f} MiB "
            f"traced {traced / 2**20:7.2f} MiB "
            f"reuse record {record}",
            flush=True,
        )
        if trace and i == 1:
            s1 = tracemalloc.take_snapshot()
    if trace:
        s2 = tracemalloc.take_snapshot()
        assert s1 is not None
        for stat in s2.compare_to(s1, "traceback")[:12]:
            print(stat)
            for line in stat.traceback.format()[-12:]:
                print("   ", line)
