"""The host tier's local disk (LMCache's LocalDiskBackend on a real directory): chunks its memory
no longer holds are read from the disk, counted as disk hits (by the scheduler's estimate too),
with the logits of a plain forward; a path that cannot hold the tier is a start-up error naming
the key; a disk that refuses writes leaves the chunks in memory, warns and counts, loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from through_tiers import forward_with_tiers

from tiered.cli import main
from tiered.config import ConfigError, HostTierConfig
from tiered.hybrid.forward import forward
from tiered.hybrid.model import CausalLM
from tiered.offload.tiers import KVTiers

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32 logits, relative to the largest |logit|


def _disk(path: Path, cpu_gb: float = 0.05) -> HostTierConfig:
    return HostTierConfig(lmcache={"max_local_cpu_size": cpu_gb, "local_disk": str(path), "max_local_disk_size": 0.2})


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: CausalLM, tiers: KVTiers, ids: torch.Tensor, name: str):
    return forward_with_tiers(model, tiers, tiers.new_request(name, ids), chunk_tokens=64)


def test_a_prefix_only_the_disk_holds_is_read_from_it(model: CausalLM, make_tiers, tmp_path: Path) -> None:
    tiers = make_tiers(host=_disk(tmp_path))
    host = tiers.host_tier
    assert host is not None and host.has_disk
    ids = _tokens(200, 1)  # 12 full blocks of 16; the 13th is partial
    req = tiers.new_request("a", ids)
    _run(model, tiers, ids, "a")
    tiers.flush()
    assert host.evict_from_memory(req.keys) == 12
    assert len(list(tmp_path.glob("*.pt"))) == 12  # one file per chunk, on the file system
    later = _tokens(64, 11)  # another user's 4 chunks, stored to the disk after these
    _run(model, tiers, later, "later")
    tiers.flush()
    assert host.evict_from_memory(tiers.new_request("later", later).keys) == 4
    tiers.device_tier.clear()
    estimate = tiers.estimate(tiers.new_request("b", ids))
    assert (estimate.num_host_hit_tokens, estimate.num_disk_hit_tokens) == (0, 192)
    logits, prepared = _run(model, tiers, ids, "b")
    split = prepared.split
    assert (split.num_device_hit_tokens, split.num_host_hit_tokens, split.num_disk_hit_tokens) == (0, 0, 192)
    assert split.num_miss_tokens == 8
    assert tiers.stats().host.num_disk_hit_tokens == 192
    # Read, so just used by the disk's own LRU: its last 12, the prefix's first chunk last (evicted last).
    disk = host._storage.storage_backends["LocalDiskBackend"]
    order = list(disk.dict)
    assert set(order[:4]) == {host._key(k) for k in tiers.new_request("l", later).keys[:4]}
    assert order[4:] == [host._key(k) for k in reversed(req.keys[:12])]
    ref = forward(model, ids)
    assert (logits - ref).abs().max().item() <= TOL * ref.abs().max().item()
    # Now on the device again: a device hit, not a disk one.
    _, again = _run(model, tiers, ids, "c")
    assert again.split.num_device_hit_tokens == 192 and again.split.num_disk_hit_tokens == 0


def test_chunks_in_memory_are_host_hits_even_with_a_disk(model: CausalLM, make_tiers, tmp_path: Path) -> None:
    tiers = make_tiers(host=_disk(tmp_path))
    ids = _tokens(100, 2)
    _run(model, tiers, ids, "a")
    tiers.flush()
    tiers.device_tier.clear()
    assert tiers.estimate(tiers.new_request("b", ids)).num_disk_hit_tokens == 0
    _, prepared = _run(model, tiers, ids, "b")
    assert (prepared.split.num_host_hit_tokens, prepared.split.num_disk_hit_tokens) == (96, 0)


def test_a_disk_path_that_cannot_hold_the_tier_is_a_start_up_error(make_tiers, tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=r"config key 'cache.host.lmcache.local_disk': '.*not-a-directory'"):
        make_tiers(host=_disk(a_file))
    under_a_file = a_file / "kv"
    with pytest.raises(ConfigError, match="cannot hold the disk tier"):
        make_tiers(host=_disk(under_a_file))


def test_serve_refuses_such_a_path_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "kv-file"
    a_file.write_text("")
    argv = [
        "serve",
        "--set",
        f"cache.host.lmcache.local_disk={a_file}",
        "--set",
        "cache.host.lmcache.max_local_disk_size=1",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config key 'cache.host.lmcache.local_disk'" in err[0] and str(a_file) in err[0]


REFUSED_WRITES = """
import logging, resource, signal, sys, time, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from tiered.config import CacheConfig, HostTierConfig
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model
from tiered.offload.tiers import KVTiers, TierSetup
from through_tiers import forward_with_tiers

model = load_model(sys.argv[2], "float32")
a = model.args
host = HostTierConfig(lmcache={"max_local_cpu_size": 0.05, "local_disk": sys.argv[1], "max_local_disk_size": 0.2})
cfg = CacheConfig(block_tokens=16, device_tier_bytes=64 * 16 * a.kv_bytes_per_token(torch.float32), host=host)
tiers = KVTiers(cfg, TierSetup(a, torch.float32, "cpu", "refused-writes"))
# From here the OS refuses every write past one byte, as a full disk refuses them.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
ids = torch.randint(0, 1300, (200,), generator=torch.Generator().manual_seed(3))
forward_with_tiers(model, tiers, tiers.new_request("a", ids), chunk_tokens=64)
tiers.flush()
host_tier = tiers.host_tier
backend = host_tier._storage.storage_backends["LocalDiskBackend"]
deadline = time.monotonic() + 20
while host_tier.stats().num_disk_write_failures < 12 and time.monotonic() < deadline:
    time.sleep(0.02)
stats = host_tier.stats()
print("failures", stats.num_disk_write_failures, stats.num_failures)
in_flight = sum(backend.exists_in_put_tasks(host_tier._key(k)) for k in tiers.new_request("x", ids).keys)
print("disk", backend.current_cache_size, len(backend.dict), in_flight)
tiers.device_tier.clear()
logits, prepared = forward_with_tiers(model, tiers, tiers.new_request("b", ids), chunk_tokens=64)
ref = forward(model, ids)
print("split", prepared.split.num_host_hit_tokens, prepared.split.num_disk_hit_tokens, prepared.split.num_miss_tokens)
print("close", bool((logits - ref).abs().max() <= 1e-5 * ref.abs().max()))
tiers.close()
"""


def test_a_disk_that_refuses_writes_keeps_the_chunks_in_memory(tmp_path: Path, tiny_dir: Path) -> None:
    """A real write failure (RLIMIT_FSIZE: the OS refuses the file's bytes, EFBIG, as a full disk
    refuses them with ENOSPC), in a child process: every chunk's write fails, once warned and
    counted each; LMCache's disk accounting is given back (no bytes, keys or writes in flight
    left); the chunks are still served from memory, with the logits of a plain forward."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REFUSED_WRITES), str(tmp_path / "disk"), str(tiny_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["failures"] == "12 12"
    assert lines["disk"] == "0.0 0 0"
    assert lines["split"] == "192 0 8"
    assert lines["close"] == "True"
    assert done.stdout.count("host tier disk write failed") == 1  # one warning, however many chunks


def test_a_disk_prefix_larger_than_the_memory_is_read_straight_into_device_blocks(
    model: CausalLM, make_tiers, tmp_path: Path
) -> None:
    """A prefix of more chunks than LMCache's memory holds is read from the disk in one load (a
    read staged in that memory would need several), straight into device blocks: nothing waits for
    memory, and the logits are a plain forward's."""
    import signal

    chunk_bytes = 16 * model.args.kv_bytes_per_token(torch.float32)
    tiers = make_tiers(host=_disk(tmp_path, cpu_gb=5.5 * chunk_bytes / 2**30))
    host = tiers.host_tier
    assert host is not None
    ids = _tokens(200, 3)  # 12 full blocks of 16
    for n in (64, 128, 200):  # onto the disk 4 blocks at a time: the memory holds 5
        _run(model, tiers, ids[:n], f"part-{n}")
        host.evict_from_memory(tiers.new_request(f"keys-{n}", ids[:n]).keys)
        tiers.device_tier.clear()
    assert len(list(tmp_path.glob("*.pt"))) == 12
    loads = host.stats().num_loads

    def stuck(*_: object) -> None:
        raise TimeoutError("the disk read waited for memory")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(60)
    try:
        logits, prepared = _run(model, tiers, ids, "b")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert (prepared.split.num_disk_hit_tokens, prepared.split.num_miss_tokens) == (192, 8)
    assert host.stats().num_loads == loads + 1
    ref = forward(model, ids)
    assert (logits - ref).abs().max().item() <= TOL * ref.abs().max().item()


def test_a_disk_file_cut_short_is_recomputed_from_there(model: CausalLM, make_tiers, tmp_path: Path) -> None:
    """A chunk file cut short after LMCache listed it (a failing disk): the load ends before it and
    the request is prepared again (the engine's rule), with the chunks read before it now in the
    device tier; that chunk and the rest are recomputed with a plain forward's logits, the failure
    is counted, LMCache forgets the chunk, and the recomputed chunk is stored again: the next load
    reads all."""
    tiers = make_tiers(host=_disk(tmp_path))
    host = tiers.host_tier
    assert host is not None
    ids = _tokens(200, 5)
    keys = tiers.new_request("keys", ids).keys
    _run(model, tiers, ids, "a")
    tiers.flush()
    assert host.evict_from_memory(keys) == 12
    disk = host._storage.storage_backends["LocalDiskBackend"]
    path = Path(disk.dict[host._key(keys[5])].path)
    path.write_bytes(path.read_bytes()[:100])
    tiers.device_tier.clear()
    logits, prepared = _run(model, tiers, ids, "b")
    split = prepared.split
    assert (split.num_device_hit_tokens, split.num_host_hit_tokens, split.num_miss_tokens) == (80, 0, 120)
    assert host.stats().num_failures == 1 and host.stats().num_disk_hit_tokens == 80
    assert host._key(keys[5]) not in disk.dict
    ref = forward(model, ids)
    assert (logits - ref).abs().max().item() <= TOL * ref.abs().max().item()
    tiers.flush()  # the recomputed chunk stored again: LMCache's disk counts 12 chunks, not 13
    assert disk.current_cache_size == 12 * disk.dict[host._key(keys[0])].size
    tiers.device_tier.clear()
    _, again = _run(model, tiers, ids, "c")
    assert again.split.num_miss_tokens == 8


@pytest.mark.parametrize("wait_s", [5.0, 0.0])
def test_a_store_waits_for_memory_that_disk_writes_hold(
    model: CausalLM, make_tiers, tmp_path: Path, wait_s: float
) -> None:
    """LMCache's memory full of chunks on their way to its disk (the disk's index held by the test,
    so their writes cannot finish): a store waits for them to land (`store_wait_s`) and gets its
    memory once they do, instead of dropping chunks a later request would recompute; with no wait
    allowed it drops them at once."""
    import threading
    import time

    chunk_bytes = 16 * model.args.kv_bytes_per_token(torch.float32)
    tiers = make_tiers(host=replace(_disk(tmp_path, cpu_gb=5.5 * chunk_bytes / 2**30), store_wait_s=wait_s))
    host = tiers.host_tier
    assert host is not None
    disk = host._storage.storage_backends["LocalDiskBackend"]
    with disk.disk_lock:
        _run(model, tiers, _tokens(81, 7), "a")  # 5 chunks: all of the memory, held until on disk
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(host.begin_store([11, 12, 13])))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() == (wait_s > 0)
    waiter.join(10)
    batch = got[0]
    stats = host.stats()
    if wait_s > 0:
        assert batch is not None and batch.keys == [11, 12, 13]
        assert stats.store_wait_seconds >= 0.25 and stats.num_dropped_chunks == 0
        host.abort_store(batch)
    else:
        assert batch is None and stats.num_dropped_chunks == 3 and stats.store_wait_seconds == 0
