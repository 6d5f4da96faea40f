"""The block cache (tiered/allocator/block_cache.py, tiered/native/csrc/blocks.cpp): the CPU
allocator of a process under a memory budget. It replaces the allocator of the whole process,
so each test runs in its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiered.config import load_config
from tiered.config.tree import ConfigError
from tiered.native import library as native

needs_native = pytest.mark.skipif(not native.available(), reason="the native library does not build here")


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env or dict(os.environ)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


REUSE_SCRIPT = """
import torch
from tiered.allocator import block_cache as blocks
MiB = 2**20
assert blocks.install(8 * MiB) and blocks.stats() is not None
a = torch.ones(MiB // 4)  # fp32: 1 MiB
where = a.data_ptr()
del a
b = torch.empty(MiB // 4)
s = blocks.stats()
assert b.data_ptr() == where and (s.hits, s.misses, s.cached_bytes) == (1, 1, 0), s
c = torch.empty(MiB // 2)  # another size: a new block
assert blocks.stats().misses == 2
del b, c
assert blocks.stats().cached_bytes == 3 * MiB and blocks.stats().live_bytes == 0
big = torch.zeros(4 * MiB)  # 16 MiB, above the cap: unmapped when freed, and the cache keeps under its cap
del big
s = blocks.stats()
assert s.cached_bytes == 3 * MiB, s
fill = [torch.empty(MiB // 4 + 1024 * i) for i in range(1, 9)]  # eight more sizes, each just over 1 MiB
del fill
assert blocks.stats().cached_bytes <= 8 * MiB
small = torch.empty(1024)  # under 64 KiB: the allocator it replaced
assert blocks.stats().live_bytes == 0
blocks.release()
assert blocks.stats().cached_bytes == 0
d = torch.arange(MiB, dtype=torch.float32)  # a fresh mapping after the release holds what is written
assert float(d[-1]) == MiB - 1 and small.numel() == 1024
print("ok")
"""


@needs_native
def test_a_freed_block_is_taken_back_by_its_exact_size_within_the_cap() -> None:
    assert _run(REUSE_SCRIPT).strip().endswith("ok")


OOM_SCRIPT = """
import resource, torch
from tiered.engine.executor import out_of_memory
from tiered.allocator import block_cache as blocks
assert blocks.install(2**20)
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
try:
    torch.empty(2**30, dtype=torch.uint8)
    raise SystemExit("a 1 GiB tensor was mapped under a 256 MiB address-space limit")
except Exception as exc:  # what the engine's executor sees
    assert out_of_memory(exc), repr(exc)
kept = torch.ones(2**20)  # the cache goes on serving
assert float(kept.sum()) == 2**20 and blocks.stats().live_bytes == 4 * 2**20
print("ok")
"""


@needs_native
def test_a_mapping_that_fails_is_out_of_memory_to_the_engine() -> None:
    """Out of memory fails one request and the engine goes on: the error is one the executor knows."""
    assert _run(OOM_SCRIPT).strip().endswith("ok")


FORWARD_SCRIPT = """
import sys, torch
from tiered.allocator import block_cache as blocks
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model
from tiered.hybrid.memory import use_block_cache
model = load_model(sys.argv[1], "float32", "cpu")
ids = torch.randint(3, 1000, (3000,), generator=torch.Generator().manual_seed(0))
ref = forward(model, ids, chunk_tokens=256)
assert use_block_cache(model, 256, None)
assert blocks.stats().cap_bytes == blocks.cap_bytes(model.args.intermediate_size, 256, 4)
first, second = forward(model, ids, chunk_tokens=256), forward(model, ids, chunk_tokens=256)
s = blocks.stats()
assert s.hits > s.misses, s  # the chunk loop takes its blocks back
assert torch.equal(first, ref) and torch.equal(second, ref)
print("ok")
"""


@needs_native
def test_forwards_from_cached_blocks_give_the_same_logits(tiny_dir: Path) -> None:
    """Where a tensor's memory comes from changes no value: logits equal bit for bit."""
    assert _run(FORWARD_SCRIPT, str(tiny_dir)).strip().endswith("ok")


PEAK_SCRIPT = """
import sys, torch
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model
from tiered.hybrid.memory import PeakShape, measure_forward_peak, use_block_cache
model = load_model(sys.argv[1], "float32", "cpu")
assert use_block_cache(model, 2048, None)
if sys.argv[2] == "after-longer-forwards":  # they move glibc's dynamic mmap threshold, and leave cached blocks
    for n in (30000, 7000, 21000):
        forward(model, torch.randint(3, 1000, (n,)), chunk_tokens=2048)
print(measure_forward_peak(model, PeakShape(12000), "hybrid", 2048).peak_bytes)
"""


@needs_native
def test_at_glibcs_defaults_the_peak_reads_the_same_after_longer_forwards(tiny_dir: Path) -> None:
    """With the block cache every large tensor has its own mapping and each forward starts with the
    cache empty, so what ran before changes the measured peak by little, at glibc's dynamic mmap
    threshold (no MALLOC_ variable set)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    fresh = int(_run(PEAK_SCRIPT, str(tiny_dir), "fresh", env=env).split()[-1])
    after = int(_run(PEAK_SCRIPT, str(tiny_dir), "after-longer-forwards", env=env).split()[-1])
    assert abs(after - fresh) <= 0.03 * fresh, (fresh, after)  # without the cache: up to a sixth above


def test_the_cap_must_be_null_or_not_negative() -> None:
    with pytest.raises(ConfigError, match="engine.block_cache_bytes"):
        load_config(None, ["engine.block_cache_bytes=-1"])
    assert load_config(None, ["engine.block_cache_bytes=0"]).engine.block_cache_bytes == 0
