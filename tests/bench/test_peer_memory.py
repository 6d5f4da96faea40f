"""The peer with our tiers and memory counted alike: `vllm-lmcache`'s LMCache server sized as our
tiers, its faults keeping a run out of the headline, each system's processes in a memory cgroup
(page cache included), pairs in ABBA order, and results that are never overwritten."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.lmcache_peer import COUNTERS, NO_CONNECTOR, LMCacheServer, LMCacheTiers, run_faults
from benchmarks.memory_group import MemoryGroup, cached_bytes, folder_bytes
from benchmarks.report import new_json_path, records_path_of, write_report
from benchmarks.stats import abba
from benchmarks.traces import BenchError
from benchmarks.visits import disk_tier, peer_tiers
from benchmarks.vllm import PeerOptions, VLLMServer, peer_launch
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG

MiB = 2**20


def _cfg(tiny_dir: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_config(DEFAULT_CONFIG, [f"model.path={tiny_dir}", *overrides])


def test_the_peers_lmcache_has_our_tiers_sizes(tiny_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    cfg = _cfg(
        tiny_dir,
        "cache.device_tier_bytes=67108864",
        "cache.block_tokens=64",
        f'cache.host.lmcache={{max_local_cpu_size: 0.25, local_disk: "file://{disk}", max_local_disk_size: 2}}',
    )
    assert disk_tier(cfg) == (disk, 2 * 2**30)
    tiers = peer_tiers(cfg)
    # L1 = our host tier's memory, chunk = our KV block, L2 beside our disk tier (same file system), its size
    assert tiers == LMCacheTiers(256 * MiB, 64, tmp_path / "disk-vllm-lmcache", 2 * 2**30)
    server = LMCacheServer("/venv/bin/python", tiers)
    a = server.args
    assert a[:2] == ["/venv/bin/lmcache", "server"] and a[a.index("--chunk-size") + 1] == "64"
    assert float(a[a.index("--l1-size-gb") + 1]) == 0.25 and a[a.index("--host") + 1] == "127.0.0.1"
    assert json.loads(a[a.index("--l2-adapter") + 1]) == {"type": "fs", "base_path": str(tiers.l2_folder)}
    # vLLM keeps our device tier's bytes as its own KV and reaches the server through the MP connector
    v = VLLMServer(peer_launch(cfg, "/venv/bin/python", 4096, 64 * MiB, PeerOptions(lmcache=tiers)))
    transfer = json.loads(v.args[v.args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "LMCacheMPConnector"
    assert v.lmcache is not None and transfer["kv_connector_extra_config"]["lmcache.mp.port"] == v.lmcache.port
    assert v.env["LMCACHE_MP_TRANSFER_MODE"] == "engine_driven"
    assert v.args[v.args.index("--kv-cache-memory-bytes") + 1] == str(64 * MiB)
    assert set(v.launch_record()) == {"argv", "env", "startup_seconds", "lmcache"}
    # without a disk tier the peer has no L2 either; without a host tier it cannot be sized
    no_disk = peer_tiers(_cfg(tiny_dir, "cache.host.lmcache.max_local_cpu_size=0.5"))
    assert no_disk.l2_folder is None and "--l2-adapter" not in LMCacheServer("/py", no_disk).args
    with pytest.raises(BenchError, match="host tier"):
        peer_tiers(_cfg(tiny_dir, "cache.suffix=discard"))


def test_a_peer_run_that_dropped_stores_or_recomputed_is_flagged(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO all good\n")
    clean = dict.fromkeys(COUNTERS, 0.0) | {
        "lmcache_mp_l2_store_submitted_objects_chunks_total": 5.0,
        "lmcache_mp_l2_store_completed_objects_chunks_total": 5.0,
    }
    assert run_faults(clean, log) == []
    dropped = clean | {"lmcache_mp_l1_allocation_failure_chunks_total": 3.0}
    assert run_faults(dropped, log) == ["LMCache dropped 3 chunk stores (L1 allocation failures)"]
    unfinished = clean | {"lmcache_mp_l2_store_completed_objects_chunks_total": 4.0}
    assert run_faults(unfinished, log) == ["LMCache completed 4 of 5 L2 chunk stores"]
    log.write_text(f"WARNING {NO_CONNECTOR}, falling back\n")
    assert len(run_faults(clean, log)) == 1 and NO_CONNECTOR in run_faults(clean, log)[0]


def test_lmcache_server_starts_with_a_cold_disk_and_reports_its_counters(tmp_path: Path) -> None:
    """The real server (LMCache is in our venv too): its L2 folder emptied at start, healthy, every
    counter the harness reads present (0 before any store), gone after stop."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    (l2 / "stale").write_bytes(b"x" * 4096)  # a previous run's chunk
    server = LMCacheServer(sys.executable, LMCacheTiers(64 * MiB, 256, l2, 2**30))
    server.start(tmp_path / "lmcache.log")
    try:
        assert server.healthy() and list(l2.iterdir()) == []
        counters = server.counters()
        assert set(counters) == set(COUNTERS) and all(v == 0 for v in counters.values())
    finally:
        server.stop()
    assert server.proc is not None and server.proc.poll() is not None
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/healthcheck", timeout=2)


def _group_or_skip(name: str, limit: int, folders: list[Path]) -> MemoryGroup:
    group = MemoryGroup(name, limit, folders)
    if group.path is None:
        pytest.skip("no rights to make a memory cgroup here")
    return group


def test_a_memory_group_charges_its_processes_and_their_page_cache(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    folder.mkdir()
    group = _group_or_skip("test-charge", 512 * MiB, [folder])
    try:
        # a child that holds 64 MiB and writes 32 MiB to a file of its disk folder, then waits
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, time\nb = bytearray(64 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
                f"open({str(folder / 'kv')!r}, 'wb').write(b'y' * (32 << 20))\n"
                "print('ready', flush=True)\ntime.sleep(30)",
            ],
            stdout=subprocess.PIPE,
            preexec_fn=group.preexec,
        )
        group.begin_run([child.pid])
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        assert child.pid in group.pids()
        use = group.end_run([child.pid])
        assert use.limit_bytes == 512 * MiB and use.method.startswith("cgroup")
        assert use.peak_bytes >= 96 * MiB  # its heap and the file's pages
        assert use.page_cache_bytes >= 32 * MiB and use.disk_written_bytes >= 32 * MiB
        assert use.disk_folder_bytes == folder_bytes([folder]) == 32 * MiB and use.oom_kills == 0
        assert 0 < sum(use.cpu_seconds.values()) < 30  # the child's CPU time over the run, by process name
        child.kill()
        child.wait()
    finally:
        group.close()
    assert group.path is not None and not group.path.exists()


def test_a_process_past_the_limit_is_killed_and_counted(tmp_path: Path) -> None:
    group = _group_or_skip("test-oom", 64 * MiB, [])
    try:
        group.begin_run([])
        child = subprocess.run(
            [sys.executable, "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"],
            preexec_fn=group.preexec,
        )
        assert child.returncode == -9  # SIGKILL from the kernel at the cgroup's limit
        assert group.end_run([]).oom_kills >= 1
    finally:
        group.close()


def test_without_a_limit_the_group_samples_rss_and_the_folders_page_cache(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    folder.mkdir()
    (folder / "kv").write_bytes(b"z" * (4 * MiB))
    group = MemoryGroup("no-limit", None, [folder])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        group.begin_run([child.pid])
        use = group.end_run([child.pid])
    finally:
        child.kill()
        child.wait()
    assert group.path is None and use.method == "rss+fincore" and use.limit_bytes is None
    assert use.peak_bytes >= use.page_cache_bytes == cached_bytes([folder]) and use.disk_folder_bytes == 4 * MiB


def test_pairs_alternate_abba() -> None:
    assert [abba(["tiered", "vllm"], rep) for rep in range(4)] == [
        ["tiered", "vllm"],
        ["vllm", "tiered"],
        ["tiered", "vllm"],
        ["vllm", "tiered"],
    ]


def test_a_rerun_writes_a_new_dated_json_and_keeps_the_old(tmp_path: Path) -> None:
    first = new_json_path(tmp_path / "visits.json")
    assert first == tmp_path / "visits.json"
    write_report(first, "visits", "cpu", {"run": 1})
    second = new_json_path(tmp_path / "visits.json")
    assert second.name.startswith("visits-20") and second.suffix == ".json"
    write_report(second, "visits", "cpu", {"run": 2})
    third = new_json_path(tmp_path / "visits.json")
    assert third.stem == f"{second.stem}-2"
    assert json.loads(first.read_text())["run"] == 1 and json.loads(second.read_text())["run"] == 2
    assert records_path_of(second) == tmp_path / f"{second.stem}.records.json.gz"
